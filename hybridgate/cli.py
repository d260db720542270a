"""The `hybridgate` command. Each subcommand imports what it needs lazily,
so `hybridgate generate` loads neither torch nor numba."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _settings(args: argparse.Namespace):
    """The root settings of this command line: flag > environment > --config file > default."""
    from hybridgate.config import resolve

    return resolve(args).settings


def _cmd_serve(args: argparse.Namespace) -> int:
    from hybridgate.run.serve import serve

    return serve(_settings(args))


def _cmd_gateway(args: argparse.Namespace) -> int:
    from hybridgate.run.serve import gateway_only

    return gateway_only(_settings(args))


def _cmd_worker(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from hybridgate.workers.process import run_worker

    settings = _settings(args)
    if not settings.worker.endpoint:  # HYBRIDGATE_ENDPOINT= or --endpoint '' reads as unset
        raise ValueError("--endpoint: give where to bind, ipc://PATH or tcp://127.0.0.1:PORT")
    if len(settings.models) > 1:
        raise ValueError(f"--model: a worker serves one model, got {len(settings.models)}")
    own = settings.model_settings(0)  # --model NAME=PATH,kv-cache-dtype=...: the model's own settings
    run_worker(replace(own.worker, model_path=settings.model_path, model_name=settings.models[0].name,
                       max_model_len=own.worker.max_model_len or own.router.max_model_len),
               redis=settings.redis, transport=settings.transport, metrics_port=settings.gateway.metrics_port)
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from hybridgate.config import report, resolve
    from hybridgate.settings import model_rows

    resolved = resolve(args)
    print(report(resolved, as_json=args.json, models=model_rows(resolved)))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from hybridgate.client import generate

    # `echo ... |` and heredocs end the text with a newline the user did not mean as part of the prompt.
    prompt = sys.stdin.read().removesuffix("\n") if args.prompt == "-" else args.prompt
    return generate(args, prompt)


def _cmd_keys_generate(args: argparse.Namespace) -> int:
    from hybridgate.security.keys import generate_keys

    if args.auth_token:
        _write_token(args.auth_token, args.keep_existing)
    try:
        keys = generate_keys(args.path)
    except FileExistsError:
        if not args.keep_existing:
            raise OSError(f"{args.path} exists; a key file is never overwritten (remove it first, or pass "
                          "--keep-existing to keep it)") from None
        from hybridgate.security.keys import load_keys

        keys = load_keys(args.path, "keys generate PATH")  # the kept file must be a key pair of mode 0600
        print(f"kept {args.path} (public key {keys.public.decode()})")
        return 0
    print(f"wrote {args.path} (mode 0600: the key pair, for --curve-key on every process) and "
          f"{args.path}.pub (public key {keys.public.decode()})")
    return 0


def _write_token(path: str, keep_existing: bool) -> None:
    from hybridgate.security.keys import generate_token, read_secret_file

    try:
        generate_token(path)
    except FileExistsError:
        if not keep_existing:
            raise OSError(f"{path} exists; a token file is never overwritten (remove it first, or pass "
                          "--keep-existing to keep it)") from None
        read_secret_file(path, "keys generate --auth-token")  # the kept file must be a secret of mode 0600
        print(f"kept {path}")
        return
    print(f"wrote {path} (mode 0600: a bearer token, for --auth-token-file on the gateway)")


def _cmd_info(args: argparse.Namespace) -> int:
    """Print what the model file holds and which runners can serve it; exit 2 when none can."""
    from hybridgate.models import model_fingerprint
    from hybridgate.models.info import describe, report_lines

    settings = _settings(args)
    own = settings.model_settings(0)  # --model PATH,cpu-activations=...
    report = describe(settings.model_path)
    lines = report_lines(report)
    if report.model is not None:
        fingerprint = model_fingerprint(report.model)
        lines.append(("fingerprint", fingerprint))
        from hybridgate.workers.support import runner_verdicts

        served = 0
        for runner, refusal in runner_verdicts(report.model, fingerprint):
            served += not refusal
            lines.append((f"runner {runner.kind}", f"{runner.description}: " + (f"no: {refusal}" if refusal else "yes")))
            if runner.kind == "cpu" and not refusal:
                lines += _cpu_kernel_lines(report, own.worker.engine)
    else:
        served = 0
        lines.append(("runners", "none (the file is refused above)"))
    width = max(len(label) for label, _ in lines) + 2
    for label, value in lines:
        print(f"{label + ':':<{width}}{value}")
    return 0 if served and not report.tokenizer_refusal else 2


def _cpu_kernel_lines(report, engine) -> list[tuple[str, str]]:
    """The kernel table's rows for the file's weight types on this machine's path (no Numba is imported)."""
    from hybridgate.workers.cpu import isa, kernel_table

    target = isa.select(engine.cpu_isa, engine.cpu_amx)
    path = kernel_table.path_of(target.isa, target.amx)
    names = [name for name, _ in report.quant_mix if name in kernel_table.AUTO[path]]
    return [("cpu kernels", f"{path} path, cpu_activations {engine.cpu_activations} (type: class, decode "
                            "activations and kernel; prompt kernel)"),
            *((f"  {line.split(': ', 1)[0]}", line.split(": ", 1)[1])
              for line in kernel_table.table_lines(names, engine.cpu_activations, path))]


