"""Benchmarks: `hybridgate bench ...`. Medians, and ratios against a baseline run in the same process.

Only argument parsing lives here; each benchmark imports torch (and its
baseline) when it runs. The settings it shares with `serve` (--model, --threads,
--device, --kv-cache-memory, and --kind: cpu measures the Numba runner, against llama.cpp
with --baseline llama-cpp; gpu the torch runner, against transformers) come from the
configuration root, with their bounds and defaults.
"""

from __future__ import annotations

import argparse


def add_engine_parser(sub) -> None:
    from hybridgate.config import bounded
    from hybridgate.settings import add_command_settings

    p = sub.add_parser("engine", help="drive the engine in-process; decode, prefill and TTFT against a baseline")
    add_command_settings(p, "bench engine")
    p.add_argument("--concurrency", type=bounded(int, 1, many=True), default=None,
                   help="decode concurrencies, comma-separated (default 1,4,16,64 for gpu, 1,4,16 for cpu, "
                        "1,16,64,256 for gpu --shape)")
    p.add_argument("--prompt-len", type=bounded(int, 1), default=None,
                   help="prompt tokens of each decode request (default 32; 1024 for gpu --shape)")
    p.add_argument("--new-tokens", type=bounded(int, 1), default=None,
                   help="new tokens per decode request (default 64; 256 for gpu --shape)")
    p.add_argument("--prefill-lens", type=bounded(int, 1, many=True), default=None,
                   help="prefill prompt lengths, comma-separated (default 128,512,2048 for gpu, 128,512 for cpu, "
                        "512,2048,8192 for gpu --shape)")
    p.add_argument("--prefill-prompts", type=bounded(int, 1), default=None,
                   help="prompts per prefill case (default 16 for gpu, 4 for cpu, 1 for gpu --shape)")
    shaped = p.add_argument_group("--kind gpu --shape: random bf16 weights made on the device, the device's roofline "
                                  "and transformers on the same weights (hybridgate/bench/gpu_engine.py)")
    shaped.add_argument("--tiny", action="store_true",
                        help="the shape's family at tiny widths (2 blocks, head dim 16, vocabulary 512): a run a "
                             "CPU torch device finishes in seconds")
    shaped.add_argument("--baseline-concurrency", type=bounded(int, 1, many=True), default=None,
                        help="the decode concurrencies transformers runs at too (default: every --concurrency)")
    shaped.add_argument("--mixed-chunk", type=bounded(int, 1), default=512,
                        help="prompt tokens of the mixed step's chunk (default 512)")
    shaped.add_argument("--mixed-decodes", type=bounded(int, 1), default=63,
                        help="decodes in the mixed step, and beside the hand-off (default 63)")
    shaped.add_argument("--handoff-len", type=bounded(int, 1), default=2048,
                        help="prompt tokens of the hand-off whose export is timed under decodes (default 2048)")
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
                   help="--kind cpu: MiB of the array whose parallel sum measures the read bandwidth, probed in a "
                        "child process before each timed decode step (default 512)")
    p.add_argument("--compare-eager", action="store_true",
                   help="on CUDA, also time the decode step without CUDA graphs (--enforce-eager)")
    mixed = p.add_argument_group("latency under mixed load (--kind cpu; --prompt-len, --new-tokens and --repeats "
                                 "apply)")
    mixed.add_argument("--mixed-load", action="store_true",
                       help="instead of the cases above, a running stream's inter-token gaps (p50, p99) while a "
                            "--long-prompt prompt is prefilled on the same engine, against its unloaded ITL, with "
                            "the step budget and without")
    mixed.add_argument("--long-prompt", type=bounded(int, 2), default=4000,
                       help="tokens of the prompt that arrives during the stream (default 4000)")
    mixed.add_argument("--busy-core", action="store_true",
                       help="run beside a process spinning on one core, and add decode tokens/s at one sequence on "
                            "the default threads against one thread")
    _add_bench_model_args(p, required=False)
    p.add_argument("--type-shares", action=argparse.BooleanOptionalAction, default=True,
                   help="--kind cpu: time each weight matrix's matmul at batch 1, in the forward pass's order, and "
                        "report each quant type's share of the decode step (default on)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures to this JSON file")
    p.add_argument("--profile-out", default=None, metavar="FILE",
                   help="instead of the cases above, measure the step tables (decode step by batch, prefill "
                        "tokens/s by step tokens) and KV capacity at serve's defaults, and write them as a "
                        "worker profile for bench sim")
    p.add_argument("--constrained-fraction", type=bounded(float, 0, 1), default=None, metavar="F",
                   help="instead of the cases above, decode --concurrency sequences (default 16) with F of them "
                        "JSON-schema constrained against all unconstrained, side by side; also mask fill time per "
                        "sequence-step and grammar compile time, cold and cached")
    p.add_argument("--schema", default=None, metavar="FILE",
                   help="with --constrained-fraction: the JSON schema (default: a typical tool's parameters)")
    p.set_defaults(func=_run_engine)


