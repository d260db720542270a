"""End to end: the worker lifecycle under `serve` (restart, false death, give-up, no stale delivery)
and a gateway pointed at an ipc socket that does not exist."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import TIME_FACTOR
from hybridgate.v1 import generation_pb2 as pb
from procs import Proc, Serve, alive, metrics, stub, wait_metric

# One CPU-runner worker on one thread: with its kernel cache warm (every start after the first) it
# is READY in 3-6 s here, where the torch runner takes 10-20 s on these loaded 2 cores.
ONE_WORKER = ("--cpu-workers", "1", "--gpu-workers", "0")
NAME = "cpu-0"
AFTER_ABORT = "hybridgate:engine_tokens_after_abort_total{}"
RUNNING = "hybridgate:num_requests_running{}"
STEPS = "hybridgate:engine_steps_total{}"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def health(target: str) -> int:
    return health_pb2_grpc.HealthStub(grpc.insecure_channel(target)).Check(
        health_pb2.HealthCheckRequest(service="hybridgate.v1.Generation"), timeout=5).status


def wait_health(target: str, status: int, timeout: float = 60.0) -> float:
    """Seconds until health is `status` (polled every 20 ms)."""
    start = time.monotonic()
    while health(target) != status:
        if time.monotonic() - start > timeout * TIME_FACTOR:
            raise AssertionError(f"health not {status} after {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - start


def worker_pid(server: Proc) -> int:
    """The pid of the worker that last said it is ready."""
    return int(re.findall(r"worker ready on \S+ \(pid (\d+)\)", server.text())[-1])


def wait_log_count(proc: Proc, pattern: str, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout * TIME_FACTOR
    while len(re.findall(pattern, proc.text())) < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"fewer than {n} of {pattern!r}:\n{proc.text()}")
        time.sleep(0.05)


def answer(target: str, prompt: str, n: int = 8) -> list[int]:
    msgs = list(stub(target).Generate(pb.GenerateRequest(prompt=prompt, max_tokens=n, ignore_eos=True, temperature=0),
                                      timeout=60 * TIME_FACTOR))
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    return [i for m in msgs for i in m.token_ids]


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_path):
    # Resume off: these tests watch what happens to the requests the router gives up on (with resume
    # on they would be placed again on the successor; tests/e2e/test_resume.py covers that).
    proc = Serve(tmp_path_factory.mktemp("lifecycle") / "serve.log", *ONE_WORKER, "--worker-timeout", "0.5",
                 "--no-resume-on-worker-loss")
    yield proc
    assert proc.stop() == 0, proc.text()


def test_killed_worker_is_restarted_and_serves_again(server, record_property):
    answer(server.target, "The first prompt")
    pid = worker_pid(server)
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_health(server.target, NOT_SERVING, timeout=5)
    wait_health(server.target, SERVING, timeout=120)
    seconds = time.monotonic() - killed
    record_property("kill_to_serving_s", round(seconds, 2))
    print(f"\nkill to SERVING again: {seconds:.2f} s")
    assert worker_pid(server) != pid and alive(worker_pid(server))
    assert f"worker {NAME} (pid {pid}) exited (killed by signal SIGKILL); restarting it in 0.5 s" in server.text()
    assert len(answer(server.target, "A new prompt after the restart")) == 8
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    assert f'hybridgate:worker_restarts_total{{worker="{NAME}"}} 1.0' in text
    assert f'hybridgate:worker_up{{worker="{NAME}"}} 1.0' in text
    assert f'hybridgate:engine_steps_total{{worker="{NAME}"}}' in text and ".sock" not in text  # stable labels


def test_stopped_worker_is_readmitted_and_its_abandoned_sequences_aborted(server):
    before = metrics(server.metrics_url)[AFTER_ABORT]
    call = stub(server.target).Generate(pb.GenerateRequest(prompt="Once upon a time", max_tokens=2000,
                                                           ignore_eos=True))
    next(call)
    pid = worker_pid(server)
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(grpc.RpcError) as info:
            list(call)  # given up on after --worker-timeout 0.5
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        wait_health(server.target, NOT_SERVING, timeout=2)
        time.sleep(0.5)  # well past the timeout: it is DEAD, being probed
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_health(server.target, SERVING, timeout=10)
    server.wait_for(rf"worker {NAME} is back \(same boot\): aborting the 1 sequences given up on")
    wait_metric(server.metrics_url, RUNNING, lambda v: v == 0)
    assert metrics(server.metrics_url)[AFTER_ABORT] - before <= 1
    assert worker_pid(server) == pid  # re-admitted, not restarted
    assert len(answer(server.target, "Another prompt after the pause")) == 8


def test_nothing_queued_for_a_dead_worker_reaches_its_successor(server):
    answer(server.target, "Warm")
    pid = worker_pid(server)
    ready_lines = len(re.findall(r"worker ready on", server.text()))
    os.kill(pid, signal.SIGSTOP)  # sent now, these queue in the stopped worker's socket, and die with it
    errors: list[grpc.StatusCode] = []

    def send(i: int) -> None:
        try:
            list(stub(server.target).Generate(pb.GenerateRequest(prompt=f"Lost request {i}", max_tokens=500,
                                                                 ignore_eos=True), timeout=30 * TIME_FACTOR))
        except grpc.RpcError as exc:
            errors.append(exc.code())

    threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    # Right after the kill (before the gateway calls it dead) and while it is down: not queued anywhere.
    threads += [threading.Thread(target=send, args=(i,)) for i in range(2, 6)]
    for t in threads[2:]:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert errors == [grpc.StatusCode.UNAVAILABLE] * 6
    wait_log_count(server, r"worker ready on", ready_lines + 1)
    wait_health(server.target, SERVING, timeout=30)
    time.sleep(1.0 * TIME_FACTOR)  # time for anything stale to arrive and run
    wait_metric(server.metrics_url, STEPS, lambda v: v == 0)  # the successor's own counters
    m = metrics(server.metrics_url)
    assert m[STEPS] == 0 and m[RUNNING] == 0


def test_worker_crashing_at_start_is_given_up_on_after_five_restarts_and_serve_exits(tmp_path, model_path):
    """With no worker left to serve, serve exits 1 naming the worker's last error (a new user's serve
    used to stay up answering 503 forever)."""
    proc = Proc(["serve", "--port", "0", "--metrics-port", "0", "--threads", "1", *ONE_WORKER,
                 "--worker-restart-backoff", "0.05"], tmp_path / "serve.log",
                env={"HYBRIDGATE_TEST_CRASH_AT_START": "1"})
    try:
        assert proc.popen.wait(150 * TIME_FACTOR) == 1
        text = proc.text()
        line = re.search(rf"hybridgate: worker {NAME} \(pid \d+\) exited \(([^\n]*)\) after 5 restarts within 60 s; "
                         r"not restarting it", text)
        assert line and "exit code 1; last error: RuntimeError: crashing at start" in line.group(1), text
        assert len(re.findall(rf"worker {NAME} \(pid \d+\) exited", text)) == 6  # no restart after that
        error = re.search(r"hybridgate: error: every worker stays down after its restarts \(--worker-max-restarts\); "
                          r"([^\n]*)", text)
        assert error and f"worker {NAME}: exit code 1; last error: RuntimeError: crashing at start" in error.group(1)
        assert "Traceback" not in text.split("not restarting it", 1)[1]
    finally:
        proc.stop()


@pytest.mark.parametrize("wait", [False, True])
def test_gateway_says_nothing_listens_on_a_missing_socket(tmp_path, model_path, wait):
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    proc = Proc(["gateway", "--port", "0", "--worker", endpoint, *(["--wait-for-workers"] if wait else [])],
                tmp_path / "gateway.log")
    try:
        proc.wait_for(r"gRPC on 127\.0\.0\.1:\d+")
        listening = time.monotonic()
        proc.wait_for(re.escape(f"nothing is listening on {endpoint} (no socket file)"), timeout=5)
        # Said at serve.SOCKET_CHECK_S (3 s), not only when a request finds no worker: 2 s of slack, scaled.
        assert time.monotonic() - listening < 5 * TIME_FACTOR
        if wait:
            assert "waiting for a worker to bind it" in proc.text()
            time.sleep(0.5)
            assert proc.popen.poll() is None
        else:
            assert proc.popen.wait(10 * TIME_FACTOR) == 1
            assert "--wait-for-workers" in proc.text() and "Traceback" not in proc.text()
    finally:
        proc.stop()
