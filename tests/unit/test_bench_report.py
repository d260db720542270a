"""`hybridgate bench report`: the benchmark pages hold the tables their results JSON renders, and one table
reads the right values from a small literal file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from conftest import ROOT

from hybridgate.bench import report

ENGINE_RUN = {
    "model": "/cache/bench-models/llama-3.2-1b-16l-Q4_K_M-seed0-v1.gguf",
    "machine": {"cpu_model": "AMD EPYC", "isa": "avx512", "loadavg_1m": 1.17},
    "cpu_isa": "avx512", "threads": 2, "baseline": "llama-cpp",
    "decode": {"1": {"hybridgate_tokens_per_s": 17.846, "ratio": 0.8264},
               "16": {"hybridgate_tokens_per_s": 32.96, "ratio": 1.0051}},
    "prefill": {"1x512": {"ratio": 2.305}},
    "ttft": {"cached_over_cold": 0.312},
    "step_over_bandwidth_bound": 1.3497,
}


def test_pages_are_current():
    rendered = report.render_pages(ROOT / "docs")
    assert rendered, "no page holds a generated block"
    for page, text in rendered.items():
        assert (ROOT / "docs" / page).read_text() == text, \
            f"docs/{page} is stale: hybridgate bench report"


def test_the_command_checks_the_committed_pages():
    from hybridgate.cli import main

    assert main(["bench", "report", "--check", "--docs", str(ROOT / "docs")]) == 0


def test_every_table_reads_some_file():
    # A table whose glob matches nothing (results renamed or moved) would render an empty block silently;
    # only a table that says why none exists yet (`pending`: figures of a borrowed GPU) may match nothing.
    for table in report.TABLES:
        assert table.pending or sorted((ROOT / "docs" / "results").glob(table.pattern)), table.pattern


def test_a_pending_table_says_so_until_a_file_exists():
    gpu = next(t for t in report.TABLES if t.name == "gpu-engine")
    assert report.render_table(gpu, []) == gpu.pending
    run = {"shape": "llama-3.1-8b", "device": "NVIDIA H100", "decode_step": {"ms": 6.41, "over_bound": 1.2345},
           "decode": {"64": {"ratio": 5.5}}, "prefill": {"8192": {"fraction_of_matmul_rate": 0.612}},
           "handoff": {"hidden_fraction": 0.95}}
    path = Path("gpu-engine/2026-12-07-h100-llama-3.1-8b.json")
    header, _, row = report.render_table(gpu, [(path, run)]).splitlines()
    cells = dict(zip(split_row(header), split_row(row)))
    assert (cells["decode step ms"], cells["step / (weights + KV) bound"]) == ("6.41", "1.23×")
    assert (cells["c=64 vs transformers"], cells["c=256 vs transformers"]) == ("5.50×", "—")
    assert (cells["prefill 8k of matmul rate"], cells["hand-off hidden"]) == ("61.2%", "95.0%")


def engine_table():
    return next(t for t in report.TABLES if t.name == "cpu-engine")


def split_row(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_engine_row_from_a_literal_run():
    body = report.render_table(engine_table(), [(Path("cpu-engine/2026-12-06-avx512-epyc-x.json"), ENGINE_RUN)])
    header, rule, row = body.splitlines()
    cells = dict(zip(split_row(header), split_row(row)))
    # The page is docs/benchmarks/cpu-worker.md, the file docs/results/cpu-engine/...
    assert cells["file"] == "[`2026-12-06-avx512-epyc-x.json`](../results/cpu-engine/2026-12-06-avx512-epyc-x.json)"
    assert cells["model"] == "llama-3.2-1b-16l-Q4_K_M-seed0-v1.gguf"
    assert cells["CPU"] == "AMD EPYC" and cells["load"] == "1.17" and cells["ISA"] == "avx512"
    assert cells["AMX"] == "—"  # absent from the file
    assert cells["decode c=1 tok/s"] == "17.8"
    assert (cells["decode c=1"], cells["decode c=16"], cells["prefill"]) == ("0.83×", "1.01×", "2.31×")
    assert cells["TTFT cached/cold"] == "0.31" and cells["step / bandwidth bound"] == "1.35"
    assert rule == "|" + "---|" * 14  # the file, then 13 columns


def test_a_table_of_records_per_file_is_captioned():
    kernels = next(t for t in report.TABLES if t.name == "cpu-kernels")
    doc = {"command": "hybridgate bench kernels", "machine": {"cpu_model": "Xeon", "isa": "avx2"},
           "rows": [{"isa": "avx2", "type": "Q4_K", "batch": 16, "fast": {"ms": 0.5, "gb_s": 2.25},
                     "speedup_vs_other": 1.5}]}
    lines = report.render_table(kernels, [(Path("cpu-kernels/a.json"), doc)]).splitlines()
    assert lines[0] == "[`a.json`](../results/cpu-kernels/a.json): Xeon, avx2; `hybridgate bench kernels`"
    assert lines[4] == "| avx2 | Q4_K | 16 | — | — | 0.500 | 2.2 | 1.50× | — | — | — | — |"  # no prompt kernel here


def test_records_keyed_by_name_and_a_file_without_a_machine():
    sim = next(t for t in report.TABLES if t.name == "placement-sim")
    doc = {"policies": {"cost": {"policy": "cost", "capacity": 1.25, "attainment": 0.9, "tpot_p99": 0.0694}}}
    lines = report.render_table(sim, [(Path("placement-sim/a.json"), doc)]).splitlines()
    assert lines[0] == "[`a.json`](../results/placement-sim/a.json)"
    assert lines[4] == "| cost | 1.250 | — | 90.0% | — | — | 69.4 |"


def test_keep_leaves_out_files_of_another_shape():
    accuracy = next(t for t in report.TABLES if t.name == "accuracy")
    body = report.render_table(accuracy, [(Path("accuracy/formats.json"), {"formats": []}),
                                          (Path("accuracy/b.json"), {"top1_agreement": 0.988, "kl_mean": 3.8e-4})])
    assert "formats.json" not in body
    assert "| 98.8% | 3.8e-04 | — |" in body


def test_star_matches_only_a_single_key():
    assert report.lookup({"prefill": {"2x512": {"ratio": 1.5}}}, "prefill.*.ratio") == 1.5
    assert report.lookup({"prefill": {"a": {"ratio": 1}, "b": {"ratio": 2}}}, "prefill.*.ratio") is None


def test_check_fails_on_a_stale_page_and_writing_fixes_it(tmp_path, capsys):
    (tmp_path / "results" / "cpu-engine").mkdir(parents=True)
    (tmp_path / "results" / "cpu-engine" / "2026-12-06-avx512-epyc-x.json").write_text(json.dumps(ENGINE_RUN))
    page = tmp_path / "benchmarks" / "cpu-worker.md"
    page.parent.mkdir()
    page.write_text("# Prose\n\n<!-- begin generated: bench report cpu-engine -->\nSTALE\n"
                    "<!-- end generated -->\n\nmore\n")
    table = engine_table()
    args = argparse.Namespace(docs=str(tmp_path), check=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(report, "TABLES", (table,))
        assert report.run(args) == 1
        assert "STALE" in page.read_text()
        assert report.run(argparse.Namespace(docs=str(tmp_path), check=False)) == 0
        assert report.run(args) == 0
    text = page.read_text()
    assert text.startswith("# Prose\n\n") and text.endswith("<!-- end generated -->\n\nmore\n")
    assert "| 0.83× |" in text and "STALE" not in text
    assert "(../results/cpu-engine/2026-12-06-avx512-epyc-x.json)" in text


def test_a_page_without_the_markers_is_refused(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "cpu-worker.md").write_text("# no block\n")
    with pytest.raises(ValueError, match="bench report cpu-engine"):
        report.render_pages(tmp_path, (engine_table(),))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(report, "TABLES", (engine_table(),))
        assert report.run(argparse.Namespace(docs=str(tmp_path), check=True)) == 2
