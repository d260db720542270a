"""docs/results/ holds each run as <bench>/<date>-<machine>-<model>[-<variant>].json (its plot beside it as .png),
and scripts/results_layout.py moves a flat name there."""

from __future__ import annotations

import importlib.util
import json
import subprocess

import pytest
from conftest import ROOT

from hybridgate.bench.report import RESULT_PATH, TABLES

RESULTS = ROOT / "docs" / "results"


def layout():
    spec = importlib.util.spec_from_file_location("results_layout", ROOT / "scripts" / "results_layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_results_file_follows_the_scheme():
    files = sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file())
    assert len(files) > 90
    wrong = [f for f in files if not RESULT_PATH.fullmatch(f)]
    assert not wrong, f"outside <bench>/<date>-<machine>-<model>[-<variant>].json (scripts/results_layout.py): {wrong}"
    # The ISA path belongs to the machine, before the model, never in the variant.
    misplaced = [f for f in files if "avx" in (RESULT_PATH.fullmatch(f)["variant"] or "")]
    assert not misplaced, misplaced


def test_a_plot_sits_beside_its_json():
    plots = sorted(RESULTS.rglob("*.png"))
    assert plots and all(p.with_suffix(".json").is_file() for p in plots), plots


def test_the_scheme_refuses_flat_and_misordered_names():
    for name in ("cpu-engine-llama-3.2-1b-q4_k_m-avx2-epyc-zen3-idle.json",  # flat
                 "cpu-engine/llama-3.2-1b-q4_k_m-avx2-epyc-zen3-idle.json",  # no date
                 "cpu-engine/2026-12-06-llama-3.2-1b-q4_k_m.json",  # no machine
                 "cpu-engine/2026-12-06-avx2-epyc-zen3.json",  # no model
                 "engine/2026-12-06-avx2-epyc-zen3-smollm2-q4_1.json",  # no such bench
                 "cpu-engine/2026-12-06-avx2-epyc-zen3-smollm2-q4_1.txt"):
        assert not RESULT_PATH.fullmatch(name), name
    m = RESULT_PATH.fullmatch("gpu-engine/2026-12-07-h100-80gb-hbm3-llama-3.1-8b.json")  # scripts/gpu_check.sh's
    assert (m["machine"], m["model"], m["variant"]) == ("h100-80gb-hbm3", "llama-3.1-8b", None)
    m = RESULT_PATH.fullmatch("cpu-engine/2026-12-07-avx512-epyc-zen4-qwen3-30b-a3b-8l-q4_k_m.json")  # --layers 8
    assert (m["machine"], m["model"], m["variant"]) == ("avx512-epyc-zen4", "qwen3-30b-a3b-8l-q4_k_m", None)


def test_every_table_globs_inside_a_bench_folder():
    for table in TABLES:
        bench = table.pattern.split("/")[0]
        assert "/" in table.pattern and RESULT_PATH.fullmatch(f"{bench}/2026-12-06-epyc-smollm2-q4_1.json"), table


# Flat names as they were (and as runs still arrive), and where the scheme puts them: read off the name
# by hand, the model from the JSON where the name has none, the date from the name or else the one given.
MOVES = [
    ("cpu-engine-llama-3.2-1b-q4_k_m-avx512-amx-final-2-xeon-207-idle.json", {},
     "cpu-engine/2026-12-06-avx512-amx-xeon-207-llama-3.2-1b-q4_k_m-final-2-idle.json"),
    ("cpu-engine-llama-3.2-1b-q4_k_m-int8-prompts-avx2-epyc-zen3-2026-12-07.json", {},
     "cpu-engine/2026-12-07-avx2-epyc-zen3-llama-3.2-1b-q4_k_m-int8-prompts.json"),
    ("cpu-engine-smollm2-Q6_K-avx512-xeon-emr.json", {},
     "cpu-engine/2026-12-06-avx512-xeon-emr-smollm2-requantized-q6_k.json"),
    ("cpu-engine-avx2-epyc-zen1.json", {"model": "/x/SmolLM2-135M-Instruct.Q4_1.gguf"},
     "cpu-engine/2026-12-06-avx2-epyc-zen1-smollm2-q4_1.json"),
    ("cpu-kernels-int8-prompt-2048x8192-avx2-epyc-zen3.json", {"shape": [2048, 8192]},
     "cpu-kernels/2026-12-06-avx2-epyc-zen3-random-2048x8192-int8-prompt.json"),
    ("accuracy-smollm2-requantized-q4_k_m-int8-prompts-avx2-epyc-zen3.json", {},
     "accuracy/2026-12-06-avx2-epyc-zen3-smollm2-requantized-q4_k_m-int8-prompts.json"),
    ("gateway-grpc-floor-xeon-emr-idle.json", {},
     "gateway/2026-12-06-xeon-emr-instant-worker-grpc-floor-idle.json"),
    ("placement-serve.json", {"machine": {"cpu_model": "AMD EPYC"}},
     "placement-serve/2026-12-06-epyc-smollm2-q4_1.json"),
    ("placement-sim-h200-decode-heavy.json", {}, "placement-sim/2026-12-06-h200-llama-3.1-8b-decode-heavy.json"),
]


@pytest.mark.parametrize("old, doc, new", MOVES)
def test_the_script_places_a_flat_name(old, doc, new):
    assert layout().new_name(old, doc, "2026-12-06") == new
    assert RESULT_PATH.fullmatch(new)


def test_the_script_refuses_a_name_of_no_bench():
    with pytest.raises(ValueError, match="benches"):
        layout().new_name("engine-avx2-epyc.json", {}, "2026-12-06")


def test_the_script_moves_a_flat_file_and_its_plot_in_a_repository(tmp_path):
    # A real git repository: the script uses git mv and git's date of the file's first commit.
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / "placement-serve-xeon.json").write_text(json.dumps({"machine": {"cpu_model": "Intel Xeon"}}))
    (results / "placement-serve-xeon.png").write_bytes(b"\x89PNG")
    (tmp_path / "page.md").write_text("docs/results/placement-serve-xeon.json, results/placement-serve-xeon.png\n")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "runs", "--date", "2026-12-05T12:00:00Z"], check=True,
                   env={"GIT_COMMITTER_DATE": "2026-12-05T12:00:00Z", "PATH": "/usr/bin:/bin"})
    module = layout()
    module.ROOT, module.RESULTS = tmp_path, results
    assert module.main(["--apply"]) == 0
    moved = sorted(p.relative_to(results).as_posix() for p in results.rglob("*") if p.is_file())
    new = "placement-serve/2026-12-05-xeon-smollm2-q4_1"
    assert moved == [f"{new}.json", f"{new}.png"]
    assert (tmp_path / "page.md").read_text() == f"docs/results/{new}.json, results/{new}.png\n"
