"""`bench accuracy`: the committed token file against the fp32 torch runner and the CPU runner.

The CPU runner is measured twice: on this process's default path (its default
activation format), and with the AVX2 path forced in a child process
(`python tests/component/test_accuracy.py OUT.npy`, Numba compiles for one
target per process), where every quantized matmul takes int16 activations, so
the accuracy floor holds on the path every x86-64 user with AVX2 gets.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hybridgate.bench import accuracy  # noqa: E402
from hybridgate.workers.cpu import isa  # noqa: E402
from tests.conftest import TIME_FACTOR  # noqa: E402

# The floor for the CPU runner against the fp32 reference (llama.cpp, 8-bit activations:
# 95.9% and 0.0028 on this model).
TOP1_FLOOR, KL_CEILING = 0.995, 1e-4


@pytest.fixture(scope="module")
def reference(gguf_model):
    import torch

    from hybridgate.workers.gpu.runner import TorchRunner

    return accuracy.teacher_forced_logits(
        TorchRunner(gguf_model, torch.device("cpu"), torch.float32, kv_cache_memory="128MiB"), accuracy.load_cases())


def test_cpu_runner_accuracy_and_token_file(gguf_model, reference):
    from hybridgate.workers.cpu.runner import NumbaRunner

    cases = accuracy.load_cases()
    assert len(cases) == 8 and all(len(c["ids"]) == 64 and 2 not in c["ids"] for c in cases)
    committed = np.array([i for c in cases for i in c["ids"]])
    # The token file is transformers' greedy output with EOS masked; the fp32 runner (pinned to
    # transformers) agrees once EOS is masked the same way.
    masked = reference.copy()
    masked[:, gguf_model.config.eos_token_id] = -np.inf
    assert (masked.argmax(1) == committed).mean() >= 0.99
    got = accuracy.teacher_forced_logits(NumbaRunner(gguf_model, kv_cache_memory="128MiB"), cases)  # defaults: fp16 KV
    figures = accuracy.compare(reference, got)
    assert figures["positions"] == 512
    assert figures["top1_agreement"] >= TOP1_FLOOR and figures["kl_mean"] <= KL_CEILING, figures


@pytest.mark.parametrize("kv_cache_dtype", ["bf16"])
def test_a_16_bit_kv_cache_meets_the_floor(gguf_model, reference, kv_cache_dtype):
    # bf16, the coarser of the two (8 significant bits to fp16's 11): 99.8% and 4e-5 on this machine.
    from hybridgate.workers.cpu.runner import NumbaRunner

    runner = NumbaRunner(gguf_model, kv_cache_memory="128MiB", kv_cache_dtype=kv_cache_dtype)
    figures = accuracy.compare(reference, accuracy.teacher_forced_logits(runner, accuracy.load_cases()))
    assert figures["top1_agreement"] >= TOP1_FLOOR and figures["kl_mean"] <= KL_CEILING, figures


@pytest.mark.skipif("avx2" not in isa.ISAS[isa.ISAS.index(isa.best(isa.host_features())):],
                    reason="this CPU has no AVX2")
def test_forced_avx2_path_with_int16_activations_meets_the_floor(reference, model_path, tmp_path):
    out = tmp_path / "logits.npy"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYBRIDGATE_CPU_ISA": "avx2"}
    proc = subprocess.run([sys.executable, __file__, str(model_path), str(out)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300 * TIME_FACTOR)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["avx2", "i16"]
    figures = accuracy.compare(reference, np.load(out))
    assert figures["top1_agreement"] >= TOP1_FLOOR and figures["kl_mean"] <= KL_CEILING, figures


if __name__ == "__main__":  # the child: the CPU runner's logits on the path HYBRIDGATE_CPU_ISA names
    isa.select()
    from hybridgate.models import load_gguf
    from hybridgate.workers.cpu.runner import NumbaRunner

    runner = NumbaRunner(load_gguf(sys.argv[1]), kv_cache_memory="128MiB")
    np.save(sys.argv[2], accuracy.teacher_forced_logits(runner, accuracy.load_cases()).astype(np.float32))
    formats = {m.activations for layer in runner.model.layers for m in layer.arrays() if hasattr(m, "activations")}
    print(runner.cpu_isa, " ".join(sorted(formats | {runner.model.lm_head.activations})))
