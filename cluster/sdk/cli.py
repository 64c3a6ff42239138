"""`orchard generate`: one request through the SDK, printed."""

from __future__ import annotations

import sys

from cluster.sdk.client import Client
from cluster.api.errors import OrchardError


def add_constraint_flags(parser) -> None:
    """Penalties, logit bias and one structured-output constraint."""
    for name in ("presence", "frequency", "repetition"):
        parser.add_argument(f"--{name}-penalty", type=float, default=None)
    parser.add_argument("--logit-bias", action="append", default=None, metavar="TOKEN_ID=BIAS",
                        help="add BIAS (-100..100) to a token's logit (repeatable)")
    one = parser.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="SCHEMA|@FILE", help="constrain the output to this JSON schema")
    one.add_argument("--json-object", action="store_true", help="constrain the output to a JSON object")
    one.add_argument("--regex", help="constrain the output to this regular expression")
    one.add_argument("--choice", action="append", help="constrain the output to one of these (repeatable)")
    one.add_argument("--grammar", metavar="LARK|@FILE", help="constrain the output to this Lark grammar")


def _text(value: str) -> str:
    if value.startswith("@"):
        with open(value[1:], encoding="utf-8") as f:
            return f.read()
    return value


def constraint_params(args) -> dict:
    params = {f"{n}_penalty": getattr(args, f"{n}_penalty") for n in ("presence", "frequency", "repetition")
              if getattr(args, f"{n}_penalty", None) is not None}
    if getattr(args, "logit_bias", None):
        try:
            params["logit_bias"] = {int(t): float(b) for t, b in (item.split("=", 1) for item in args.logit_bias)}
        except ValueError:
            raise SystemExit("--logit-bias takes TOKEN_ID=BIAS, e.g. --logit-bias 42=-100") from None
    if getattr(args, "json_schema", None):
        params["structured"] = {"json_schema": _text(args.json_schema)}
    elif getattr(args, "json_object", False):
        params["structured"] = {"json_object": True}
    elif getattr(args, "regex", None):
        params["structured"] = {"regex": args.regex}
    elif getattr(args, "choice", None):
        params["structured"] = {"choice": args.choice}
    elif getattr(args, "grammar", None):
        params["structured"] = {"grammar": _text(args.grammar)}
    return params


def generate(args) -> int:
    params = dict(model=args.model, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                  seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, **constraint_params(args))
    prompt = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    try:
        with Client(args.target, timeout=args.timeout, api_key=args.api_key, tls_ca=args.tls_ca,
                    tls_cert=args.tls_cert, tls_key=args.tls_key) as client:
            if args.stream:
                last = None
                for chunk in client.stream(**prompt, **params):
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    last = chunk
                sys.stdout.write("\n")
                finish, usage, worker = last.finish_reason, last.usage, last.worker_id
            else:
                result = client.generate(**prompt, **params)
                print(result.text)
                finish, usage, worker = result.finish_reason, result.usage, result.worker_id
    except OrchardError as e:
        print(f"orchard generate: {e}", file=sys.stderr)
        return 1
    u = usage
    print(f"[{finish}; {u.prompt_tokens} prompt + {u.completion_tokens} completion tokens"
          f" ({u.cached_tokens} cached); worker {worker}]", file=sys.stderr)
    return 0
