"""`orchard ...`: argument parsing and dispatch only. Each command lives in its module."""

from __future__ import annotations

import argparse
import logging
import sys


def _cmd_model_create(args) -> int:
    from cluster.modelgen import create_model, num_parameters

    path = create_model(args.dir, arch=args.arch, size=args.size, seed=args.seed)
    print(f"wrote {args.arch} {args.size} model ({num_parameters(path):,} parameters) to {path}")
    return 0


def _cmd_run(args) -> int:
    """Offline generation on one machine: the engine without any server."""
    from cluster.worker.offline import run_offline

    return run_offline(args)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (default: from memory)")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-num-partial-prefills", type=int, default=1)
    g.add_argument("--max-long-partial-prefills", type=int, default=1)
    g.add_argument("--long-prefill-token-threshold", type=int, default=0)
    g.add_argument("--max-waiting", type=int, default=1024, help="queued requests before refusing (0 = unbounded)")


def engine_config_from_args(args):
    from cluster.worker.config import EngineConfig

    return EngineConfig(
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_partial_prefills=args.max_num_partial_prefills,
        max_long_partial_prefills=args.max_long_partial_prefills,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_waiting=args.max_waiting,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchard", description="Serve LLMs from a fleet of Macs.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model utilities").add_subparsers(dest="model_command", required=True)
    create = model.add_parser("create", help="write a random-weight mlx-lm model directory (offline)")
    create.add_argument("dir")
    create.add_argument("--arch", choices=["qwen3", "llama", "qwen2"], default="qwen3")
    create.add_argument("--size", choices=["tiny", "small"], default="tiny")
    create.add_argument("--seed", type=int, default=0)
    create.set_defaults(func=_cmd_model_create)

    run = sub.add_parser("run", help="generate offline with the engine (no server)")
    run.add_argument("prompts", nargs="*", help="prompts (default: a few built-in ones)")
    run.add_argument("--model", default=None, help="mlx-lm model directory (default: the built-in small model)")
    run.add_argument("--max-tokens", type=int, default=32)
    run.add_argument("--temperature", type=float, default=0.0)
    add_engine_args(run)
    run.set_defaults(func=_cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
