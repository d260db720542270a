"""Incremental step inputs (`input_batch`, `gpu.staging`) against the inputs rebuilt from scratch
(`step_inputs.build_step_inputs`, the reference) over random schedules of the real scheduler: preemption
(a cache of few blocks), prefix hits (prompts sharing prefixes), hand-offs (parked, then freed or resumed;
imported sequences) and aborts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd.profiler import profile

from hybridgate.mempool import BlockAllocator
from hybridgate.wire import AddRequest, SamplingParams
from hybridgate.workers.gpu.staging import DeviceInputs
from hybridgate.workers.input_batch import BlockTables, pack_step
from hybridgate.workers.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from hybridgate.workers.sequence import Sequence, SequenceStatus
from hybridgate.workers.step_inputs import build_step_inputs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS, BLOCKS, VOCAB = 4, 12, 40
PAD_SLOT = BLOCKS * BS  # the scratch block's first slot, as the runner's


def _host(dtype, n):
    return np.empty(n, dtype)


def reference_tables(batch: ScheduledBatch) -> np.ndarray:
    """Each entry's blocks up to its context, padded with the scratch block (the runner's former rebuild)."""
    used = [-(-(s.num_computed + n) // BS) for s, n in batch.entries]
    out = np.full((len(used), max(used)), BLOCKS, dtype=np.int32)
    for i, (seq, _) in enumerate(batch.entries):
        out[i, : used[i]] = seq.block_table[: used[i]]
    return out


def check_step(batch: ScheduledBatch, tables: BlockTables, device: DeviceInputs) -> None:
    ref = build_step_inputs(batch, BS, None, PAD_SLOT)
    packed = pack_step(batch, tables, _host, VOCAB)
    tables.check()
    for name in ("ids", "positions", "last"):
        np.testing.assert_array_equal(packed.view(name), getattr(ref, name), err_msg=name)
    assert packed.seq_lens == ref.contexts and packed.decodes == ref.decodes
    step = device.upload(packed, tables)
    np.testing.assert_array_equal(step.slots.numpy(), ref.slots)
    np.testing.assert_array_equal(step.block_tables.numpy(), reference_tables(batch))
    paged = step.paged_step(block_gather=True)
    if ref.decodes:
        np.testing.assert_array_equal(paged.decode_context.numpy(), ref.decode_context)
        np.testing.assert_array_equal(paged.decode_blocks.numpy(), ref.decode_tables)
        np.testing.assert_array_equal(paged.decode_rows.numpy(), ref.last[ref.decodes])
    assert [(a, n) for a, n, _ in paged.prefills] == [(a, n) for a, n, _, _ in ref.prefills]
    for (_, _, ctx), (_, _, offset, length) in zip(paged.prefills, ref.prefills):
        np.testing.assert_array_equal(ctx.numpy(), ref.prefill_context[offset : offset + length])
    check_sampling(step, packed.ready)


def check_sampling(step, ready: list[Sequence]) -> None:
    """The penalties' masks and counts against the sequences' own ids (the sampler's reference inputs)."""
    fields = step.sampling(VOCAB)
    seen = np.zeros((len(ready), VOCAB), bool)
    counts = np.zeros((len(ready), VOCAB))
    for i, s in enumerate(ready):
        if s.params.repetition_penalty != 1.0 or s.params.presence_penalty:
            seen[i, s.all_ids] = True
            np.add.at(counts[i], s.generated_ids, 1)
    if fields["seen_mask"] is not None:
        np.testing.assert_array_equal(fields["seen_mask"].numpy()[seen.any(1)], seen[seen.any(1)])
    if fields["counts"] is not None:
        np.testing.assert_array_equal(fields["counts"].numpy()[seen.any(1)], counts[seen.any(1)])
    np.testing.assert_array_equal(fields["repetition_penalty"].numpy(), [s.params.repetition_penalty for s in ready])


class World:
    """A scheduler over few blocks, driven by the actions of one example."""

    def __init__(self):
        self.alloc = BlockAllocator(BLOCKS, BS)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=12), self.alloc, "fp")
        self.tables = BlockTables(2, rows=2, pad_block=BLOCKS)  # small, so that rows and columns grow too
        self.device = DeviceInputs(torch.device("cpu"), 8, self.tables, BS, PAD_SLOT)
        self.parked: list[Sequence] = []
        self.count = 0
        self.rng = np.random.default_rng(0)

    def add(self, prefix: int, length: int, penalized: bool, resumed: int) -> None:
        prompt = [3 + (i % 5) for i in range(prefix)] + self.rng.integers(3, VOCAB, length).tolist()
        params = SamplingParams(temperature=0, repetition_penalty=1.3 if penalized else 1.0,
                                presence_penalty=0.5 if penalized else 0.0)
        self.count += 1
        self.scheduler.add(Sequence(AddRequest(f"r{self.count}", prompt, params, 0, 10, 2,
                                               first_token_index=min(resumed, len(prompt)))))

    def step(self) -> None:
        batch = self.scheduler.schedule()
        if not len(batch):
            return
        check_step(batch, self.tables, self.device)
        for seq, n in batch.entries:
            seq.num_computed += n
        self.scheduler.after_step(batch)
        for seq, n in batch.entries:
            if seq.num_computed == seq.num_tokens:
                seq.append(int(self.rng.integers(2, VOCAB)))
                if seq.status.finished:
                    self.scheduler.finish(seq, seq.status)

    def abort(self, pick: int) -> None:
        live = list(self.scheduler.waiting) + self.scheduler.running
        if live:
            self.scheduler.finish(live[pick % len(live)], SequenceStatus.FINISHED_ABORTED)

    def hand_off(self, pick: int, outcome: int) -> None:
        """Park a running decode (its export); later free it (export done), resume it, or import a copy."""
        decodes = [s for s in self.scheduler.running if s.output_ids and s.num_computed == s.num_tokens - 1]
        if outcome == 0 and decodes:
            seq = decodes[pick % len(decodes)]
            self.scheduler.park(seq)
            self.parked.append(seq)
        elif self.parked:
            seq = self.parked.pop(pick % len(self.parked))
            if outcome == 1:  # the receiver took it: the sender frees its blocks
                self.alloc.release(seq.block_table)
                seq.status = SequenceStatus.FINISHED_STOPPED
            elif outcome == 2:
                self.scheduler.unpark(seq)
            else:  # imported here: new blocks, its KV written by the import
                self.alloc.release(seq.block_table)
                table: list[int] = []
                if self.alloc.ensure(table, seq.num_computed + 1):
                    seq.block_table, seq.imported, seq.cacheable = table, True, False
                    self.scheduler.unpark(seq)


