"""`hybridgate bench engine --kind cpu`: the figures it reports, on a tiny run; llama.cpp where installed."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from hybridgate.bench import add_engine_parser, engine


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="bench"))
    return parser.parse_args(["engine", "--kind", "cpu", "--threads", "1", "--concurrency", "1,2",
                              "--prefill-lens", "24", "--prefill-prompts", "2", "--ttft-len", "40",
                              "--new-tokens", "4", "--repeats", "1", "--kv-cache-memory", "64MiB", *argv])


def test_cpu_bench_reports_rates_bytes_and_rss(tmp_path, model_path):
    out = engine.run(bench_args("--model", str(model_path), "--json", str(tmp_path / "b.json")))
    assert set(out["decode"]) == {1, 2} and all(r["hybridgate_tokens_per_s"] > 0 for r in out["decode"].values())
    assert out["prefill"]["2x24"]["hybridgate_tokens_per_s"] > 0
    assert 80 * 2**20 < out["weight_bytes_read_per_step"] < 1.25 * 98 * 2**20  # the GGUF holds ~92 MiB of tensors
    assert out["peak_rss_mib"] > 100 and out["ttft"]["cached_ms"] < out["ttft"]["cold_ms"]
    assert (tmp_path / "b.json").exists()


def test_baselines_belong_to_their_kind():
    with pytest.raises(ValueError, match="--baseline transformers"):
        engine.run(bench_args("--baseline", "transformers"))


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="the optional bench extra (llama-cpp-python)")
def test_llama_cpp_baseline_runs_side_by_side(model_path):
    out = engine.run(bench_args("--model", str(model_path), "--baseline", "llama-cpp"))
    for row in list(out["decode"].values()) + list(out["prefill"].values()):
        assert row["llama_cpp_tokens_per_s"] > 0 and row["ratio"] > 0
    assert out["llama_cpp_decode_step_ms_c1"] > 0
