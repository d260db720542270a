"""`make gpu-check` (scripts/gpu_check.sh), read as text: it cannot run here (no CUDA), so what can go wrong on the
lent machine before any figure exists is checked by parsing it: a time limit on every command, their sum within
270 s, the JSON where the machine hands files back, the benches and tests it names present in the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def commands() -> list[str]:
    """The script's lines with continuations joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", SCRIPT.read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_the_time_limits_sum_to_at_most_270_s():
    limits = [int(n) for line in commands() for n in re.findall(r"\btimeout (\d+)\b", line)]
    assert len(limits) >= 6 and sum(limits) <= 270, limits


def test_every_python_command_runs_under_a_time_limit():
    runs = [line for line in commands() if "$PY " in line]
    assert runs and all(re.search(r"\btimeout \d+ \$PY ", line) for line in runs), runs


def test_json_goes_under_out_when_set_else_docs_results():
    lines = commands()
    # docs/results/<bench>/<date>-<machine>-<model>.json, the layout tests/unit/test_results_layout.py holds every
    # results file to; under $OUT the same gpu-engine/ folder, to copy into docs/results/ as it is.
    assert 'DEST=${OUT:-docs/results}/gpu-engine' in lines and "DAY=$(date -u +%F)" in lines
    benches = [line for line in lines if "bench engine" in line]
    shapes = [re.search(r"--shape (\S+)", line).group(1) for line in benches]
    assert shapes == ["llama-3.2-1b", "llama-3.1-8b"]
    assert all(re.search(r'--json "\$DEST/\$DAY-\$DEVICE-' + re.escape(s) + r'\.json"', line)
               for s, line in zip(shapes, benches))


def test_the_tests_it_names_exist_and_the_makefile_runs_it():
    named = {p for line in commands() for p in re.findall(r"tests/\S+\.py", line)}
    assert "tests/unit/test_gpu_kernels.py" in named and "tests/component/test_handoff_gpu.py" in named
    assert all((ROOT / p).is_file() for p in named), named
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if re.search(r"^(pytestmark\b.*|@)pytest\.mark\.gpu\b", p.read_text(), re.M)}
    assert marked and marked <= named, marked - named  # every test marked gpu runs there
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^gpu-check:\n\tbash scripts/gpu_check\.sh$", make, re.M)


def test_it_writes_no_more_files_than_a_lent_machine_hands_back():
    """A lent machine hands back at most 8 files from $OUT, no more than 2 folders down: every file the script
    writes there ($LOGS and $DEST are under $OUT when it is set) counts, the JSON included."""
    text = "\n".join(commands())
    written = set(re.findall(r'(?:>|--json|--junitxml|2>)\s*"(\$(?:LOGS|DEST)/[^"]+)"', text))
    assert written == {"$DEST/$DAY-$DEVICE-llama-3.2-1b.json", "$DEST/$DAY-$DEVICE-llama-3.1-8b.json",
                       "$LOGS/bench-llama-3.2-1b.log", "$LOGS/bench-llama-3.1-8b.log", "$LOGS/tests-gpu-kernels.log",
                       "$LOGS/tests-gpu.log"}, written
    assert len(written) <= 8
    assert not re.search(r'\$(?:LOGS|DEST)/[^"\s]*/', text)  # nothing deeper than $OUT/gpu-engine/
