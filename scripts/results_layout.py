"""Move flat benchmark results to docs/results/<bench>/<date>-<machine>-<model>[-<variant>].<ext>.

A flat name reads `<bench>-...` with, in any order after the bench, a model (`llama-3.2-1b-q4_k_m`,
`smollm2-q4_1`, ...), a machine (`[avx2|avx512[-amx]-]epyc|xeon|h200[-zen3|-207|-emr]`), an optional
date (`2026-12-06`), and the rest, which becomes the variant (`idle`, `busy-core`, `int8-prompts`, ...)
in the order it came. Where the name has no model, the JSON's `model` path gives it, else the bench's
default (the default model, or what the bench runs instead of one). The date is the name's, else the
JSON's `date`, else the day git added the file. A plot goes beside its JSON with the same stem.

    python scripts/results_layout.py            # print old -> new for the flat files under docs/results/
    python scripts/results_layout.py --apply    # git mv them, and rewrite `results/OLD` in the docs and code

References that elide or glob a name (`…-zen1-idle.json`, `cpu-engine-*-xeon.json`) are left to fix by hand.
Run `hybridgate bench report` afterwards to regenerate the pages' links.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hybridgate.bench.report import QUANT, RESULT_PATH  # noqa: E402  (the scheme the unit test holds files to)

RESULTS = ROOT / "docs" / "results"
# Longest first, so cpu-mixed-load is not read as a cpu-... bench with a variant.
BENCHES = ("cpu-mixed-load", "cpu-engine", "cpu-kernels", "cpu-pinning", "gpu-engine", "accuracy", "gateway",
           "placement-serve", "placement-sim")
# What a bench's file without a model in its name or JSON ran: the default model, or what stands in for one
# (random weights of the kernel's shape, the gateway bench's instant worker); (bench, host) before bench.
DEFAULT_MODEL: dict[str | tuple[str, str], str] = {
    "cpu-engine": "smollm2-q4_1", "cpu-mixed-load": "smollm2-q4_1", "cpu-pinning": "smollm2-q4_1",
    "placement-serve": "smollm2-q4_1", "placement-sim": "smollm2-q4_1", ("placement-sim", "h200"): "llama-3.1-8b",
    "gateway": "instant-worker", "cpu-kernels": "random-{shape}"}
MODEL = re.compile(rf"(?:^|-)(llama-3\.\d-\d+b|qwen2\.5-\d\.\db|smollm2)((?:-requantized)?)((?:-{QUANT})?)(?=-|$)",
                   re.IGNORECASE)
ISA = re.compile(r"(?:^|-)((?:avx2|avx512)(?:-amx)?)(?=-|$)")
HOST = re.compile(r"(?:^|-)((?:epyc|xeon|h100|h200)(?:-(?:zen\d|\d{3}|emr))?)(?=-|$)")
# Variant words that read otherwise once the machine is taken out of the name around them.
VARIANT_WORDS = {"off": "amx-off"}  # avx512-amx-off-xeon-207: `--cpu-amx off` on the AMX machine
DATE = re.compile(r"(?:^|-)(\d{4}-\d\d-\d\d)(?=-|$)")


def model_slug(family: str, requantized: str, quant: str) -> str:
    """`smollm2` + `-Q4_K_M` -> `smollm2-requantized-q4_k_m`: SmolLM2 ships as Q4_1, any other type is llama.cpp's
    requantization of it; a bare `smollm2` (no type) is the Q4_1 file."""
    family, quant = family.lower(), quant.lower()
    if family == "smollm2" and quant and quant != "-q4_1":
        requantized = "-requantized"
    if family == "smollm2" and not quant and not requantized:
        quant = "-q4_1"
    return family + requantized.lower() + quant


def model_from_json(doc: dict) -> str | None:
    """The model slug of the JSON's `model` (a GGUF path such as `SmolLM2-135M-Instruct.Q4_1-requantized-Q6_K.gguf`
    or `llama-3.2-1b-16l-Q4_K_M-seed0-v1.gguf`): its family and its last weight type; None where it has none."""
    name = Path(str(doc.get("model", ""))).name.lower()
    family = re.match(r"smollm2|llama-3\.\d-\d+b|qwen2\.5-\d\.\db", name)
    quants = re.findall(rf"(?<![a-z0-9]){QUANT}(?![a-z0-9])", name)
    return model_slug(family.group(0), "", "-" + quants[-1] if quants else "") if family else None


def host_from_json(doc: dict) -> str | None:
    """`epyc` or `xeon` from the JSON's `machine.cpu_model`, None where it has none."""
    cpu = str((doc.get("machine") or {}).get("cpu_model", "")).lower()
    return next((h for h in ("epyc", "xeon") if h in cpu), None)


