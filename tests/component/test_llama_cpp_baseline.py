"""`make bench-check`: `bench engine --baseline llama-cpp` on the default model, against a real llama.cpp.

Marked `bench`, which `make test` deselects: it needs the `bench` extra (llama-cpp-python, which pip
builds from source in about 10 minutes on 2 cores), which `make test` does not install. Here a missing
llama_cpp is an error, never a skip (imported in the test, so that collecting the suite needs none). The crash handling of the baseline is tested in CI with a fake llama_cpp
(tests/component/test_bench.py).
"""

from __future__ import annotations

import argparse

import pytest

from hybridgate.bench import add_engine_parser, engine
from hybridgate.models import default_model_path


pytestmark = pytest.mark.bench


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="bench"))
    return parser.parse_args(["engine", "--kind", "cpu", "--threads", "1", "--concurrency", "1,2",
                              "--prefill-lens", "24", "--prefill-prompts", "2", "--ttft-len", "40",
                              "--new-tokens", "4", "--repeats", "1", "--kv-cache-memory", "64MiB", *argv])


def test_llama_cpp_baselines_run_side_by_side():
    import llama_cpp  # noqa: F401  (the bench extra: an ImportError here is the answer)

    out = engine.run(bench_args("--model", str(default_model_path()), "--baseline", "llama-cpp",
                                "--bandwidth-mib", "64"))
    for row in list(out["decode"].values()) + list(out["prefill"].values()):
        assert row["llama_cpp_plain_tokens_per_s"] > 0 and row["llama_cpp_plain_ratio"] > 0 and row["ratio"] > 0
        # the defaults (extra buffer types on) may crash inside ggml on some CPUs: then it says so
        assert row.get("llama_cpp_defaults_tokens_per_s", 0) > 0 or "llama_cpp_defaults_error" in row
        fastest = max(row.get(f"llama_cpp_{c}_tokens_per_s", 0) for c in ("defaults", "plain"))
        assert row["ratio_vs_fastest"] == row["hybridgate_tokens_per_s"] / fastest
    assert out["llama_cpp_plain_decode_step_ms_c1"] > 0
    assert "AVX" in out["llama_cpp"]["plain"]["system_info"]


def test_accuracy_puts_llama_cpps_figures_on_the_same_positions_beside_ours(tmp_path):
    """`bench accuracy --baseline llama-cpp`: llama.cpp's logits come back from its child process as the
    in-process baseline computes them (bit for bit), and its figures sit beside ours on the same 512 positions."""
    import llama_cpp  # noqa: F401  (the bench extra: an ImportError here is the answer)
    import numpy as np

    from hybridgate.bench import accuracy, add_accuracy_parser
    from hybridgate.bench.llama_baseline import LlamaCppBaseline, LlamaCppProcess

    cases = accuracy.load_cases()[:2]
    inprocess = LlamaCppBaseline(default_model_path(), threads=1, max_seqs=2, extra_bufts=True)
    try:
        expected = inprocess.teacher_forced_logits(cases)
    finally:
        inprocess.close()
    child = LlamaCppProcess(default_model_path(), 1, 2, "defaults")
    try:
        np.testing.assert_array_equal(child.teacher_forced_logits(cases), expected)
    finally:
        child.close()

    parser = argparse.ArgumentParser()
    add_accuracy_parser(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["accuracy", "--kind", "cpu", "--threads", "1", "--baseline", "llama-cpp",
                              "--json", str(tmp_path / "a.json")])
    out = accuracy.run(args)
    theirs = out["llama_cpp"]
    assert theirs["positions"] == out["positions"] == 512 and theirs["version"] == llama_cpp.__version__
    assert 0.5 < theirs["top1_agreement"] <= 1 and theirs["kl_mean"] > 0
    assert out["as_accurate_as_llama_cpp"] == (out["top1_agreement"] >= theirs["top1_agreement"]
                                               and out["kl_mean"] <= theirs["kl_mean"])
