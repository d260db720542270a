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
