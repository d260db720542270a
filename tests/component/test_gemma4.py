"""Gemma 4 on both runners against llama.cpp on tiny random files (F32 weights, F32 KV cache).

The reference here is llama.cpp itself (`tests/golden/gemma4.json`, made by
`tests/reference/make_gemma4_golden.py`); transformers' `Gemma4ForCausalLM` is the other, in
`test_gemma4_transformers.py`. Its CPU GELU reads an fp16 table, which moves its logits by up to
5e-3 from an exact forward here; the golden also holds the float64 forward written from llama.cpp's graph
(`gemma4_numpy`), checked there to give llama.cpp's logits within 1e-3 when it uses llama.cpp's table GELU, and
kept with the exact GELU. The runners are held to those float64 logits within 1e-3, to llama.cpp's within
LLAMA_CPP_TOL, and to llama.cpp's greedy ids. The files are rebuilt here from their seeds
(`tiny_gemma4.write_gemma4_gguf`) and must be the bytes llama.cpp read (sha256). Their layout (`tiny_gemma4`'s
doc): sliding and full layers alternating with their own head sizes, KV head counts and RoPE bases, proportional
RoPE on the full layers, two layers sharing the K/V of earlier ones, a layer whose V is its K, per-layer FFN
widths and output scales, the final softcap; the MoE file adds experts beside every dense FFN. Per file: the
last-position logits of three prompts on both runners, packed in one step; greedy ids for 16 tokens
equal (or the first difference where llama.cpp's top-2 gap is below 1e-3) through the paged cache with chunked
prefill (windows of 16 starting mid-chunk) and a prefix-cache hit, every block back in its pool, and through a
GPU→CPU hand-off (the torch engine prefills and exports, the Numba engine imports and decodes) that sends only
the layers that own K/V, each in its own shape; the KV cache holding only those layers. A file with E2B/E4B's
per-layer embeddings is refused, naming why.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from conftest import GOLDEN
from hybridgate.cli import main
from hybridgate.models import ModelLoadError, load_gguf, model_fingerprint
from hybridgate.workers.engine import EngineCore
from hybridgate.workers.gpu.model import DecoderModel
from hybridgate.workers.gpu.runner import TorchRunner
from hybridgate.workers.handoff_checks import KVLayout
from hybridgate.workers.scheduler import SchedulerConfig
from test_cpu_architectures import greedy_through_chunks_and_prefix
# The GPU→CPU hand-off test of every family (the torch engine exports, the Numba engine imports and decodes), here
# held to llama.cpp's greedy ids, and the K/V imported (each owning layer in its own shape) to the Numba prefill's.
from test_cpu_architectures import test_a_gpu_to_cpu_handoff_decodes_the_ids_of_the_cpu_runner_alone as \
    test_a_gpu_to_cpu_handoff_decodes_llama_cpps_ids
from test_cpu_architectures import torch_engine
# qwen3moe's tests of logits (within 1e-3, packed) and of greedy ids through chunked prefill and the prefix cache
# (every block back), run here on this module's `case`: they read only its fields, here llama.cpp's answers.
from test_moe import TOL, numba_packed, numba_runner, torch_packed
from test_moe import test_greedy_through_chunked_prefill_and_the_prefix_cache
from test_moe import test_numba_runner_logits_match_transformers as test_numba_runner_logits_match_llama_cpp
from test_moe import test_torch_runner_logits_match_transformers as test_torch_runner_logits_match_llama_cpp
from tiny_gemma4 import (EXPERT_FFN, EXPERTS, EXPERTS_USED, FFN, HEAD_DIM_FULL, HEAD_DIM_SWA, KV_HEADS, SLIDING,
                         WINDOW, write_gemma4_gguf)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

# collected here under these names (torch_engine: the hand-off test's fixture)
REUSED = (test_greedy_through_chunked_prefill_and_the_prefix_cache, test_numba_runner_logits_match_llama_cpp,
          test_torch_runner_logits_match_llama_cpp, test_a_gpu_to_cpu_handoff_decodes_llama_cpps_ids, torch_engine)
GOLDENS = json.loads((GOLDEN / "gemma4.json").read_text())
LLAMA_CPP_TOL = 1e-2  # llama.cpp's fp16-table GELU: 5e-3 at most from the float64 logits on these files


class Case:
    """A tiny Gemma 4 file rebuilt from its seed, and llama.cpp's answers on it."""

    def __init__(self, path, golden: dict):
        self.path, self.name = path, path.stem
        self.sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
        self.golden = golden
        self.gguf = load_gguf(path)
        self.prompts = golden["prompts"]
        self.want_logits = np.asarray(golden["float64_logits"])  # what the reused logits tests read
        self.llama_cpp_logits = np.asarray(golden["logits"])
        self.want_greedy, self.gaps = golden["greedy"]["ids"], golden["greedy"]["top2_gaps"]
        self.fingerprint = model_fingerprint(self.gguf)
        self.runner = numba_runner(self.gguf)