def new_name(old: str, doc: dict, added: str) -> str:
    """`cpu-engine-llama-3.2-1b-q4_k_m-avx2-epyc-zen3-idle.json` -> `cpu-engine/DATE-avx2-epyc-zen3-llama-...-idle.json`

    doc: the file's JSON (or its plot's), {} where none; added: YYYY-MM-DD, the date when neither name nor JSON
    has one. ValueError when the name starts with no known bench.
    """
    stem, ext = old.rsplit(".", 1)
    bench = next((b for b in BENCHES if stem.startswith(b + "-") or stem == b), None)
    if bench is None:
        raise ValueError(f"{old}: the name starts with none of the benches {', '.join(BENCHES)}")
    rest = stem[len(bench):].strip("-")
    date = DATE.search(rest)
    if date:
        rest = (rest[:date.start()] + rest[date.end():]).strip("-")
    model = MODEL.search(rest)
    if model:
        rest = (rest[:model.start()] + rest[model.end():]).strip("-")
    isa = ISA.search(rest)
    if isa:
        rest = (rest[:isa.start()] + rest[isa.end():]).strip("-")
    machine = HOST.search(rest)
    if machine:
        host = machine.group(1)
        rest = rest[:machine.start()] + "-" + rest[machine.end():]
    else:
        host = host_from_json(doc) or "unrecorded"
        if host == "unrecorded":
            print(f"results_layout: {old} records no machine (epyc, xeon, h100, h200): `unrecorded`", file=sys.stderr)
    shape = "x".join(map(str, doc.get("shape", (8192, 2048))))
    slug = (model_slug(*model.groups()) if model else model_from_json(doc)
            or DEFAULT_MODEL.get((bench, host), DEFAULT_MODEL[bench]).format(shape=shape))
    variant = "-".join(VARIANT_WORDS.get(t, t) for t in rest.split("-") if t and t != shape)  # shape: in the slug
    day = date.group(1) if date else doc.get("date", added)[:10]
    return f"{bench}/{day}-{isa.group(1) + '-' if isa else ''}{host}-{slug}{'-' + variant if variant else ''}.{ext}"


def git_added(path: Path) -> str:
    out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%cs", "--", str(path)], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return out[-1] if out else subprocess.run(["date", "-u", "+%F"], capture_output=True, text=True).stdout.strip()


def plan(paths: list[Path]) -> dict[str, str]:
    """{old name: new path relative to docs/results/} for these flat files; a plot follows its JSON's date."""
    moves = {}
    for p in sorted(paths, key=lambda p: p.suffix != ".json"):
        twin = p.with_suffix(".json")
        doc = json.loads(twin.read_text()) if twin.exists() else {}
        doc = doc if isinstance(doc, dict) else {}
        if p.suffix != ".json" and twin.name in moves:
            moves[p.name] = moves[twin.name].rsplit(".", 1)[0] + p.suffix
        else:
            moves[p.name] = new_name(p.name, doc, git_added(p))
    clashes = {n for n in moves.values() if list(moves.values()).count(n) > 1 or (RESULTS / n).exists()}
    if clashes:
        raise ValueError("two files would get the same name (a rerun? keep one): " + ", ".join(sorted(clashes)))
    outside = [n for n in moves.values() if not RESULT_PATH.fullmatch(n)]
    if outside:
        raise ValueError("outside the scheme (a new bench, model or machine? extend the tables): " + ", ".join(outside))
    return moves


def rewrite_references(moves: dict[str, str]) -> list[Path]:
    """Replace `results/OLD` by `results/NEW` in the tracked docs, code and tests; the files changed."""
    files = subprocess.run(["git", "ls-files", "*.md", "*.py", "*.yml", "*.sh", "Makefile"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    pattern = re.compile(r"(?<=results/)(" + "|".join(map(re.escape, moves)) + r")(?![\w.-])")
    changed = []
    for name in files:
        path = ROOT / name
        text = path.read_text()
        new = pattern.sub(lambda m: moves[m.group(1)], text)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", type=Path,
                   help="flat files to place (default: those directly under docs/results/)")
    p.add_argument("--apply", action="store_true", help="git mv them and rewrite the references")
    args = p.parse_args(argv)
    paths = args.files or [f for f in RESULTS.iterdir() if f.is_file() and f.suffix in (".json", ".png")]
    try:
        moves = plan([f.resolve() for f in paths])
    except ValueError as e:
        print(f"results_layout: {e}", file=sys.stderr)
        return 2
    for old, new in moves.items():
        print(f"{old} -> {new}")
        if args.apply:
            (RESULTS / new).parent.mkdir(exist_ok=True)
            subprocess.run(["git", "mv", str(RESULTS / old), str(RESULTS / new)], cwd=ROOT, check=True)
    if args.apply:
        for path in rewrite_references(moves):
            print(f"rewrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
