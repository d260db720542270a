"""GPU-only: constraints on the CUDA path (graph replay, bitmasks copied to the device); run by `make gpu-check`,
skipped without CUDA. On the random-weight model the texts are nonsense, but the grammar still holds them."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from hybridgate.wire import AddRequest, Constraint, FinishReason, SamplingParams
from hybridgate.workers import sampling
from hybridgate.workers.constraints import bitmask_words
from hybridgate.workers.gpu import sampling as torch_sampling

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_twin_samples_what_the_numpy_twin_samples_under_a_bitmask():
    rng = np.random.default_rng(3)
    batch, vocab = 8, 49152
    logits = rng.standard_normal((batch, vocab)).astype(np.float32) * 3
    bitmask = rng.integers(-2**31, 2**31, size=(batch, bitmask_words(vocab)), dtype=np.int64).astype(np.int32)
    bitmask[-1] = -1
    params = [SamplingParams(temperature=t) for t in (0.0, 1.0, 0.7, 1.3, 0.0, 1.0, 0.5, 1.0)]
    args = (params, list(range(batch)), [5] * batch, [()] * batch)
    ours = sampling.sample(logits, *args, bitmask=bitmask)
    cuda = torch_sampling.sample(torch.from_numpy(logits).cuda(), *args, bitmask=bitmask).cpu().numpy()
    assert ours.tolist() == cuda.tolist()


def test_constrained_batch_on_cuda(gpu_model_path):
    from hybridgate.models import Tokenizer, load_gguf, model_fingerprint
    from hybridgate.workers.engine import EngineCore, output_of
    from hybridgate.workers.gpu.runner import TorchRunner
    from hybridgate.workers.scheduler import SchedulerConfig

    model = load_gguf(gpu_model_path)
    tokenizer = Tokenizer.from_model(model)
    runner = TorchRunner(model, torch.device("cuda"), kv_cache_memory="2GiB", max_num_seqs=16)
    runner.warm_up()
    engine = EngineCore(runner, SchedulerConfig(max_num_seqs=16), model_fingerprint(model))
    prompt = tokenizer.encode("Write a code:")
    regex = Constraint(kind="regex", grammar="start: /[a-z]{4}[0-9]{2}/")
    requests = [AddRequest(f"c{i}", prompt, SamplingParams(temperature=1.0, constraint=regex), i, 16, 2)
                for i in range(6)]
    free = AddRequest("free", prompt, SamplingParams(temperature=0, ignore_eos=True), 0, 8, 2)
    out: dict[str, list] = {}

    def run(reqs):
        for r in reqs:
            assert engine.add(r) is None
        while engine.has_work():
            for seq in engine.step():
                o = output_of(seq)
                out.setdefault(seq.request_id, []).extend(o.token_ids)
                if o.finish:
                    out[seq.request_id + ":finish"] = o.finish

    run([*requests, free])
    run([AddRequest("alone", free.prompt_ids, free.params, 0, 8, 2)])
    assert not engine.take_failures()
    for i in range(6):
        assert re.fullmatch(r"[a-z]{4}[0-9]{2}", tokenizer.decode(out[f"c{i}"])), tokenizer.decode(out[f"c{i}"])
        assert out[f"c{i}:finish"] == FinishReason.STOP
    assert out["free"] == out["alone"]