def _add_bench_model_args(p, required: bool) -> None:
    """--shape, --quant, --seed, --layers: a random-weight bench file (`bench.model_files`)."""
    from hybridgate.bench.mixes import MIXES
    from hybridgate.bench.shapes import SHAPES
    from hybridgate.config import bounded

    p.add_argument("--shape", choices=tuple(SHAPES), default=None, required=required,
                   help="a named model's shapes: a random-weight GGUF of them (written and cached on first use)"
                        + ("" if required else ", measured instead of --model"))
    p.add_argument("--quant", choices=tuple(MIXES), default="Q4_K_M" if required else None,
                   help="with --shape: llama.cpp's quant mix of the file (default Q4_K_M)")
    p.add_argument("--seed", type=bounded(int, 0), default=0, help="with --shape: the weights' seed (default 0)")
    p.add_argument("--layers", type=bounded(int, 1), default=None,
                   help="with --shape: keep only this many blocks (same matrices; default: the model's count)")


def add_model_parser(sub) -> None:
    p = sub.add_parser("model", help="write (once, cached) a random-weight GGUF of a named model's shapes in one of "
                                     "llama.cpp's quant mixes, and print its path")
    _add_bench_model_args(p, required=True)
    p.set_defaults(func=_run_model)


def _run_model(args) -> int:
    from hybridgate.bench.model_files import named_bench_model

    print(named_bench_model(args.shape, args.quant, args.seed, args.layers))
    return 0


def _run_engine(args) -> int:
    from hybridgate.config import resolve

    if args.shape and resolve(args).settings.worker.kind == "gpu":  # random weights made on the device
        from hybridgate.bench import gpu_engine

        gpu_engine.run(args)
    else:
        from hybridgate.bench import engine

        engine.run(args)
    return 0


def add_accuracy_parser(sub) -> None:
    from hybridgate.settings import add_command_settings

    p = sub.add_parser("accuracy", help="teacher-forced next-token distributions against the fp32 reference")
    add_command_settings(p, "bench accuracy")
    from hybridgate.bench.mixes import MIXES

    p.add_argument("--quant", choices=tuple(MIXES), default=None,
                   help="first requantize the model with llama.cpp's quantizer (llama_model_quantize, allow_requantize) "
                        "to this mix, cached, and measure that file (needs llama-cpp-python: the bench extra or "
                        "--llama-cpp-path)")
    p.add_argument("--llama-cpp-path", default=None, metavar="DIR",
                   help="a folder holding a llama-cpp-python build, put first on the quantizer's and the baseline's "
                        "sys.path")
    p.add_argument("--baseline", choices=("llama-cpp", "none"), default=None,
                   help="llama-cpp: llama.cpp's own figures on the same file and positions beside ours, and whether "
                        "ours are at least as good (default llama-cpp with --quant, none without)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures to this JSON file")
    p.set_defaults(func=_run_accuracy)


def _run_accuracy(args) -> int:
    from hybridgate.bench import accuracy

    accuracy.run(args)
    return 0


