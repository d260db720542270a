"""Real processes for end-to-end tests: `hybridgate serve`, `gateway`, `worker`, and gRPC helpers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from conftest import TIME_FACTOR
from hybridgate.v1 import generation_pb2_grpc as pb_grpc

HYBRIDGATE = str(Path(sys.executable).parent / "hybridgate")


class Proc:
    """A child process whose combined output goes to a log file we can wait on."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None):
        self.log = log
        self._out = open(log, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYBRIDGATE_LOG_LEVEL": "INFO", **(env or {})}
        self.popen = subprocess.Popen([HYBRIDGATE, *args], stdout=self._out, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 90.0) -> re.Match:
        deadline = time.monotonic() + timeout * TIME_FACTOR
        while time.monotonic() < deadline:
            match = re.search(pattern, self.text())
            if match:
                return match
            if self.popen.poll() is not None:
                raise AssertionError(f"exited ({self.popen.returncode}) before {pattern!r}:\n{self.text()}")
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {pattern!r}:\n{self.text()}")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout * TIME_FACTOR)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        self._out.close()
        return self.popen.returncode


class Serve(Proc):
    """`hybridgate serve` on free ports; `target` and `metrics_url` once READY."""

    def __init__(self, log: Path, *extra: str, env: dict[str, str] | None = None):
        super().__init__(["serve", "--port", "0", "--metrics-port", "0", "--threads", "1", *extra], log, env)
        self.port = int(self.wait_for(r"gRPC on 127\.0\.0\.1:(\d+)").group(1))
        self.metrics_url = self.wait_for(r"metrics on (http://\S+)").group(1)
        self.wait_for(r"hybridgate: READY")
        self.target = f"127.0.0.1:{self.port}"


def children_of(pid: int) -> list[int]:
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if int(fields.get("PPid", "0").strip()) == pid:
            out.append(int(status.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def stub(target: str) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]))


def metrics(url: str) -> dict[str, float]:
    """Samples as {"name{label=value,...}": value} (labels sorted)."""
    out = {}
    for family in text_string_to_metric_families(urllib.request.urlopen(url, timeout=5).read().decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "worker")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def wait_metric(url: str, name: str, predicate, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout * TIME_FACTOR
    while True:
        value = metrics(url).get(name)
        if value is not None and predicate(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} = {value} after {timeout} s")
        time.sleep(0.05)
