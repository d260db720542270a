"""`serve --gateways 2`: two gateway processes on one port share the workers, and drain together."""

from __future__ import annotations

import re
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from conftest import TIME_FACTOR
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.v1 import generation_pb2_grpc as pb_grpc
from procs import Serve, alive, children_of, metrics

STREAMS = 64
CHANNELS = 16  # connections, each from its own port: the kernel spreads connections, not streams
TOKENS = 8


def _served(url: str) -> float:
    return sum(v for k, v in metrics(url).items() if k.startswith("hybridgate:request_success_total"))


@pytest.fixture(scope="module")
def serve2(tmp_path_factory):
    proc = Serve(tmp_path_factory.mktemp("gateways") / "serve.log", "--gateways", "2")
    yield proc
    proc.stop()


def test_two_gateways_share_the_port_and_the_workers(serve2):
    extra_url = serve2.wait_for(r"gateway 1 metrics on (http://\S+)").group(1)
    channels = [grpc.insecure_channel(serve2.target, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(CHANNELS)]
    request = pb.GenerateRequest(prompt="Count to ten:", max_tokens=TOKENS, ignore_eos=True, temperature=0)

    def one(k: int) -> list[int]:
        stub = pb_grpc.GenerationStub(channels[k % CHANNELS])
        return [t for m in stub.Generate(request, timeout=120 * TIME_FACTOR) for t in m.token_ids]

    with ThreadPoolExecutor(STREAMS) as pool:
        results = list(pool.map(one, range(STREAMS)))
    for channel in channels:
        channel.close()
    assert all(len(ids) == TOKENS for ids in results)
    assert len({tuple(ids) for ids in results}) == 1  # greedy: one answer, whichever gateway served it
    served = [_served(serve2.metrics_url), _served(extra_url)]
    assert sum(served) == STREAMS and min(served) > 0, served


def test_a_port_held_by_another_program_is_refused(tmp_path):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        from procs import Proc

        proc = Proc(["serve", "--gateways", "2", "--port", str(port), "--threads", "1"], tmp_path / "serve.log")
        assert proc.popen.wait(60 * TIME_FACTOR) != 0
        assert re.search(rf"cannot listen on 127\.0\.0\.1:{port}", proc.text()), proc.text()
        proc.stop()


def test_sigint_drains_both_gateways_and_leaves_no_child(serve2):
    pid = serve2.pid
    kids = children_of(pid)
    assert len(kids) >= 2  # a worker and the second gateway
    assert serve2.stop(signal.SIGINT) == 0, serve2.text()
    # multiprocessing's resource tracker exits once the last holder of its pipe has: just after serve
    deadline = time.monotonic() + 5 * TIME_FACTOR
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [k for k in kids if alive(k)]