def add_handoff_parser(sub) -> None:
    from hybridgate.config import bounded
    from hybridgate.settings import add_command_settings

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
    from hybridgate.bench.profile import PROFILERS
    from hybridgate.config import bounded
    from hybridgate.settings import add_command_settings

    p = sub.add_parser("gateway", help="the gateway's CPU per streamed token and its tokens/s, against an instant "
                                       "worker (no model compute) over the real wire and real gRPC")
    add_command_settings(p, "bench gateway")
    p.add_argument("--concurrency", type=bounded(int, 1, many=True), default=[1, 16, 64],
                   help="concurrent streams, comma-separated (default 1,16,64)")
    p.add_argument("--requests", type=bounded(int, 1), default=64,
                   help="streams per concurrency (at least the concurrency; default 64)")
    p.add_argument("--max-tokens", type=bounded(int, 1), default=256, help="ids per stream (default 256)")
    p.add_argument("--protocol", type=_doors, default=["grpc"],
                   help="the doors to drive, comma-separated: grpc (the gRPC stream), openai (the OpenAI-compatible "
                        "HTTP door, /v1/completions as server-sent events; not with --tls); several run alternately "
                        "on the same gateway (default grpc)")
    p.add_argument("--gateways", type=bounded(int, 1, 64), default=1,
                   help="gateway processes on the one port (hybridgate gateway --gateways N; default 1)")
    p.add_argument("--step-ms", type=bounded(float, 0), default=0.0,
                   help="the instant worker's step time in ms (default 0: steps back to back)")
    p.add_argument("--startup-timeout", type=bounded(float, 0, low_open=True), default=120.0,
                   help="seconds for the worker and gateway to be READY (default 120)")
    p.add_argument("--tls", action="store_true",
                   help="also run each concurrency against a second gateway with TLS (a self-signed certificate) "
                        "and a bearer token, alternately with plaintext, and report the tokens/s ratio")
    p.add_argument("--repeats", type=bounded(int, 1), default=None,
                   help="runs per concurrency and door (with --tls: plaintext/TLS run pairs), medians reported "
                        "(default 1; 3 with --tls or --tools)")
    p.add_argument("--auth", action=argparse.BooleanOptionalAction, default=True,
                   help="the gateway requires a bearer token and every call carries it, as deployed (default on)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="profile the gateway process over the measured runs only, into FILE (cprofile: a pstats "
                        "file; callgrind: FILE.1, FILE.2, ... one per run, and instructions per token reported)")
    p.add_argument("--profiler", choices=PROFILERS, default=PROFILERS[0],
                   help="with --profile: cProfile on the gateway's event-loop thread, or valgrind's callgrind "
                        "(every thread; about 50 times slower, so lengthen --step-ms) (default cprofile)")
    p.add_argument("--tools", action="store_true",
                   help="send chats, alternately without and with a tool; the instant worker streams a recorded "
                        "tool-call generation for the latter, which the gateway parses; report the ratio of the "
                        "gateway's CPU per token, tools / no tools (not with --tls)")
    p.add_argument("--large-chat-bytes", type=bounded(int, 0, 1 << 20), default=0,
                   help="during each run, send chat requests of this many bytes and of half as many, one at a "
                        "time, and report the gateway's event-loop lag (default 0: none)")
    p.add_argument("--grpc-floor", action="store_true",
                   help="also drive, alternately with the gateway's gRPC door, a bare grpc.aio server of the same "
                        "service that only yields prebuilt messages at the same step (hybridgate/bench/grpcfloor.py), "
                        "and report its CPU per message: the floor any grpc.aio server pays, and the gateway's "
                        "figure less it (needs --step-ms > 0: one message per token, and grpc among --protocol; not with "
                        "--tls or --tools)")
    coalescing = ("the gateway's output coalescing (its --stream-coalesce), comma-separated on,off: each mode runs "
                  "as its own gateway on the same worker, alternately, reported on its own line (default on)")
    p.add_argument("--coalesce", type=_coalesce_modes, default=[True], help=coalescing)
    p.add_argument("--stream-interval", type=bounded(int, 1), default=1, metavar="N",
                   help="the gateways' --stream-interval: at most one message per N ids (default 1)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures to this JSON file")
    p.set_defaults(func=_run_gateway)


def _coalesce_modes(text: str) -> list[bool]:
    """`--coalesce`'s comma-separated modes, each on or off."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in ("on", "off") for m in modes):
        raise argparse.ArgumentTypeError(f"each mode must be on or off, got {text!r}")
    return [m == "on" for m in dict.fromkeys(modes)]


def _doors(text: str) -> list[str]:
    """`--protocol`'s comma-separated doors, each grpc or openai."""
    doors = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in doors if d not in ("grpc", "openai")]
    if bad or not doors:
        raise argparse.ArgumentTypeError(f"each door must be grpc or openai, got {text!r}")
    return list(dict.fromkeys(doors))


def _run_gateway(args) -> int:
    from hybridgate.bench import gateway

    results = gateway.run(args)
    return 0 if all(r["errors"] == 0 and r["short_streams"] == 0 for r in results) else 1


