"""The Numba model runner: the same engine contract as the torch runner, on GGUF blocks."""

from __future__ import annotations

import logging
import os
import sys
import time

from hybridgate.workers.cpu import isa

isa.selected()  # before Numba is imported: it compiles for the chosen instruction set

import numba  # noqa: E402
import numpy as np  # noqa: E402

from hybridgate.cpuset import format_cpulist  # noqa: E402
from hybridgate.mempool import DEFAULT_BLOCK_SIZE, PinnedPool, PoolStats  # noqa: E402
from hybridgate.models import GGUFModel  # noqa: E402
from hybridgate.workers.cpu import model as cpu_model  # noqa: E402
from hybridgate.workers.cpu import blocks, kernel_table, quant  # noqa: E402
from hybridgate.workers.config import DEFAULT_KV_DTYPE  # noqa: E402
from hybridgate.workers.cpu.kvdtype import kv_dtype  # noqa: E402
from hybridgate.workers.cpu.model import CpuModel  # noqa: E402
from hybridgate.workers.cpu.threadfallback import ThreadFallback  # noqa: E402
from hybridgate.workers import pooling  # noqa: E402
from hybridgate.workers.faults import FaultHook  # noqa: E402
from hybridgate.workers.handoff_checks import KVLayout  # noqa: E402
from hybridgate.workers.memory import host_available_bytes, num_blocks_for  # noqa: E402
from hybridgate.workers.sampling import sample, token_logprobs  # noqa: E402
from hybridgate.workers.scheduler import ScheduledBatch, SchedulerConfig  # noqa: E402
from hybridgate.workers.sequence import Sequence  # noqa: E402
from hybridgate.workers.step_inputs import build_step_inputs, staging_bytes  # noqa: E402
from hybridgate.wire import TokenLogprobs  # noqa: E402

log = logging.getLogger("hybridgate.worker")

# The matmul kernels this path's table names under any cpu_activations, and the layers' own.
KERNELS = [
    *((name.split(".")[1], quant.kernel(name)) for name in sorted({kernel_table.choose(t, fmt, quant.PATH).kernel
                                                     for t in kernel_table.AUTO[quant.PATH] for fmt in kernel_table.FORMATS})),
    ("dequant_row", blocks.dequant_row),
    ("rms_norm", cpu_model.rms_norm), ("rope_and_store", cpu_model.rope_and_store),
    ("paged_attention", cpu_model.paged_attention), ("silu_mul", cpu_model.silu_mul),
    ("import_kv_layer", cpu_model.import_kv_layer), ("rms_norm_serial", cpu_model.rms_norm_serial),
    ("rope_and_store_serial", cpu_model.rope_and_store_serial),
    ("silu_mul_serial", cpu_model.silu_mul_serial), ("qkv_prologue", cpu_model.qkv_prologue),
    ("qkv_prologue_serial", cpu_model.qkv_prologue_serial), ("gelu_tanh_mul", cpu_model.gelu_tanh_mul),
    ("gelu_tanh_mul_serial", cpu_model.gelu_tanh_mul_serial),
]


def type_names(model: cpu_model.CpuModel, layers_only: bool = False) -> list[str]:
    """The weight types ("Q4_K", ...) of the model's matrices, sorted; `layers_only`: of its layers' alone, the
    matrices that multiply a prompt's rows (the LM head takes each sequence's last row only)."""
    matrices = [m for layer in model.layers for m in layer.arrays() if hasattr(m, "kind") or hasattr(m, "parts")]
    matrices += [] if layers_only else [model.lm_head]
    kinds = {part.kind for m in matrices for part in getattr(m, "parts", [m]) if hasattr(part, "kind")}
    return sorted(blocks.LAYOUTS[k].name for k in kinds if k in blocks.LAYOUTS)


def activations_summary(model: cpu_model.CpuModel, setting: str) -> str:
    """The activation formats the model's matrices run, e.g. "auto: q4_1 i16/32, q4_k i16/256 (prompts i8/32)"."""
    rows = {name: kernel_table.choose(name, setting, quant.PATH) for name in type_names(model)}
    return f"{setting}: " + ", ".join(f"{name.lower()} {row.decode}" + (f" (prompts {row.prompt})" if row.prompt else "")
                                      for name, row in rows.items())


