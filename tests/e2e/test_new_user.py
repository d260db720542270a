"""End to end, as a new user meets it: the worker's ready line, one clear line for each bad start."""

from __future__ import annotations

import re
import socket
import subprocess

import pytest

from conftest import TIME_FACTOR
from procs import HYBRIDGATE, Proc

NOISE = ("Traceback", "Event loop is closed")
C_CORE_LOG = re.compile(r"^[EWID]\d{4} ", re.M)  # gRPC C-core (absl) lines: "E1201 04:17:28.321157 ..."


def run(*args: str) -> subprocess.CompletedProcess:
    """`hybridgate ARGS` at the default log level; output of both streams."""
    return subprocess.run([HYBRIDGATE, "--log-level", "WARNING", *args], capture_output=True, text=True,
                          timeout=120 * TIME_FACTOR)


def assert_one_clear_line(out: subprocess.CompletedProcess, problem: str, *named: str) -> None:
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    lines = [line for line in text.splitlines() if problem in line]
    assert len(lines) == 1 and all(n in lines[0] for n in named), text
    assert not any(n in text for n in NOISE) and not C_CORE_LOG.search(text), text


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_worker_prints_a_ready_line_at_the_default_log_level(tmp_path, model_path):
    endpoint = f"ipc://{tmp_path}/w.sock"
    worker = Proc(["--log-level", "WARNING", "worker", "--endpoint", endpoint, "--threads", "1"], tmp_path / "w.log")
    try:
        pid = worker.wait_for(rf"hybridgate worker: READY \(cpu, pid (\d+)\) on {re.escape(endpoint)}\n").group(1)
        assert int(pid) == worker.pid
        assert (tmp_path / "w.sock").exists() and (tmp_path / "w.sock.handoff").exists()
    finally:
        assert worker.stop() == 0, worker.text()
    # Its socket files went with it: a gateway started later is told nothing listens, at once.
    assert not (tmp_path / "w.sock").exists() and not (tmp_path / "w.sock.handoff").exists()


@pytest.mark.parametrize(("endpoint", "problem", "flag"), [
    ("ipc:///nonexistent-folder/w.sock", "the folder /nonexistent-folder does not exist", "--endpoint"),
    ("tcp://127.0.0.1:port", "Invalid argument", "--endpoint"),
    ("/tmp/w.sock", "must start with ipc://", "endpoint"),
])
def test_a_bad_worker_endpoint_is_one_line(endpoint, problem, flag, model_path):
    assert_one_clear_line(run("worker", "--endpoint", endpoint), problem, flag, endpoint)


def test_a_worker_port_in_use_is_one_line(taken_port, model_path):
    endpoint = f"tcp://127.0.0.1:{taken_port}"
    assert_one_clear_line(run("worker", "--endpoint", endpoint), "in use", "--endpoint", endpoint)


def test_a_metrics_port_in_use_is_one_line(tmp_path, taken_port, model_path):
    out = run("gateway", "--worker", f"ipc://{tmp_path}/none.sock", "--port", "0", "--metrics-port", str(taken_port))
    assert_one_clear_line(out, "in use", "--metrics-port", f"127.0.0.1:{taken_port}")


def test_a_grpc_port_in_use_is_one_line(tmp_path, taken_port, model_path):
    out = run("gateway", "--worker", f"ipc://{tmp_path}/none.sock", "--port", str(taken_port))
    assert_one_clear_line(out, "in use", "--port", f"127.0.0.1:{taken_port}")
