"""A reader that falls behind gets the queued deltas joined, exactly; one that keeps up gets one per step.

Real processes: an instant worker (the real worker process and wire, a runner
that streams a fixed text at a set step time) and `hybridgate gateway`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import grpc
import pytest

from conftest import TIME_FACTOR
from hybridgate.bench.instant import run_instant_worker
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.v1 import generation_pb2_grpc as pb_grpc
from hybridgate.workers.process import WorkerConfig
from procs import Proc

STEP_S = 0.01
TOKENS = 160
# The reader's HTTP/2 receive window: small, so that a reader that falls behind holds the gateway's
# writes back after a few hundred bytes (with the default 64 KiB, and more after BDP probing, a
# short stream would sit in the window unread and the gateway would never see the reader lag).
SLOW_READER = [("grpc.http2.lookahead_bytes", 256), ("grpc.http2.bdp_probe", 0)]


@pytest.fixture(scope="module")
def gateway(model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("coalescing")
    endpoint = f"ipc://{folder}/instant-0"
    worker = mp.get_context("spawn").Process(
        target=run_instant_worker, args=(WorkerConfig(model_path=str(model_path), endpoint=endpoint,
                                                      parent_pid=os.getpid()), STEP_S))
    worker.start()
    gw = Proc(["gateway", "--model", str(model_path), "--port", "0", "--worker", endpoint], folder / "gateway.log")
    try:
        port = gw.wait_for(r"gRPC on 127\.0\.0\.1:(\d+)").group(1)
        gw.wait_for(r"hybridgate: READY")
        yield f"127.0.0.1:{port}"
    finally:
        gw.stop()
        worker.terminate()
        worker.join(30)


def _read(target: str, pause_s: float) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(prompt="Tell me about lighthouses.", max_tokens=TOKENS, temperature=0,
                                 ignore_eos=True)
    channel = grpc.insecure_channel(target, options=SLOW_READER if pause_s else [])
    out = []
    for msg in pb_grpc.GenerationStub(channel).Generate(request, timeout=60 * TIME_FACTOR):
        out.append(msg)
        time.sleep(pause_s)
    return out


def test_slow_reader_gets_joined_deltas_equal_to_a_fast_readers(gateway, tokenizer):
    fast = _read(gateway, 0.0)
    slow = _read(gateway, 3 * STEP_S)  # reads a message while about three steps' tokens arrive
    for msgs in (fast, slow):
        ids = [t for m in msgs for t in m.token_ids]
        assert len(ids) == TOKENS
        # token indexes contiguous: each message starts where the previous ones ended
        starts = [m.token_index for m in msgs]
        assert starts == [sum(len(m.token_ids) for m in msgs[:k]) for k in range(len(msgs))]
        assert "".join(m.text for m in msgs) == tokenizer.decode(ids)
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert [t for m in slow for t in m.token_ids] == [t for m in fast for t in m.token_ids]
    assert "".join(m.text for m in slow) == "".join(m.text for m in fast)
    # One step, one token, one message: a reader that keeps up gets a message per step (at least 95% of
    # them: a gateway descheduled for a step on a busy 2-core machine joins that step's id with the next).
    assert len(fast) >= 0.95 * TOKENS, len(fast)
    assert len(slow) < TOKENS / 2, len(slow)
