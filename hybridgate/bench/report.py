"""`hybridgate bench report`: the benchmark pages' tables, rendered from the results JSON.

Each `Table` says which results files (a glob under docs/results/) feed a
generated block of which page, and how each column reads its value from a
file's JSON (a dotted path, `*` standing for a record's only key). A block sits
between `<!-- begin generated: bench report NAME -->` and
`<!-- end generated -->`; the hand-written prose around it is kept as it is.
`--check` renders without writing and fails when a page differs, for CI.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BEGIN = "<!-- begin generated: bench report {name} -->"
# A results file's path under docs/results/: <bench>/<date>-<machine>-<model>[-<variant>].json, its plot beside it
# as .png. The machine: the ISA path where the run forced or names one, then the host (epyc-zen3, xeon-207, a GPU's
# device name); the model: a model file's family, its block count where a bench file keeps fewer (`-8l`) and its
# weight type, or what a bench runs instead (random weights of a kernel's shape, the gateway bench's instant
# worker). scripts/results_layout.py moves flat names into it.
QUANT = r"(?:q\d_k(?:_[sml])?|q\d_\d|f16|bf16|f32)"
RESULT_PATH = re.compile(
    r"(?P<bench>accuracy|cpu-engine|cpu-kernels|cpu-mixed-load|cpu-pinning|embeddings|gateway|gpu-engine|placement-serve"
    r"|placement-sim)/(?P<date>20\d\d-[01]\d-[0-3]\d)-(?P<machine>(?:(?:avx2|avx512)(?:-amx)?-)?[a-z][a-z0-9-]*?)"
    rf"-(?P<model>(?:smollm2(?:-requantized)?|llama-\d\.\d-\d+b|qwen2\.5-\d\.\db|qwen3-\d+b-a\d+b)(?:-\d+l)?(?:-{QUANT})?"
    r"|random-\d+x\d+"
    r"|instant-worker)(?:-(?P<variant>[a-z0-9][a-z0-9.-]*))?\.(?:json|png)")
END = "<!-- end generated -->"
MISSING = "—"


def ratio(v: float) -> str:
    return f"{v:.2f}×"


def fixed(digits: int) -> Callable[[Any], str]:
    return lambda v: f"{v:.{digits}f}"


def percent(v: float) -> str:
    return f"{100 * v:.1f}%"


def sci(v: float) -> str:
    return f"{v:.1e}"


def basename(v: str) -> str:
    return os.path.basename(v)


def seconds_from_ms(v: float) -> str:
    return f"{v / 1000:.1f}"


def ms_from_seconds(v: float) -> str:
    return f"{v * 1000:.1f}"


def yes_no(v: bool) -> str:
    return "yes" if v else "no"


def on_off(v: bool) -> str:
    return "on" if v else "off"


@dataclass(frozen=True)
class Column:
    """One column: its header, where its value sits in the JSON, and how the value is written."""

    header: str
    path: str  # dotted keys into the record, e.g. "decode.1.ratio"; "*" matches a dict's only key
    fmt: Callable[[Any], str] = str


@dataclass(frozen=True)
class Table:
    """One generated block: results files -> rows of a table on a page.

    With `rows` unset each file is one row, led by a link to the file. With
    `rows` set (a dotted path to a list of records, or to a dict whose values
    are the records) each file gets a caption line naming it, its machine and
    its command, and each record is a row.
    `keep` leaves out files without that path (another bench sharing the prefix).
    `pending` is rendered while no file matches: why none exists yet and what writes one (figures taken only
    on a machine the project borrows); a table without it must read some file.
    """

    name: str
    page: str  # relative to docs/
    pattern: str  # glob relative to docs/results/, whose files are <bench>/<date>-<machine>-<model>[-<variant>].json
    columns: tuple[Column, ...]
    rows: str | None = None
    keep: str | None = None
    pending: str = ""


MACHINE = (Column("CPU", "machine.cpu_model"), Column("load", "machine.loadavg_1m", fixed(2)))

POLICY_COLUMNS = (
    Column("policy", "policy"),
    Column("capacity req/s", "capacity", fixed(3)),
    Column("at rate req/s", "headline_rate", fixed(3)),
    Column("SLO attainment", "attainment", percent),
    Column("best goodput req/s", "goodput", fixed(3)),
    Column("TTFT p99 s", "ttft_p99", fixed(2)),
    Column("TPOT p99 ms", "tpot_p99", ms_from_seconds),
)

TABLES: tuple[Table, ...] = (
    Table("cpu-engine", "benchmarks/cpu-worker.md", "cpu-engine/*.json", (
        Column("model", "model", basename),
        *MACHINE,
        Column("ISA", "cpu_isa"),
        Column("AMX", "cpu_amx", yes_no),
        Column("threads", "threads"),
        Column("baseline", "baseline"),
        Column("decode c=1 tok/s", "decode.1.hybridgate_tokens_per_s", fixed(1)),
        Column("decode c=1", "decode.1.ratio", ratio),
        Column("decode c=16", "decode.16.ratio", ratio),
        Column("prefill", "prefill.*.ratio", ratio),
        Column("TTFT cached/cold", "ttft.cached_over_cold", fixed(2)),
        Column("step / bandwidth bound", "step_over_bandwidth_bound", fixed(2)),
    )),
    Table("accuracy", "benchmarks/cpu-worker.md", "accuracy/*.json", (
        Column("model", "model", basename),
        *MACHINE,
        Column("ISA", "cpu_isa"),
        Column("activations", "cpu_activations"),
        Column("positions", "positions"),
        Column("top-1 agreement", "top1_agreement", percent),
        Column("KL mean", "kl_mean", sci),
        Column("KL p99", "kl_p99", sci),
        Column("llama.cpp top-1", "llama_cpp.top1_agreement", percent),
        Column("llama.cpp KL mean", "llama_cpp.kl_mean", sci),
    ), keep="top1_agreement"),
    Table("embeddings", "benchmarks/cpu-worker.md", "embeddings/*.json", (
        Column("model", "model"),
        *MACHINE,
        Column("worker", "kind"),
        Column("inputs", "inputs"),
        Column("prompt tokens", "prompt_tokens"),
        Column("embeddings tok/s", "embeddings_tokens_per_s", fixed(1)),
        Column("prefill tok/s", "prefill_tokens_per_s", fixed(1)),
        Column("ratio", "ratio", ratio),
    )),
    Table("cpu-mixed-load", "benchmarks/cpu-worker.md", "cpu-mixed-load/*.json", (
        Column("CPU", "machine_at_start.cpu_model"),
        Column("load", "machine_at_start.loadavg_1m", fixed(2)),
        Column("ISA", "cpu_isa"),
        Column("busy core", "busy_core", yes_no),
        Column("min chunk", "scheduler.min_prefill_chunk"),
        Column("gap p50 alone ms", "mixed_load.unloaded.p50_ms", fixed(1)),
        Column("gap p99 ms", "mixed_load.budgeted.p99_ms", fixed(1)),
        Column("target p99 ms", "mixed_load.target_p99_ms", fixed(1)),
        Column("meets it", "mixed_load.meets_target", yes_no),
        Column("long prompt TTFT s", "mixed_load.budgeted.long_prompt_ttft_ms", seconds_from_ms),
        Column("without the budget s", "mixed_load.budget_off.long_prompt_ttft_ms", seconds_from_ms),
    )),
    Table("cpu-kernels", "benchmarks/cpu-worker.md", "cpu-kernels/*.json", (
        Column("ISA", "isa"),
        Column("type", "type"),
        Column("batch", "batch"),
        Column("kernel", "fast.class"),
        Column("activations", "fast.activations"),
        Column("ms", "fast.ms", fixed(3)),
        Column("GB/s", "fast.gb_s", fixed(1)),
        Column("vs the path it replaced", "speedup_vs_other", ratio),
        Column("vs row-dequantize", "speedup_vs_row-dequantize", ratio),
        Column("prompt kernel", "prompt.kernel"),
        Column("prompt kernel ms", "prompt.ms", fixed(3)),
        Column("prompt vs decode kernel", "prompt.speedup_vs_decode_kernel", ratio),
    ), rows="rows"),
    Table("gateway", "benchmarks/gateway.md", "gateway/*.json", (
        Column("door", "protocol"),
        Column("streams", "concurrency"),
        Column("coalescing", "coalesce", on_off),
        Column("tokens/s", "tokens_per_s", fixed(0)),
        Column("gateway CPU µs/token", "gateway_cpu_us_per_token", fixed(1)),
        Column("messages/token", "messages_per_token", fixed(2)),
        Column("TTFT p50 ms", "ttft_ms.p50", fixed(1)),
        Column("ITL p50 ms", "itl_ms.p50", fixed(2)),
        Column("ITL p99 ms", "itl_ms.p99", fixed(1)),
        Column("errors", "errors"),
    ), rows="results"),
    Table("gateway-grpc-floor", "benchmarks/gateway.md", "gateway/*.json", (
        Column("streams", "concurrency"),
        Column("coalescing", "coalesce", on_off),
        Column("runs", "runs"),
        Column("gRPC floor CPU µs/message", "floor_cpu_us_per_message", fixed(1)),
        Column("gateway CPU µs/message", "gateway_cpu_us_per_message", fixed(1)),
        Column("less floor µs/message", "gateway_less_floor_us_per_message", fixed(1)),
        Column("messages/token", "messages_per_token", fixed(2)),
        Column("gateway CPU µs/token", "gateway_cpu_us_per_token", fixed(1)),
        Column("gateway less floor µs", "gateway_less_floor_us", fixed(1)),
    ), rows="grpc_floor.summary", keep="grpc_floor.summary"),
    Table("gpu-engine", "benchmarks/gpu-worker.md", "gpu-engine/*.json", (
        Column("shape", "shape"),
        Column("device", "device"),
        Column("decode step ms", "decode_step.ms", fixed(2)),
        Column("step / (weights + KV) bound", "decode_step.over_bound", ratio),
        Column("c=1 tok/s", "decode.1.hybridgate_tokens_per_s", fixed(0)),
        Column("c=64 tok/s", "decode.64.hybridgate_tokens_per_s", fixed(0)),
        Column("c=64 vs transformers", "decode.64.ratio", ratio),
        Column("c=256 vs transformers", "decode.256.ratio", ratio),
        Column("prefill 8k of matmul rate", "prefill.8192.fraction_of_matmul_rate", percent),
        Column("mixed / (decode + chunk)", "mixed_step.over_sum", ratio),
        Column("hand-off hidden", "handoff.hidden_fraction", percent),
    ), pending="No run recorded yet: `make gpu-check` on a lent GPU writes `gpu-engine/DATE-DEVICE-SHAPE.json`."),
    Table("placement-serve", "benchmarks/placement.md", "placement-serve/*.json", POLICY_COLUMNS, rows="policies"),
    Table("placement-sim", "benchmarks/placement.md", "placement-sim/*-h200-*.json", POLICY_COLUMNS, rows="policies"),
)


def lookup(record: Any, path: str) -> Any:
    """The value at a dotted path, or None where a key is missing (or "*" meets more than one key)."""
    for key in path.split("."):
        if not isinstance(record, dict):
            return None
        if key == "*":
            if len(record) != 1:
                return None
            key = next(iter(record))
        record = record.get(key)
    return record


def cell(record: Any, column: Column) -> str:
    value = lookup(record, column.path)
    text = MISSING if value is None else column.fmt(value)
    return text.replace("|", "\\|")


def markdown_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def file_link(table: Table, path: Path) -> str:
    # Pages sit at docs/<page>; results at docs/results/<bench>/ (path is relative to docs/results/).
    up = "../" * table.page.count("/")
    return f"[`{path.name}`]({up}results/{path.as_posix()})"


def caption(table: Table, path: Path, doc: dict) -> str:
    """The file's link, then what of its machine, load and command it records (a simulation records none)."""
    load = lookup(doc, "machine.loadavg_1m")
    facts = [f for f in (lookup(doc, "machine.cpu_model"), lookup(doc, "machine.isa"),
                         None if load is None else f"load {load:.2f}") if f]
    text = file_link(table, path) + (": " + ", ".join(facts) if facts else "")
    command = doc.get("command")
    return text + (f"; `{command}`" if command else "")


