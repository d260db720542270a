"""The torch runner's fused path (Triton norms, RoPE and activation around the Triton attention; CUDA's path,
interpreted here) against its eager reference path, on tiny random models of the families whose layers
differ (Llama 3: the plain layer; Qwen 2: QKV bias; Qwen 3: per-head Q/K norms; Gemma 3: Q/K norms, sandwich
norms, GeGLU; Gemma 2: softcaps and windows), and the launches a layer makes, counted.

Launches are counted with torch.profiler on the CPU device, per decoder layer: each kernel entry point
(`kernels.fused`, `kernels.attention`) is called through a thin wrapper that opens a profiler range, so a
launch is one range whatever the interpreter does inside it; every other operator called directly in the
layer counts as one launch unless it only makes a view (a slice, a reshape that copies nothing).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from hybridgate.wire import AddRequest, SamplingParams
from hybridgate.workers.gpu.kernels import attention as attention_kernels
from hybridgate.workers.gpu.kernels import fused as fused_kernels
from hybridgate.workers.gpu.ops import EagerOps
from hybridgate.workers.gpu.runner import TorchRunner
from hybridgate.workers.scheduler import ScheduledBatch
from hybridgate.workers.sequence import Sequence

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VIEWS = {"aten::slice", "aten::select", "aten::reshape", "aten::view", "aten::transpose", "aten::unsqueeze",
         "aten::t", "aten::expand", "aten::chunk", "aten::split", "aten::as_strided", "aten::empty",
         "aten::empty_like", "aten::detach", "aten::alias", "aten::_reshape_alias", "aten::squeeze",
         "aten::flatten", "aten::_unsafe_view"}
COPIES = {"aten::copy_", "aten::clone", "aten::contiguous"}
KERNELS = {fused_kernels: ("add_rms_norm", "rope", "act_mul"), attention_kernels: ("write_kv", "paged_attention")}
KERNEL_NAMES = {name for names in KERNELS.values() for name in names}
# The fused path's launches per layer (module doc of hybridgate/workers/gpu/ops.py): the plain layer's ten,
# plus Qwen 2's bias add; Q/K norms and Gemma's post norms ride in the rope and add_rms_norm launches.
PLAIN = Counter({"aten::matmul": 4, "add_rms_norm": 2, "rope": 1, "act_mul": 1, "write_kv": 1, "paged_attention": 1})
FUSED = {"llama3": PLAIN, "qwen2": PLAIN + Counter({"aten::add": 1}), "gemma3": PLAIN}
# The same Llama layer through EagerOps in bf16 (ops.py's "before" figure); the first layer has no residual to add.
EAGER_LLAMA_BF16 = 33


def sequence(name: str, ids: list[int], blocks: list[int]) -> Sequence:
    seq = Sequence(AddRequest(name, ids, SamplingParams(temperature=0), 0, 4, -1))
    seq.block_table = blocks
    return seq


def steps(vocab: int) -> list[ScheduledBatch]:
    """A prefill of two prompts (9 and 3 tokens), then a mixed step: their decodes and a third prompt's
    first chunk of 5 tokens over a block of its own."""
    a = sequence("a", [(7 * i + 3) % vocab for i in range(9)], [0])
    b = sequence("b", [(5 * i + 1) % vocab for i in range(3)], [1])
    c = sequence("c", [(11 * i + 2) % vocab for i in range(8)], [2])
    first = ScheduledBatch([(a, 9), (b, 3)])
    return [first, ScheduledBatch([(a, 1), (b, 1), (c, 5)])]


def advance(batch: ScheduledBatch) -> None:
    for seq, n in batch.entries:
        seq.num_computed += n
        if seq.num_computed == seq.num_tokens:
            seq.output_ids.append(seq.num_tokens)


def counted(name: str, fn):
    def call(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return call


def launches(event, children) -> int:
    """1 for a kernel range or an operator that computes; 0 for one that only makes a view."""
    if event.name in KERNEL_NAMES or event.name not in VIEWS:
        return 1
    stack = list(children.get(event.id, ()))
    while stack:  # a view op that had to copy (a reshape of non-contiguous data) is a kernel too
        e = stack.pop()
        if e.name in COPIES:
            return 1
        stack += children.get(e.id, ())
    return 0


def layer_launches(runner: TorchRunner, batch: ScheduledBatch, monkeypatch) -> list[Counter]:
    """Per decoder layer, the launches of `runner.forward(batch)` by kind (module doc)."""
    for module, names in KERNELS.items():
        for name in names:
            monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    monkeypatch.setattr(runner.model, "_decoder_layer", counted("layer", runner.model._decoder_layer))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.forward(batch)
    events = prof.events()
    children: dict[int, list] = {}
    for e in events:
        if e.cpu_parent is not None:
            children.setdefault(e.cpu_parent.id, []).append(e)
    layers = [e for e in events if e.name == "layer"]
    assert len(layers) == runner.model.config.num_layers
    return [Counter(e.name for e in children[layer.id] if launches(e, children)) for layer in layers]


@pytest.fixture(scope="module", params=["llama3", "qwen2", "qwen3", "gemma3", "gemma2"])
def family(request, tiny_models):
    from hybridgate.models import load_gguf

    return request.param, load_gguf(tiny_models(request.param))


def runner_of(gguf, attention: str, dtype=torch.float32) -> TorchRunner:
    return TorchRunner(gguf, torch.device("cpu"), dtype, kv_cache_memory="4MiB", max_num_blocks=8,
                       attention=attention)


def test_fused_path_equals_the_eager_reference(family):
    """fp32 logits of a prefill then a mixed step: the Triton path (fused layer, paged kernels) against the
    reference (torch ops, gather + SDPA). Both compute in float32 from the same weights; 1e-4 is float32
    noise through three layers (the real model's paths agree as closely: test_paged_engine.py)."""
    name, gguf = family
    fused, reference = runner_of(gguf, "triton"), runner_of(gguf, "reference")
    assert type(fused.model.ops).__name__ == "FusedOps" and type(reference.model.ops) is EagerOps
    for batch in steps(gguf.config.vocab_size):
        got, want = fused.forward(batch).numpy(), reference.forward(batch).numpy()
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=name)
        advance(batch)


