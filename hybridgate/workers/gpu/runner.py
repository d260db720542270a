"""The torch model runner over a paged KV cache: a scheduled batch in, sampled ids out.

A step makes one copy each way (`gpu.staging`): its host inputs (token ids,
positions, the rows of the persistent block tables, the block-table cells added
since the last step, the sampler's fields and the penalties' ids) are packed
into one `PinnedPool` buffer and reach the device with one non-blocking copy;
slots and contexts are expanded there from the device's block tables; the
sampled ids come back with one non-blocking copy into pinned memory, then one
sync. On CUDA the buffer goes back to the pool when an event recorded after its
copy has completed (two buffers, so packing a step never waits on the last
one's copy). On the CPU the same pool is used and the check is immediate.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from hybridgate.mempool import DEFAULT_BLOCK_SIZE, PinnedPool, PoolStats, aligned_slab
from hybridgate.models import GGUFModel
from hybridgate.workers.gpu import sampling
from hybridgate.workers.gpu.attention import (KernelAttention, PagedAttention, PagedKVCache, attention_kind,
                                              num_splits_for)
from hybridgate.workers.gpu.export import StepTimeline, dtype_name
from hybridgate.workers.gpu.graphs import DecodeGraphs
from hybridgate.workers.gpu.sizing import CudaMemory, graphs_allowance, profile_batches
from hybridgate.workers.memory import budget_text, host_available_bytes, kv_cache_budget, num_blocks_for, size_text
from hybridgate.workers.gpu.model import DecoderModel, default_device
from hybridgate.workers import pooling
from hybridgate.workers.faults import FaultHook
from hybridgate.workers.handoff_checks import KVLayout
from hybridgate.workers.config import EngineConfig
from hybridgate.workers.scheduler import ScheduledBatch, SchedulerConfig
from hybridgate.workers.sequence import Sequence
from hybridgate.workers.gpu.staging import DeviceInputs, DeviceStep
from hybridgate.workers.input_batch import BlockTables, pack_step, packed_words
from hybridgate.wire import TokenLogprobs

log = logging.getLogger("hybridgate.worker")
MAX_MODEL_LEN_FLAGS = "--worker-max-model-len (serve: --max-model-len)"  # where a worker's length is asked


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return host_available_bytes()


def fitted_max_model_len(context: int, asked: int | None, cache_tokens: int) -> int:
    """The worker's max model length: `asked` (--worker-max-model-len, under serve its --max-model-len) or the
    model's `context`, and no more than one sequence can hold in a KV cache of `cache_tokens` tokens. The
    default is lowered to fit, with a warning; an asked length that does not fit raises ValueError naming the
    flags and the numbers (vLLM does the same: a sequence of max_model_len tokens must fit in the cache)."""
    want = min(asked, context) if asked else context
    if want <= cache_tokens:
        return want
    if asked:
        raise ValueError(f"{MAX_MODEL_LEN_FLAGS} {asked}: the KV cache holds {cache_tokens} tokens; lower it to "
                         f"{cache_tokens} or less, or give the cache more memory (--gpu-memory-utilization on "
                         f"CUDA, --kv-cache-memory)")
    log.warning("max model length lowered from the model's %d tokens to %d: what the KV cache holds (raise "
                "--gpu-memory-utilization on CUDA or --kv-cache-memory for more, or set %s)", context,
                cache_tokens, MAX_MODEL_LEN_FLAGS)
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
        self.attention = attention_kind(attention, dev)  # "triton" | "reference"
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
                    and model.config.moe is None)
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
        self._staging(max_num_batched_tokens, max_num_seqs, self.max_model_len)
        if captures:
            self.graphs = DecodeGraphs(self.model, self.cache, self.scratch_slot, max_num_seqs,
                                       self.max_model_len, num_splits=self._num_splits)
        log.info("KV cache: %d blocks of %d tokens, %.1f MiB on %s (weights %.1f MiB%s); max model length %d; "
                 "attention: %s", self.num_blocks, block_size, self.num_blocks * self.block_bytes / 2**20, dev,
                 self.model.weight_bytes / 2**20, f"; budget {self.budget}" if self.budget else "",
                 self.max_model_len, "Triton paged kernels" if self.attention == "triton" else
                 "gather + SDPA (reference)")

    def _staging(self, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> None:
        """The step's staging: two pinned buffers, each holding the largest step's packed inputs (`packed_words`),
        so none falls back, the persistent block tables and the device buffers they are copied to."""
        words = packed_words(max_num_batched_tokens, max_num_seqs, max_model_len, self.block_size)
        self.pool = PinnedPool(8 * words, 2, self._slab)
        self.tables = BlockTables(-(-max_model_len // self.block_size), max_num_seqs,
                                  pad_block=self.scratch_slot // self.block_size)
        self.inputs = DeviceInputs(self.model.device, words, self.tables, self.block_size, self.scratch_slot)

    def _allocate_cache(self, num_blocks: int) -> None:
        dev = self.model.device
        # One extra block beyond the allocator's: padding rows of captured decode graphs write there.
        self.cache = PagedKVCache(self.model.config, num_blocks + 1, self.block_size, dev, self.model.dtype)
        self.scratch_slot = num_blocks * self.block_size
        for t in self.cache.tensors:
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
        self._staging(tokens, max_num_seqs, tokens)  # until max_model_len is known
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

    def kv_layout(self) -> KVLayout:
        """The layers this cache holds, their shapes and its dtype: a KV hand-off's header fields."""
        return KVLayout.of(self.model.config, dtype_name(self.model.dtype))

    def kernel_cache_stats(self) -> tuple[int, int]:
        return 0, 0  # nothing compiled ahead of time (CUDA graphs are captured, not cached)

    def pool_stats(self) -> PoolStats:
        self.pool.drain()
        return self.pool.stats

    def forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """float32 logits `[len(batch), vocab]` at each entry's last new token; K/V go to the cache. The
        step's embedding entries' pooled partial sums are kept for `take_pooled`."""
        return self._forward(batch, self._stage(batch))

    def _stage(self, batch: ScheduledBatch) -> DeviceStep:
        """Pack the step's host inputs into a pinned buffer and copy them to the device (one copy)."""
        buf = self.pool.acquire()
        try:
            return self.inputs.upload(pack_step(batch, self.tables, buf.fit, self.vocab_size), self.tables)
        finally:
            self.pool.release(buf, self._done_check())

    def _forward(self, batch: ScheduledBatch, step: DeviceStep) -> torch.Tensor:
        p = step.packed
        rows, plan = pooling.pool_plan(batch)
        if self.graphs is not None and not plan and len(p.decodes) == len(batch) and self.graphs.padded(len(batch)):
            return self.graphs.run(step.ids, step.positions, step.slots, step.block_tables, step.seq_lens)
        if self.attention == "triton":
            splits = num_splits_for(len(batch), p.max_q, self.cache.config.num_kv_heads, self.model.device)
            attention = KernelAttention(self.cache, step.kernel_step(splits))
        else:
            attention = PagedAttention(self.cache, step.paged_step(self.block_gather))
        if not plan:
            return self.model.forward_tokens(step.ids, step.positions, attention, step.last)
        logits, hidden = self.model.forward_pooled(step.ids, step.positions, attention, step.last, torch.from_numpy(rows))
        self._pooled = pooling.partial_sums(hidden.cpu().numpy(), plan)
        return logits

    def execute(self, batch: ScheduledBatch) -> dict[Sequence, int]:
        if self.fault is not None:
            self.fault.check(batch)
        self.timeline.begin()
        try:
            return self._execute(batch)
        finally:
            self.timeline.end()

    def _execute(self, batch: ScheduledBatch) -> dict[Sequence, int]:
        """One step: one host-to-device copy of its inputs (the sampler's and the penalties' with them), the
        forward pass, the sampler, one device-to-host copy of the sampled ids. A constrained step adds the
        copy of its token bitmasks, which fill while the forward pass runs; logprobs, when asked, theirs."""
        self._logprobs, self._pooled = {}, {}
        step = self._stage(batch)
        logits = self._forward(batch, step)
        seqs = step.packed.ready  # embeddings sample nothing (`pack_step`)
        if not seqs:
            return {}
        rows = step.view("ready")
        bitmask = batch.masks.for_rows(seqs) if batch.masks is not None else None
        allowed = None
        if bitmask is not None:
            allowed = sampling.allowed_of_bitmask(self.inputs.upload_bitmask(bitmask), self.vocab_size)
        sampled = sampling.sample_tensors(logits[rows], **step.sampling(self.vocab_size), allowed=allowed,
                                          vocab_ids_hash=self._vocab_hash, precision=self.sampler_precision)
        ids = self.inputs.download(sampled)
        if any(s.params.logprobs is not None for s in seqs):
            lps = sampling.token_logprobs(logits[rows], sampled, [s.params.logprobs for s in seqs])
            self._logprobs = {s: lp for s, lp in zip(seqs, lps) if lp is not None}
        return dict(zip(seqs, ids))

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