def render_table(table: Table, files: list[tuple[Path, dict]]) -> str:
    """The block's Markdown for these (path, parsed JSON) pairs, in the order given."""
    headers = [c.header for c in table.columns]
    kept = [(p, d) for p, d in files if table.keep is None or lookup(d, table.keep) is not None]
    if not kept and table.pending:
        return table.pending
    if table.rows is None:
        rows = [[file_link(table, p)] + [cell(d, c) for c in table.columns] for p, d in kept]
        return "\n".join(markdown_table(["file"] + headers, rows))
    parts = []
    for path, doc in kept:
        records = lookup(doc, table.rows) or []
        records = list(records.values()) if isinstance(records, dict) else records
        rows = [[cell(r, c) for c in table.columns] for r in records]
        parts.append("\n".join([caption(table, path, doc), ""] + markdown_table(headers, rows)))
    return "\n\n".join(parts)


def load_results(results: Path, pattern: str) -> list[tuple[Path, dict]]:
    """(path relative to results, parsed JSON) of each file the glob matches, by path: by date within a bench."""
    return [(p.relative_to(results), json.loads(p.read_text())) for p in sorted(results.glob(pattern))]


def replace_block(page: str, name: str, body: str, where: str = "page") -> str:
    """The page with the text between NAME's markers replaced by body; ValueError when the markers are missing."""
    begin = BEGIN.format(name=name)
    start = page.find(begin)
    end = page.find(END, start + len(begin)) if start >= 0 else -1
    if start < 0 or end < 0:
        raise ValueError(f"{where} has no `{begin}` ... `{END}` block for the {name} table")
    return page[:start + len(begin)] + "\n" + body + "\n" + page[end:]


def render_pages(docs: Path, tables: tuple[Table, ...] | None = None) -> dict[str, str]:
    """Every page that holds a generated block, as it would be rendered: {page relative to docs/: text}."""
    pages: dict[str, str] = {}
    for table in TABLES if tables is None else tables:
        text = pages.get(table.page) or (docs / table.page).read_text()
        body = render_table(table, load_results(docs / "results", table.pattern))
        pages[table.page] = replace_block(text, table.name, body, where=f"docs/{table.page}")
    return pages


def run(args) -> int:
    docs = Path(args.docs)
    try:
        pages = render_pages(docs)
    except ValueError as e:
        print(f"hybridgate bench report: {e}", file=sys.stderr)
        return 2
    stale = []
    for page, text in pages.items():
        target = docs / page
        if target.read_text() == text:
            continue
        stale.append(page)
        if not args.check:
            target.write_text(text)
    if args.check and stale:
        print("stale benchmark pages (run `hybridgate bench report`): " + ", ".join(stale), file=sys.stderr)
        return 1
    print(("rewrote " + ", ".join(stale)) if stale else "benchmark pages are current")
    return 0
