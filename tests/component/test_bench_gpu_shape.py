"""`bench engine --kind gpu --shape NAME`, run here on the CPU torch device at tiny widths (`--tiny`): the figures it
writes, each checked against a hand-worked literal or against the other figures it is made from, and the random
model's transformers twin against our forward pass (transformers is the reference: a wrong Q/K row order, RoPE
table or tensor mapping shows in the logits).

Hand-worked sizes of llama-3.2-1b at tiny widths (`Shape.tiny`: GQA group 32 / 8 = 4 -> 8 query heads, 2 KV heads
of 16, hidden 128, FFN 256, vocabulary 512, 2 blocks, tied LM head): per block attn_norm 128 + Q|K|V
128 x (128 + 2 x 32) = 24,576 + output 128 x 128 = 16,384 + ffn_norm 128 + gate|up 128 x 512 = 65,536 + down
256 x 128 = 32,768 = 139,520; two blocks 279,040, embedding 512 x 128 = 65,536, output norm 128: 344,704
parameters, 1,378,816 bytes in fp32. One token's K and V over both blocks: 2 x 2 x 2 x 16 x 4 = 512 bytes.
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridgate.bench import report
from hybridgate.bench.device_weights import RandomModel, transformers_twin
from hybridgate.bench.shapes import shape
from hybridgate.cli import main
from hybridgate.workers.gpu.model import DecoderModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WEIGHT_BYTES = 1_378_816
KV_BYTES_PER_TOKEN = 512
ARGS = ["--kind", "gpu", "--device", "cpu", "--threads", "1", "--tiny", "--seed", "3", "--concurrency", "1,2",
        "--baseline-concurrency", "2", "--prompt-len", "16", "--new-tokens", "4", "--prefill-lens", "16,32",
        "--mixed-chunk", "16", "--mixed-decodes", "2", "--handoff-len", "32", "--repeats", "1"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-shape") / "gpu-engine-tiny.json"
    assert main(["bench", "engine", "--shape", "llama-3.2-1b", *ARGS, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_the_run_writes_every_figure_with_its_parts(tiny_run, capsys):
    run = tiny_run
    assert (run["shape"], run["layers"], run["device"], run["dtype"], run["baseline"]) == \
        ("llama-3.2-1b-tiny", 2, "cpu", "float32", "transformers")
    assert run["weight_bytes"] == WEIGHT_BYTES
    assert run["copy_gb_per_s"] > 0 and run["matmul_tflops"] > 0
    step = run["decode_step"]
    assert step["weight_bytes"] == WEIGHT_BYTES  # tied: the embedding is the LM head, read whole
    assert step["kv_bytes"] == KV_BYTES_PER_TOKEN * (16 + 32) and step["context_tokens"] == 48
    assert step["bound_ms"] == pytest.approx((WEIGHT_BYTES + step["kv_bytes"]) / (run["copy_gb_per_s"] * 1e6))
    assert step["over_bound"] == pytest.approx(step["ms"] / step["bound_ms"])
    assert set(run["decode"]) == {"1", "2"} and "ratio" not in run["decode"]["1"]  # transformers only at 2
    at2 = run["decode"]["2"]
    assert min(at2["hybridgate_tokens_per_s"], at2["transformers_tokens_per_s"]) > 0
    assert at2["ratio"] == pytest.approx(at2["hybridgate_tokens_per_s"] / at2["transformers_tokens_per_s"])
    assert set(run["prefill"]) == {"16", "32"}
    for row in run["prefill"].values():
        assert row["transformers_tokens_per_s"] > 0 and 0 < row["fraction_of_matmul_rate"] <= 1
        assert row["fraction_of_matmul_rate"] == pytest.approx(row["hybridgate_tflops"] / run["matmul_tflops"])
    mixed = run["mixed_step"]
    assert (mixed["chunk_tokens"], mixed["decodes"]) == (16, 2)
    assert mixed["over_sum"] == pytest.approx(mixed["mixed_ms"] / (mixed["decode_ms"] + mixed["chunk_alone_ms"]))
    hand = run["handoff"]
    assert (hand["tokens"], hand["bytes"]) == (32, 32 * KV_BYTES_PER_TOKEN)
    assert hand["copy_ms"] > 0 and 0 <= hand["hidden_fraction"] <= 1


def test_the_bench_report_renders_the_run(tiny_run, tmp_path):
    table = next(t for t in report.TABLES if t.name == "gpu-engine")
    header, _, row = report.render_table(table, [(tmp_path / "gpu-engine-tiny.json", tiny_run)]).splitlines()
    cells = dict(zip((c.strip() for c in header.strip("|").split("|")), (c.strip() for c in row.strip("|").split("|"))))
    assert cells["shape"] == "llama-3.2-1b-tiny" and cells["hand-off hidden"].endswith("%")
    assert cells["c=64 vs transformers"] == report.MISSING  # not a concurrency of this run


def test_prefill_flops_by_hand():
    from hybridgate.bench.gpu_engine import prefill_flops

    config = RandomModel(shape("llama-3.2-1b").tiny(), 0, torch.device("cpu"), torch.float32).config
    # 2 x 16 tokens x 2 blocks x (24,576 + 16,384 + 3 x 128 x 256 = 139,264 matrix parameters) + LM head
    # 2 x 128 x 512, + attention 4 x 2 blocks x 8 heads x 16 x (16 x 17 / 2)
    assert prefill_flops(config, 16) == 2 * 16 * 2 * 139_264 + 2 * 128 * 512 + 4 * 2 * 8 * 16 * 136


def test_a_gguf_quant_mix_is_refused_for_device_weights(capsys):
    assert main(["bench", "engine", "--shape", "llama-3.2-1b", "--quant", "Q4_K_M", *ARGS]) != 0
    assert "--quant: only with --kind cpu" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen2.5-0.5b"])  # pairs RoPE (rows un-permuted); halves, biases
def test_transformers_twin_on_the_same_tensors_gives_our_logits(name):
    s = shape(name).tiny()
    model = RandomModel(s, 7, torch.device("cpu"), torch.float32)
    ours = DecoderModel(model, torch.device("cpu"), torch.float32, model.load)
    twin = transformers_twin(ours, s)
    ids = torch.randint(1, s.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = twin(ids).logits[0, -1].float()
        got = ours.forward(ids[0], [40], [ours.new_cache()])[0]
    assert want.abs().max() > 1  # logits of a few units: a comparison that can tell the functions apart
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_random_weights_follow_the_seed_and_the_writers_scales():
    s = shape("llama-3.1-8b").tiny()
    a, b = (RandomModel(s, seed, torch.device("cpu"), torch.float32) for seed in (5, 6))
    q = a.load("blk.0.attn_q.weight")
    assert torch.equal(q, a.load("blk.0.attn_q.weight")) and not torch.equal(q, b.load("blk.0.attn_q.weight"))
    assert a.load("output.weight").shape == (512, 128)  # untied: the 8B shape's LM head is its own
    assert q.std().item() == pytest.approx(2 / 128**0.5, rel=0.1)  # gain 2 / sqrt(columns), as model_files
    assert a.load("blk.1.ffn_norm.weight").mean().item() == pytest.approx(1.0, abs=0.05)
    assert a.fingerprint != b.fingerprint


def test_one_summary_line_per_figure_with_the_targets_that_apply(tiny_run):
    from hybridgate.bench.gpu_engine import summary_lines

    lines = summary_lines(tiny_run)
    # probes, decode step, 2 prefill lengths, mixed step, hand-off, 2 concurrencies
    assert len(lines) == 8 and all(line.startswith("summary: llama-3.2-1b-tiny on cpu: ") for line in lines)
    # the targets are per shape (none for a tiny one) but for the mixed step and the hand-off
    assert [line.rsplit("(target ", 1)[1] for line in lines if "(target " in line] == ["<= 1.3)", ">= 0.9)"]


def test_the_mixed_step_holds_its_decodes_through_a_prefill_of_many_steps(tmp_path, monkeypatch):
    """The mixed step's decodes prefill over several steps (12 prompts of 64 tokens, steps of 64 tokens here; 63 of
    1,024 in steps of 8,192 at the real shape's defaults), the first ones decoding a token a step meanwhile: none may
    reach its max_tokens before the last timed step, or the step is no longer the chunk and every decode and the run
    stops there, the hand-off's and the decode figures lost."""
    from dataclasses import replace

    from hybridgate.bench import gpu_engine

    monkeypatch.setattr(gpu_engine, "WHOLE_CHUNKS", replace(gpu_engine.WHOLE_CHUNKS, max_num_batched_tokens=64))
    out = tmp_path / "mixed.json"
    assert main(["bench", "engine", "--shape", "llama-3.2-1b", *ARGS, "--baseline", "none", "--prompt-len", "64",
                 "--mixed-decodes", "12", "--repeats", "2", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["mixed_step"]["decodes"] == 12 and got["mixed_step"]["chunk_tokens"] == 16
    assert "handoff" in got and set(got["decode"]) == {"1", "2"}
