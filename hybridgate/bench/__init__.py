"""Benchmarks: `hybridgate bench ...`. Medians, and ratios against a baseline run in the same process.

Only argument parsing lives here; each benchmark imports torch (and its
baseline) when it runs. The settings it shares with `serve` (--model, --threads,
--device, --kv-cache-memory, and --kind: cpu measures the Numba runner, against llama.cpp
with --baseline llama-cpp; gpu the torch runner, against transformers) come from the
configuration root, with their bounds and defaults.
"""

from __future__ import annotations


def add_engine_parser(sub) -> None:
    from hybridgate.config import add_command_settings, bounded

    p = sub.add_parser("engine", help="drive the engine in-process; decode, prefill and TTFT against a baseline")
    add_command_settings(p, "bench engine")
    p.add_argument("--concurrency", type=bounded(int, 1, many=True), default=None,
                   help="decode concurrencies, comma-separated (default 1,4,16,64 for gpu, 1,4,16 for cpu)")
    p.add_argument("--prompt-len", type=bounded(int, 1), default=32,
                   help="prompt tokens of each decode request (default 32)")
    p.add_argument("--new-tokens", type=bounded(int, 1), default=64, help="new tokens per decode request (default 64)")
    p.add_argument("--prefill-lens", type=bounded(int, 1, many=True), default=None,
                   help="prefill prompt lengths, comma-separated (default 128,512,2048 for gpu, 128,512 for cpu)")
    p.add_argument("--prefill-prompts", type=bounded(int, 1), default=None,
                   help="prompts per prefill case (default 16 for gpu, 4 for cpu)")
    p.add_argument("--ttft-len", type=bounded(int, 1), default=1024,
                   help="prompt tokens of the TTFT case (default 1024)")
    p.add_argument("--repeats", type=bounded(int, 1), default=3, help="runs per case; medians are reported (default 3)")
    p.add_argument("--baseline", choices=("transformers", "llama-cpp", "none"), default=None,
                   help="baseline run side by side (default: transformers for gpu; none for cpu, where llama-cpp "
                        "needs the bench extra: pip install -e '.[bench]')")
    p.add_argument("--no-baseline", action="store_true", help="same as --baseline none")
    p.add_argument("--llama-cpp-path", default=None, metavar="DIR",
                   help="with --baseline llama-cpp: a folder holding another llama-cpp-python build (e.g. "
                        "pip install --target DIR, built for AVX2 only), put first on the baseline's sys.path "
                        "(default: the installed llama_cpp)")
    p.add_argument("--bandwidth-mib", type=bounded(int, 1), default=512,
                   help="--kind cpu: MiB of the array whose parallel sum measures the read bandwidth (default 512)")
    p.add_argument("--compare-eager", action="store_true",
                   help="on CUDA, also time the decode step without CUDA graphs (--enforce-eager)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures to this JSON file")
    p.set_defaults(func=_run_engine)


def _run_engine(args) -> int:
    from hybridgate.bench import engine

    engine.run(args)
    return 0


def add_accuracy_parser(sub) -> None:
    from hybridgate.config import add_command_settings

    p = sub.add_parser("accuracy", help="teacher-forced next-token distributions against the fp32 reference")
    add_command_settings(p, "bench accuracy")
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures to this JSON file")
    p.set_defaults(func=_run_accuracy)


def _run_accuracy(args) -> int:
    from hybridgate.bench import accuracy

    accuracy.run(args)
    return 0


def add_handoff_parser(sub) -> None:
    from hybridgate.config import add_command_settings, bounded

    p = sub.add_parser("handoff", help="GPU prefill, KV hand-off, CPU decode in real worker processes; where the "
                                       "time goes")
    add_command_settings(p, "bench handoff")
    p.add_argument("--lengths", type=bounded(int, 1, many=True), default=[128, 512, 2048, 4096],
                   help="prompt lengths, comma-separated (default 128,512,2048,4096)")
    p.add_argument("--repeats", type=bounded(int, 1), default=3, help="runs per length; medians are reported (default 3)")
    p.add_argument("--timeout", type=bounded(float, 0, low_open=True), default=300.0,
                   help="seconds per request (default 300)")
    p.add_argument("--startup-timeout", type=bounded(float, 0, low_open=True), default=300.0,
                   help="seconds for the workers to be READY (default 300)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures to this JSON file")
    p.set_defaults(func=_run_handoff)


def _run_handoff(args) -> int:
    from hybridgate.bench import handoff

    results = handoff.run(args)
    return 0 if all(r["ids_equal_plain_run"] for r in results) else 1


def add_gateway_parser(sub) -> None:
    from hybridgate.config import add_command_settings, bounded

    p = sub.add_parser("gateway", help="the gateway's CPU per streamed token and its tokens/s, against an instant "
                                       "worker (no model compute) over the real wire and real gRPC")
    add_command_settings(p, "bench gateway")
    p.add_argument("--concurrency", type=bounded(int, 1, many=True), default=[1, 16, 64],
                   help="concurrent streams, comma-separated (default 1,16,64)")
    p.add_argument("--requests", type=bounded(int, 1), default=64,
                   help="streams per concurrency (at least the concurrency; default 64)")
    p.add_argument("--max-tokens", type=bounded(int, 1), default=256, help="ids per stream (default 256)")
    p.add_argument("--gateways", type=bounded(int, 1, 64), default=1,
                   help="gateway processes on the one port (hybridgate gateway --gateways N; default 1)")
    p.add_argument("--step-ms", type=bounded(float, 0), default=0.0,
                   help="the instant worker's step time in ms (default 0: steps back to back)")
    p.add_argument("--startup-timeout", type=bounded(float, 0, low_open=True), default=120.0,
                   help="seconds for the worker and gateway to be READY (default 120)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures to this JSON file")
    p.set_defaults(func=_run_gateway)


def _run_gateway(args) -> int:
    from hybridgate.bench import gateway

    results = gateway.run(args)
    return 0 if all(r["errors"] == 0 and r["short_streams"] == 0 for r in results) else 1