def build_parser() -> argparse.ArgumentParser:
    from hybridgate import __version__
    from hybridgate.config import environment

    parser = argparse.ArgumentParser(prog="hybridgate", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hybridgate {__version__}")
    parser.add_argument("--log-level", default=environment("HYBRIDGATE_LOG_LEVEL", "WARNING"), type=_log_level,
                        help=f"logging level, one of {', '.join(LOG_LEVELS)} in any case (default WARNING, or "
                             "$HYBRIDGATE_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_settings_commands(sub, ("serve", "gateway", "worker", "config"))
    _add_generate(sub)
    _add_bench(sub)
    from hybridgate.run.health import add_health_parser  # argparse only

    add_health_parser(sub)
    _add_keys(sub)
    _add_settings_commands(sub, ("info",))
    return parser


# Commands whose flags are their settings: name -> (help, handler).
SETTINGS_COMMANDS = {
    "serve": ("run the gRPC gateway with its workers (the default model unless --model)", _cmd_serve),
    "gateway": ("run the gRPC gateway alone, connected to running workers", _cmd_gateway),
    "worker": ("run one worker alone; it binds ENDPOINT and waits for gateways", _cmd_worker),
    "config": ("print the effective settings and where each came from (flag, env, file, default)", _cmd_config),
    "info": ("print a GGUF model's architecture, parameters, quant mix, tokenizer, chat template, context and "
             "fingerprint, and which runners can serve it or why not", _cmd_info),
}


def _add_settings_commands(sub, names: tuple[str, ...]) -> None:
    from hybridgate.settings import add_command_settings

    for name in names:
        text, func = SETTINGS_COMMANDS[name]
        command = sub.add_parser(name, help=text)
        if name == "config":
            command.add_argument("--json", action="store_true", help="print one JSON object")
        add_command_settings(command, name)
        command.set_defaults(func=func)


def _add_generate(sub) -> None:
    from hybridgate.config import environment
    from hybridgate.settings import TARGET_HELP, add_command_settings

    gen = sub.add_parser("generate", help="stream one answer from a running gateway")
    gen.add_argument("prompt", metavar="PROMPT", help="the prompt text, or - to read it from stdin (one trailing newline dropped)")
    gen.add_argument("--target", default=None, help=TARGET_HELP)
    gen.add_argument("--chat", action="store_true", help="send PROMPT as one user message through the chat template")
    gen.add_argument("--model", dest="request_model", default=None, metavar="NAME",  # not serve's --model (a path)
                     help="which of the gateway's models answers (default: its first)")
    gen.add_argument("--max-tokens", type=int, default=None, help="most tokens to generate (default: the gateway's, the rest "
                     "of the model's context and at most 4096)")
    gen.add_argument("--temperature", type=float, default=None, help="sampling temperature; 0 is greedy (default 1)")
    gen.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1] (default 1)")
    gen.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens; 0 or -1 is off")
    gen.add_argument("--repetition-penalty", type=float, default=None, help="penalty on seen tokens, 1 is off")
    gen.add_argument("--seed", type=int, default=None, help="seed of the sampling noise (default: random)")
    gen.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string; repeat for several")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")
    gen.add_argument("--no-skip-special-tokens", dest="skip_special_tokens", action="store_false",
                     help="keep special tokens such as <|im_end|> in the text (skipped by default; ids always stream)")
    gen.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds (default: none)")
    gen.add_argument("--route", default=None, metavar="R",
                     help="where the request runs: auto, gpu, cpu or gpu->cpu (GPU prefill, KV hand-off, CPU decode); "
                          "the gateway honours it only with --allow-client-routes (default: auto)")
    gen.add_argument("--json", action="store_true", help="print each response message as one JSON object per line")
    gen.add_argument("--auth-token", default=environment("HYBRIDGATE_AUTH_TOKEN"), metavar="TOKEN",
                     help="send `authorization: Bearer TOKEN` (default: $HYBRIDGATE_AUTH_TOKEN; a flag shows in "
                          "the process list, the variable does not)")
    gen.add_argument("--tls-ca", default=None, metavar="PEM",
                     help="connect over TLS, trusting the CA certificates in this PEM file (e.g. the gateway's "
                          "self-signed certificate); default: plaintext")
    add_command_settings(gen, "generate")
    gen.set_defaults(func=_cmd_generate)


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks with side-by-side baselines (engine, accuracy, handoff, gateway, cache, serve, sim, model, kernels, attention, embeddings; report renders the pages)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from hybridgate.bench import (  # argparse only
        add_accuracy_parser,
        add_attention_parser,
        add_cache_parser,
        add_embeddings_parser,
        add_engine_parser,
        add_gateway_parser,
        add_handoff_parser,
        add_model_parser,
        add_report_parser,
        add_serve_parser,
        add_sim_parser,
        kernels,
    )

    add_engine_parser(bench_sub)
    add_accuracy_parser(bench_sub)
    add_handoff_parser(bench_sub)
    add_gateway_parser(bench_sub)
    add_serve_parser(bench_sub)
    add_sim_parser(bench_sub)
    add_cache_parser(bench_sub)
    add_model_parser(bench_sub)
    add_attention_parser(bench_sub)
    kernels.add_parser(bench_sub)
    add_embeddings_parser(bench_sub)
    add_report_parser(bench_sub)


