"""Qwen3 MoE on both runners against transformers' `Qwen3MoeForCausalLM` on the same random weights.

The reference is the transformers model itself (fp32, eager), made with random weights in
`tiny_moe.make_qwen3moe` and written to GGUF under llama.cpp's names: 2 layers, hidden 64, 4 heads
over 2 KV heads, 8 experts choosing 2 and 16 choosing 8 (Qwen3-30B-A3B's k), 260 tokens. Per
case: last-position logits of three packed prompts within 1e-3 on both runners (F32 file); greedy
ids for 16 tokens equal (or the first difference where the reference's top-2 gap is below 1e-3),
through the paged cache with chunked prefill and a prefix-cache hit on both runners, and through a
GPU→CPU hand-off (`test_cpu_architectures`' test on these files). The Numba
runner's experts on a Q8_0 file against the torch runner's fp32 weights from gguf's dequantizer,
still in their Q8_0 codes. Router ties: two experts with equal router rows and equal weights give
transformers' logits whichever of them is chosen. The refused families fail at load in one line.
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_reference import assert_greedy_matches, greedy
from hybridgate.cli import main
from hybridgate.models import REFUSED_ARCHITECTURES, ModelLoadError, load_gguf, model_fingerprint
from hybridgate.wire import AddRequest, SamplingParams
from hybridgate.workers.cpu.runner import NumbaRunner
from hybridgate.workers.engine import EngineCore
from hybridgate.workers.gpu.model import DecoderModel
from hybridgate.workers.gpu.runner import TorchRunner
from hybridgate.workers.scheduler import ScheduledBatch, SchedulerConfig
from hybridgate.workers.sequence import Sequence
# The dense families' GPU→CPU hand-off test, run here on this module's `case`: the experts change no KV.
from test_cpu_architectures import greedy_through_chunks_and_prefix, run_engine
from test_cpu_architectures import torch_engine  # noqa: F401 (a fixture of the test below)
from test_cpu_architectures import test_a_gpu_to_cpu_handoff_decodes_the_ids_of_the_cpu_runner_alone  # noqa: F401
from tiny_moe import VOCAB, make_qwen3moe, write_qwen3moe_gguf

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

TOL = 1e-3
PROMPT_LENGTHS = (5, 23, 40)
PROMPTS = [np.random.default_rng(1).integers(0, VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]
GREEDY_STEPS = 16
GREEDY = SamplingParams(temperature=0, ignore_eos=True)


@torch.inference_mode()
def hf_logits(hf, prompts: list[list[int]]) -> np.ndarray:
    return np.stack([hf(input_ids=torch.tensor([p])).logits[0, -1].numpy() for p in prompts])


class Case:
    """transformers' model, its GGUF file, and its answers."""

    def __init__(self, hf, path):
        self.hf, self.gguf, self.name = hf, load_gguf(path), path.stem
        rng = np.random.default_rng(hf.config.num_experts or 0)  # a dense model (gemma4's) has None
        self.prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]
        self.want_logits = hf_logits(hf, self.prompts)
        self.want_greedy, self.gaps = greedy(hf, self.prompts[-1], GREEDY_STEPS)
        self.fingerprint = model_fingerprint(self.gguf)
        self.runner = numba_runner(self.gguf)


@pytest.fixture(scope="module", params=[(8, 2), (16, 8)], ids=lambda p: f"{p[0]}experts-top{p[1]}")
def case(request, tmp_path_factory) -> Case:
    experts, k = request.param
    hf = make_qwen3moe(experts=experts, top_k=k)
    return Case(hf, write_qwen3moe_gguf(hf, tmp_path_factory.mktemp("moe") / f"qwen3moe-{experts}-{k}.gguf"))


def numba_runner(model) -> NumbaRunner:
    return NumbaRunner(model, kv_cache_memory="4MiB", threads=1, kv_cache_dtype="fp32", activations="f32")


def numba_packed(runner: NumbaRunner, prompts: list[list[int]]) -> np.ndarray:
    seqs = []
    for i, ids in enumerate(prompts):
        seq = Sequence(AddRequest(str(i), ids, GREEDY, 0, 4, -1))
        seq.block_table = list(range(3 * i, 3 * i + 3))
        seqs.append(seq)
    return np.asarray(runner.forward(ScheduledBatch([(s, s.num_tokens) for s in seqs])))


