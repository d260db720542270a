"""`bench engine --kind gpu --shape NAME`: the torch runner at a real model's shapes, in bf16 on random weights made
on the device (`device_weights`: nothing large is written or carried), against the device's own roofline and
transformers on the same weights, in one run.

Probed first, in the same process: the device-to-device copy bandwidth (bytes read plus written per second:
the device's whole memory traffic, FACTS.md) and the matmul rate of an n x n x n product in the runner's
dtype (`bench.attention`'s probes). Then, each figure a median over `--repeats`:
- the batch-1 decode step (`--prompt-len` tokens of context) against its memory bound: (the weight bytes a
  step reads, every matrix and the LM head, + the KV bytes of its context) / the copy bandwidth;
- output tokens/s at each `--concurrency`: c prompts of `--prompt-len` random ids, `--new-tokens` each, c x
  new tokens over the whole run's wall time (prefill included), beside transformers' `generate` on the
  same tensors (`transformers_twin`; left padding, exactly `--new-tokens`) at `--baseline-concurrency`;
- prefill tokens/s of one prompt of each `--prefill-lens`, and the FLOP rate that makes (2 x the matrices'
  parameters per token, the LM head for the last token only, and causal attention's 2 x 2 x heads x
  head_dim x T(T+1)/2 per layer) as a fraction of the probed matmul rate; transformers' one forward beside;
- a mixed step (one `--mixed-chunk`-token prompt chunk with `--mixed-decodes` decodes) against the pure
  decode step of those decodes plus the chunk's step alone;
- the KV hand-off's export (`KVExporter` to a real ZeroMQ socket, `--handoff-len` tokens) while
  `--mixed-decodes` sequences go on decoding: the fraction of its copy time hidden behind their steps.
Each figure is also printed as one `summary:` line with the issue's target beside it; `--json` writes all of
them, `bench report` renders `results/gpu-engine/*.json` into the GPU worker's benchmark page. `--tiny` (the shape's
family at tiny widths, `Shape.tiny`) and `--layers` make a run that a CPU torch device finishes in seconds.
"""

from __future__ import annotations

import json
import queue
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from hybridgate.bench.attention import probe_copy_gbs, probe_matmul_tflops
from hybridgate.bench.device_weights import RandomModel, transformers_twin
from hybridgate.bench.engine import (BENCH_SCHEDULER, EngineBench, TransformersBaseline, _alternate, _median, _print,
                                     apply_defaults)
from hybridgate.bench.shapes import Shape, shape as named_shape
from hybridgate.mempool import DEFAULT_BLOCK_SIZE as BLOCK
from hybridgate.wire import AddRequest, HandoffTarget, SamplingParams
from hybridgate.workers.gpu.attention import PagedKVCache

GREEDY = SamplingParams(temperature=0, ignore_eos=True)
WHOLE_CHUNKS = replace(BENCH_SCHEDULER, mixed_step_budget=0)  # prompt chunks of the whole token budget
HANDOFF_ENDPOINT = "inproc://bench-handoff"
HANDOFF_TIMEOUT_S = 120.0
# The targets, printed beside each figure: JSON path -> (comparison, bound or {shape: bound}).
TARGETS = {"decode_step.over_bound": ("<=", {"llama-3.1-8b": 1.3, "llama-3.2-1b": 2.0}),
           "mixed_step.over_sum": ("<=", 1.3), "handoff.hidden_fraction": (">=", 0.9),
           "prefill.8192.fraction_of_matmul_rate": (">=", {"llama-3.1-8b": 0.5}),
           "decode.64.ratio": (">=", {"llama-3.2-1b": 4.0}), "decode.256.ratio": (">=", {"llama-3.2-1b": 4.0})}


def bench_shape(args) -> Shape:
    """`--shape`, made tiny with `--tiny`, then cut to `--layers` blocks."""
    s = named_shape(args.shape)
    s = s.tiny() if args.tiny else s
    return s.with_layers(args.layers) if args.layers else s


