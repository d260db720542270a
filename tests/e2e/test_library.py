"""The router as a library in a user's own programs, against a live worker process: docs/library.md's snippet run
as written, the grpc.aio example service and the aiohttp SSE example; `hybridgate.router` without torch or numba."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest

from conftest import ROOT, TIME_FACTOR, free_port, generated_code_lines, golden_json
from procs import Proc

FRANCE = golden_json("greedy.json")["france"]  # transformers' greedy answer (tests/reference)
ANSWER = FRANCE["text"].removesuffix("<|im_end|>")  # the streamed text leaves the special token out
EXAMPLES = ROOT / "examples"
# A meta-path finder that refuses the heavy packages, so any import of them (direct or not) fails loudly.
BLOCKER = """
import sys
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "numba", "llvmlite"):
            raise ImportError(f"{name} is blocked in this test")
        return None
sys.meta_path.insert(0, _Blocked())
"""


@pytest.fixture(scope="module")
def worker(tmp_path_factory, model_path):
    folder = tmp_path_factory.mktemp("library")
    endpoint = f"ipc://{folder}/w0.sock"
    proc = Proc(["worker", "--endpoint", endpoint, "--threads", "1"], folder / "worker.log")
    try:
        proc.wait_for(r"hybridgate worker: READY", 120)
        yield endpoint
    finally:
        proc.stop()


def library_snippet() -> str:
    section = (ROOT / "docs" / "library.md").read_text().split("# The router as a library", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_python(code: str, env: dict[str, str], cwd: Path, *args: str, timeout: float = 60.0):
    return subprocess.run([sys.executable, "-c", code, *args], env={**os.environ, **env}, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout * TIME_FACTOR)


def test_library_page_snippet_runs_as_a_script_without_torch_or_numba(worker, tmp_path, model_path):
    script = tmp_path / "client.py"
    script.write_text(library_snippet())
    code = BLOCKER + f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')\n"
    out = run_python(code, {"HYBRIDGATE_WORKER": worker, "HYBRIDGATE_MODEL": str(model_path)}, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ANSWER + "\n"


def test_router_imports_with_torch_and_numba_blocked(tmp_path):
    code = BLOCKER + ("import hybridgate.router, hybridgate.router.response_cache, hybridgate.router.registry\n"
                      "assert not any(m.partition('.')[0] in ('torch', 'numba') for m in sys.modules)\n"
                      "try:\n    import torch\nexcept ImportError as exc:\n    print('blocked:', exc)\n")
    out = run_python(code, {}, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "blocked: torch is blocked in this test"  # the blocker really was in force


def test_grpc_example_service_streams_an_answer_and_stops_on_ctrl_c(worker, tmp_path, model_path):
    sys.path.insert(0, str(EXAMPLES / "grpc_service"))
    try:
        import assistant_pb2
        import assistant_pb2_grpc
    finally:
        sys.path.pop(0)
    port = free_port()
    server = Popen([sys.executable, str(EXAMPLES / "grpc_service" / "server.py"), "--worker", worker, "--model",
                    str(model_path), "--port", str(port)], tmp_path / "assistant.log", background_job=True)
    try:
        server.wait_for(rf"assistant on 127\.0\.0\.1:{port}", 60)
        stub = assistant_pb2_grpc.AssistantStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        replies = list(stub.Ask(assistant_pb2.AskRequest(question=FRANCE["question"], max_tokens=32),
                                timeout=60 * TIME_FACTOR))
        assert "".join(r.text for r in replies) == ANSWER
        assert [r.done for r in replies] == [False] * (len(replies) - 1) + [True]
        assert replies[-1].finish_reason == "eos"
    finally:
        code = server.stop(signal.SIGINT, timeout=20)  # kill -INT (Ctrl-C): one that ignores it is killed at 20 s
    assert code == 0 and "assistant: stopping" in server.text(), server.text()


def test_grpc_example_generated_code_is_fresh(tmp_path):
    from grpc_tools import protoc

    folder = EXAMPLES / "grpc_service"
    assert protoc.main(["protoc", f"-I{folder}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                        str(folder / "assistant.proto")]) == 0
    for name in ("assistant_pb2.py", "assistant_pb2_grpc.py"):
        assert generated_code_lines((tmp_path / name).read_text()) == generated_code_lines((folder / name).read_text()), (
            f"{name} is stale: regenerate it")


def test_sse_example_streams_events(worker, tmp_path, model_path):
    port = free_port()
    app = Popen([sys.executable, str(EXAMPLES / "sse_app.py"), "--worker", worker, "--model", str(model_path),
                 "--port", str(port)], tmp_path / "sse.log")
    try:
        app.wait_for(rf"Running on http://127\.0\.0\.1:{port}", 60)
        url = f"http://127.0.0.1:{port}/ask?" + urllib.parse.urlencode({"q": FRANCE["question"]})
        with urllib.request.urlopen(url, timeout=60 * TIME_FACTOR) as response:
            assert response.headers["Content-Type"].startswith("text/event-stream")
            events = response.read().decode().split("\n\n")
        events = [e for e in events if e]
        texts = [json.loads(e.removeprefix("data: "))["text"] for e in events[:-1]]
        assert len(texts) > 1 and "".join(texts) == ANSWER
        assert events[-1].startswith("event: done\n")
        done = json.loads(events[-1].split("data: ", 1)[1])
        assert done == {"finish_reason": "eos", "completion_tokens": len(FRANCE["ids"])}
    finally:
        app.stop()


class Popen(Proc):
    """A `Proc` for a program that is not the hybridgate command."""

    def __init__(self, argv: list[str], log: Path, background_job: bool = False):
        """`background_job`: started with SIGINT ignored, as a shell script's `program &` starts it (Python then
        installs no KeyboardInterrupt handler: only a handler of the program's own makes Ctrl-C / kill -INT work)."""
        self.log = log
        self._out = open(log, "wb")
        ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if background_job else None
        self.popen = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, preexec_fn=ignore,
                                      env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