@pytest.fixture(scope="module", params=["dense", "moe"])
def case(request, tmp_path_factory) -> Case:
    golden = GOLDENS[request.param]
    path = tmp_path_factory.mktemp("gemma4") / f"gemma4-{request.param}.gguf"
    return Case(write_gemma4_gguf(path, moe=request.param == "moe", seed=golden["seed"]), golden)


def test_the_file_is_the_one_llama_cpp_read_and_reads_as_gemma4(case):
    assert case.sha256 == case.golden["gguf_sha256"]
    c = case.gguf.config
    assert c.layer_windows == tuple(WINDOW if s else 0 for s in SLIDING)
    assert c.layer_head_dims == tuple(HEAD_DIM_SWA if s else HEAD_DIM_FULL for s in SLIDING)
    assert c.layer_kv_heads == KV_HEADS and c.layer_intermediate_sizes == FFN
    # the last two layers read the last earlier owning layer of their kind (llama.cpp: n_layer_kv_from_start - 2
    # for a sliding layer, - 1 for a full one)
    assert c.layer_kv_source == (0, 1, 2, 3, 2, 3) and c.kv_layers == (0, 1, 2, 3)
    assert c.layer_qkv[3] == ("attn_q", "attn_k", "attn_k") and c.layer_qkv[4] == ("attn_q",)
    assert c.attention_scale == 1.0 and c.final_softcap == 30.0
    assert c.layer_rope_factors == tuple(not s for s in SLIDING)
    assert (c.num_experts, c.experts_per_token) == ((EXPERTS, EXPERTS_USED) if "moe" in case.name else (0, 0))


def test_both_runners_logits_are_llama_cpps_within_its_gelu_tables_rounding(case):
    assert np.abs(case.want_logits - case.llama_cpp_logits).max() < LLAMA_CPP_TOL / 2  # the golden's two references
    got = [torch_packed(DecoderModel(case.gguf, torch.device("cpu"), torch.float32), case.prompts),
           numba_packed(case.runner, case.prompts)]
    for logits in got:
        assert np.abs(logits - case.llama_cpp_logits).max() < LLAMA_CPP_TOL
        assert (logits.argmax(axis=1) == case.llama_cpp_logits.argmax(axis=1)).all()


def test_numba_on_q8_0_weights_matches_gguf_dequantized_weights(case, tmp_path):
    # The Numba runner keeps Q8_0 matrices in their blocks, per-layer shapes and all; the torch runner's fp32
    # weights from gguf's dequantizer are the reference (llama.cpp rounds activations on quantized weights).
    model = load_gguf(write_gemma4_gguf(tmp_path / "q8_0.gguf", moe="moe" in case.name, seed=case.golden["seed"],
                                        ggml_type="Q8_0"))
    assert model.tensors["blk.1.attn_q.weight"].ggml_type.name == "Q8_0"
    want = torch_packed(DecoderModel(model, torch.device("cpu"), torch.float32), case.prompts)
    got = numba_packed(numba_runner(model), case.prompts)
    assert np.abs(got - want).max() < TOL