@pytest.mark.parametrize("name", list(FUSED))
def test_fused_launches_per_layer(name, tiny_models, monkeypatch):
    from hybridgate.models import load_gguf

    runner = runner_of(load_gguf(tiny_models(name)), "triton")
    prefill, mixed = steps(runner.vocab_size)
    runner.forward(prefill)
    advance(prefill)
    per_layer = layer_launches(runner, mixed, monkeypatch)
    assert all(layer == FUSED[name] for layer in per_layer), per_layer


def test_eager_launches_per_layer(tiny_models, monkeypatch):
    """The "before" figure: the same Llama layer through the eager torch ops in bf16 (what CUDA ran before
    the fusions), attention still the two Triton kernels."""
    from hybridgate.models import load_gguf

    runner = runner_of(load_gguf(tiny_models("llama3")), "triton", torch.bfloat16)
    runner.model.ops = EagerOps(runner.model.config)
    prefill, mixed = steps(runner.vocab_size)
    runner.forward(prefill)
    advance(prefill)
    per_layer = layer_launches(runner, mixed, monkeypatch)
    want = [EAGER_LLAMA_BF16 - 1] + [EAGER_LLAMA_BF16] * (len(per_layer) - 1)
    assert [sum(layer.values()) for layer in per_layer] == want, per_layer


def test_the_docs_give_the_launch_counts_these_tests_hold():
    from pathlib import Path

    docs = " ".join((Path(__file__).resolve().parents[2] / "docs" / "engine.md").read_text().split())
    assert (f"launches {sum(PLAIN.values())} kernels (4 matmuls, 2 add + RMSNorm, RoPE, the activation and attention's "
            f"2) instead of {EAGER_LLAMA_BF16} through the eager torch ops in bf16") in docs
