"""A randomized load for the mirrored-state check (tests/test_group.py): phases of prefill
only, decode only, mixed, idle (the group only heartbeats), aborts, and a pool small enough
to preempt, for at least `steps` engine steps."""

from __future__ import annotations

import random
import time

from cluster.worker.sampling_params import SamplingParams


def run_random(engine, steps: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    vocab = min(500, engine.vocab_size)
    live: list[str] = []
    n = 0
    phases = ["prefill", "decode", "mixed", "idle", "aborts", "mixed"]
    counts = {p: 0 for p in phases}
    done = 0
    while done < steps:
        phase = phases[(done // 40) % len(phases)]
        if phase == "idle":
            for rid in live:
                engine.abort(rid)
            live.clear()
            while engine.has_unfinished():
                engine.step()
                done += 1
            time.sleep(rng.uniform(0.2, 1.5))  # heartbeats only
            counts[phase] += 1
            done += 1  # an idle round counts as a step of the load
            continue
        if phase in ("prefill", "mixed") and rng.random() < (0.9 if phase == "prefill" else 0.4):
            for _ in range(rng.randint(1, 3)):
                n += 1
                rid = f"x{n}"
                prompt = [rng.randrange(3, vocab) for _ in range(rng.choice((1, 5, 17, 33, 64, 90, 130)))]
                engine.add_request(rid, prompt, SamplingParams(max_tokens=rng.randint(1, 40), temperature=0,
                                                               ignore_eos=True))
                live.append(rid)
        if phase == "aborts" and live and rng.random() < 0.5:
            engine.abort(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
        engine.check_integrity()
        counts[phase] += 1
        done += 1
    while engine.has_unfinished():
        engine.step()
    s = engine.stats
    return {"results": {}, "preemptions": s.num_preemptions, "prefix_hits": s.prefix_hits, "steps": done,
            "phases": counts}