def torch_packed(model: DecoderModel, prompts: list[list[int]]) -> np.ndarray:
    caches = [model.new_cache() for _ in prompts]
    return model.forward(torch.tensor([i for p in prompts for i in p]), [len(p) for p in prompts], caches).numpy()


def test_torch_runner_logits_match_transformers(case):
    got = torch_packed(DecoderModel(case.gguf, torch.device("cpu"), torch.float32), case.prompts)
    err = np.abs(got - case.want_logits).max(axis=1)
    assert (err < TOL).all(), err


def test_numba_runner_logits_match_transformers(case):
    got = numba_packed(case.runner, case.prompts)
    err = np.abs(got - case.want_logits).max(axis=1)
    assert (err < TOL).all(), err


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_greedy_through_chunked_prefill_and_the_prefix_cache(case, kind):
    # The 40-token prompt in chunks of 12, then 16 decodes; then again beside a prompt sharing its first 32
    # tokens (prefix-cache hits, decode batches of two whose tokens route to different experts).
    runner = TorchRunner(case.gguf, torch.device("cpu"), torch.float32, kv_cache_memory="4MiB") if kind == "gpu" \
        else numba_runner(case.gguf)
    greedy_through_chunks_and_prefix(runner, case)


def test_numba_experts_in_q8_0_match_gguf_dequantized_weights(case, tmp_path):
    path = write_qwen3moe_gguf(case.hf, tmp_path / "q8_0.gguf", "Q8_0")
    model = load_gguf(path)
    assert model.tensors["blk.0.ffn_down_exps.weight"].ggml_type.name == "Q8_0"
    want = torch_packed(DecoderModel(model, torch.device("cpu"), torch.float32), case.prompts)
    runner = numba_runner(model)
    experts = runner.model.layers[0].experts
    # Kept as Q8_0 codes (int8, a float32 scale per 32), not dequantized at load.
    assert all(m.qs.dtype == np.int8 for m in experts.gate_up + experts.down)
    c = model.config
    assert experts.down[0].nbytes == c.hidden_size * c.expert_intermediate_size * (1 + 4 / 32)
    got = numba_packed(runner, case.prompts)
    err = np.abs(got - want).max(axis=1)
    assert (err < TOL).all(), err


def test_the_numba_runner_keeps_no_view_of_the_file(case, tmp_path):
    """The runners copy what they keep, so a worker unmaps the GGUF once loaded (`workers.process`): one
    matrix left a view (the float32 router was) kept the whole mapping, and every page the load touched,
    resident beside the copies: twice the file's memory on a mixture of experts."""
    path = write_qwen3moe_gguf(case.hf, tmp_path / "q8_0.gguf", "Q8_0")
    model = load_gguf(path)
    assert model.tensors["blk.0.ffn_gate_inp.weight"].ggml_type.name == "F32"
    runner = numba_runner(model)
    assert str(path) in Path("/proc/self/maps").read_text()
    del model
    gc.collect()
    assert runner.model.layers[0].experts is not None and str(path) not in Path("/proc/self/maps").read_text()


def test_numba_logits_do_not_depend_on_batch_mates(case, tmp_path):
    # The design's contract (a request's tokens whatever its batch): with its batch mates a prompt's tokens
    # route with theirs through shared expert matmuls, its logits bit for bit those it has alone (Q8_0 on
    # this path's own activation format).
    runner = NumbaRunner(load_gguf(write_qwen3moe_gguf(case.hf, tmp_path / "q8_0.gguf", "Q8_0")),
                         kv_cache_memory="4MiB", threads=2)
    a, b = case.prompts[0], case.prompts[2]
    alone = numba_packed(runner, [a])[0]
    assert np.array_equal(numba_packed(runner, [a, b])[0], alone)
    assert np.array_equal(numba_packed(runner, [b, a])[1], alone)


@pytest.fixture(scope="module")
def wide_hf():
    """Rows of 256 (hidden and expert width) for the K-quants' super-blocks; one layer."""
    return make_qwen3moe(hidden=256, heads=8, head_dim=32, expert_ffn=256, layers=1)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q4_0"])  # Q4_0: repacked onto the Q4_1 kernels
