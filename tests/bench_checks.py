"""What a bench serve or bench sim report must hold (issue: every figure named), shared by their tests."""

from __future__ import annotations

import pytest

FIGURES = ("goodput", "capacity", "throughput", "attainment", "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50",
           "tpot_p90", "tpot_p99", "e2e_p50", "e2e_p90", "e2e_p99", "plans")


def check_report(report: dict, policies: list[str]) -> None:
    """Every figure the issue names, per policy, with values that hold together."""
    assert sorted(report["policies"]) == sorted(policies)
    for name, p in report["policies"].items():
        assert p["policy"] == name
        missing = [k for k in FIGURES if k not in p]
        assert not missing, (name, missing)
        runs = p["sweep"] + p["capacity_runs"]
        assert runs and all(r["requests"] >= 1 for r in runs)
        for r in runs:
            assert 0.0 <= r["attainment"] <= 1.0 and r["goodput"] == pytest.approx(r["rate"] * r["attainment"])
            assert r["ttft_p50"] <= r["ttft_p90"] <= r["ttft_p99"] and r["e2e_p50"] <= r["e2e_p99"]
            assert sum(r["plans"].values()) == r["completed"]
    assert "unloaded_ttft_s" in report["slo"] and "unloaded_tpot_s" in report["slo"]
