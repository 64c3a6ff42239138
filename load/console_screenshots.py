"""The README's picture of the console's fleet view with a fleet: docs/console-fleet-nodes.png.

    python load/console_screenshots.py [--out docs/console-fleet-nodes.png]

A router with a catalog and three node agents on 127.0.0.1 (`LocalFleet`), random-weight
models made with `orchard model create`'s code: `big` (qwen3 small), on node-0's and
node-1's disks, which the budgets let no node hold alone, so the controller forms a 2-node
pipeline group; `chat` (qwen3 tiny), served whole on node-2; `moe`, in the catalog and on
node-2's disk, not loaded. Once both serve and a request has gone through each, Debian's
chromium (Playwright, as the console's browser test drives it) takes the fleet view in a
1280x800 window, the whole page: the workers (the group's ranks), the nodes and the
catalog. Every process is stopped when it is done (the agents stop their workers).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.fleet.local import LocalFleet, ModelRecipe, make_model  # noqa: E402

CONTEXT = 512
LOAD_WAIT = 300.0  # two loads on a loaded 2-core machine
BIG = ModelRecipe("big", "qwen3", "small", seed=6)
CHAT = ModelRecipe("chat", "qwen3", seed=0)
MOE = ModelRecipe("moe", "qwen3_moe", seed=2)


def budget_for(models: dict[str, Path]) -> int:
    """A node budget that holds one half of `big` or `chat`, but not `big` whole."""
    from cluster import platform
    from cluster.fleet import facts, footprint
    from cluster.fleet.config import DEFAULT_CONCURRENCY

    kind = "metal" if platform.has_metal() else "cpu"
    big = facts.disk_model(models["big"], kind)
    whole = footprint.estimate(big, CONTEXT, DEFAULT_CONCURRENCY, kind)
    half = max(b for _, _, b in footprint.rank_shares(big, [1, 1], whole))
    chat = footprint.estimate(facts.disk_model(models["chat"], kind), CONTEXT, DEFAULT_CONCURRENCY, kind).total
    budget = (whole.total + max(half, chat)) // 2
    if not max(half, chat) <= budget < whole.total:
        raise SystemExit(f"no budget fits: big {whole.total} B whole, {half} B a half; chat {chat} B")
    return budget


def wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {seconds:g} s: {what}")
        time.sleep(0.5)


def screenshot(url: str, out: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
            page.goto(url)
            expect(page.locator("#workers .group").first).to_be_visible(timeout=60_000)
            expect(page.locator('#catalog tr[data-model="moe"]')).to_be_visible(timeout=60_000)
            page.screenshot(path=str(out), full_page=True)  # 1280 wide; as tall as the catalog needs
        finally:
            browser.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs/console-fleet-nodes.png")
    args = ap.parse_args()
    from cluster.cli import main as orchard
    from cluster.sdk import Client

    with tempfile.TemporaryDirectory(prefix="orchard-shot-") as tmp:
        models = {r.name: make_model(r, Path(tmp) / "models") for r in (BIG, CHAT, MOE)}
        fleet = LocalFleet([budget_for(models)] * 3, Path(tmp) / "fleet", router_args=["--default-keep-alive", "1h"])
        fleet.add_model("big", models["big"], nodes=[0, 1])
        fleet.add_model("chat", models["chat"], nodes=[2])
        fleet.add_model("moe", models["moe"], nodes=[2])
        with fleet:  # stops the agents (each its workers) and the router, by their processes
            for r in (BIG, CHAT, MOE):
                assert orchard(["models", "add", r.name, "--source", r.name, "--context", str(CONTEXT),
                                "--router", fleet.router_address]) == 0, r.name
            for name in ("big", "chat"):  # one after the other: big's group on the nodes that hold it
                assert orchard(["models", "load", name, "--router", fleet.router_address]) == 0, name
                wait_for(lambda: fleet.catalog()[name].state == "serving", LOAD_WAIT, f"{name} serving")
            with Client(fleet.router_address, timeout=LOAD_WAIT) as c:
                for name in ("big", "chat"):  # so their cards show a TTFT and tokens/s
                    c.generate("An orchard in spring", model=name, max_tokens=16, temperature=0)
            screenshot(fleet.http_url + "/", args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
