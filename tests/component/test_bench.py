"""`hybridgate bench engine --kind cpu`: the figures it reports, on a tiny run; a crashing llama.cpp baseline.
The run against a real llama.cpp is `make bench-check` (tests/component/test_llama_cpp_baseline.py, marked `bench`)."""

from __future__ import annotations

import argparse

import pytest

from hybridgate.bench import add_engine_parser, engine


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="bench"))
    return parser.parse_args(["engine", "--kind", "cpu", "--threads", "1", "--concurrency", "1,2",
                              "--prefill-lens", "24", "--prefill-prompts", "2", "--ttft-len", "40",
                              "--new-tokens", "4", "--repeats", "1", "--kv-cache-memory", "64MiB", *argv])


# A llama_cpp whose every call succeeds until llama_decode, which aborts the process: a real crash
# of the baseline's own process, which the bench must outlive.
CRASHING_LLAMA_CPP = """
import os
__version__ = "0-crashing"
class _Any:
    def __getattr__(self, name): return _Any()
    def __setattr__(self, name, value): pass
    def __call__(self, *args, **kwargs): return _Any()
    def __getitem__(self, index): return _Any()
    def __setitem__(self, index, value): pass
def llama_decode(ctx, batch):
    os.abort()
def __getattr__(name):
    return _Any()
"""


def test_cpu_bench_reports_rates_bytes_bandwidth_and_outlives_a_crashing_baseline(tmp_path, model_path):
    (tmp_path / "fake" / "llama_cpp").mkdir(parents=True)
    (tmp_path / "fake" / "llama_cpp" / "__init__.py").write_text(CRASHING_LLAMA_CPP)
    out = engine.run(bench_args("--model", str(model_path), "--json", str(tmp_path / "b.json"), "--baseline",
                                "llama-cpp", "--llama-cpp-path", str(tmp_path / "fake"), "--bandwidth-mib", "64"))
    assert set(out["decode"]) == {1, 2} and all(r["hybridgate_tokens_per_s"] > 0 for r in out["decode"].values())
    assert out["prefill"]["2x24"]["hybridgate_tokens_per_s"] > 0
    assert 80 * 2**20 < out["weight_bytes_read_per_step"] < 1.25 * 98 * 2**20  # the GGUF holds ~92 MiB of tensors
    assert out["peak_rss_mib"] > 100 and out["ttft"]["cached_ms"] < out["ttft"]["cold_ms"]
    # one bandwidth probe before each of our timed steps; the step's bound set against the probe just before it
    probes, runs = out["read_bandwidth_probes_gb_per_s"], out["decode_step_ms_c1_runs"]
    assert len(probes) == len(runs) == 1 and probes[0] > 0.5 and runs[0] == out["decode_step_ms_c1"]
    bound = probes[0] * runs[0] * 1e6 / out["weight_bytes_read_per_step"]
    assert out["step_over_bandwidth_bound"] == pytest.approx(bound)
    assert out["read_bandwidth_gb_per_s"] == probes[0] and out["read_bandwidth_spread"] == 1.0
    assert out["cpu_isa"] in ("avx512", "avx2", "generic") and out["cpu_activations"].startswith("auto")
    for config in ("defaults", "plain"):  # each ran in its own process from the given folder, and crashed there
        assert out["llama_cpp"][config]["version"] == "0-crashing"
        assert str(tmp_path / "fake") in out["llama_cpp"][config]["path"]
        row = out["decode"][1]
        assert "crashed" in row[f"llama_cpp_{config}_error"] and f"llama_cpp_{config}_tokens_per_s" not in row
        assert "ratio" not in row and "ratio_vs_fastest" not in row  # no baseline finished: nothing to divide by
    assert (tmp_path / "b.json").exists()
    # per-type shares of the step: the types are the file's matrix types (its linear weights Q4_1, the tied
    # embedding Q8_0), each timed; with the rest of the step they add up to the step
    shares = out["type_shares_c1"]
    assert set(shares) - {"other_ms"} == {"Q4_1", "Q8_0"}
    assert all(shares[t]["ms"] > 0 and shares[t]["bytes"] > 0 for t in ("Q4_1", "Q8_0"))
    assert shares["other_ms"] + sum(shares[t]["ms"] for t in ("Q4_1", "Q8_0")) == pytest.approx(out["decode_step_ms_c1"])


def test_baselines_belong_to_their_kind():
    with pytest.raises(ValueError, match="--baseline transformers"):
        engine.run(bench_args("--baseline", "transformers"))


def test_constrained_bench_reports_the_ratio_mask_fill_and_compile_times(tmp_path, model_path):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}')
    out = engine.run(bench_args("--model", str(model_path), "--constrained-fraction", "0.5", "--schema", str(schema),
                                "--new-tokens", "6"))
    row = out["constrained"]
    assert (row["concurrency"], row["constrained_sequences"]) == (2, 1)  # the last --concurrency, half of it
    assert row["unconstrained_tokens_per_s"] > 0 and row["constrained_tokens_per_s"] > 0 and row["ratio"] > 0
    assert row["full_batch_steps"] >= 1 and row["mask_fills"] >= 2
    assert row["mask_fill_us_p50"] <= row["mask_fill_us_p99"]
    assert row["compile_ms_cached"] < row["compile_ms_cold"]
    assert "decode" not in out  # the constrained comparison replaces the other cases


def test_mixed_load_reports_a_streams_gaps_with_the_step_budget_and_without(model_path):
    # A budget of 1.5 decode steps fits fewer prompt tokens than a --min-prefill-chunk of 16 on any
    # machine where a prompt token costs more than 1/32 of a decode step: chunks of exactly 16.
    out = engine.run(bench_args("--model", str(model_path), "--mixed-load", "--long-prompt", "64",
                                "--new-tokens", "8", "--mixed-step-budget", "1.5", "--min-prefill-chunk", "16"))
    rows = out["mixed_load"]
    assert rows["unloaded"]["gaps"] == 7 and rows["budgeted"]["gaps"] >= rows["budgeted"]["prompt_steps"] - 1
    assert rows["budget_off"]["prompt_steps"] == 1 and rows["budget_off"]["chunk_tokens_max"] == 64
    assert rows["budgeted"]["prompt_steps"] == 4 and rows["budgeted"]["chunk_tokens_max"] == 16
    assert rows["target_p99_ms"] == 4 * rows["unloaded"]["p50_ms"] + 50
    assert out["scheduler"]["mixed_step_budget"] == 1.5 and out["long_prompt_tokens"] == 64


def test_shape_and_model_are_one_choice(model_path):
    with pytest.raises(ValueError, match="--shape and --model"):
        engine.run(bench_args("--model", str(model_path), "--shape", "llama-3.2-1b"))
