"""How much of a CUDA device the KV cache gets, measured as vLLM measures it (`memory.kv_cache_budget`).

After the weights load, the runner runs two profiling steps on a small
temporary cache: the largest step the scheduler makes (`--max-num-batched-tokens`
tokens: one prompt chunk from position 0 and single-token entries up to
`--max-num-seqs` rows of logits) and the largest captured decode step, and
reads how far `torch.cuda.max_memory_allocated` rose over each. The first is
the activations every eager step may need; the second, with the logits every
captured graph keeps, is the decode graphs' allowance (checked against the
real capture in `TorchRunner.warm_up`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridgate.wire import AddRequest, SamplingParams
from hybridgate.workers.scheduler import ScheduledBatch
from hybridgate.workers.sequence import Sequence

GRAPH_OVERHEAD_BYTES = 1 << 20  # per captured graph beyond its pool: the driver's copy of the graph (estimated)
_PROFILE_PARAMS = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)  # the sampler's sorting path too


class CudaMemory:
    """The device's memory counters that the budget reads (tests inject an object with the same methods)."""

    def __init__(self, device: torch.device):
        self.device = device

    def total_and_used(self) -> tuple[int, int]:
        """(total, in use) bytes of the device, the caching allocator's unused blocks given back first."""
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return total, total - free

    def peak_growth(self, step: Callable[[], object]) -> int:
        """Bytes by which allocated memory peaked above its level before `step()` while it ran."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        step()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - before

    def free(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]


INJECTED_MEMORY_ENV = "HYBRIDGATE_TEST_GPU_MEMORY"


class InjectedMemory:
    """A device's counters given, not read: `total` and `used` bytes, and `peak` bytes for every profiled step
    (which still runs). Tests start a worker process with it to size a GPU worker by vLLM's rule on a CPU
    torch device, e.g. `HYBRIDGATE_TEST_GPU_MEMORY=64MiB:25MiB:6MiB` (TOTAL:USED:PEAK)."""

    def __init__(self, total: int, used: int, peak: int):
        self.total, self.used, self.peak = total, used, peak

    @classmethod
    def from_env(cls) -> InjectedMemory | None:
        """From `INJECTED_MEMORY_ENV`; None when it is unset or empty. Raises ValueError naming the variable
        when it is not three sizes."""
        from hybridgate.config import environment

        spec = environment(INJECTED_MEMORY_ENV, "")
        if not spec:
            return None
        units = {"MiB": 1 << 20, "GiB": 1 << 30}
        sizes = []
        for part in spec.split(":"):
            unit = part[-3:] if part[-3:] in units else ""
            number = part[: len(part) - len(unit)]
            sizes.append(int(number) * units.get(unit, 1) if number.isdigit() else -1)
        if len(sizes) != 3 or min(sizes) < 0:
            raise ValueError(f"{INJECTED_MEMORY_ENV}: expected TOTAL:USED:PEAK, each bytes, MiB or GiB (e.g. "
                             f"64MiB:25MiB:6MiB), got {spec!r}")
        return cls(*sizes)

    def total_and_used(self) -> tuple[int, int]:
        return self.total, self.used

    def peak_growth(self, step: Callable[[], object]) -> int:
        step()
        return self.peak


@dataclass(frozen=True)
class ProfileBatches:
    """The two profiling steps and the blocks their (shared, temporary) cache needs, scratch block included."""

    largest: ScheduledBatch
    decode: ScheduledBatch
    num_blocks: int


def _sequence(name: str, length: int, computed: int, table: list[int], vocab_size: int) -> Sequence:
    seq = Sequence(AddRequest(name, [(7 * i + 1) % vocab_size for i in range(length)], _PROFILE_PARAMS, 0, 2, -1))
    seq.num_computed, seq.block_table = computed, table
    return seq


def profile_batches(tokens: int, max_num_seqs: int, decode_batch: int, decode_context: int,
                    block_size: int, vocab_size: int) -> ProfileBatches:
    """The largest step: one prompt chunk of `tokens` less the single-token entries that bring its rows to
    `max_num_seqs` (each on its own block); the decode step: `decode_batch` decodes at `decode_context` tokens,
    sharing one block table (they only read it, and write their token to one slot). Blocks: [0, num_blocks - 1)
    hold the sequences, the last is free."""
    singles = min(max_num_seqs, tokens) - 1
    chunk = tokens - singles
    chunk_blocks = -(-chunk // block_size)
    entries = [(_sequence("profile-chunk", chunk, 0, list(range(chunk_blocks)), vocab_size), chunk)]
    entries += [(_sequence(f"profile-{i}", 1, 0, [chunk_blocks + i], vocab_size), 1) for i in range(singles)]
    shared = list(range(-(-decode_context // block_size)))
    decodes = [(_sequence(f"profile-decode-{i}", decode_context, decode_context - 1, shared,
                                  vocab_size), 1)
               for i in range(decode_batch)]
    return ProfileBatches(ScheduledBatch(entries), ScheduledBatch(decodes),
                          max(chunk_blocks + singles, len(shared)) + 1)


def graphs_allowance(batch_sizes: list[int], vocab_size: int, decode_peak: int) -> int:
    """Bytes the captured decode graphs hold: their shared pool, at least the largest decode step's
    intermediates (`decode_peak`, measured); the float32 logits `[batch, vocab]` every graph keeps as its
    output; and `GRAPH_OVERHEAD_BYTES` per graph (one per batch size). An estimate: `TorchRunner.warm_up` logs
    what capture took."""
    return decode_peak + sum(batch_sizes) * vocab_size * 4 + len(batch_sizes) * GRAPH_OVERHEAD_BYTES
