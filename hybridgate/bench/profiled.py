"""The launcher of `bench gateway --profile FILE --profiler cprofile` (hybridgate.bench.profile).

`python -m hybridgate.bench.profiled OUT -- ARGS` runs `hybridgate ARGS` with a `cProfile.Profile`
that SIGUSR1 enables and SIGUSR2 disables, and writes its pstats file to OUT when the command exits.
A module of its own because it imports the CLI, which imports the bench package.
"""

from __future__ import annotations

import signal
import sys


def main(argv: list[str]) -> int:
    """`python -m hybridgate.bench.profiled OUT -- ARGS`: `hybridgate ARGS`, cProfile switched by SIGUSR1/SIGUSR2."""
    import cProfile

    from hybridgate.cli import main as hybridgate

    out, args = argv[0], argv[argv.index("--") + 1:]
    profiler = cProfile.Profile()
    signal.signal(signal.SIGUSR1, lambda signum, frame: profiler.enable())
    signal.signal(signal.SIGUSR2, lambda signum, frame: profiler.disable())
    try:
        return hybridgate(args)
    finally:
        profiler.disable()
        profiler.dump_stats(out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