def kv_tokens_needed(args) -> tuple[int, int]:
    """(blocks' worth of tokens, the longest sequence) the cases need at once, so the KV cache is sized for the
    run (and transformers keeps the rest of the device): the largest of the decode runs, the longest prefill,
    the mixed step's and the hand-off's sequences, each rounded up to whole blocks with one spare."""
    def tokens(seqs: int, length: int) -> int:
        return seqs * (-(-length // BLOCK) + 1) * BLOCK

    steps = 2 * args.repeats + 70  # decode steps of the mixed case's and batch-1 case's sequences at most
    longest = max(args.prompt_len + max(args.new_tokens, steps, 1024), max(args.prefill_lens) + 1,
                  args.handoff_len + 8)
    need = max(tokens(max(args.concurrency), args.prompt_len + args.new_tokens), tokens(1, longest),
               tokens(args.mixed_decodes, args.prompt_len + steps) + tokens(1, args.mixed_chunk + 1),
               tokens(args.mixed_decodes, args.prompt_len + 1024) + tokens(1, args.handoff_len + 8))
    return need, longest


def build(args, settings, threads: int | None):
    """(EngineBench on the random model, the model, the shape, the device)."""
    from hybridgate.workers.gpu.runner import TorchRunner

    engine = settings.worker.engine
    device = torch.device(engine.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if threads:
        torch.set_num_threads(threads)
    s = bench_shape(args)
    model = RandomModel(s, args.seed, device, dtype)
    need, longest = kv_tokens_needed(args)
    sized = need // BLOCK * PagedKVCache.block_bytes(model.config, BLOCK, dtype)
    memory = engine.kv_cache_memory or max(1 << 20, sized)
    runner = TorchRunner(model, device, dtype, kv_cache_memory=memory, max_model_len=longest, load=model.load,
                         max_num_seqs=BENCH_SCHEDULER.max_num_seqs,
                         max_num_batched_tokens=BENCH_SCHEDULER.max_num_batched_tokens)
    return EngineBench(runner, model.fingerprint), model, s, device


def random_prompts(rng: np.random.Generator, vocab: int, count: int, length: int) -> list[list[int]]:
    return [rng.integers(1, vocab, length).tolist() for _ in range(count)]


def step_bytes(runner, context: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step of one sequence at `context` tokens reads: every weight but an
    untied embedding (of which it reads one row), and K and V of every layer."""
    m, c = runner.model, runner.model.config
    weights = m.weight_bytes - (0 if m.lm_head is m.embed else m.embed.numel() * m.embed.element_size())
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * m.embed.element_size() * context
    return weights, kv


def prefill_flops(config, tokens: int) -> float:
    """FLOPs of prefilling `tokens` tokens of one sequence: 2 x parameters of the block matrices per token, the
    LM head once (logits of the last token), causal attention 4 x heads x head_dim x T(T+1)/2 per layer."""
    c = config
    per_layer = c.hidden_size * (c.q_dim + 2 * c.kv_dim) + c.q_dim * c.hidden_size + 3 * c.hidden_size * \
        c.intermediate_size
    linear = 2 * tokens * c.num_layers * per_layer + 2 * c.hidden_size * c.vocab_size
    attention = 4 * c.num_layers * c.num_heads * c.head_dim * tokens * (tokens + 1) / 2
    return linear + attention


def _add(engine, request: AddRequest, client: bytes = b"") -> None:
    """Add `request`; raises RuntimeError with the engine's refusal (a case sized past the cache or the length)."""
    error = engine.add(request, client)
    if error is not None:
        raise RuntimeError(f"bench request {request.request_id} refused: {error.message}")


def _timed_step(engine) -> float:
    start = time.perf_counter()
    engine.step()
    return (time.perf_counter() - start) * 1e3


def mixed_step(ours: EngineBench, rng, vocab: int, args) -> dict:
    """Medians (ms) of the pure decode step of `--mixed-decodes` sequences, of that step with one
    `--mixed-chunk`-token prompt added (the mixed step; the prompt finishes in it: one token out), and of the
    chunk's step alone on an idle engine. The scheduler runs without --mixed-step-budget (which would cut the chunk
    by the measured rates), so the step is exactly the chunk and the decodes; raises RuntimeError when it was not
    (the figure would not be a mixed step)."""
    engine = ours.engine(scheduler=WHOLE_CHUNKS)
    # The first prompts decode one token a step while the later ones prefill: room for those, the warm step and
    # the timed ones, so that no decode finishes before the last timed step (within kv_tokens_needed's steps).
    prefill_steps = -(-args.mixed_decodes * args.prompt_len // WHOLE_CHUNKS.max_num_batched_tokens)
    for i, ids in enumerate(random_prompts(rng, vocab, args.mixed_decodes, args.prompt_len)):
        _add(engine, AddRequest(f"d{i}", ids, GREEDY, 0, prefill_steps + 2 * args.repeats + 8, -1))
    while engine.scheduler.waiting or any(s.num_computed < s.num_tokens - 1 for s in engine.scheduler.running):
        engine.step()
    engine.step()  # one decode step first: graphs and caches warm
    decode, mixed, alone = [], [], []
    for r in range(args.repeats):
        decode.append(_timed_step(engine))
        before = sum(s.num_tokens for s in engine.scheduler.running)
        _add(engine, AddRequest(f"c{r}", random_prompts(rng, vocab, 1, args.mixed_chunk)[0], GREEDY, 0, 1, -1))
        mixed.append(_timed_step(engine))
        after = sum(s.num_tokens for s in engine.scheduler.running)
        if engine.scheduler.waiting or len(engine.scheduler.running) != args.mixed_decodes or \
                after != before + args.mixed_decodes:
            raise RuntimeError(f"mixed step: the {args.mixed_chunk}-token chunk and {args.mixed_decodes} decodes did "
                               "not run in one step (raise --max-num-batched-tokens)")
    engine.abort([f"d{i}" for i in range(args.mixed_decodes)])
    for r in range(args.repeats):
        single = ours.engine()
        _add(single, AddRequest(f"a{r}", random_prompts(rng, vocab, 1, args.mixed_chunk)[0], GREEDY, 0, 1, -1))
        alone.append(_timed_step(single))
    row = {"chunk_tokens": args.mixed_chunk, "decodes": args.mixed_decodes, "mixed_ms": statistics.median(mixed),
           "decode_ms": statistics.median(decode), "chunk_alone_ms": statistics.median(alone)}
    row["over_sum"] = row["mixed_ms"] / (row["decode_ms"] + row["chunk_alone_ms"])
    return row


def _handoff_once(ours: EngineBench, exporter, sock, events: queue.Queue, prompt, others) -> dict:
    """One hand-off of `prompt` while `others` decode: its bytes, copy ms and hidden fraction (engine stats)."""
    engine = ours.engine()
    engine.handoffs.exporter = exporter
    room = min(1024, ours.runner.max_model_len - max(map(len, others)))  # decodes outlast the export
    for i, ids in enumerate(others):
        _add(engine, AddRequest(f"o{i}", ids, GREEDY, 0, room, -1), b"r")
    while engine.scheduler.waiting or any(s.num_computed < s.num_tokens - 1 for s in engine.scheduler.running):
        engine.step()
    _add(engine, AddRequest("h", prompt, GREEDY, 0, 8, -1, handoff=HandoffTarget(HANDOFF_ENDPOINT, "bench")), b"r")
    while not engine.handoffs.parked:
        engine.step()
    event, deadline = None, time.monotonic() + HANDOFF_TIMEOUT_S
    while event is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"hand-off: no export event within {HANDOFF_TIMEOUT_S:.0f} s")
        engine.step()  # the next decode steps run while the export copies
        while sock.poll(0):
            sock.recv_multipart()
        try:
            event = events.get_nowait()
        except queue.Empty:
            pass
    if event.kind != "sent":
        raise RuntimeError(f"hand-off: the export {event.kind}: {event.reason}")
    engine.handoffs.handle(b"", event)
    stats = engine.refresh_stats()
    engine.abort([f"o{i}" for i in range(len(others))] + ["h"], b"r")
    copy, hidden = stats.handoff_copy_seconds_total, stats.handoff_copy_hidden_seconds_total
    return {"bytes": stats.handoff_bytes_total, "copy_ms": copy * 1e3, "hidden_ms": hidden * 1e3,
            "hidden_fraction": hidden / copy if copy > 0 else 0.0}


def handoff(ours: EngineBench, rng, vocab: int, args) -> dict:
    """Medians over `--repeats` hand-offs of a `--handoff-len`-token prompt under `--mixed-decodes` decodes."""
    import zmq

    from hybridgate.workers.gpu.export import KVExporter

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(HANDOFF_ENDPOINT)
    events: queue.Queue = queue.Queue()
    exporter = KVExporter(ours.runner, ctx, events.put)
    try:
        rows = [_handoff_once(ours, exporter, sock, events, random_prompts(rng, vocab, 1, args.handoff_len)[0],
                              random_prompts(rng, vocab, args.mixed_decodes, args.prompt_len))
                for _ in range(args.repeats)]
    finally:
        exporter.close()
        sock.close(0)
        ctx.term()
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out.update(bytes=int(out["bytes"]), tokens=args.handoff_len, decodes=args.mixed_decodes)
    return out


def decode_step(ours: EngineBench, prompt: list[int], copy_gbs: float, repeats: int) -> dict:
    """The batch-1 decode step (median ms) over its memory bound at the copy bandwidth."""
    ms = _median(lambda: ours.decode_step_ms(prompt), repeats)
    weights, kv = step_bytes(ours.runner, len(prompt) + 32)  # the 64 timed steps' middle context
    bound_ms = (weights + kv) / (copy_gbs * 1e9) * 1e3
    return {"ms": ms, "context_tokens": len(prompt) + 32, "weight_bytes": weights, "kv_bytes": kv,
            "bound_ms": bound_ms, "over_bound": ms / bound_ms}


def decode_rows(ours: EngineBench, twin, rng, vocab: int, args, done=lambda rows: None) -> dict:
    """{concurrency: row}: output tokens/s, ours beside transformers at `--baseline-concurrency`; `done(rows)`
    after each row."""
    rows = {}
    for c in args.concurrency:
        batch = random_prompts(rng, vocab, c, args.prompt_len)
        bases = {"transformers": twin} if twin is not None and c in args.baseline_concurrency else {}
        rows[c] = _alternate(lambda b: b.decode(batch, args.new_tokens), ours, bases, args.repeats)
        _print("decode", f"c={c}", rows[c])
        done(rows)
    return rows


def prefill_rows(ours: EngineBench, twin, rng, vocab: int, args, matmul_tflops: float, done=lambda rows: None) -> dict:
    """{prompt tokens: row}: prefill tokens/s of one prompt and its fraction of the matmul rate, beside transformers;
    `done(rows)` after each row."""
    rows = {}
    for length in args.prefill_lens:
        batch = random_prompts(rng, vocab, 1, length)
        rows[length] = row = _alternate(lambda b: b.prefill(batch), ours, {} if twin is None else
                                        {"transformers": twin}, args.repeats)
        row["hybridgate_tflops"] = prefill_flops(ours.runner.model.config, length) * \
            row["hybridgate_tokens_per_s"] / length / 1e12
        row["fraction_of_matmul_rate"] = row["hybridgate_tflops"] / matmul_tflops
        _print("prefill", f"{length}", row)
        done(rows)
    return rows


def run(args) -> dict:
    """The cases of the module docstring; returns (and with `--json` writes) the figures. Raises ValueError for
    flags of a GGUF file (--quant, --model) and a shape without transformers' twin (unless --baseline none)."""
    from hybridgate.bench.machine import describe
    from hybridgate.config import resolve
    from hybridgate.workers import affinity

    settings = resolve(args).settings
    if args.quant:
        raise ValueError("--quant: only with --kind cpu (--kind gpu --shape makes bf16 weights on the device)")
    if settings.model:
        raise ValueError("--shape and --model: name one model, not both")
    if args.baseline == "llama-cpp":
        raise ValueError("--baseline llama-cpp: only with --kind cpu")
    apply_defaults(args, "gpu-shape")
    threads = affinity.pin_engine(settings.worker.engine)  # before any compute thread starts
    ours, model, s, device = build(args, settings, threads)
    probes = 10 if device.type == "cuda" else 3
    copy_gbs = probe_copy_gbs(device, 1024 if device.type == "cuda" else 16, probes)
    matmul = probe_matmul_tflops(device, 8192 if device.type == "cuda" else 256, model.dtype, probes)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{s.name}: {name}, {str(model.dtype).removeprefix('torch.')}, weights "
          f"{ours.runner.model.weight_bytes / 2**30:.2f} GiB", flush=True)
    out = {"kind": "gpu", "shape": s.name, "layers": s.layers, "seed": args.seed, "device": name,
           "dtype": str(model.dtype).removeprefix("torch."), "torch": torch.__version__, "machine": describe(),
           "command": "hybridgate bench " + " ".join(sys.argv[2:]), "repeats": args.repeats,
           "prompt_tokens": args.prompt_len, "new_tokens": args.new_tokens,
           "weight_bytes": ours.runner.model.weight_bytes, "copy_gb_per_s": copy_gbs, "matmul_tflops": matmul}
    twin = None
    if args.baseline != "none" and not args.no_baseline:
        twin = TransformersBaseline(transformers_twin(ours.runner.model, s), device)
        import transformers

        out["transformers"] = transformers.__version__
    out["baseline"] = "transformers" if twin else "none"
    rng = np.random.default_rng(args.seed)
    vocab = s.vocab_size
    printed = 0

    def record(key: str, value) -> None:  # each figure printed and written as soon as it is measured
        nonlocal printed
        out[key] = value
        lines = summary_lines(out)
        for line in lines[printed:]:
            print(line, flush=True)
        printed = len(lines)
        if args.json:  # whole or not at all: a time limit may end the run at any moment
            path = Path(args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_suffix(".part").write_text(json.dumps(out, indent=1) + "\n")
            path.with_suffix(".part").replace(path)

    # The longest case last: a run cut short by its time limit keeps the figures measured before.
    record("decode_step", decode_step(ours, random_prompts(rng, vocab, 1, args.prompt_len)[0], copy_gbs, args.repeats))
    prefill_rows(ours, twin, rng, vocab, args, matmul, lambda rows: record("prefill", rows))
    record("mixed_step", mixed_step(ours, rng, vocab, args))
    record("handoff", handoff(ours, rng, vocab, args))
    decode_rows(ours, twin, rng, vocab, args, lambda rows: record("decode", rows))
    return out


def _target(path: str, shape_name: str) -> str:
    op, bound = TARGETS.get(path, ("", None))
    bound = bound.get(shape_name) if isinstance(bound, dict) else bound
    return f" (target {op} {bound:g})" if bound is not None else ""


def summary_lines(out: dict) -> list[str]:
    """One `summary:` line per figure measured so far, each with the issue's target where it sets one for this
    shape; in the order they are measured (the probes, the decode step, prefill, mixed step, hand-off, decode)."""
    s = out["shape"]
    head = f"summary: {s} on {out['device']}:"
    lines = [f"{head} copy bandwidth {out['copy_gb_per_s']:.0f} GB/s (read + written), {out['dtype']} matmul "
             f"{out['matmul_tflops']:.3g} TFLOP/s"]
    if "decode_step" in out:
        step = out["decode_step"]
        lines.append(f"{head} decode step at batch 1 {step['ms']:.3f} ms = {step['over_bound']:.2f}x (weights + KV) / "
                     f"copy bandwidth ({step['bound_ms']:.3f} ms){_target('decode_step.over_bound', s)}")
    for length, row in out.get("prefill", {}).items():
        lines.append(f"{head} prefill of {length} tokens {row['hybridgate_tokens_per_s']:.0f} tokens/s, "
                     f"{row['hybridgate_tflops']:.3g} TFLOP/s = {row['fraction_of_matmul_rate']:.1%} of the matmul "
                     f"rate{_target(f'prefill.{length}.fraction_of_matmul_rate', s)}")
    if "mixed_step" in out:
        m = out["mixed_step"]
        lines.append(f"{head} mixed step ({m['chunk_tokens']}-token chunk + {m['decodes']} decodes) "
                     f"{m['mixed_ms']:.2f} ms = {m['over_sum']:.2f}x (decode step {m['decode_ms']:.2f} + chunk alone "
                     f"{m['chunk_alone_ms']:.2f}){_target('mixed_step.over_sum', s)}")
    if "handoff" in out:
        h = out["handoff"]
        lines.append(f"{head} hand-off of {h['tokens']} tokens: copy {h['copy_ms']:.2f} ms, {h['hidden_fraction']:.0%} "
                     f"hidden behind {h['decodes']} decodes{_target('handoff.hidden_fraction', s)}")
    for c, row in out.get("decode", {}).items():
        versus = (f", {row['ratio']:.2f}x transformers generate ({row['transformers_tokens_per_s']:.0f})"
                  if "ratio" in row else "")
        lines.append(f"{head} output tokens/s at concurrency {c}: {row['hybridgate_tokens_per_s']:.0f}{versus}"
                     f"{_target(f'decode.{c}.ratio', s) if versus else ''}")
    return lines