def _add_load_args(p, serve: bool) -> None:
    """The workload, rates and output flags `bench serve` and `bench sim` share."""
    from hybridgate.config import bounded

    p.add_argument("--workload", default=None, metavar="FILE",
                   help='JSON lines, one request a line: {"prompt_tokens": N, "max_tokens": M, "class": "name"} '
                        "(default: the built-in mix of short chats, 1,000-4,000-token summaries and long generations)")
    p.add_argument("--mix", default=None, metavar="W",
                   help="weights of the built-in mix's classes, e.g. short=0.7,summary=0.15,long=0.15 (the default); "
                        "a fourth, document (6,000-10,000 prompt and output tokens), weighs 0 unless named")
    p.add_argument("--seed", type=bounded(int, 0), default=0, help="seed of the workload and the arrivals (default 0)")
    p.add_argument("--rates", default=None, metavar="R",
                   help="offered loads of the sweep, requests/s or multiples of the first policy's capacity under "
                        "SLO, comma-separated, e.g. 0.25x,0.5x,1x,1.5x (default: no sweep, the capacity search only)")
    p.add_argument("--capacity-runs", type=bounded(int, 0), default=5,
                   help="runs of the capacity search per policy: doubling, then bisection (0: none; default 5)")
    p.add_argument("--duration", type=bounded(float, 0, low_open=True), default=60.0,
                   help="seconds of arrivals per run: requests = rate x duration, bounded below (default 60)")
    p.add_argument("--min-requests", type=bounded(int, 1), default=8, help="fewest requests per run (default 8)")
    p.add_argument("--max-requests", type=bounded(int, 1, 100_000), default=200,
                   help="most requests per run (default 200)")
    p.add_argument("--time-limit", type=bounded(float, 0, low_open=True), default=120.0,
                   help="seconds after a run's last arrival by which every request must have ended; those still "
                        "open are cut off and count as missing the SLOs (default 120)")
    p.add_argument("--compare-policies", default=None, metavar="P",
                   help="policies to run side by side, comma-separated, e.g. cost,least_loaded"
                        + (" (serve restarts for each)" if serve else "") + " (default: --policy alone)")
    p.add_argument("--slo-from", default=None, metavar="JSON",
                   help="take the SLOs from an earlier bench serve or bench sim report (its \"slo\"), so runs judge "
                        "the same objectives (default: --ttft-slo/--tpot-slo, else 3 x the unloaded figures of the "
                        "first layout)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures to this JSON file")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="write goodput and p99 TTFT against offered load to this PNG (needs matplotlib)")


def add_serve_parser(sub) -> None:
    from hybridgate.config import bounded
    from hybridgate.settings import add_command_settings

    p = sub.add_parser("serve", help="open-loop Poisson load on a real gateway: goodput under SLOs, TTFT/TPOT/e2e "
                                     "percentiles, plan mix, capacity under SLO, per policy and layout")
    add_command_settings(p, "bench serve")
    _add_load_args(p, serve=True)
    p.add_argument("--target", default=None, metavar="HOST:PORT",
                   help="drive this running gateway, and nothing else (default: start hybridgate serve on "
                        "127.0.0.1 with a free port, once per layout and policy)")
    p.add_argument("--protocol", choices=("grpc", "openai"), default="grpc",
                   help="how the load generator talks to the gateway: its gRPC stream, or the OpenAI-compatible HTTP "
                        "API (/v1/completions, server-sent events; --target is then the HTTP HOST:PORT); "
                        "the plan mix is known only over gRPC (default grpc)")
    p.add_argument("--layouts", default=None, metavar="L",
                   help="worker layouts to start, comma-separated, each gpu, cpu or a sum like gpu+cpu or cpu*2; "
                        "every layout gets the same --total-threads (default gpu+cpu)")
    p.add_argument("--total-threads", type=bounded(int, 1), default=None,
                   help="threads of all the workers together, split evenly among a layout's workers "
                        "(default: the machine's cores)")
    p.add_argument("--serve-arg", action="append", default=None, metavar="FLAG",
                   help="one more flag for the serve it starts, e.g. --serve-arg=--max-num-seqs=32; repeat for several")
    p.add_argument("--startup-timeout", type=bounded(float, 0, low_open=True), default=300.0,
                   help="seconds for serve to be READY (default 300)")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="where serve's logs go (default: a new temporary folder)")
    p.add_argument("--chaos-kill-every", type=bounded(float, 0, low_open=True), default=None, metavar="S",
                   help="instead of the search and sweep, one load run of --chaos-duration seconds at the first of "
                        "--rates (default: half the unloaded rate) while a worker process is SIGKILLed every S "
                        "seconds; reports requests lost, blocks and pinned bytes leaked, recovery after each restart")
    p.add_argument("--compare-protocols", action="store_true",
                   help="instead of the search and sweep: one serve of the first layout, the same requests over gRPC "
                        "and over the OpenAI HTTP door alternately, one stream at a time and --compare-concurrency "
                        "at once; decode tokens/s, aggregate tokens/s, TTFT, gateway CPU per streamed token and "
                        "the HTTP/gRPC ratios (medians over --compare-pairs)")
    p.add_argument("--compare-pairs", type=bounded(int, 1, 100), default=5,
                   help="with --compare-protocols: gRPC/HTTP run pairs per case (default 5)")
    p.add_argument("--compare-concurrency", type=bounded(int, 1, 1024), default=64,
                   help="with --compare-protocols: streams at once in the concurrent case (default 64)")
    p.add_argument("--compare-max-tokens", type=bounded(int, 2, 4096), default=128,
                   help="with --compare-protocols: ids per request at one stream; a quarter of it (at least 8) "
                        "per stream in the concurrent case (default 128)")
    p.add_argument("--chaos-duration", type=bounded(float, 0, low_open=True), default=180.0,
                   help="seconds of arrivals of the chaos run (default 180)")
    p.set_defaults(func=_run_serve)


