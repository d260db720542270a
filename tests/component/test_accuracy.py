"""`bench accuracy`: the committed token file against the fp32 torch runner and the CPU runner."""

from __future__ import annotations

import numpy as np
import torch

from hybridgate.bench import accuracy
from hybridgate.workers.cpu.runner import NumbaRunner
from hybridgate.workers.gpu.runner import TorchRunner


def test_cpu_runner_accuracy_and_token_file(gguf_model):
    cases = accuracy.load_cases()
    assert len(cases) == 8 and all(len(c["ids"]) == 64 and 2 not in c["ids"] for c in cases)
    reference = accuracy.teacher_forced_logits(
        TorchRunner(gguf_model, torch.device("cpu"), torch.float32, kv_cache_memory="128MiB"), cases)
    committed = np.array([i for c in cases for i in c["ids"]])
    # The token file is transformers' greedy output with EOS masked; the fp32 runner (pinned to
    # transformers) agrees once EOS is masked the same way.
    masked = reference.copy()
    masked[:, gguf_model.config.eos_token_id] = -np.inf
    assert (masked.argmax(1) == committed).mean() >= 0.99
    got = accuracy.teacher_forced_logits(NumbaRunner(gguf_model, kv_cache_memory="128MiB"), cases)
    figures = accuracy.compare(reference, got)
    assert figures["positions"] == 512
    assert figures["top1_agreement"] >= 0.95 and figures["kl_mean"] <= 0.005
