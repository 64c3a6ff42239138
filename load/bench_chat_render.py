"""A chat's prompt tokens: the render in a render process vs in a worker thread (before).

    python load/bench_chat_render.py [--model DIR] [--template NAME] [--turns 4] [--tools] [--rounds 300]

Microseconds from a chat's messages to its prompt token ids, one chat at a time:
  in-thread : apply_chat_template(tokenize=True) on a thread of a 2-thread pool, the
              worker's path before chat templates were bounded
  process   : the render in a render process (`RenderPool.render`, what the worker does
              now), then the text tokenized in the worker (inline when short, else on the
              thread pool, as `WorkerService` does)
The two alternate round by round, so drift hits both alike; the texts and token ids are
checked equal. The model: --model (its tokenizer and template), else a tiny qwen3 made
here; --template NAME: one of cluster/formats/chat_templates/ instead of the model's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster import platform  # noqa: E402

platform.preload_blas()  # before MLX is imported
from cluster.formats.chat import template_text  # noqa: E402
from cluster.worker.chat_render import ChatTemplateLimits, RenderPool, render_call  # noqa: E402
from cluster.worker.prompt import INLINE_TOKENIZE_CHARS  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}: what grows in an orchard in autumn?"})
        messages.append({"role": "assistant", "content": f"Answer {i}: apples, pears, plums and quinces."})
    messages.append({"role": "user", "content": "And in spring?"})
    return messages


def summary(name: str, us: list[float]) -> str:
    q = statistics.quantiles(us, n=10)
    return f"{name:10s} p50 {statistics.median(us):8.0f} us   p90 {q[8]:8.0f} us   mean {statistics.fmean(us):8.0f} us"


async def bench(tokenizer, messages: list[dict], tools, rounds: int) -> None:
    loop = asyncio.get_running_loop()
    threads = ThreadPoolExecutor(max_workers=2)
    pool = RenderPool(ChatTemplateLimits())
    pool.start()

    def in_thread():
        return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True))

    async def in_process():
        text = await pool.render(render_call(tokenizer, messages, tools))
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return list(tokenizer.encode(text, add_special_tokens=False)), text
        return list(await loop.run_in_executor(threads, lambda: tokenizer.encode(text, add_special_tokens=False))), text

    try:
        ids, text = await in_process()  # waits for the render processes' start
        assert ids == await loop.run_in_executor(threads, in_thread), "the token ids differ"
        assert text == tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                     tokenize=False), "the texts differ"
        before, after = [], []
        for i in range(rounds):
            for which in (("thread", "process") if i % 2 == 0 else ("process", "thread")):
                t = time.perf_counter()
                if which == "thread":
                    await loop.run_in_executor(threads, in_thread)
                    before.append((time.perf_counter() - t) * 1e6)
                else:
                    await in_process()
                    after.append((time.perf_counter() - t) * 1e6)
        print(f"{len(messages)} messages, {len(text)} characters, {len(ids)} tokens, {rounds} rounds")
        print(summary("in-thread", before))
        print(summary("process", after))
        print(f"added: p50 {statistics.median(after) - statistics.median(before):+.0f} us")
    finally:
        await pool.close()
        threads.shutdown()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a model directory (default: a tiny qwen3 made here)")
    ap.add_argument("--template", help="one of cluster/formats/chat_templates/ (without .jinja) instead of the model's")
    ap.add_argument("--turns", type=int, default=4, help="user / assistant turns before the last question")
    ap.add_argument("--tools", action="store_true", help="pass a tool")
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args(argv)
    from mlx_lm.tokenizer_utils import load

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from cluster.modelgen import create_model

            model = create_model(Path(tmp) / "tiny", "qwen3", "tiny", seed=0)
        tokenizer = load(Path(model))
        if args.template:
            tokenizer._tokenizer.chat_template = template_text(args.template)
        asyncio.run(bench(tokenizer, conversation(args.turns), TOOLS if args.tools else None, args.rounds))


if __name__ == "__main__":
    main()