def _run_serve(args) -> int:
    from hybridgate.bench import serve

    report = serve.run(args)
    chaos = report.get("chaos")
    return 1 if chaos and (chaos["lost"] or chaos["leaked_blocks"] or chaos["leaked_pinned_bytes"]) else 0


def add_sim_parser(sub) -> None:
    p = sub.add_parser("sim", help="discrete-event simulation of a worker layout driving the real policy objects, "
                                   "worker models from calibration profiles; bench serve's figures")
    from hybridgate.settings import add_command_settings

    add_command_settings(p, "bench sim")
    _add_load_args(p, serve=False)
    p.add_argument("--layouts", default=None, metavar="L",
                   help="layouts, comma-separated, each a sum of profiles with counts, e.g. "
                        "h200-llama8b*1+epyc32-llama8b*8; a profile is a JSON file (bench engine --profile-out) or the "
                        "name of a shipped one: smollm2-gpu-t1, smollm2-cpu-t1, smollm2-gpu-t2, smollm2-cpu-t2, "
                        "smollm2-gpu-t1-xeon, smollm2-cpu-t1-xeon, "
                        "h200-llama8b, epyc32-llama8b")
    p.add_argument("--frontend-latency", default="0", metavar="S|auto",
                   help="seconds added to every request's TTFT for what a worker profile does not hold: the client, "
                        "gateway and sockets on the way to the worker's first step and back; 'auto' takes, per layout, "
                        "the --slo-from report's unloaded TTFT at its shortest probe less the layout's own at that "
                        "prompt length (default 0)")
    p.set_defaults(func=_run_sim)


def _run_sim(args) -> int:
    from hybridgate.bench import sim

    sim.run(args)
    return 0


def add_cache_parser(sub) -> None:
    from hybridgate.config import bounded
    from hybridgate.settings import add_command_settings

    p = sub.add_parser("cache", help="the response cache over gRPC: a hit's TTFT beside one round trip, a long "
                                     "answer replayed against generated, single-flight against one request")
    add_command_settings(p, "bench cache")
    p.add_argument("--redis-url", default=None, help="the Redis of the redis mode (default: a redis-server "
                                                     "started here from PATH on a free port)")
    p.add_argument("--threads", type=bounded(int, 1), default=1, help="the CPU worker's threads (default 1)")
    p.add_argument("--repeats", type=bounded(int, 1), default=7, help="runs per case; medians are reported (default 7)")
    p.add_argument("--replay-tokens", type=bounded(int, 1), default=1000,
                   help="tokens of the answer generated once and replayed (default 1000)")
    p.add_argument("--coalesce", type=bounded(int, 2), default=10,
                   help="identical requests sent at once in the single-flight case (default 10)")
    p.add_argument("--coalesce-tokens", type=bounded(int, 1), default=48,
                   help="tokens of each single-flight request (default 48)")
    p.add_argument("--startup-timeout", type=bounded(float, 0, low_open=True), default=120.0,
                   help="seconds for the worker and gateways to be READY (default 120)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures to this JSON file")
    p.set_defaults(func=_run_cache)


