"""`lmc` command line. Subcommands so far: `generate` (one prompt through the local engine) and `models`."""
from __future__ import annotations

import argparse
import json
import os
import sys


def _generate(args) -> int:
    from lmc.runtime import Engine, RequestError, UnknownModelError

    try:
        engine = Engine(args.model, device=args.device)
    except UnknownModelError as e:
        print(f"lmc: {e}", file=sys.stderr)
        return 2
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                      add_generation_prompt=True)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    if args.stop:
        params["stop"] = args.stop
    try:
        out = engine.generate(prompt, params)
    except RequestError as e:
        print(f"lmc: {e}", file=sys.stderr)
        return 2
    finally:
        engine.shutdown()
    print(json.dumps(out) if args.json else out["text"])
    return 0


def _models(_args) -> int:
    from lmc.runtime.model.loader import known_models

    print("\n".join(known_models()))
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(prog="lmc", description="An optimizing compiler and runtime for LM programs")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate from one prompt with the local engine")
    g.add_argument("prompt")
    g.add_argument("--model", default="smollm2-135m-instruct")
    g.add_argument("--device", default="auto")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--stop", action="append")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print the whole result (text, ids, meta info)")
    g.set_defaults(fn=_generate)
    m = sub.add_parser("models", help="list the built-in model names")
    m.set_defaults(fn=_models)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
