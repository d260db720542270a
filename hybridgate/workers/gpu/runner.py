"""The torch model runner over a paged KV cache: a scheduled batch in, sampled ids out.

Step inputs (token ids, positions, slot mapping, context slots, last rows)
are written into one `PinnedPool` buffer per step and reach the device with
non-blocking copies; on CUDA the buffer goes back to the pool when an event
recorded after the copies has completed (two buffers in flight at most, so
staging the next step overlaps the current one). On the CPU the same pool is
used and the check is immediate.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from hybridgate.mempool import DEFAULT_BLOCK_SIZE, PinnedPool, PoolStats, aligned_slab
from hybridgate.models import GGUFModel
from hybridgate.workers.gpu import sampling
from hybridgate.workers.gpu.attention import (KernelAttention, KernelStep, PagedAttention, PagedKVCache, PagedStep,
                                              attention_kind, num_splits_for)
from hybridgate.workers.gpu.export import StepTimeline, dtype_name
from hybridgate.workers.gpu.graphs import DecodeGraphs
from hybridgate.workers.gpu.sizing import CudaMemory, graphs_allowance, profile_batches
from hybridgate.workers.memory import budget_text, host_available_bytes, kv_cache_budget, num_blocks_for, size_text
from hybridgate.workers.gpu.model import DecoderModel, default_device
from hybridgate.workers import pooling
from hybridgate.workers.faults import FaultHook
from hybridgate.workerconf import EngineConfig
from hybridgate.workers.scheduler import ScheduledBatch, SchedulerConfig
from hybridgate.workers.sequence import Sequence
from hybridgate.workers.step_inputs import StepInputs, build_step_inputs, staging_bytes
from hybridgate.wire import TokenLogprobs

log = logging.getLogger("hybridgate.worker")


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return host_available_bytes()


def fitted_max_model_len(context: int, asked: int | None, cache_tokens: int) -> int:
    """The worker's max model length: `asked` (--max-model-len) or the model's `context`, and no more than one
    sequence can hold in a KV cache of `cache_tokens` tokens. The default is lowered to fit, with a warning;
    an asked length that does not fit raises ValueError naming both flags and the numbers (vLLM does the
    same: a sequence of max_model_len tokens must fit in the cache)."""
    want = min(asked, context) if asked else context
    if want <= cache_tokens:
        return want
    if asked:
        raise ValueError(f"--max-model-len {asked}: the KV cache holds {cache_tokens} tokens; lower --max-model-len "
                         f"or give the cache more memory (--gpu-memory-utilization on CUDA, --kv-cache-memory)")
    log.warning("max model length lowered from the model's %d tokens to %d: what the KV cache holds (raise "
                "--gpu-memory-utilization on CUDA or --kv-cache-memory for more, or set --max-model-len)", context,
                cache_tokens)
    return cache_tokens


def _pinned_slab(nbytes: int) -> np.ndarray:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


class TorchRunner:
    """Runs `DecoderModel` over a `PagedKVCache` and samples on the device."""

    kind = "gpu"

    def __init__(self, model: GGUFModel, device: torch.device | None = None, dtype: torch.dtype | None = None,
                 kv_cache_memory: str | float | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 max_num_blocks: int | None = None, enforce_eager: bool = False,
                 max_num_seqs: int = SchedulerConfig.max_num_seqs,
                 block_gather: bool | None = None, attention: str = "auto", max_model_len: int | None = None,
                 gpu_memory_utilization: float = EngineConfig.gpu_memory_utilization,
                 max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens, memory=None, load=None):
        """kv_cache_memory: bytes or a fraction of free memory (`parse_memory`); unset on CUDA, the
        budget of `memory.kv_cache_budget` from `gpu_memory_utilization` and two profiled steps
        (`sizing`), whose counters `memory` reads (default `CudaMemory` on CUDA; tests inject theirs,
        which also selects that rule on a CPU device). load: each tensor by name instead of the file's
        (`DecoderModel`). Raises ValueError naming the flags when the cache would not hold one block, or
        an asked `max_model_len`."""
        dev = device or default_device()
        self.attention = attention_kind(attention, dev)  # "triton" or "reference"
        # The Triton path fuses the layer's norms, RoPE and activation too; the reference path is all eager.
        self.model = DecoderModel(model, dev, dtype, load, fused=self.attention == "triton")
        self.vocab_size = model.config.vocab_size
        self.metadata = model.metadata  # the tokenizer constraints are enforced with is built from it
        self.fault = FaultHook.from_env()  # tests only: None unless HYBRIDGATE_TEST_FAULT is set
        self._logprobs: dict[Sequence, TokenLogprobs] = {}  # of the last execute (take_logprobs)
        self._pooled: dict[Sequence, np.ndarray] = {}  # of the last execute (take_pooled)
        # Decode attention gathers whole blocks on CUDA (fewer, larger copies); per-slot
        # index_select on the CPU, where it measured as fast and needs no padding to a block.
        self.block_gather = dev.type == "cuda" if block_gather is None else block_gather
        self.block_size = block_size
        self.block_bytes = PagedKVCache.block_bytes(model.config, block_size, self.model.dtype)
        self._slab = _pinned_slab if dev.type == "cuda" else aligned_slab
        self._vocab_hash = torch.from_numpy(sampling.vocab_hash(model.config.vocab_size)).to(dev)
        # float32 on CUDA (no whole-vocabulary sort in the common cases); on a CPU device the float64 twin, whose
        # ids equal the numpy runner's (`gpu.sampling`'s docstring says why no contract needs more)
        self.sampler_precision = "fp32" if dev.type == "cuda" else "fp64"
        self.timeline = StepTimeline(dev)  # when steps ran: the hand-off's hidden copy time is measured on it
        kv_heads = model.config.num_kv_heads
        self._num_splits = lambda batch: num_splits_for(batch, 1, kv_heads, dev)  # noqa: E731
        self.graphs = None
        # Graphs over the Triton kernels only (graphs.py: why); the experts' FFN reads its per-expert counts on
        # the host (`gpu.moe`): no graph can hold it.
        captures = (dev.type == "cuda" and not enforce_eager and self.attention == "triton"
                    and model.config.arch.moe is None)
        if memory is None and kv_cache_memory is None and dev.type == "cuda":
            memory = CudaMemory(dev)
        self.budget = ""  # the budget's parts, on the start-up line (vLLM's rule only)
        self.graphs_allowance = 0  # bytes the budget left the decode graphs (vLLM's rule only)
        if kv_cache_memory is None and memory is not None:
            asked = min(max_model_len, model.config.max_model_len) if max_model_len else 0
            self.num_blocks = self._profiled_blocks(memory, gpu_memory_utilization, max_num_seqs,
                                                    max_num_batched_tokens, captures, asked)
        else:
            self.num_blocks = num_blocks_for(kv_cache_memory, self.block_bytes, _available_bytes(dev),
                                             dev.type == "cuda")
        if max_num_blocks is not None:
            self.num_blocks = min(self.num_blocks, max_num_blocks)
        self.max_model_len = fitted_max_model_len(model.config.max_model_len, max_model_len,
                                                  self.num_blocks * block_size)
        self._allocate_cache(self.num_blocks)
        self.pool = self._staging_pool(max_num_batched_tokens, max_num_seqs, self.max_model_len)
        if captures:
            self.graphs = DecodeGraphs(self.model, self.cache, self.scratch_slot, max_num_seqs,
                                       self.max_model_len, num_splits=self._num_splits)
        log.info("KV cache: %d blocks of %d tokens, %.1f MiB on %s (weights %.1f MiB%s); max model length %d; "
                 "attention: %s", self.num_blocks, block_size, self.num_blocks * self.block_bytes / 2**20, dev,
                 self.model.weight_bytes / 2**20, f"; budget {self.budget}" if self.budget else "",
                 self.max_model_len, "Triton paged kernels" if self.attention == "triton" else
                 "gather + SDPA (reference)")

    def _staging_pool(self, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> PinnedPool:
        """Two buffers, each holding the largest step's inputs (`staging_bytes`), so none falls back."""
        return PinnedPool(staging_bytes(max_num_batched_tokens, max_num_seqs, max_model_len), 2, self._slab)

    def _allocate_cache(self, num_blocks: int) -> None:
        dev = self.model.device
        # One extra block beyond the allocator's: padding rows of captured decode graphs write there.
        self.cache = PagedKVCache(self.model.config, num_blocks + 1, self.block_size, dev, self.model.dtype)
        self.scratch_slot = num_blocks * self.block_size
        for t in self.cache.k + self.cache.v:
            # Padding reads these (masked): uninitialized memory could hold NaN, and 0 * NaN is NaN.
            # Block gathers also read the unused tail of each last block, so zero everything then.
            (t if self.block_gather else t[self.scratch_slot :]).zero_()

    def _profiled_blocks(self, memory, utilization: float, max_num_seqs: int, max_num_batched_tokens: int,
                         captures: bool, asked: int) -> int:
        """Blocks of the budget `kv_cache_budget` gives, after profiling the largest step and (when graphs will
        be captured) the largest decode step on a temporary cache; `asked`: a max model length (0: none) whose
        blocks the budget must hold."""
        c = self.model.config
        total, used = memory.total_and_used()
        batch_sizes = DecodeGraphs.batch_sizes_for(max_num_seqs)
        tokens = min(max_num_batched_tokens, asked or c.max_model_len)
        # The captured decode step's memory does not grow with context (graphs.py): profiled at one token.
        batches = profile_batches(tokens, max_num_seqs, batch_sizes[-1], 1, self.block_size, c.vocab_size)
        self._allocate_cache(batches.num_blocks - 1)
        self.pool = self._staging_pool(tokens, max_num_seqs, tokens)  # until max_model_len is known
        activations = memory.peak_growth(lambda: self._execute(batches.largest))
        graphs = 0
        if captures:
            graphs = graphs_allowance(batch_sizes, c.vocab_size,
                                      memory.peak_growth(lambda: self._execute(batches.decode)))
        del self.cache
        self.graphs_allowance = graphs
        need = -(-asked // self.block_size) * self.block_bytes if asked else self.block_bytes
        nbytes = kv_cache_budget(total, used, activations, utilization, graphs, need)
        self.budget = (f"{budget_text(total, used, activations, utilization, graphs)} = {size_text(nbytes)}, "
                       f"a profiled step of {tokens} tokens")
        return nbytes // self.block_bytes

    def kv_layout(self) -> tuple[int, int, int, str]:
        """(layers, KV heads, head dim, dtype) of this cache: a KV hand-off's header fields."""
        c = self.model.config
        return c.num_layers, c.num_kv_heads, c.head_dim, dtype_name(self.model.dtype)

    def kernel_cache_stats(self) -> tuple[int, int]:
        return 0, 0  # nothing compiled ahead of time (CUDA graphs are captured, not cached)

    def pool_stats(self) -> PoolStats:
        self.pool.drain()
        return self.pool.stats

    def forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """float32 logits `[len(batch), vocab]` at each entry's last new token; K/V go to the cache. The
        step's embedding entries' pooled partial sums are kept for `take_pooled`."""
        buf = self.pool.acquire()
        try:
            host = self._host_inputs(batch, buf)
            rows, plan = pooling.pool_plan(batch)
            tables = self._block_tables(batch, host) if self.attention == "triton" else None
            if (self.graphs is not None and not plan and len(host.decodes) == len(batch)
                    and self.graphs.padded(len(batch))):
                lengths = np.asarray(host.contexts, dtype=np.int64)
                return self.graphs.run(host.ids, host.positions, host.slots, tables, lengths)
            if tables is not None:
                ids, positions, attention, last_rows = self._kernel_inputs(batch, host, tables)
            else:
                ids, positions, step, last_rows = self._to_device(host)
                attention = PagedAttention(self.cache, step)
            if not plan:
                return self.model.forward_tokens(ids, positions, attention, last_rows)
            logits, hidden = self.model.forward_pooled(ids, positions, attention, last_rows, torch.from_numpy(rows))
            self._pooled = pooling.partial_sums(hidden.cpu().numpy(), plan)
            return logits
        finally:
            self.pool.release(buf, self._done_check())

    def execute(self, batch: ScheduledBatch) -> dict[Sequence, int]:
        if self.fault is not None:
            self.fault.check(batch)
        self.timeline.begin()
        try:
            return self._execute(batch)
        finally:
            self.timeline.end()

    def _execute(self, batch: ScheduledBatch) -> dict[Sequence, int]:
        self._logprobs, self._pooled = {}, {}
        logits = self.forward(batch)
        ready = [(row, seq) for row, (seq, n) in enumerate(batch.entries)
                 if seq.num_computed + n == seq.num_tokens and not seq.pooling]  # embeddings sample nothing
        if not ready:
            return {}
        rows = torch.tensor([r for r, _ in ready], device=logits.device)
        seqs = [s for _, s in ready]
        sampled = sampling.sample(
            logits[rows], [s.params for s in seqs], [s.seed for s in seqs], [s.next_token_index for s in seqs],
            [s.all_ids if s.params.repetition_penalty != 1.0 else () for s in seqs], self._vocab_hash,
            generated=[s.generated_ids if s.params.presence_penalty or s.params.frequency_penalty else ()
                       for s in seqs],
            bitmask=batch.masks.for_rows(seqs) if batch.masks is not None else None,
            precision=self.sampler_precision,
        )
        if any(s.params.logprobs is not None for s in seqs):
            lps = sampling.token_logprobs(logits[rows], sampled, [s.params.logprobs for s in seqs])
            self._logprobs = {s: lp for s, lp in zip(seqs, lps) if lp is not None}
        return dict(zip(seqs, sampled.tolist()))

    def take_logprobs(self) -> dict[Sequence, TokenLogprobs]:
        """The logprobs of the last `execute`, for the sequences that asked (then forgotten)."""
        out, self._logprobs = self._logprobs, {}
        return out

    def take_pooled(self) -> dict[Sequence, np.ndarray]:
        """The last `execute`'s pooled partial sums of its embedding entries (`pooling.partial_sums`; then
        forgotten)."""
        out, self._pooled = self._pooled, {}
        return out

    def _done_check(self):
        if self.model.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event.query

    def _host_inputs(self, batch: ScheduledBatch, buf) -> StepInputs:
        return build_step_inputs(batch, self.block_size, buf, self.scratch_slot)

    def _block_tables(self, batch: ScheduledBatch, h: StepInputs) -> np.ndarray:
        """int32 `[entries, max_blocks]`: each entry's blocks up to its context, padded with the scratch block."""
        used = [-(-c // self.block_size) for c in h.contexts]
        tables = np.full((len(used), max(used)), self.scratch_slot // self.block_size, dtype=np.int32)
        for i, (seq, _) in enumerate(batch.entries):
            tables[i, : used[i]] = seq.block_table[: used[i]]
        return tables

    def _kernel_inputs(self, batch: ScheduledBatch, h: StepInputs, tables: np.ndarray):
        """(ids, positions, the Triton kernels' attention, last rows) of the step, on the device."""
        dev = self.model.device
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev, non_blocking=True)  # noqa: E731
        q_starts = np.zeros(len(batch) + 1, dtype=np.int32)
        q_starts[1:] = h.last + 1
        max_q = max(n for _, n in batch.entries)
        step = KernelStep(to(h.slots), to(tables), to(np.asarray(h.contexts, dtype=np.int32)), to(q_starts), max_q,
                          num_splits_for(len(batch), max_q, self.cache.config.num_kv_heads, dev))
        return to(h.ids), to(h.positions), KernelAttention(self.cache, step), to(h.last)

    def _to_device(self, h: StepInputs):
        dev = self.model.device
        to = lambda a: torch.from_numpy(a).to(dev, non_blocking=True)  # noqa: E731
        mask = lens = None
        lengths = [h.contexts[i] for i in h.decodes]
        if h.decodes:
            lens = torch.tensor(lengths, device=dev)  # [num_decodes]
        if h.decodes and any(n != h.width for n in lengths):
            mask = (torch.arange(h.width, device=dev)[None, :] < lens[:, None])[:, None, None, :]
        pctx = to(h.prefill_context)
        blocks = block_mask = None
        if self.block_gather and h.decodes:
            blocks = to(h.decode_tables)
            span = h.decode_tables.shape[1] * self.block_size
            block_mask = (torch.arange(span, device=dev)[None, :] < lens[:, None])[:, None, None, :]
        step = PagedStep(
            slots=to(h.slots),
            decode_rows=to(h.last[h.decodes]) if h.decodes else None,
            decode_context=to(h.decode_context) if h.decodes else None,
            decode_mask=mask,
            prefills=[(start, n, pctx[o : o + c]) for start, n, o, c in h.prefills],
            decode_blocks=blocks,
            decode_block_mask=block_mask,
            decode_lengths=lens,
        )
        return to(h.ids), to(h.positions), step, to(h.last)

    def warm_up(self) -> None:
        """One prefill and one decode step through the paged path, on scratch blocks."""
        from hybridgate.wire import AddRequest, SamplingParams

        seq = Sequence(AddRequest("warm-up", [1, 2, 3, 4], SamplingParams(temperature=0), 0, 2, -1))
        seq.block_table = [0]
        self.execute(ScheduledBatch([(seq, 4)]))
        seq.num_computed = 4
        seq.append(5)
        self.execute(ScheduledBatch([(seq, 1)]))
        if self.graphs is not None:
            free = torch.cuda.mem_get_info(self.model.device)[0]
            self.graphs.capture_all()
            took = free - torch.cuda.mem_get_info(self.model.device)[0]
            over = self.budget and took > self.graphs_allowance  # the KV cache took memory the graphs needed
            log.log(logging.WARNING if over else logging.INFO, "decode graphs: %d captured in %s%s",
                    self.graphs.captured, size_text(took),
                    f" (the KV cache budget allowed {size_text(self.graphs_allowance)})" if self.budget else "")
