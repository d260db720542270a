"""End to end: `serve --model` a Llama 3.x-shaped GGUF (a 131,072-token context) starts a GPU worker sized by
vLLM's rule, its device's memory counters injected (HYBRIDGATE_TEST_GPU_MEMORY): the worker lowers its max model
length to what the budget's KV cache holds, says so with the budget's parts on its start-up line, and serves; asked
for a longer length, it refuses in one line naming the flag and the numbers (issue 40)."""

from __future__ import annotations

import pytest
from tiny_gguf import write_tiny_llama

from hybridgate.v1 import generation_pb2 as pb
from procs import Proc, Serve, stub

# 64 MiB x 0.50 - 25 MiB in use - 6 MiB of profiled activations: a 1 MiB KV cache. A block of the tiny model
# (fp32 on the CPU device): K and V x 2 layers x 16 tokens x 2 KV heads x head dim 8 x 4 bytes = 4 KiB, so 256
# blocks, 4,096 tokens.
MEMORY = {"HYBRIDGATE_TEST_GPU_MEMORY": "64MiB:25MiB:6MiB"}
FLAGS = ("--gpu-workers", "1", "--cpu-workers", "0", "--gpu-memory-utilization", "0.5",
         "--max-num-batched-tokens", "512")


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("long") / "llama-131072.gguf", heads=4, kv_heads=2,
                            context=131072)


def test_a_131072_token_model_starts_a_gpu_worker_at_the_length_its_budget_holds(long_model, tmp_path):
    server = Serve(tmp_path / "serve.log", "--model", str(long_model), *FLAGS, env=MEMORY)
    try:
        server.wait_for(r"max model length lowered from the model's 131072 tokens to 4096")
        server.wait_for(r"KV cache: 256 blocks of 16 tokens, 1\.0 MiB on cpu \(weights [\d.]+ MiB; budget 64\.0 MiB x "
                        r"0\.50 utilization - 25\.0 MiB weights and runtime - 6\.0 MiB peak activations - 0\.0 MiB "
                        r"decode graphs = 1\.0 MiB, a profiled step of 512 tokens\); max model length 4096")
        messages = list(stub(server.target).Generate(pb.GenerateRequest(prompt="abc", max_tokens=4, ignore_eos=True)))
        assert sum(len(m.token_ids) for m in messages) == 4
    finally:
        assert server.stop() == 0, server.text()


def test_a_longer_asked_length_is_refused_in_one_line(long_model, tmp_path):
    worker = Proc(["worker", "--model", str(long_model), "--kind", "gpu", "--endpoint",
                   f"ipc://{tmp_path}/w.sock", "--gpu-memory-utilization", "0.5", "--max-num-batched-tokens", "512",
                   "--worker-max-model-len", "8192"], tmp_path / "worker.log", env=MEMORY)
    try:
        # One sequence of 8,192 tokens needs 2 MiB of blocks; the budget gives 1 MiB.
        worker.wait_for(r"the KV cache would get 1\.0 MiB \(at least 2\.0 MiB needed\): 64\.0 MiB x 0\.50 utilization "
                        r"- 25\.0 MiB weights and runtime - 6\.0 MiB peak activations - 0\.0 MiB decode graphs \(raise "
                        r"--gpu-memory-utilization, lower --max-num-batched-tokens, --max-num-seqs or "
                        r"--worker-max-model-len \(serve: --max-model-len\), or set --kv-cache-memory\)")
        worker.popen.wait(60)
        assert worker.popen.returncode != 0
    finally:
        worker.stop()