_ADD = st.tuples(st.just("add"), st.integers(0, 8), st.integers(1, 10), st.booleans(), st.integers(0, 3))
ACTIONS = st.one_of(_ADD, _ADD, st.tuples(st.just("step")), st.tuples(st.just("step")),
                    st.tuples(st.just("abort"), st.integers(0, 20)),
                    st.tuples(st.just("hand_off"), st.integers(0, 20), st.integers(0, 3)))


@settings(max_examples=80, deadline=None)
@given(st.lists(ACTIONS, min_size=8, max_size=60))
def test_incremental_step_inputs_equal_the_inputs_rebuilt_from_scratch(actions):
    world = World()
    for name, *args in actions:
        getattr(world, name)(*args)
    while world.scheduler.has_work():  # run everything out: the longest schedules, every finish
        world.step()


def test_a_decode_writes_a_table_cell_only_when_it_starts_a_block():
    """Hand-worked: with block 0 taken by another table, a 6-token prompt on blocks of 4 takes blocks 1 and 2;
    decoding positions 6..9 adds block 3 at position 8, and only that step carries a cell."""
    alloc = BlockAllocator(16, 4)
    assert alloc.ensure([], 4)
    seq = Sequence(AddRequest("a", [3, 4, 5, 6, 7, 8], SamplingParams(temperature=0), 0, 8, -1))
    tables = BlockTables(4, rows=2, pad_block=16)
    cells_per_step = []
    n = 6
    for _ in range(5):
        assert alloc.ensure(seq.block_table, seq.num_computed + n)
        rows, cells = tables.update([(seq, n)])
        cells_per_step.append(cells[2].tolist())
        seq.num_computed += n
        seq.append(10)
        n = 1
    assert cells_per_step == [[1, 2], [], [], [3], []]
    assert tables.table[rows[0], :3].tolist() == [1, 2, 3] and tables.rebuilds == 0 and tables.appended == 1


def _host_tensors(events) -> int:
    """Tensors made from host data in the profiled ops (`aten::lift_fresh`: torch.tensor, torch.from_numpy,
    indexing by a list, a Python scalar assigned into a tensor): on CUDA each is a host-to-device copy."""
    return [e.name for e in events].count("aten::lift_fresh")


def test_every_step_copies_its_inputs_once_and_its_sampled_ids_once(tmp_path):
    """Chunked prefills (steps that sample nothing), decodes, a penalized seeded request beside greedy ones:
    one tensor from host data per step (the packed inputs) and one copy of the sampled ids when any."""
    from hybridgate.models import load_gguf
    from hybridgate.workers.engine import EngineCore
    from hybridgate.workers.gpu.runner import TorchRunner
    from tiny_gguf import write_tiny_llama

    runner = TorchRunner(load_gguf(write_tiny_llama(tmp_path / "m.gguf", heads=4, kv_heads=2)), torch.device("cpu"),
                         torch.float32, kv_cache_memory="1MiB")
    engine = EngineCore(runner, SchedulerConfig(max_num_batched_tokens=24), "fp")
    penalized = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, repetition_penalty=1.2, presence_penalty=0.3,
                               frequency_penalty=0.2)
    for i, (n, params) in enumerate([(40, SamplingParams(temperature=0)), (9, penalized), (5, SamplingParams())]):
        engine.add(AddRequest(f"r{i}", list(range(3, 3 + n)), params, 7, 6, -1))
    per_step = []
    while engine.has_work():
        before = (runner.inputs.copies.host_to_device, runner.inputs.copies.device_to_host)
        with profile() as ops:
            sampled = engine.step()
        copies = runner.inputs.copies
        per_step.append((_host_tensors(ops.function_events), copies.host_to_device - before[0], copies.device_to_host - before[1],
                         bool(sampled)))
    assert len(per_step) >= 7 and any(not s for *_, s in per_step)  # steps that sample nothing too
    assert all((made, up, down) == (1, 1, int(s)) for made, up, down, s in per_step), per_step
    assert runner.pool.stats.fallbacks == 0
