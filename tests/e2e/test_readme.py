"""The README's first request, run as written against what `make serve` starts: `hybridgate serve` with its
default model and workers (one thread, as the README says for a busy machine). The commands are read from the
README's "A first request" section and run by bash, with `.venv/bin/` this environment's and the test server's
ports put in for the defaults; the expected text is the README's own comment lines, and that answer is
transformers' greedy one (tests/golden/greedy.json)."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from conftest import ROOT, TIME_FACTOR, golden_json
from procs import HYBRIDGATE, Serve

SECTION = (ROOT / "README.md").read_text().split("\n## A first request\n", 1)[1].split("\n## ", 1)[0]
BLOCKS = re.findall(r"```sh\n(.*?)```", SECTION, re.S)
ANSWER = golden_json("greedy.json")["france"]["text"].removesuffix("<|im_end|>")


def commands(block: str) -> tuple[list[str], list[str]]:
    """(commands, the output lines the block shows as `# ...` comments); a trailing backslash continues a line."""
    lines = block.replace("\\\n", " ").splitlines()
    return ([line for line in lines if line and not line.startswith("#")],
            [line.removeprefix("# ") for line in lines if line.startswith("#")])


def run_as_written(command: str, server: Serve) -> subprocess.CompletedProcess:
    """`command` in bash, its `.venv/bin/hybridgate` this environment's and its default ports the server's."""
    command = command.replace(".venv/bin/hybridgate", HYBRIDGATE)
    command = command.replace("http://127.0.0.1:8000", server.http_url)
    env = {**os.environ, "HYBRIDGATE_PORT": str(server.port)}  # what `generate` reads, as the server does
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=120 * TIME_FACTOR)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_path):
    proc = Serve(tmp_path_factory.mktemp("readme") / "serve.log")  # the default layout, as `make serve` runs it
    yield proc
    assert proc.stop() == 0, proc.text()


def test_the_first_request_section_has_the_commands_this_test_runs():
    assert len(BLOCKS) == 3  # generate; the PyTorch runner's serve; the two curl commands
    (generate,), shown = commands(BLOCKS[0])
    assert generate.startswith(".venv/bin/hybridgate generate ") and len(shown) == 2
    assert shown[0] == ANSWER  # the README's answer is the reference's
    curls, _ = commands(BLOCKS[2])
    assert len(curls) == 2 and all(c.startswith("curl -s http://127.0.0.1:8000/v1/") for c in curls)


def test_generate_as_written_prints_what_the_readme_shows(server):
    (generate,), (answer, stats) = commands(BLOCKS[0])
    out = run_as_written(generate, server)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == answer
    pattern = re.escape(stats).replace(re.escape("..."), r"\S+")  # ttft_ms=... and total_ms=... vary
    assert re.search(pattern, out.stderr), (stats, out.stderr)


def test_the_curl_commands_as_written_list_the_model_and_answer(server):
    (models, chat), _ = commands(BLOCKS[2])
    listed = run_as_written(models, server)
    assert listed.returncode == 0, listed.stderr
    asked = json.loads(re.search(r"-d '(.*)'", chat).group(1))["model"]
    assert asked in [m["id"] for m in json.loads(listed.stdout)["data"]]
    answered = run_as_written(chat, server)
    assert answered.returncode == 0, answered.stderr
    body = json.loads(answered.stdout)
    assert body["model"] == asked and body["choices"][0]["message"]["content"] == ANSWER, body
