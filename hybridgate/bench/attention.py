"""`hybridgate bench attention`: the GPU worker's paged attention kernels against the reference path and dense
SDPA on the same data, with the device's copy bandwidth and matmul rate probed in the same run.

For each (batch, context) a paged cache of one layer is filled at random (blocks shuffled, as a long-running
cache holds them) and three paths attend for one decode step (one query token per sequence): our Triton
kernel (`kernels.attention.paged_attention`, split-KV where `num_splits_for` chooses it), the reference path
(`attention.PagedAttention`: gather the blocks, then masked SDPA) and dense SDPA over contiguous
`[batch, heads, context, head_dim]` tensors (no paging: what a paged kernel can at best match; for a
prefill chunk without a mask, every query over every key: more work than the causal chunk). One prefill
row: a chunk of `--prefill-chunk` tokens over a cached prefix of `--prefill-prefix`, batch 1. Each figure is
the median over `--repeats` timed calls, alternated between the paths; each row gives the KV bytes a decode
reads over its time (GB/s) against the probed copy bandwidth (bytes read plus bytes written of a
device-to-device copy, FACTS.md), a prefill's attention FLOP rate against the probed matmul rate, and our
speedups over the other two.

On a CPU device the kernels run only under Triton's interpreter (`TRITON_INTERPRET=1`): `--smoke` runs
tiny shapes there, to check the benchmark itself, not to time anything.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from hybridgate.models import ModelConfig


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fns: dict, repeats: int, device: torch.device) -> dict[str, float]:
    """Median milliseconds of each callable, calls alternated between them (one warm-up call each first)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def probe_copy_gbs(device: torch.device, mib: int, repeats: int) -> float:
    """Device-to-device copy of `mib` MiB: bytes read plus written per second, in GB/s (median)."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _median_ms({"copy": lambda: dst.copy_(src)}, repeats, device)["copy"]
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def probe_matmul_tflops(device: torch.device, n: int, dtype: torch.dtype, repeats: int) -> float:
    """An n x n x n matmul in `dtype`: TFLOP/s (median)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = _median_ms({"mm": lambda: a @ b}, repeats, device)["mm"]
    return 2 * n**3 / (ms * 1e-3) / 1e12


class _Layer:
    """One layer's paged cache holding `batch` sequences of `context` keys, and a step's queries."""

    def __init__(self, batch: int, context: int, q_len: int, heads: int, kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, device: torch.device):
        from hybridgate.workers.gpu.attention import KernelStep, PagedKVCache, PagedStep, num_splits_for

        per_seq = -(-context // block_size)
        blocks = batch * per_seq + 1
        g = torch.Generator(device="cpu").manual_seed(0)
        self.config = _attention_only(heads, kv_heads, head_dim)
        self.cache = PagedKVCache(self.config, blocks, block_size, device, dtype)
        for t in self.cache.k + self.cache.v:
            t.normal_()
        order = torch.randperm(blocks - 1, generator=g).to(device)
        tables = order.view(batch, per_seq)
        self.q = torch.randn(batch * q_len, heads, head_dim, device=device, dtype=dtype)
        self.k_new = torch.randn(batch * q_len, kv_heads, head_dim, device=device, dtype=dtype)
        self.v_new = torch.randn_like(self.k_new)
        positions = torch.arange(context - q_len, context, device=device)
        slots = (tables[:, positions // block_size] * block_size + positions % block_size).reshape(-1)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.kernel_step = KernelStep(slots, tables.to(torch.int32), lens,
                                      torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=device),
                                      q_len, num_splits_for(batch, q_len, kv_heads, device))
        span = per_seq * block_size
        mask = (torch.arange(span, device=device)[None, :] < context)[:, None, None, :]
        self.ref_step = PagedStep(slots=slots, decode_rows=torch.arange(batch, device=device) if q_len == 1 else None,
                                  decode_context=None, decode_mask=None, decode_blocks=tables.long(),
                                  decode_block_mask=mask, decode_lengths=lens.long(),
                                  prefills=[] if q_len == 1 else [
                                      (0, q_len, (tables[0, :, None] * block_size +
                                                  torch.arange(block_size, device=device)).reshape(-1)[:context])])
        self.dense_k = torch.randn(batch, kv_heads, context, head_dim, device=device, dtype=dtype)
        self.dense_v = torch.randn_like(self.dense_k)
        self.kv_bytes = 2 * batch * context * kv_heads * head_dim * self.dense_k.element_size()

    def ours(self):
        from hybridgate.workers.gpu.attention import KernelAttention

        return KernelAttention(self.cache, self.kernel_step)(0, self.q, self.k_new, self.v_new)

    def reference(self):
        from hybridgate.workers.gpu.attention import PagedAttention

        return PagedAttention(self.cache, self.ref_step)(0, self.q, self.k_new, self.v_new)

    def dense(self, q_len: int):
        b, kv, ctx, d = self.dense_k.shape
        q = self.q.view(b, q_len, -1, d).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, self.dense_k, self.dense_v, enable_gqa=True)


