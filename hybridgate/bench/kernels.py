"""`hybridgate bench kernels`: each weight type's CPU matmul against the path it replaced, per ISA path.

For every type of the kernel table (`kernel_table.AUTO`, so a type added there
appears here without an edit) and every instruction-set path asked for (each in
its own process: Numba compiles for one target per process), a random weight of
the given shape is multiplied at each batch size by the table's choice
(cpu_activations auto), by the choice of the other activation format where that
is another class or kernel (i16 for a float32 row, f32 for an int16 one), and by
the row-dequantizing `QuantMatrix`, the three alternated in each repeat; where the
row has a prompt kernel (`int8`, `amx`) and the batch reaches its prompt length,
the batch as prompt rows on it (`matmul_prompt`) too. Reported: median
milliseconds per call, the weight bytes each class reads per call over that time
(GB/s), the fast class's speedups against the other two, and the prompt kernel's
against the fast class's decode kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np


BASELINES = ("other", "row-dequantize")


def random_weight(kind: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 `[rows, row_bytes]` GGUF blocks of type `kind`: gguf's quantizer of Gaussian values for the
    types it quantizes, otherwise random bytes with fp16 scales (and mins) in [0.001, 0.05]."""
    import gguf

    from hybridgate.workers.cpu.blocks import LAYOUTS

    values = rng.standard_normal((rows, cols)).astype(np.float32)
    try:
        return np.ascontiguousarray(gguf.quants.quantize(values, kind)).view(np.uint8).reshape(rows, -1)
    except NotImplementedError:  # the K-quants: gguf-py cannot make them
        pass
    lay = LAYOUTS[kind]
    raw = rng.integers(0, 256, (rows, cols // lay.weights, lay.nbytes), dtype=np.uint8)
    scale = rng.uniform(0.001, 0.05, (rows, cols // lay.weights, 1)).astype(np.float16).view(np.uint8)
    raw[:, :, lay.d_at : lay.d_at + 2] = scale
    if lay.has_min:  # the K-quants' dmin sits beside d
        raw[:, :, lay.d_at + 2 : lay.d_at + 4] = scale
    return raw.reshape(rows, -1)


def table_types(names: list[str] | None = None) -> list[int]:
    """The GGUF type ids of this path's kernel table, in its order (those named in `names` only, if given).
    Raises ValueError naming --types for a type the table lacks."""
    from hybridgate.workers.cpu import kernel_table, quant
    from hybridgate.workers.cpu.blocks import LAYOUTS

    ids = {layout.name: kind for kind, layout in LAYOUTS.items()}
    table = list(kernel_table.AUTO[quant.PATH])
    unknown = sorted(set(names or ()) - set(table))
    if unknown:
        raise ValueError(f"--types: {', '.join(unknown)} not in the kernel table (it has {', '.join(table)})")
    return [ids[name] for name in table if names is None or name in names]


def _time(matrices: dict, x: np.ndarray, repeats: int) -> dict[str, float]:
    """Median seconds per matmul of each matrix (or callable of x), the matrices alternated within each repeat."""
    calls = {name: m if callable(m) else m.matmul for name, m in matrices.items()}
    for call in calls.values():
        call(x)  # compile or load, and touch the weights once
    times: dict[str, list[float]] = {name: [] for name in matrices}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call(x)
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def measure(shape: tuple[int, int], batches: list[int], repeats: int, seed: int = 0,
            types: list[str] | None = None) -> list[dict]:
    """The rows of the table for this process's path (see the module docstring)."""
    from hybridgate.workers.cpu import isa, kernel_table, quant
    from hybridgate.workers.cpu.blocks import LAYOUTS

    rng = np.random.default_rng(seed)
    rows, cols = shape
    out = []
    for kind in table_types(types):
        data = random_weight(kind, rows, cols, rng)
        matrices = {"fast": quant.quant_matrix("w", kind, data, shape)}
        name = LAYOUTS[kind].name
        fast, other = (kernel_table.choose(name, fmt, quant.PATH) for fmt in ("auto", "f32", "i16")
                       if fmt == "auto" or not kernel_table.choose(name, "auto", quant.PATH).decode.startswith(fmt))
        if (other.matrix, other.kernel) != (fast.matrix, fast.kernel) and other.matrix != "QuantMatrix":
            matrices["other"] = quant.quant_matrix("w", kind, data, shape, other.decode.split("/")[0])
        matrices["row-dequantize"] = quant.QuantMatrix("w", kind, data, shape)
        for batch in batches:
            x = rng.standard_normal((batch, cols)).astype(np.float32)
            timed = dict(matrices)
            if fast.prompt_kernel and batch >= fast.prompt_rows:
                every = np.arange(batch, dtype=np.int64)
                timed["prompt"] = lambda x, m=matrices["fast"], every=every: m.matmul_prompt(x, every)
            seconds = _time(timed, x, repeats if batch < 16 else max(3, repeats // 3))
            row = {"isa": isa.selected().isa, "type": LAYOUTS[kind].name, "rows": rows, "cols": cols, "batch": batch}
            if "prompt" in seconds:
                row["prompt"] = {"kernel": fast.prompt_kernel, "activations": fast.prompt, "ms": seconds["prompt"] * 1e3,
                                 "speedup_vs_decode_kernel": seconds["fast"] / seconds["prompt"]}
            if "other" in matrices:
                row["other_is"] = "not chosen"
            for name, m in matrices.items():
                row[name] = {"class": type(m).__name__, "activations": m.activations, "ms": seconds[name] * 1e3,
                             "weight_bytes": m.nbytes, "gb_s": m.nbytes / seconds[name] / 1e9}
            for name in BASELINES:
                if name in row:
                    row[f"speedup_vs_{name}"] = seconds[name] / seconds["fast"]
            out.append(row)
    return out


def _format(rows: list[dict]) -> str:
    head = (f"{'path':7} {'type':5} {'batch':>5}  {'fast class':12} {'act':4} {'ms':>8} {'GB/s':>6}  "
            f"{'other class':12} {'(role)':12} {'ms':>8} {'x':>5}  {'row-dequant ms':>14} {'x':>6}  {'prompt ms':>9} {'x':>5}")
    lines = [head]
    for r in rows:
        f, o, d = r["fast"], r.get("other"), r["row-dequantize"]
        other = (f"{o['class']:12} {'(' + r['other_is'] + ')':12} {o['ms']:8.3f} {r['speedup_vs_other']:5.2f}" if o
                 else f"{'-':12} {'':12} {'':8} {'':5}")
        lines.append(f"{r['isa']:7} {r['type']:5} {r['batch']:5d}  {f['class']:12} {f['activations']:4} {f['ms']:8.3f} "
                     f"{f['gb_s']:6.1f}  {other}  {d['ms']:14.3f} {r['speedup_vs_row-dequantize']:6.1f}"
                     + (f"  {r['prompt']['ms']:9.3f} {r['prompt']['speedup_vs_decode_kernel']:5.2f}" if "prompt" in r else ""))
    return "\n".join(lines)


def _child_command(path: str, args) -> list[str]:
    return [sys.executable, "-m", "hybridgate.bench.kernels", path, f"{args.shape[0]}x{args.shape[1]}",
            ",".join(map(str, args.batch)), str(args.repeats), str(args.threads), ",".join(args.types or [])]


def run(args) -> int:
    """Every path asked for (default: all this CPU runs), each in a child process; print the table and
    write `--json`."""
    from hybridgate.workers.cpu import isa, kernel_table  # data only: no Numba before the child selects its path

    runnable = isa.ISAS[isa.ISAS.index(isa.best(isa.host_features())):]
    paths = args.isa or list(runnable)
    for path in paths:
        if path not in runnable:
            raise ValueError(f"--isa: this CPU cannot run {path} (it runs {', '.join(runnable)})")
    known = {name for table in kernel_table.AUTO.values() for name in table}
    if set(args.types or ()) - known:
        raise ValueError(f"--types: {', '.join(sorted(set(args.types) - known))} is no weight type of the kernel table "
                         f"({', '.join(sorted(known))})")
    rows = []
    for path in paths:
        env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", isa.ENV)}
        proc = subprocess.run(_child_command(path, args), capture_output=True, text=True, env=env)
        if proc.returncode:
            sys.stderr.write(proc.stderr[-4000:])
            return proc.returncode
        rows += json.loads(proc.stdout.strip().splitlines()[-1])
    from hybridgate.bench.machine import summary

    print(summary())
    print(_format(rows))
    if args.json:
        from hybridgate.bench.machine import describe

        doc = {"benchmark": "kernels", "command": " ".join(["hybridgate", *sys.argv[1:]]), "machine": describe(),
               "shape": list(args.shape),
               "threads": args.threads, "repeats": args.repeats, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


def _child_main(argv: list[str]) -> None:
    path, shape, batches, repeats, threads, types = argv
    from hybridgate.workers.cpu import isa

    isa.select(path)
    import numba

    numba.set_num_threads(int(threads))
    rows, cols = (int(v) for v in shape.split("x"))
    print(json.dumps(measure((rows, cols), [int(b) for b in batches.split(",")], int(repeats),
                             types=types.split(",") if types else None)))


def add_parser(sub) -> None:
    """`hybridgate bench kernels`' flags (the parser lives beside the bench: no Numba is imported here)."""
    from hybridgate.config import bounded

    p = sub.add_parser("kernels", help="each weight type's CPU matmul per ISA path, batch 1 and 16, against the "
                                       "path it replaced and the row-dequantizing one")
    p.add_argument("--isa", type=lambda v: v.split(","), default=None,
                   help="paths, comma-separated, of avx512, avx2, generic (default: every path this CPU runs)")
    p.add_argument("--shape", type=lambda v: tuple(int(n) for n in v.split("x")), default=(8192, 2048),
                   metavar="ROWSxCOLS", help="the weight's shape (default 8192x2048: a 1B model's FFN gate)")
    p.add_argument("--batch", type=bounded(int, 1, many=True), default=[1, 16],
                   help="activation rows, comma-separated (default 1,16)")
    p.add_argument("--repeats", type=bounded(int, 1), default=15,
                   help="calls per case, alternated between the kernels; medians are reported (default 15)")
    p.add_argument("--threads", type=bounded(int, 1), default=1, help="kernel threads (default 1)")
    p.add_argument("--types", type=lambda v: v.split(","), default=None, metavar="TYPES",
                   help="weight types, comma-separated, e.g. Q4_K,Q6_K (default: every type of the path's kernel table)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures to this JSON file")
    p.set_defaults(func=run)


if __name__ == "__main__":
    _child_main(sys.argv[1:])
