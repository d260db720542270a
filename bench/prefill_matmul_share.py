"""How much of a prompt's prefill on the CPU worker is weight matmuls, by matrix class.

    .venv/bin/python bench/prefill_matmul_share.py --model FILE [--tokens 512] [--threads N] [--repeats 3]

One prompt of `--tokens` random ids through the Numba runner's engine (chunks of the whole token
budget, as `hybridgate bench engine`'s prefill), every weight matrix's `matmul` timed by wall clock;
prints, per repeat, the prefill's time, tokens/s and each matrix class's milliseconds. A one-off
measurement (what a faster prompt GEMM could gain, by Amdahl), not a test. `hybridgate bench model
--shape NAME --quant MIX` prints the path of a bench file to pass.
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="GGUF file")
    parser.add_argument("--tokens", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--repeats", type=int, default=3, help="prefills, each printed (default 3)")
    args = parser.parse_args()
    from hybridgate.models import load_gguf
    from hybridgate.wire import AddRequest, SamplingParams
    from hybridgate.workers.cpu.runner import NumbaRunner
    from hybridgate.workers.engine import EngineCore
    from hybridgate.workers.scheduler import SchedulerConfig

    runner = NumbaRunner(load_gguf(args.model), "1GiB", threads=args.threads)
    runner.warm_up()
    spent: collections.Counter[str] = collections.Counter()

    def timed(matrix):
        inner, name = matrix.matmul, type(matrix).__name__

        def matmul(*a, **k):
            start = time.perf_counter()
            out = inner(*a, **k)
            spent[name] += time.perf_counter() - start
            return out

        matrix.matmul = matmul

    for layer in runner.model.layers:
        for part in ("qkv", "wo", "gate_up", "down"):
            timed(getattr(layer, part))
    timed(runner.model.lm_head)
    rng = np.random.default_rng(0)
    for _ in range(args.repeats):
        spent.clear()
        engine = EngineCore(runner, SchedulerConfig(max_num_batched_tokens=max(8192, args.tokens)), "bench", False)
        ids = rng.integers(100, min(1000, runner.vocab_size), args.tokens).tolist()
        engine.add(AddRequest("p", ids, SamplingParams(temperature=0, ignore_eos=True), 0, 1, -1))
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
        total = time.perf_counter() - start
        matmuls = sum(spent.values())
        shares = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in spent.most_common())
        print(f"prefill {args.tokens}: {total * 1e3:.0f} ms ({args.tokens / total:.1f} tok/s); weight matmuls "
              f"{matmuls * 1e3:.0f} ms ({matmuls / total:.0%}): {shares}", flush=True)


if __name__ == "__main__":
    main()
