"""Fill the CPU kernel cache for every instruction-set path this machine runs (an image build warms it once).

    python -m hybridgate.workers.cpu.warm [--model PATH]

Each path (`isa.ISAS`) is compiled in its own process, as a worker would under `HYBRIDGATE_CPU_ISA=PATH`
(Numba compiles for one target per process), into that path's `NUMBA_CACHE_DIR` folder: unset, one folder per
path and source digest under ~/.cache/hybridgate/numba (so do not set NUMBA_CACHE_DIR for this, or the paths
share one folder). The GGUF header cache (`HYBRIDGATE_CACHE_DIR`) is filled on the way. A path the CPU cannot
run (`avx512` on an AVX2 machine) is skipped and said so: a worker on a CPU that runs it compiles it at its
first start (8-14 s on 2 cores). Exit status 0 when every runnable path is warm.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def warm_one(model_path: str) -> None:
    """In this process: select the path from `HYBRIDGATE_CPU_ISA`, load the model, compile every kernel."""
    from hybridgate.workers.cpu import isa

    target = isa.select()
    from hybridgate.models import load_gguf
    from hybridgate.workers.cpu.runner import NumbaRunner

    runner = NumbaRunner(load_gguf(model_path), kv_cache_memory="16MiB", threads=1)
    runner.warm_up(progress=False)
    print(f"{target.isa}: warm in {target.cache_dir}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    args = parser.parse_args(argv)
    from hybridgate.models import default_model_path
    from hybridgate.workers.cpu import isa

    model = args.model or str(default_model_path())
    best = isa.best(isa.host_features())
    failed = 0
    for path in isa.ISAS:
        if isa.ISAS.index(path) < isa.ISAS.index(best):
            print(f"{path}: skipped (this CPU runs at most {best}); compiled at first start where it runs",
                  flush=True)
            continue
        code = f"from hybridgate.workers.cpu.warm import warm_one; warm_one({model!r})"
        done = subprocess.run([sys.executable, "-c", code], env={**os.environ, isa.ENV: path})
        failed += done.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
