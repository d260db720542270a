"""End to end: a stream whose worker is SIGKILLed mid-stream is resumed on another worker of the
same kind under `serve` (the torch runner: `--gpu-workers`, on a CPU torch device here), and the
client sees one stream. The reference is the same runner in this process, single-threaded as the
workers are: the undisturbed run for the ids before the move, and the run resumed from the prompt
plus those ids at their token index for the rest."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import grpc
import pytest

from conftest import TIME_FACTOR
from hybridgate.v1 import generation_pb2 as pb
from procs import Serve, children_of, stub

PROMPT = "Once upon a time, in a village by the sea,"
TOTAL, KILL_AT = 64, 10
SEED = 4242
# serve's workers: 3, so that after two kills (no restart yet) a READY one remains; `serve` may
# also restart the killed ones, which changes nothing here.
WORKER_ARGS = ("--cpu-workers", "0", "--kv-cache-memory", "256MiB")


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_path):
    proc = Serve(tmp_path_factory.mktemp("resume") / "serve.log", *WORKER_ARGS, "--gpu-workers", "3")
    yield proc
    assert proc.stop() == 0, proc.text()


@pytest.fixture(scope="module")
def reference(gguf_model, tokenizer):
    """`run(ids, max_tokens, first_token_index, **params)`: the ids the torch runner generates (seed SEED;
    a greedy request's router-chosen seed changes nothing)."""
    import torch

    from hybridgate.models import model_fingerprint
    from hybridgate.wire import AddRequest, SamplingParams
    from hybridgate.workers.engine import EngineCore, output_of
    from hybridgate.workers.gpu.runner import TorchRunner
    from hybridgate.workers.scheduler import SchedulerConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers (--threads 1): the same reduction order
    engine = EngineCore(TorchRunner(gguf_model, torch.device("cpu"), torch.float32, kv_cache_memory="64MiB"),
                        SchedulerConfig(), model_fingerprint(gguf_model), prefix_caching=False)

    def run(ids, max_tokens, first_token_index=0, **params):
        params = SamplingParams(ignore_eos=True, **params)
        assert engine.add(AddRequest("ref", ids, params, SEED, max_tokens, 2, first_token_index)) is None
        out = []
        while engine.has_work():
            out += [i for s in engine.step() for i in output_of(s).token_ids]
        return out

    yield run
    torch.set_num_threads(threads)


def pid_bound_to(parent: int, endpoint: str) -> int:
    """The child of `parent` whose listening socket is bound to this ipc endpoint (/proc/net/unix)."""
    path = endpoint.removeprefix("ipc://")
    inodes = {f"socket:[{f[6]}]" for f in (line.split() for line in Path("/proc/net/unix").read_text().splitlines()[1:])
              if len(f) > 7 and f[7] == path}
    for pid in children_of(parent):
        try:
            if any(os.readlink(fd) in inodes for fd in Path(f"/proc/{pid}/fd").iterdir()):
                return pid
        except OSError:
            continue
    raise AssertionError(f"no child of {parent} is bound to {path}")


def kill_the_worker_running_it(server) -> float:
    """SIGKILL the one worker with a running sequence; returns when it was killed."""
    info = stub(server.target).GetModelInfo(pb.GetModelInfoRequest())
    busy = [w.endpoint for w in info.workers if w.ready and w.running > 0]
    assert len(busy) == 1, info
    os.kill(pid_bound_to(server.pid, busy[0]), signal.SIGKILL)
    return time.monotonic()


def stream_and_kill(server, request: pb.GenerateRequest):
    """Read the stream, kill its worker once the 10th token has arrived.

    Returns (messages, kill time, the RpcError that ended the stream or None, when it ended).
    """
    messages, ids, killed, error = [], [], None, None
    try:
        for msg in stub(server.target).Generate(request):
            messages.append(msg)
            ids += msg.token_ids
            if killed is None and len(ids) >= KILL_AT:
                killed = kill_the_worker_running_it(server)
    except grpc.RpcError as exc:
        error = exc
    return messages, killed, error, time.monotonic()


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"temperature": 0.8, "seed": SEED}],
                         ids=["greedy", "seeded-0.8"])
def test_a_stream_whose_worker_is_killed_is_resumed_elsewhere(server, reference, tokenizer, params):
    request = pb.GenerateRequest(prompt=PROMPT, max_tokens=TOTAL, ignore_eos=True, **params)
    messages, killed, error, _ = stream_and_kill(server, request)
    assert killed is not None and error is None, error
    ids = [i for m in messages for i in m.token_ids]
    assert [m.finish_reason != 0 for m in messages] == \
        [False] * (len(messages) - 1) + [True]
    assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH and len(ids) == TOTAL
    starts = [sum(len(m.token_ids) for m in messages[:i]) for i in range(len(messages))]
    assert [m.token_index for m in messages] == starts  # contiguous: no gap, no repeat
    route = messages[-1].route
    moved = re.fullmatch(r"gpu \(.+\), resumed at token (\d+) on gpu \(.+\)", route)
    assert moved, route
    k = int(moved.group(1))
    assert KILL_AT <= k < TOTAL
    prompt_ids, t = tokenizer.encode(PROMPT), params["temperature"]
    assert ids[:k] == reference(prompt_ids, TOTAL, temperature=t)[:k]  # the undisturbed run's
    assert ids[k:] == reference(prompt_ids + ids[:k], TOTAL - k, k, temperature=t)  # resumed at index k


def test_with_resume_off_the_stream_ends_unavailable(tmp_path, model_path):
    server = Serve(tmp_path / "serve.log", *WORKER_ARGS, "--gpu-workers", "2", "--no-resume-on-worker-loss")
    try:
        request = pb.GenerateRequest(prompt=PROMPT, max_tokens=TOTAL, ignore_eos=True, temperature=0)
        messages, killed, error, ended = stream_and_kill(server, request)
        assert killed is not None and error is not None and error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert ended - killed < 2.0 * TIME_FACTOR
        assert KILL_AT <= sum(len(m.token_ids) for m in messages) < TOTAL
    finally:
        assert server.stop() == 0, server.text()