def _attention_only(heads: int, kv_heads: int, head_dim: int) -> ModelConfig:
    """A one-layer ModelConfig with only the attention fields set: what the cache and both attention paths read
    (no sinks, no window; the other sizes are placeholders no path here reads)."""
    return ModelConfig(architecture="llama", name="attention-bench", num_layers=1, hidden_size=heads * head_dim,
                       intermediate_size=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       max_model_len=1 << 20, rope_theta=10000.0, rms_norm_eps=1e-6, vocab_size=1,
                       bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)


def run_case(batch: int, context: int, q_len: int, args, device: torch.device, dtype: torch.dtype,
             copy_gbs: float, tflops: float) -> dict:
    layer = _Layer(batch, context, q_len, args.heads, args.kv_heads, args.head_dim, args.block_size, dtype, device)
    ms = _median_ms({"ours": layer.ours, "reference": layer.reference, "dense": lambda: layer.dense(q_len)},
                    args.repeats, device)
    row = {"batch": batch, "context": context, "query_tokens": q_len, "num_splits": layer.kernel_step.num_splits,
           "ms": ms, "kv_bytes": layer.kv_bytes, "speedup_vs_reference": ms["reference"] / ms["ours"],
           "speedup_vs_dense": ms["dense"] / ms["ours"]}
    if q_len == 1:
        row["kv_read_gbs"] = layer.kv_bytes / (ms["ours"] * 1e-3) / 1e9
        row["fraction_of_copy_bandwidth"] = row["kv_read_gbs"] / copy_gbs
    else:
        prefix = context - q_len
        flops = 4 * batch * args.heads * args.head_dim * q_len * (prefix + (q_len + 1) / 2)
        row["attention_tflops"] = flops / (ms["ours"] * 1e-3) / 1e12
        row["fraction_of_matmul_rate"] = row["attention_tflops"] / tflops
    return row


def run(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if device.type != "cuda":
        import triton

        if not triton.knobs.runtime.interpret or not args.smoke:
            print("bench attention: on a CPU device run with --smoke and TRITON_INTERPRET=1 (the kernels are "
                  "interpreted there: a check of the benchmark, not a timing)")
            return 2
    smoke = args.smoke
    batches, contexts = ([2], [33]) if smoke else (args.batch, args.context)
    copy_gbs = probe_copy_gbs(device, 4 if smoke else args.copy_mib, args.repeats)
    tflops = probe_matmul_tflops(device, 64 if smoke else 8192, dtype if device.type == "cuda" else torch.float32,
                                 args.repeats)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreted)"
    rows = []
    budget = args.max_kv_gib * 2**30
    for batch in batches:
        for context in contexts:
            kv = 2 * batch * context * args.kv_heads * args.head_dim * torch.empty((), dtype=dtype).element_size()
            if 3 * kv > budget:  # the paged cache, the reference's gathered copy and the dense tensors
                print(f"skip batch {batch} x context {context}: {3 * kv / 2**30:.1f} GiB over --max-kv-gib")
                continue
            rows.append(run_case(batch, context, 1, args, device, dtype, copy_gbs, tflops))
            _print(rows[-1])
    chunk, prefix = (16, 17) if smoke else (args.prefill_chunk, args.prefill_prefix)
    rows.append(run_case(1, prefix + chunk, chunk, args, device, dtype, copy_gbs, tflops))
    _print(rows[-1])
    result = {"device": device_name, "torch": torch.__version__, "dtype": args.dtype, "heads": args.heads,
              "kv_heads": args.kv_heads, "head_dim": args.head_dim, "block_size": args.block_size,
              "copy_gbs": copy_gbs, "matmul_tflops": tflops, "repeats": args.repeats, "rows": rows}
    print(f"{device_name}: copy {copy_gbs:.0f} GB/s (read + written), matmul {tflops:.0f} TFLOP/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _print(row: dict) -> None:
    ms = row["ms"]
    tail = (f"{row['kv_read_gbs']:.0f} GB/s = {row['fraction_of_copy_bandwidth']:.0%} of copy"
            if "kv_read_gbs" in row else
            f"{row['attention_tflops']:.1f} TFLOP/s = {row['fraction_of_matmul_rate']:.0%} of matmul")
    print(f"batch {row['batch']:>4} context {row['context']:>6} q {row['query_tokens']:>5}: ours {ms['ours']:.3f} ms, "
          f"reference {ms['reference']:.3f} ms ({row['speedup_vs_reference']:.1f}x), dense {ms['dense']:.3f} ms "
          f"({row['speedup_vs_dense']:.2f}x); {tail}")
