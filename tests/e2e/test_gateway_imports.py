"""A running gateway process loads no module of `hybridgate.workers` but the workers' settings (issue 29): not
at start, not serving.

The gateway is `hybridgate gateway` run through `cli.main` with an exit hook
that prints `sys.modules` as the process ends, after it has served. The worker
runs in its own process, with its own log, on a tiny random model (the torch
runner: no kernels to compile).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import urllib.request

from hybridgate.v1 import generation_pb2 as pb
from procs import Proc, stub
from tiny_gguf import write_tiny_llama

# `hybridgate ARGS` with one more line at exit: MODULES [every module name loaded].
HOOKED = ("import atexit, sys\n"
          "atexit.register(lambda: print('MODULES', sorted(sys.modules), flush=True))\n"
          "from hybridgate.cli import main\n"
          "sys.exit(main(sys.argv[1:]))\n")


class HookedGateway(Proc):
    """A Proc running `python -c HOOKED ARGS` instead of the `hybridgate` script (the same environment)."""

    def __init__(self, args: list[str], log):
        self.log = log
        self._out = open(log, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYBRIDGATE_LOG_LEVEL": "INFO"}
        self.popen = subprocess.Popen([sys.executable, "-c", HOOKED, *args], stdout=self._out,
                                      stderr=subprocess.STDOUT, env=env, start_new_session=True)


def test_a_serving_gateway_has_loaded_no_worker_module(tmp_path):
    tiny = str(write_tiny_llama(tmp_path / "tiny.gguf", heads=4, kv_heads=2))
    endpoint = f"ipc://{tmp_path}/w.sock"
    template = tmp_path / "chat.jinja"  # the tiny model has none of its own
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    worker = Proc(["worker", "--endpoint", endpoint, "--model", tiny, "--kind", "gpu", "--threads", "1",
                   "--no-measure-rates"], tmp_path / "w.log")
    gateway = HookedGateway(["gateway", "--port", "0", "--model", tiny, "--worker", endpoint, "--wait-for-workers",
                             "--chat-template", str(template), "--served-model-name", "tiny"], tmp_path / "g.log")
    try:
        target = "127.0.0.1:" + gateway.wait_for(r"gRPC on 127\.0\.0\.1:(\d+)").group(1)
        http = gateway.wait_for(r"OpenAI-compatible HTTP on (http://\S+)/v1").group(1)
        gateway.wait_for(r"hybridgate: READY")
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0}).encode()
        post = urllib.request.Request(http + "/v1/completions", body, {"content-type": "application/json"})
        assert json.loads(urllib.request.urlopen(post, timeout=30).read())["usage"]["completion_tokens"] == 2
        for chat in (False, True):  # both prompt paths, to the final message
            request = pb.GenerateRequest(max_tokens=4, temperature=0, ignore_eos=True)
            if chat:
                request.chat.messages.add(role="user", content="hi")
            else:
                request.prompt = "hi"
            replies = list(stub(target).Generate(request))
            assert sum(len(r.token_ids) for r in replies) == 4
    finally:
        assert gateway.stop() == 0
        worker.stop()
    line = next(x for x in gateway.text().splitlines() if x.startswith("MODULES "))
    loaded = ast.literal_eval(line.removeprefix("MODULES "))
    assert "hybridgate.gateway.server" in loaded and "hybridgate.router.router" in loaded  # the log is complete
    # The workers' settings (`workers/config.py`: a dataclass and its flags, importing only `hybridgate.config`)
    # are part of every process's settings; no other worker module may load.
    settings_only = {"hybridgate.workers", "hybridgate.workers.config"}
    assert [m for m in loaded if (m == "hybridgate.workers" or m.startswith("hybridgate.workers."))
            and m not in settings_only] == []
