"""gpt-oss on both runners against transformers' `GptOssForCausalLM` on the same random weights.

transformers 5.25 (installed here) has `GptOssForCausalLM`; the reference is that model itself (fp32, eager
attention: the sinks as a last softmax column), made with random weights in `tiny_gptoss.make_gptoss` and
written to GGUF under llama.cpp's names: 4 layers (0 and 2 slide over 16 tokens), hidden 64, 4 heads over
2 KV heads, biases on Q, K, V, O, the router and the experts, a sink per head, expert inputs large enough
that the SwiGLU's clamps act; 8 experts choosing 2 with F32 experts and plain RoPE, and choosing 4 (gpt-oss's
k) with MXFP4 experts (as llama.cpp's gpt-oss files hold them) and YaRN (gpt-oss's: factor 32 over 4096
positions, its correction range unrounded). Each model's expert matrices are first rounded to MXFP4 (gguf's
quantizer), so an MXFP4 file holds exactly the model.
Per file: last-position logits of three packed prompts within 1e-3 on both runners; greedy ids for 16 tokens
equal (or the first difference where the reference's top-2 gap is below 1e-3), through the paged cache with
chunked prefill (the 16-token windows start mid-chunk) and a prefix-cache hit on both runners, and through a
GPU→CPU hand-off (`test_cpu_architectures`' test). The Numba runner keeps MXFP4 experts in their blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridgate.cli import main
from hybridgate.models import Activation
from hybridgate.workers.cpu.blocks import MXFP4
from hybridgate.workers.cpu.layers import GATED_ACTIVATIONS
from hybridgate.workers.cpu.runner import NumbaRunner
from hybridgate.workers.gpu.attention import attention_kind
from hybridgate.workers.gpu.layers import ACTIVATIONS
from hybridgate.workers.gpu.runner import TorchRunner
# The dense families' GPU→CPU hand-off test, run here on this module's `case`: the experts change no KV.
from test_cpu_architectures import greedy_through_chunks_and_prefix
from test_cpu_architectures import torch_engine  # noqa: F401 (a fixture of the test below)
from test_cpu_architectures import test_a_gpu_to_cpu_handoff_decodes_the_ids_of_the_cpu_runner_alone  # noqa: F401
# qwen3moe's tests of logits, of greedy ids through chunked prefill and the prefix cache, and on CUDA, run here on
# this module's `case` (they read only its fields).
from test_moe import TOL, Case, numba_packed
from test_moe import test_cuda_runner_follows_transformers  # noqa: F401
from test_moe import test_greedy_through_chunked_prefill_and_the_prefix_cache  # noqa: F401
from test_moe import test_numba_runner_logits_match_transformers  # noqa: F401
from test_moe import test_torch_runner_logits_match_transformers  # noqa: F401
from tiny_gptoss import make_gptoss, round_experts_to_mxfp4, write_gptoss_gguf

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
I16_TOL = 2e-3  # logits with the experts' activations rounded to int16 per 32 (about 2e-5 of each product)


@pytest.fixture(scope="module", params=[(2, "F32", "default"), (4, "MXFP4", "yarn")],
                ids=lambda p: f"top{p[0]}-{p[1]}-{p[2]}")
def case(request, tmp_path_factory) -> Case:
    k, experts_type, rope = request.param
    hf = make_gptoss(top_k=k, rope=rope)
    round_experts_to_mxfp4(hf)
    path = tmp_path_factory.mktemp("gptoss") / f"gptoss-top{k}-{experts_type}-{rope}.gguf"
    return Case(hf, write_gptoss_gguf(hf, path, experts_type))


def test_the_file_reads_as_gpt_oss(case):
    c = case.gguf.config
    assert c.layer_windows == (16, 0, 16, 0)  # even layers slide (llama.cpp set_swa_pattern(2))
    want = [layer.self_attn.sinks.tolist() for layer in case.hf.model.layers]
    np.testing.assert_allclose(c.attention_sinks, want, rtol=1e-7)
    assert c.arch.activation == Activation.SWIGLU_OAI and c.experts_per_token == case.hf.config.num_experts_per_tok
    # RoPE: transformers' inverse frequencies and cos/sin factor (YaRN's, or plain RoPE's 1)
    rotary = case.hf.model.rotary_emb
    inv = 1.0 / c.rope_theta ** (np.arange(0, c.head_dim, 2) / c.head_dim) / np.asarray(c.rope_freq_factors or 1.0)
    np.testing.assert_allclose(inv, rotary.inv_freq.numpy(), rtol=2e-6)
    assert c.rope_attn_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)


def test_numba_keeps_the_experts_in_the_files_type(case):
    kind = int(case.gguf.tensors["blk.0.ffn_down_exps.weight"].ggml_type)
    experts, c = case.runner.model.layers[0].experts, case.gguf.config
    assert all(m.kind == kind for m in experts.gate_up + experts.down)
    if kind != MXFP4:
        return
    assert all(m.data.dtype == np.uint8 for m in experts.gate_up + experts.down)
    # the file's 17 bytes per 32 weights, a float32 scale per 32 widened at load and a zero minimum per row
    # (`blocks.unpack_scales`): 5.25 bits per weight and 4 bytes a row, not fp32's 32 bits
    rows, cols = c.hidden_size, c.expert_intermediate_size
    assert experts.down[0].nbytes == rows * cols * (17 + 4) // 32 + 4 * rows


def test_int16_activations_run_mxfp4_experts_on_the_packed_kernel_with_the_references_greedy_ids(case):
    # cpu_activations auto, as a worker runs: the experts on `kquant`'s int16 kernel, the file's code bytes kept as
    # they are; logits within the activations' int16 rounding of the reference's (I16_TOL; 3.5e-4 to 7.1e-4
    # measured) and the greedy ids its own, through chunked prefill and the prefix cache.
    if int(case.gguf.tensors["blk.0.ffn_down_exps.weight"].ggml_type) != MXFP4:
        pytest.skip("the F32-experts file has no MXFP4")
    runner = NumbaRunner(case.gguf, kv_cache_memory="4MiB", threads=1, kv_cache_dtype="fp32")
    experts, c = runner.model.layers[0].experts, case.gguf.config
    assert all(type(m).__name__ == "LowBitMatrix" for m in experts.gate_up + experts.down)
    rows, blocks = c.hidden_size, c.expert_intermediate_size // 32
    file_codes = case.gguf.tensors["blk.0.ffn_down_exps.weight"].data[:rows].reshape(rows, blocks, 17)[:, :, 1:]
    np.testing.assert_array_equal(experts.down[0].qs[:, : 16 * blocks], file_codes.reshape(rows, -1))
    err = np.abs(numba_packed(runner, case.prompts) - case.want_logits).max(axis=1)
    assert (err < I16_TOL).all(), err
    greedy_through_chunks_and_prefix(runner, case)


def test_the_sinks_and_the_clamps_take_part(case):
    # A test that could not fail otherwise: without its sinks, or with an unclamped SwiGLU, the reference moves.
    hf, ids = case.hf, torch.tensor([case.prompts[-1]])
    with torch.no_grad():
        inputs = []
        hook = hf.model.layers[0].mlp.experts.register_forward_hook(lambda m, a, out: inputs.append(a[0]))
        hf(input_ids=ids)
        hook.remove()
        gate_up = inputs[0] @ hf.model.layers[0].mlp.experts.gate_up_proj[0]
        assert gate_up.abs().max() > 7  # expert 0's inputs reach the clamps
        saved = [layer.self_attn.sinks.clone() for layer in hf.model.layers]
        for layer in hf.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        unsunk = hf(input_ids=ids).logits[0, -1].numpy()
        for layer, s in zip(hf.model.layers, saved):
            layer.self_attn.sinks.copy_(s)
    assert np.abs(unsunk - case.want_logits[-1]).max() > 10 * TOL


def test_clamped_swiglu_on_both_runners_matches_its_formula():
    # transformers' `GptOssExperts._apply_gate` in float64, across both clamps (gate above 7, up beyond ±7).
    g, u = np.meshgrid(np.linspace(-10, 10, 41), np.linspace(-10, 10, 41))
    g, u = g.reshape(1, -1), u.reshape(1, -1)
    gc, uc = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
    want = (uc + 1.0) * gc / (1.0 + np.exp(-1.702 * gc))
    gate_up = np.concatenate([g, u], axis=1).astype(np.float32)
    gpu = ACTIVATIONS[Activation.SWIGLU_OAI](torch.from_numpy(gate_up[:, : g.shape[1]]),
                                             torch.from_numpy(gate_up[:, g.shape[1] :])).numpy()
    for kernel in GATED_ACTIVATIONS["swiglu_oai"]:
        out = np.empty_like(g, dtype=np.float32)
        kernel(gate_up, out)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gpu, want, rtol=1e-5, atol=1e-5)


def test_info_shows_the_experts_and_the_active_parameters(case, capsys):
    c = case.hf.config
    assert main(["info", "--model", str(case.gguf.path)]) == 0
    lines = dict(line.split(":", 1) for line in capsys.readouterr().out.splitlines() if ":" in line)
    assert lines["experts"].strip().startswith(
        f"{c.num_local_experts} per block, {c.num_experts_per_tok} active per token (topk_softmax gating), "
        f"width {c.intermediate_size}, with biases, no shared expert")
    total = sum(p.numel() for p in case.hf.parameters())
    per_layer = sum(p.numel() for p in case.hf.model.layers[0].mlp.experts.parameters())  # weights and biases
    experts = c.num_hidden_layers * per_layer
    active = total - experts + experts * c.num_experts_per_tok // c.num_local_experts
    assert f"({active:,} active parameters" in lines["read per token"]


def test_the_triton_path_follows_transformers_through_chunked_prefill_and_the_prefix_cache(case):
    # The Triton kernels (under Triton's interpreter here) with the sinks in their online softmax, and the
    # layer's fused ops: greedy ids and logits as the reference's, through the paged cache's chunks and hits.
    # On the MXFP4 file only (YaRN, top-4): each interpreted step is slow, and the attention is the same.
    if case.gguf.path.name.startswith("gptoss-top2"):
        pytest.skip("the Triton path is checked on the top-4 file (interpreted steps are slow)")
    assert attention_kind("auto", torch.device("cuda")) == "triton"  # gpt-oss is no longer sent elsewhere
    runner = TorchRunner(case.gguf, torch.device("cpu"), torch.float32, kv_cache_memory="4MiB", attention="triton")
    assert runner.attention == "triton" and runner.cache.sinks[0] is not None
    greedy_through_chunks_and_prefix(runner, case)
