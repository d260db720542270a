"""`hybridgate bench cache` on a tiny case: a real worker, redis-server and gateways; the JSON's shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TIME_FACTOR

HYBRIDGATE = str(Path(sys.executable).parent / "hybridgate")


def test_bench_cache_reports_every_figure(tmp_path, model_path):
    out = tmp_path / "cache.json"
    proc = subprocess.run([HYBRIDGATE, "bench", "cache", "--repeats", "1", "--replay-tokens", "8", "--coalesce", "2",
                           "--coalesce-tokens", "4", "--json", str(out)],
                          capture_output=True, text=True, timeout=180 * TIME_FACTOR)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["benchmark"] == "cache" and set(report["modes"]) == {"memory", "redis"}
    for row in report["modes"].values():
        assert row["replay_tokens"] == 8 and 1 <= row["replay_messages"] <= 8
        for key in ("round_trip_ms", "hit_ttft_ms", "miss_ttft_ms", "generate_s", "replay_s", "replay_speedup"):
            assert row[key] > 0, key
        assert row["hit_ttft_minus_round_trip_ms"] == pytest.approx(row["hit_ttft_ms"] - row["round_trip_ms"])
    c = report["coalescing"]
    # Two identical requests at once: the worker ran one generation of 4 tokens (4 steps of one sequence).
    assert c["errors"] == [] and c["one_alone"] == {"steps": 4, "sequence_steps": 4} == c["coalesced"]
    assert c["worker_time_ratio"] == 1.0
    assert "machine: " in proc.stdout and "single-flight:" in proc.stdout