def kernel_cache_stats() -> tuple[int, int]:
    """(cache hits, cache misses) of the compiled kernels in this process (Numba's dispatcher stats)."""
    hits = sum(sum(k.stats.cache_hits.values()) for _, k in KERNELS)
    misses = sum(sum(k.stats.cache_misses.values()) for _, k in KERNELS)
    return hits, misses


class NumbaRunner:
    """Runs `CpuModel` over a paged host KV cache and samples with the numpy sampler.

    kv_cache_dtype: the cache's element format, fp32, fp16 or bf16 (`kvdtype`); a 16-bit
    cache holds twice the blocks in the same kv_cache_memory. Raises ValueError naming the
    setting for any other value. thread_fallback: decode steps move to fewer threads while
    those measure faster (`threadfallback`: cores shared with other processes). max_num_seqs,
    max_num_batched_tokens: the scheduler's, which size the staging buffers (`staging_bytes`)."""

    kind = "cpu"

    def __init__(self, model: GGUFModel, kv_cache_memory: str | float | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, max_num_blocks: int | None = None, threads: int | None = None,
                 activations: str = "auto", kv_cache_dtype: str = DEFAULT_KV_DTYPE, thread_fallback: bool = False,
                 max_num_seqs: int = SchedulerConfig.max_num_seqs,
                 max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens):
        self.kv_dtype = kv_dtype(kv_cache_dtype)
        if threads:
            numba.set_num_threads(threads)
        threads = numba.get_num_threads()
        # Numba's thread count is per calling thread: steps set it again on the thread that runs them (an
        # in-process client's engine thread would otherwise run with NUMBA_NUM_THREADS).
        self.threads = threads
        self.thread_fallback = ThreadFallback(threads) if thread_fallback and threads > 1 else None
        self.model = CpuModel(model, activations=activations)
        self.cpu_activations = activations_summary(self.model, activations)  # e.g. "auto: q4_1 i16/32, q8_0 i16/32"
        c = model.config
        self.max_model_len = c.max_model_len
        self.vocab_size = c.vocab_size
        self.metadata = model.metadata  # the tokenizer constraints are enforced with is built from it
        self.fault = FaultHook.from_env()  # tests only: None unless HYBRIDGATE_TEST_FAULT is set
        self._logprobs: dict[Sequence, TokenLogprobs] = {}  # of the last execute (take_logprobs)
        self._pooled: dict[Sequence, np.ndarray] = {}  # of the last execute (take_pooled)
        self.block_size = block_size
        self.block_bytes = block_size * c.kv_values_per_token * self.kv_dtype.itemsize
        self.num_blocks = num_blocks_for(kv_cache_memory, self.block_bytes, host_available_bytes(), gpu=False)
        if max_num_blocks is not None:
            self.num_blocks = min(self.num_blocks, max_num_blocks)
        if block_size % 16:
            raise ValueError(f"block_size: the CPU runner needs a multiple of 16, got {block_size}")
        blocks = self.num_blocks + 1  # the last block is scratch for padding reads
        # Keys transposed within each block (16 keys per vector in the score kernel), values by slot.
        store = self.kv_dtype.storage
        # Only the layers that own K/V have a cache; a layer sharing another's holds that layer's arrays.
        kv = lambda i: (c.layer_kv_heads[i], c.layer_head_dims[i])  # noqa: E731
        self.k_cache = c.per_layer_kv(lambda i: np.empty((blocks, *kv(i), block_size), store))
        self.v_cache = c.per_layer_kv(lambda i: np.empty((blocks * block_size, *kv(i)), store))
        self.scratch_slot = self.num_blocks * block_size
        for k, v in ((self.k_cache[i], self.v_cache[i]) for i in c.kv_layers):
            # Zeroed (so resident) now: a first write to a fresh page costs a fault, which would
            # otherwise land on the steps, and KV hand-off imports, that first use each block.
            k.fill(0)
            v.fill(0)
        # two buffers, each holding the largest step's inputs, so none falls back
        self.pool = PinnedPool(staging_bytes(max_num_batched_tokens, max_num_seqs, self.max_model_len), 2)
        target = isa.selected()
        self.cpu_isa = target.isa
        # Prompts of at least this many tokens multiply on the table's prompt kernels (AMX tiles, int8 GEMMs;
        # None: this path has none under these activations)
        prompt_types = type_names(self.model, layers_only=True)  # of the matrices that multiply prompt rows
        self.long_prompt = kernel_table.long_prompt(activations, quant.PATH, prompt_types)
        # ... and inside a mixture of experts, whose prompt rows spread over its experts (None: none)
        self.expert_long_prompt = kernel_table.expert_long_prompt(self.long_prompt, c.num_experts,
                                                                  c.experts_per_token)
        # the prompt kernels' name, for the logs and the benches' JSON (None: none under these activations)
        self.prompt_kernels = kernel_table.prompt_kernels(activations, quant.PATH, prompt_types)
        log.info("CPU kernels: %s path (LLVM target %s%s), activations %s%s, cache %s", target.isa, target.cpu_name,
                 ", VNNI" if target.vnni else "", self.cpu_activations,
                 (f", {self.prompt_kernels} for prompts of {self.long_prompt}+ tokens" if self.long_prompt else "")
                 + (f" ({self.expert_long_prompt}+ in the experts)" if self.expert_long_prompt else ""),
                 target.cache_dir)
        log.info("CPU runner: weights %.1f MiB in GGUF blocks, KV cache %d blocks of %d tokens (%.1f MiB, %s), "
                 "threads %d on cores %s", self.model.weight_bytes / 2**20, self.num_blocks, block_size,
                 self.num_blocks * self.block_bytes / 2**20, self.kv_dtype.name, numba.get_num_threads(),
                 format_cpulist(os.sched_getaffinity(0)))

    def pool_stats(self) -> PoolStats:
        self.pool.drain()
        return self.pool.stats

    def kernel_cache_stats(self) -> tuple[int, int]:
        return kernel_cache_stats()

    def kv_layout(self) -> KVLayout:
        """The layers this cache holds, their shapes and its dtype: what a KV hand-off must match."""
        return KVLayout.of(self.model.config, self.kv_dtype.wire)

    def import_kv(self, block_table: list[int], layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write one layer's K and V of a hand-off into `block_table`'s blocks, in this cache's layout.

        k, v: float32 `[num_tokens, kv_heads, head_dim]` (slot t of the sequence is row t),
        rounded to this cache's dtype (to nearest even) as they are stored; keys are stored
        transposed within each block. Raises ValueError on shapes that do not fit the table.
        """
        bs = self.block_size
        n = k.shape[0]
        if k.shape != v.shape or k.shape[1:] != self.v_cache[layer].shape[1:] or -(-n // bs) > len(block_table):
            raise ValueError(f"KV of shape {k.shape} and {v.shape} does not fit {len(block_table)} blocks of "
                             f"{bs} x {self.v_cache[layer].shape[1:]}")
        table = np.asarray(block_table[: -(-n // bs)], dtype=np.int64)
        cpu_model.import_kv_layer(np.ascontiguousarray(k, np.float32), np.ascontiguousarray(v, np.float32), table,
                                  self.k_cache[layer], self.v_cache[layer])

    def read_kv(self, block_table: list[int], layer: int, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """float32 K and V `[num_tokens, kv_heads, head_dim]` of a sequence's blocks, widened from
        the cache's dtype (copies; for tests)."""
        bs = self.block_size
        table = np.asarray(block_table[: -(-num_tokens // bs)], dtype=np.int64)
        k = self.k_cache[layer][table].transpose(0, 3, 1, 2).reshape(-1, *self.v_cache[layer].shape[1:])
        vc = self.v_cache[layer]
        v = vc.reshape(-1, bs, *vc.shape[1:])[table].reshape(-1, *vc.shape[1:])
        return self.kv_dtype.widen(k[:num_tokens]), self.kv_dtype.widen(v[:num_tokens])

    def forward(self, batch: ScheduledBatch) -> np.ndarray:
        """float32 logits `[len(batch), vocab]` at each entry's last new token. The step's embedding
        entries' pooled partial sums are kept for `take_pooled`."""
        buf = self.pool.acquire()
        try:
            inputs = build_step_inputs(batch, self.block_size, buf, self.scratch_slot, self.long_prompt,
                                       self.expert_long_prompt)
            rows, plan = pooling.pool_plan(batch)
            if not plan:
                return self.model.forward(inputs, self.k_cache, self.v_cache)
            logits, hidden = self.model.forward_pooled(inputs, self.k_cache, self.v_cache, rows)
            self._pooled = pooling.partial_sums(hidden, plan)
            return logits
        finally:
            self.pool.release(buf)

    def execute(self, batch: ScheduledBatch) -> dict[Sequence, int]:
        if self.fault is not None:
            self.fault.check(batch)
        self._logprobs, self._pooled = {}, {}
        logits = self._timed_forward(batch)
        ready = [(row, s) for row, (s, n) in enumerate(batch.entries)
                 if s.num_computed + n == s.num_tokens and not s.pooling]  # embeddings sample nothing
        if not ready:
            return {}
        seqs = [s for _, s in ready]
        rows = logits[[r for r, _ in ready]]
        ids = sample(rows, [s.params for s in seqs], [s.seed for s in seqs], [s.next_token_index for s in seqs],
                     [s.all_ids if s.params.repetition_penalty != 1.0 else () for s in seqs],
                     [s.generated_ids if s.params.presence_penalty or s.params.frequency_penalty else ()
                      for s in seqs], bitmask=batch.masks.for_rows(seqs) if batch.masks is not None else None)
        if any(s.params.logprobs is not None for s in seqs):
            lps = token_logprobs(rows, ids, [s.params.logprobs for s in seqs])
            self._logprobs = {s: lp for s, lp in zip(seqs, lps) if lp is not None}
        return dict(zip(seqs, ids.tolist()))

    def _timed_forward(self, batch: ScheduledBatch) -> np.ndarray:
        """`forward` on the thread count `thread_fallback` chooses, timed for it (decode-only steps)."""
        fallback = self.thread_fallback
        if fallback is None:
            if numba.get_num_threads() != self.threads:
                numba.set_num_threads(self.threads)
            return self.forward(batch)
        decode = len(batch) if all(n == 1 for _, n in batch.entries) else None
        threads = fallback.threads_for(decode, time.monotonic())
        if threads != numba.get_num_threads():
            numba.set_num_threads(threads)
        started = time.perf_counter()
        logits = self.forward(batch)
        fallback.record(threads, decode, time.perf_counter() - started, time.monotonic())
        return logits

    def take_logprobs(self) -> dict[Sequence, TokenLogprobs]:
        """The logprobs of the last `execute`, for the sequences that asked (then forgotten)."""
        out, self._logprobs = self._logprobs, {}
        return out

    def take_pooled(self) -> dict[Sequence, np.ndarray]:
        """The last `execute`'s pooled partial sums of its embedding entries (`pooling.partial_sums`; then
        forgotten)."""
        out, self._pooled = self._pooled, {}
        return out

    def warm_up(self, progress: bool = True) -> None:
        """Compile (or load from the cache) every kernel, with a progress line, then one real step."""
        from hybridgate.wire import AddRequest, SamplingParams

        start = time.monotonic()
        seq = Sequence(AddRequest("warm-up", [1, 2, 3, 4], SamplingParams(temperature=0), 0, 2, -1))
        seq.block_table = [0]
        if progress:
            print("hybridgate: preparing CPU kernels (the first start compiles them; later starts load them "
                  "from the cache)...", file=sys.stderr, flush=True)
        thresholds = self.long_prompt, self.expert_long_prompt  # the prompt kernels compiled too:
        self.long_prompt, self.expert_long_prompt = (1 if t else None for t in thresholds)
        try:
            self.execute(ScheduledBatch([(seq, 4)]))
        finally:
            self.long_prompt, self.expert_long_prompt = thresholds
        seq.num_computed = 4
        seq.append(5)
        self.execute(ScheduledBatch([(seq, 1)]))
        kv = np.zeros((4, *self.v_cache[0].shape[1:]), np.float32)  # the hand-off import kernel, into block 0:
        self.import_kv([0], 0, kv, kv)  # converted frames are writable,
        kv.setflags(write=False)
        self.import_kv([0], 0, kv, kv)  # float32 frames read-only (views of the received message)
        hits, misses = kernel_cache_stats()
        if progress:
            print(f"hybridgate: CPU kernels ready in {time.monotonic() - start:.1f} s "
                  f"({misses} compiled, {hits} loaded from the cache)", file=sys.stderr, flush=True)
