"""`orchard generate`: one request through the SDK, printed."""

from __future__ import annotations

import sys

from cluster.sdk.client import Client
from cluster.api.errors import OrchardError


def generate(args) -> int:
    params = dict(model=args.model, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                  seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
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