def _add_keys(sub) -> None:
    keys = sub.add_parser("keys", help="CURVE keys for ZeroMQ over tcp")
    keys_sub = keys.add_subparsers(dest="keys", required=True)
    keys_gen = keys_sub.add_parser("generate", help="write a new CURVE key pair (mode 0600) for --curve-key; every "
                                                    "process of one deployment takes the same file")
    keys_gen.add_argument("path", metavar="PATH", help="the key file to create (never overwritten); PATH.pub gets "
                                                       "the public key alone")
    keys_gen.add_argument("--keep-existing", action="store_true",
                          help="when PATH already holds a key pair (mode 0600), keep it and exit 0 instead of "
                               "refusing: for an init container that runs at every start of a deployment")
    keys_gen.add_argument("--auth-token", metavar="FILE", default=None,
                          help="also write a new random bearer token (256 bits, mode 0600) to FILE, for the "
                               "gateway's --auth-token-file and its clients (kept like PATH with --keep-existing)")
    keys_gen.set_defaults(func=_cmd_keys_generate)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(value: str) -> str:
    """--log-level's value upper-cased; argparse's usage error naming the choices for another (not a traceback
    from logging)."""
    if value.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return value.upper()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:  # config and model errors name the field; no traceback for users
        print(f"hybridgate {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `hybridgate info | head`: the reader left; nothing is wrong (Python's signal docs)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0
    except OSError as exc:  # a port in use, a socket path not writable
        print(f"hybridgate {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