def _run_cache(args) -> int:
    from hybridgate.bench import cache

    report = cache.run(args)
    c = report.get("coalescing")
    return 0 if c is not None and not c["errors"] else 1


def add_report_parser(sub) -> None:
    p = sub.add_parser("report", help="render the benchmark pages' tables from the results JSON under docs/results/")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 when a page differs from what it would render (for CI)")
    p.add_argument("--docs", default="docs", metavar="DIR",
                   help="the documentation folder holding results/ and the pages (default: docs)")
    p.set_defaults(func=_run_report)


def _run_report(args) -> int:
    from hybridgate.bench import report

    return report.run(args)


def add_attention_parser(sub) -> None:
    from hybridgate.config import bounded

    p = sub.add_parser("attention", help="the GPU worker's paged attention kernels against the gather+SDPA path and "
                                         "dense SDPA, against the probed copy bandwidth and matmul rate")
    p.add_argument("--device", default=None, help="torch device (default: cuda if present, else cpu)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="KV and query dtype (default bf16)")
    p.add_argument("--heads", type=bounded(int, 1), default=32, help="query heads (default 32: Llama-3.1-8B)")
    p.add_argument("--kv-heads", type=bounded(int, 1), default=8, help="KV heads (default 8)")
    p.add_argument("--head-dim", type=bounded(int, 16), default=128, help="head dimension (default 128)")
    p.add_argument("--block-size", type=bounded(int, 16), default=16, help="tokens per KV block (default 16)")
    p.add_argument("--batch", type=bounded(int, 1, many=True), default=[1, 16, 64, 256],
                   help="decode batch sizes, comma-separated (default 1,16,64,256)")
    p.add_argument("--context", type=bounded(int, 1, many=True), default=[1024, 8192, 32768],
                   help="context lengths, comma-separated (default 1024,8192,32768)")
    p.add_argument("--prefill-chunk", type=bounded(int, 1), default=2048,
                   help="query tokens of the prefill row (default 2048)")
    p.add_argument("--prefill-prefix", type=bounded(int, 0), default=8192,
                   help="cached tokens before the prefill chunk (default 8192)")
    p.add_argument("--max-kv-gib", type=float, default=40.0,
                   help="skip a case whose cache, gathered copy and dense tensors together pass this (default 40)")
    p.add_argument("--copy-mib", type=bounded(int, 1), default=1024,
                   help="MiB of the device-to-device copy that probes the bandwidth (default 1024)")
    p.add_argument("--repeats", type=bounded(int, 1), default=20, help="timed calls per path; medians (default 20)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, for a CPU device under TRITON_INTERPRET=1: checks the benchmark, times nothing")
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures to this JSON file")
    p.set_defaults(func=_run_attention)


def _run_attention(args) -> int:
    from hybridgate.bench import attention

    return attention.run(args)


def add_embeddings_parser(sub) -> None:
    from hybridgate.config import bounded

    p = sub.add_parser("embeddings", help="N short inputs in one embeddings request against the same prompts' "
                                          "prefill tokens/s, in-process on one worker")
    p.add_argument("--model", default=None, metavar="PATH", help="GGUF file (default: the default model)")
    p.add_argument("--kind", choices=("cpu", "gpu"), default="cpu",
                   help="the worker: cpu (the Numba runner) or gpu (the torch runner) (default cpu)")
    p.add_argument("--device", default=None, help="--kind gpu: torch device (default: cuda if present, else cpu)")
    p.add_argument("--threads", type=bounded(int, 1), default=None, help="--kind cpu: threads (default: Numba's)")
    p.add_argument("--inputs", type=bounded(int, 1), default=64, help="inputs of the request (default 64)")
    p.add_argument("--pooling", choices=("mean", "cls", "last"), default="last",
                   help="the pooling of a file that names none (default last)")
    p.add_argument("--repeats", type=bounded(int, 1), default=3, help="runs of each case, alternated; medians "
                                                                       "(default 3)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures to this JSON file")
    p.set_defaults(func=_run_embeddings)


def _run_embeddings(args) -> int:
    from hybridgate.bench import embeddings

    return embeddings.run(args)
