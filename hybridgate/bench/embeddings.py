"""`hybridgate bench embeddings`: N short inputs in one embeddings request against the same prompts' prefill.

In-process: one router over one worker (the Numba runner for --kind cpu, the torch runner for gpu). Each
repeat alternates the two cases on the same prompts (distinct, each under one KV block, so the prefix
cache serves neither): `Router.embed` of the N inputs at once, and N concurrent generations of one token
(greedy) from the same ids, which is their prefill plus one sampled token each. Figures: prompt tokens/s
of each (medians) and their ratio (the models issue's target: embeddings >= 0.8x the prefill). A file
without a pooling type runs with --pooling (default last).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

WORDS = ("river", "market", "engine", "winter", "garden", "signal", "copper", "harbor", "meadow", "lantern",
         "quartz", "violin", "canyon", "pepper", "orbit", "saddle")


def prompts(tokenizer, n: int, block: int = 16) -> list[list[int]]:
    """`n` distinct short prompts (3 words and an index), each cut below one KV block of `block` tokens."""
    out = []
    for i in range(n):
        text = f"{WORDS[i % 16]} {WORDS[(i // 16) % 16]} {WORDS[(i * 7) % 16]} number {i}"
        out.append(tokenizer.encode_prompt(text)[: block - 1])
    return out


def _runner(args, model):
    if args.kind == "cpu":
        from hybridgate.workers.cpu.runner import NumbaRunner

        runner = NumbaRunner(model, kv_cache_memory="256MiB", threads=args.threads)
        runner.warm_up(progress=False)
        return runner
    import torch

    from hybridgate.workers.gpu.runner import TorchRunner

    return TorchRunner(model, torch.device(args.device) if args.device else None, kv_cache_memory="256MiB")


async def _measure(args) -> dict:
    from hybridgate.models import default_model_path, load_gguf, model_fingerprint
    from hybridgate.router import Router, RouterConfig
    from hybridgate.router.prompts import TokenIds
    from hybridgate.wire import SamplingParams
    from hybridgate.workers.inprocess import InProcessClient

    model = load_gguf(args.model or default_model_path())
    client = InProcessClient(_runner(args, model), model_fingerprint(model))
    pooling = "file" if model.config.pooling_type else args.pooling
    async with Router(model, [client], RouterConfig(pooling=pooling, prompt_processes=0)) as router:
        ids = prompts(router.tokenizer, args.inputs)
        tokens = sum(len(p) for p in ids)
        greedy = SamplingParams(temperature=0, max_tokens=1)

        async def prefill_one(p: list[int]) -> None:
            async with router.generate(TokenIds(p), greedy) as stream:
                async for _ in stream:
                    pass

        async def embed() -> None:
            await router.embed([TokenIds(p) for p in ids])

        async def prefill() -> None:
            await asyncio.gather(*(prefill_one(p) for p in ids))

        await embed()  # once each first: whatever runs first pays for nothing the other does not
        await prefill()
        times = {"embeddings": [], "prefill": []}
        for _ in range(args.repeats):
            for name, case in (("embeddings", embed), ("prefill", prefill)):
                start = time.perf_counter()
                await case()
                times[name].append(time.perf_counter() - start)
    rates = {name: tokens / statistics.median(t) for name, t in times.items()}
    return {"model": model.config.name or str(model.path.name), "kind": args.kind, "inputs": args.inputs,
            "prompt_tokens": tokens, "repeats": args.repeats, "pooling": pooling,
            "embeddings_tokens_per_s": rates["embeddings"], "prefill_tokens_per_s": rates["prefill"],
            "ratio": rates["embeddings"] / rates["prefill"]}


def run(args) -> int:
    from hybridgate.bench.machine import describe

    result = asyncio.run(_measure(args)) | {"machine": describe()}
    print(f"{result['inputs']} inputs, {result['prompt_tokens']} prompt tokens, {result['kind']} worker: embeddings "
          f"{result['embeddings_tokens_per_s']:.0f} tokens/s, the same prompts' prefill "
          f"{result['prefill_tokens_per_s']:.0f} tokens/s: {result['ratio']:.2f}x (median of {result['repeats']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
