"""Figures tied to a machine live in MEASUREMENTS.md, not in the code: a comment names the
benchmark that measures a choice, never its milliseconds (they go stale on the next
machine, a Mac above all)."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# a duration in ms / us (ratios are left to review: a policy's thresholds are ratios too)
TIMING = re.compile(r"\b\d[\d.,]*(?:\s?-\s?\d[\d.,]*)?\s?(?:ms|us|µs)\b")
# defaults of other software quoted as facts, not measurements of ours
ALLOWED = ("Python's default: 5 ms", "at 5 ms it waits", "at 100 ms a busy server")


def _comments_and_docstrings(path: Path):
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    previous = None
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
        elif tok.type == tokenize.STRING and previous in (tokenize.INDENT, tokenize.NEWLINE, tokenize.DEDENT, None):
            if tok.string.lstrip("rbuRBU").startswith(('"""', "'''")):
                yield tok.start[0], tok.string
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            previous = tok.type


def test_no_timing_figures_in_code_comments_or_docstrings():
    found = []
    for path in sorted((ROOT / "cluster").rglob("*.py")):
        if "proto" in path.parts:
            continue
        for line, text in _comments_and_docstrings(path):
            for m in TIMING.finditer(text):
                around = text[max(0, m.start() - 30):m.end() + 5]
                if not any(a in around or a in text for a in ALLOWED if m.group(0) in a):
                    found.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)!r} in ...{around}...")
    assert not found, "move these to MEASUREMENTS.md and name the benchmark:\n" + "\n".join(found)


def test_the_measurements_file_is_dated_and_names_its_machine():
    text = (ROOT / "MEASUREMENTS.md").read_text()
    assert "2 shared cores" in " ".join(text.split())
    rows = [r for r in text.splitlines() if re.match(r"\| \d{4}-\d{2}-\d{2} \|", r)]
    assert len(rows) >= 20 and all(r.count("|") >= 5 for r in rows)