def test_numba_experts_in_k_quants_match_gguf_dequantized_weights(wide_hf, kind, tmp_path):
    # Q4_K and Q6_K: llama.cpp's Q4_K_M experts (random blocks: gguf cannot quantize them), held to the torch
    # runner's fp32 weights from gguf's dequantizer, and kept in their blocks (under a third of fp32's bytes).
    model = load_gguf(write_qwen3moe_gguf(wide_hf, tmp_path / f"{kind}.gguf", kind))
    assert model.tensors["blk.0.ffn_gate_exps.weight"].ggml_type.name == kind
    prompts = [p[:12] for p in PROMPTS]
    want = torch_packed(DecoderModel(model, torch.device("cpu"), torch.float32), prompts)
    runner = numba_runner(model)
    experts, c = runner.model.layers[0].experts, model.config
    assert experts.down[0].nbytes < c.hidden_size * c.expert_intermediate_size * 4 / 3
    got = numba_packed(runner, prompts)
    err = np.abs(got - want).max(axis=1)
    assert (err < TOL).all(), err


def test_tied_router_scores_give_transformers_logits(case, tmp_path):
    # Expert 5 made a copy of expert 2 (router row and weights): every token's scores tie between them, and
    # whichever a runner chooses (ours: the lower index; transformers: torch.topk's pick), the output is the same.
    hf = make_qwen3moe(experts=case.hf.config.num_experts, top_k=case.hf.config.num_experts_per_tok)
    with torch.no_grad():
        for layer in hf.model.layers:
            mlp = layer.mlp
            for p in (mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj):
                p[5] = p[2]
    model = load_gguf(write_qwen3moe_gguf(hf, tmp_path / "tied.gguf"))
    want = hf_logits(hf, case.prompts)
    for got in (torch_packed(DecoderModel(model, torch.device("cpu"), torch.float32), case.prompts),
                numba_packed(numba_runner(model), case.prompts)):
        err = np.abs(got - want).max(axis=1)
        assert (err < TOL).all(), err


@pytest.fixture(scope="module")
def small_hf():
    return make_qwen3moe(layers=1)


@pytest.mark.parametrize("arch", sorted(REFUSED_ARCHITECTURES))
def test_refused_families_fail_at_load_naming_the_architecture_and_why(small_hf, arch, tmp_path):
    path = write_qwen3moe_gguf(small_hf, tmp_path / f"{arch}.gguf", arch=arch)
    with pytest.raises(ModelLoadError) as info:
        load_gguf(path)
    message = str(info.value)
    assert "\n" not in message and repr(arch) in message and REFUSED_ARCHITECTURES[arch] in message


def test_info_shows_the_experts_and_the_active_parameters(case, capsys):
    c = case.hf.config
    assert main(["info", "--model", str(case.gguf.path)]) == 0
    lines = dict(line.split(":", 1) for line in capsys.readouterr().out.splitlines() if ":" in line)
    assert lines["experts"].strip().startswith(
        f"{c.num_experts} per block, {c.num_experts_per_tok} active per token (softmax gating, renormalised), "
        f"width {c.moe_intermediate_size}, no shared expert")
    total = sum(p.numel() for p in case.hf.parameters())
    experts = 3 * c.num_hidden_layers * c.num_experts * c.moe_intermediate_size * c.hidden_size
    active = total - experts + experts * c.num_experts_per_tok // c.num_experts
    assert f"({active:,} active parameters" in lines["read per token"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_runner_follows_transformers(case, dtype):
    # On CUDA (run by `make gpu-check`): no decode graphs for an MoE model (its experts' counts come back to the
    # host each layer); fp32 within 1e-3 of transformers and its greedy ids; bf16 within a tenth of the logits'
    # range (8 bits of mantissa through every layer) and the same ids up to the first gap below twice that error.
    runner = TorchRunner(case.gguf, torch.device("cuda"), dtype, kv_cache_memory="1GiB", max_num_seqs=4)
    runner.warm_up()
    assert runner.graphs is None
    model = runner.model
    caches = [model.new_cache() for _ in case.prompts]
    ids = torch.tensor([i for p in case.prompts for i in p], device="cuda")
    got = model.forward(ids, list(PROMPT_LENGTHS), caches).float().cpu().numpy()
    err = float(np.abs(got - case.want_logits).max())
    limit = TOL if dtype == torch.float32 else 0.1 * float(np.abs(case.want_logits).max())
    assert err < limit, (err, limit)
    engine = EngineCore(runner, SchedulerConfig(max_num_batched_tokens=12), case.fingerprint)
    greedy_ids = run_engine(engine, [AddRequest("a", case.prompts[-1], GREEDY, 0, GREEDY_STEPS, -1)])["a"]
    assert_greedy_matches(greedy_ids, case.want_greedy, case.gaps, tie=max(TOL, 2 * err))
