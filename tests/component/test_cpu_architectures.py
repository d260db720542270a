"""The Numba runner on every architecture row, against the torch runner on the same tiny random GGUF.

Reference: the torch runner (fp32, CPU device), which test_architectures.py holds to transformers
within 1e-3 on these same files (transformers' GGUF loader costs tens of seconds a file on a busy
2-core machine, so it is loaded once, there). Per family (`tiny_gguf.TINY_SPECS`: 4 heads over 2 KV
heads, real llama.cpp vocabularies, sliding windows shrunk to 16 tokens): last-position logits of three
prompts in one batch (two longer than the window) within 1e-3; greedy ids for 16 tokens equal (or the
first difference where the reference's top-2 gap is below 1e-3) through the paged cache with chunked
prefill, windows crossed mid-chunk, and a prefix-cache hit; and a GPU→CPU hand-off (the torch engine
exports over a ZeroMQ socket, the Numba engine imports and decodes) giving the reference's greedy ids (as
above) and those of the Numba runner alone, its imported keys and values those of its own prefill.
"""

from __future__ import annotations

import queue
import time
from collections import defaultdict

import numpy as np
import pytest
import torch
import zmq

from conftest import TIME_FACTOR
from hf_reference import assert_greedy_matches, reference_greedy
from hybridgate.models import load_gguf, model_fingerprint
from hybridgate.wire import AddRequest, HandoffImported, HandoffRelease, HandoffReservation, HandoffReserve
from hybridgate.wire import HandoffTarget, SamplingParams
from hybridgate.workers.cpu.runner import NumbaRunner
from hybridgate.workers.engine import EngineCore, output_of
from hybridgate.workers.gpu.export import KVExporter
from hybridgate.workers.gpu.model import DecoderModel
from hybridgate.workers.gpu.runner import TorchRunner
from hybridgate.workers.handoff import HandoffIncoming
from hybridgate.workers.scheduler import ScheduledBatch, SchedulerConfig
from hybridgate.workers.sequence import Sequence
from tiny_gguf import TINY_SPECS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-3
PROMPT_LENGTHS = (5, 23, 40)  # the last two pass the 16-token windows
GREEDY_STEPS = 16
GREEDY = SamplingParams(temperature=0, ignore_eos=True)
ROUTER = b"router-1"


class Case:
    """One family's file, the torch runner's answers on it, and a Numba runner (fp32 cache, float32
    activations: the kernels held to the fp32 reference)."""

    def __init__(self, name: str, path):
        self.name, self.gguf = name, load_gguf(path)
        rng = np.random.default_rng(len(name))
        self.prompts = [rng.integers(0, self.gguf.config.vocab_size, size=n).tolist() for n in PROMPT_LENGTHS]
        ref = DecoderModel(self.gguf, torch.device("cpu"), torch.float32)
        caches = [ref.new_cache() for _ in self.prompts]
        ids = torch.tensor([i for p in self.prompts for i in p])
        self.want_logits = ref.forward(ids, list(PROMPT_LENGTHS), caches).numpy()
        self.want_greedy, self.gaps = reference_greedy(ref, self.prompts[-1], GREEDY_STEPS)
        self.runner = NumbaRunner(self.gguf, kv_cache_memory="4MiB", threads=1, kv_cache_dtype="fp32",
                                  activations="f32")
        self.fingerprint = model_fingerprint(self.gguf)


@pytest.fixture(scope="module", params=list(TINY_SPECS))
def case(request, tiny_models) -> Case:
    return Case(request.param, tiny_models(request.param))


def run_engine(engine: EngineCore, requests: list[AddRequest]) -> dict[str, list[int]]:
    for r in requests:
        assert engine.add(r, ROUTER) is None
    out: dict[str, list[int]] = defaultdict(list)
    while engine.has_work():
        for s in engine.step():
            out[s.request_id] += output_of(s).token_ids
    return out


def test_last_position_logits_match_the_torch_runner(case):
    seqs = []
    for i, ids in enumerate(case.prompts):
        s = Sequence(AddRequest(str(i), ids, GREEDY, 0, 4, -1))
        s.block_table = list(range(3 * i, 3 * i + 3))
        seqs.append(s)
    got = case.runner.forward(ScheduledBatch([(s, s.num_tokens) for s in seqs]))
    for row, want, n in zip(got, case.want_logits, PROMPT_LENGTHS):
        assert np.abs(row - want).max() < TOL, (case.name, n, np.abs(row - want).max())


def test_greedy_through_chunked_prefill_windows_and_the_prefix_cache(case):
    # The 40-token prompt in chunks of 12 (the 16-token windows start mid-chunk and cross 16-slot chunk
    # boundaries), then 16 decodes; then again beside a prompt sharing its first 32 tokens: prefix hits.
    case.numba_greedy = greedy_through_chunks_and_prefix(case.runner, case)