def test_the_triton_kernels_give_llama_cpps_greedy_ids(case):
    # CUDA's path (fused norms/RoPE/activation and the paged attention kernels) under Triton's interpreter: per-layer
    # head sizes, K/V written only by the layers that own them, read by those that share them.
    if "moe" in case.name:
        pytest.skip("the attention path is the dense file's; the experts run the same torch ops on both paths")
    runner = TorchRunner(case.gguf, torch.device("cpu"), torch.float32, kv_cache_memory="4MiB", attention="triton")
    assert runner.attention == "triton"
    greedy_through_chunks_and_prefix(runner, case)


def test_the_kv_cache_holds_only_the_layers_that_own_kv(case):
    # Per token: the four owning layers' K and V (sliding: 2 heads of 16, full: 1 head of 32), none for the two
    # layers that share theirs; a 16-token block of fp32.
    per_token = sum(2 * KV_HEADS[i] * (HEAD_DIM_SWA if SLIDING[i] else HEAD_DIM_FULL) for i in range(4))
    torch_runner = TorchRunner(case.gguf, torch.device("cpu"), torch.float32, kv_cache_memory="4MiB")
    for runner, k, v in ((torch_runner, torch_runner.cache.k, torch_runner.cache.v),
                         (case.runner, case.runner.k_cache, case.runner.v_cache)):
        assert runner.block_bytes == 16 * per_token * 4
        assert len({id(t) for t in k + v}) == 8  # K and V of layers 0-3
        assert k[4] is k[2] and v[4] is v[2] and k[5] is k[3] and v[5] is v[3]
        assert [tuple(t.shape[1:3]) for t in k[:4]] == [(2, 16), (1, 32), (2, 16), (1, 32)]


def test_a_handoff_sends_the_layers_that_own_kv_each_in_its_own_shape(case):
    # Layers 0-3 (sliding: 2 heads of 16, full: 1 head of 32), not the two that share theirs; both runners
    # alike. The hand-off itself: `test_a_gpu_to_cpu_handoff_decodes_llama_cpps_ids`.
    shapes = tuple((KV_HEADS[i], HEAD_DIM_SWA if SLIDING[i] else HEAD_DIM_FULL) for i in range(4))
    torch_runner = TorchRunner(case.gguf, torch.device("cpu"), torch.float32, kv_cache_memory="4MiB")
    assert torch_runner.kv_layout() == case.runner.kv_layout() == KVLayout((0, 1, 2, 3), shapes, "float32")
    spec = EngineCore(case.runner, SchedulerConfig(), case.fingerprint).handoffs.spec
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.layer_shapes) == (4, 0, 0, shapes)


def test_a_file_with_per_layer_embeddings_is_refused_naming_why(tmp_path):
    path = write_gemma4_gguf(tmp_path / "e2b-like.gguf", per_layer_embedding=256)
    with pytest.raises(ModelLoadError, match=r"embedding_length_per_layer_input=256: not supported: its per-layer "
                                             r"embeddings \(the E2B and E4B models' per_layer_token_embd\)"):
        load_gguf(path)


def test_info_shows_the_experts_beside_the_dense_ffn(case, capsys):
    assert main(["info", "--model", str(case.path)]) == 0
    lines = dict(line.split(":", 1) for line in capsys.readouterr().out.splitlines() if ":" in line)
    if "moe" not in case.name:
        assert "experts" not in lines
        return
    assert lines["experts"].strip() == (f"{EXPERTS} per block, {EXPERTS_USED} active per token (softmax gating, "
                                        f"renormalised), width {EXPERT_FFN}, no shared expert, beside a dense FFN "
                                        f"of width {'/'.join(map(str, sorted(set(FFN))))}")