def greedy_through_chunks_and_prefix(runner, case) -> list[int]:
    """The last prompt greedy in chunks of 12 against the reference's ids, then again beside a prompt sharing
    its first 32 tokens: the same ids, at least 32 tokens from the prefix cache, every block back. Its ids."""
    prompt = case.prompts[-1]
    engine = EngineCore(runner, SchedulerConfig(max_num_batched_tokens=12), case.fingerprint)
    first = run_engine(engine, [AddRequest("a", prompt, GREEDY, 0, GREEDY_STEPS, -1)])["a"]
    assert_greedy_matches(first, case.want_greedy, case.gaps)
    again = run_engine(engine, [AddRequest("a", prompt, GREEDY, 0, GREEDY_STEPS, -1),
                                AddRequest("b", prompt[:32] + prompt[33:], GREEDY, 0, GREEDY_STEPS, -1)])
    assert again["a"] == first
    assert engine.refresh_stats().cached_tokens >= 32 and engine.allocator.num_used == 0
    return first


@pytest.fixture(scope="module")
def torch_engine(case):
    runner = TorchRunner(case.gguf, torch.device("cpu"), torch.float32, kv_cache_memory="4MiB")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    endpoint = f"inproc://handoff-{case.name}"
    sock.bind(endpoint)
    events: queue.Queue = queue.Queue()
    exporter = KVExporter(runner, ctx, events.put, buffer_memory=4 << 20)
    engine = EngineCore(runner, SchedulerConfig(), case.fingerprint)
    engine.handoffs.exporter = exporter
    yield engine, endpoint, sock, events
    exporter.close()
    sock.close(0)
    ctx.term()


def deliver(cpu: EngineCore, sock, events: queue.Queue) -> list:
    """Feed the hand-off socket's messages to the CPU engine until the exporter reports; its notices."""
    notices, deadline = [], time.monotonic() + 20 * TIME_FACTOR
    while events.empty() or sock.poll(0):
        if sock.poll(50):
            peer, kind, body, *frames = sock.recv_multipart(copy=False)
            cpu.handoffs.handle(peer.bytes, HandoffIncoming(kind.bytes, body.buffer, frames))
            del frames
            notices += cpu.handoffs.take_notices()[0]
        assert time.monotonic() < deadline, "the exporter never reported"
    return notices


def test_a_gpu_to_cpu_handoff_decodes_the_ids_of_the_cpu_runner_alone(case, torch_engine):
    gpu, endpoint, sock, events = torch_engine
    cpu = EngineCore(case.runner, SchedulerConfig(), case.fingerprint, prefix_caching=False)
    prompt = case.prompts[-1]
    cpu.handoffs.handle(ROUTER, HandoffReserve("h", len(prompt) + 1))
    (_, answer), = cpu.handoffs.take_notices()[0]
    assert isinstance(answer, HandoffReservation) and answer.ok, answer
    gpu.add(AddRequest("h", prompt, GREEDY, 0, GREEDY_STEPS, -1, handoff=HandoffTarget(endpoint, answer.token)),
            ROUTER)
    got = []
    while not got:
        for seq in gpu.step():
            got += output_of(seq).token_ids
    notices = deliver(cpu, sock, events)
    gpu.handoffs.handle(b"", events.get(timeout=10 * TIME_FACTOR))
    assert [type(m) for _, m in notices] == [HandoffImported], notices
    seq = cpu._by_id[(ROUTER, "h")]
    imported = [case.runner.read_kv(seq.block_table, i, len(prompt)) for i in range(case.gguf.config.num_layers)]
    gpu.handoffs.handle(ROUTER, HandoffRelease("h"))
    while cpu.has_work():
        for s in cpu.step():
            got += output_of(s).token_ids
    alone = getattr(case, "numba_greedy", None) or run_engine(
        EngineCore(case.runner, SchedulerConfig(), case.fingerprint),
        [AddRequest("a", prompt, GREEDY, 0, GREEDY_STEPS, -1)])["a"]
    assert_greedy_matches(got, case.want_greedy, case.gaps)
    assert got == alone
    # The keys arrived in the basis this runner stores (the file's RoPE layout): its own prefill's.
    own = Sequence(AddRequest("own", prompt, GREEDY, 0, 2, -1))
    assert cpu.allocator.ensure(own.block_table, len(prompt))
    case.runner.execute(ScheduledBatch([(own, len(prompt))]))
    for layer, (k, v) in enumerate(imported):
        ko, vo = case.runner.read_kv(own.block_table, layer, len(prompt))
        for name, a, b in (("k", k, ko), ("v", v, vo)):
            assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max(), (case.name, layer, name)
    cpu.allocator.release(own.block_table)
    assert cpu.allocator.num_used == 0 and gpu.allocator.num_used == 0
