"""Sizing the KV cache: `--kv-cache-memory` as bytes or a fraction of what is free; on CUDA by default,
vLLM's rule (`kv_cache_budget`): the device's memory times `--gpu-memory-utilization`, less what the
weights, the runtime, a profiled step's activations and the decode graphs take."""

from __future__ import annotations

from hybridgate.workers.config import parse_memory  # noqa: F401 (declared with the setting it checks)


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux)."""
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def num_blocks_for(value: str | float | int | None, block_bytes: int, available: int, gpu: bool) -> int:
    budget = parse_memory(value, gpu)
    nbytes = budget * available if budget <= 1 else budget
    if value is None and not gpu:
        nbytes = min(nbytes, 0.2 * available)
    return max(1, int(nbytes // block_bytes))


def size_text(nbytes: float) -> str:
    """"1.5 GiB" from 1 GiB up (negative sizes too), else "12.0 MiB"."""
    return f"{nbytes / 2**30:.1f} GiB" if abs(nbytes) >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def budget_text(total: int, used_after_weights: int, peak_activations: int, utilization: float,
                graphs_allowance: int) -> str:
    """The parts of `kv_cache_budget`, for the start-up line and the refusal: "78.0 GiB x 0.90 utilization
    - 2.9 GiB weights and runtime - 1.1 GiB peak activations - 120.0 MiB decode graphs"."""
    return (f"{size_text(total)} x {utilization:.2f} utilization - {size_text(used_after_weights)} weights and "
            f"runtime - {size_text(peak_activations)} peak activations - {size_text(graphs_allowance)} decode graphs")


def kv_cache_budget(total: int, used_after_weights: int, peak_activations: int, utilization: float,
                    graphs_allowance: int, need: int = 1) -> int:
    """Bytes of device memory for the KV cache, by vLLM's rule (`vllm/v1/worker/gpu_worker.py`,
    `determine_available_memory`): the memory the worker may use, `total` x `utilization`, less what is
    in use once the weights have loaded (weights, CUDA context, other processes on the device), the peak
    activations of a profiled step of the largest batch, and the decode graphs' allowance.

    Args (all bytes but `utilization`, a fraction in (0, 1]):
        total: the device's memory (`torch.cuda.mem_get_info`'s second value).
        used_after_weights: total less free after the weights loaded.
        peak_activations: growth of `torch.cuda.max_memory_allocated` over a profiled step.
        graphs_allowance: what the captured decode graphs will hold (`graphs.graphs_allowance`).
        need: the fewest bytes that make a cache worth starting (one block, or one sequence's blocks).
    Raises:
        ValueError: one line with the budget's parts and the flags that change them, when the budget
            is below `need`.
    """
    budget = int(total * utilization) - used_after_weights - peak_activations - graphs_allowance
    if budget < max(need, 1):
        wanted = f" (at least {size_text(need)} needed)" if budget > 0 else ""
        raise ValueError(
            f"the KV cache would get {size_text(budget)}{wanted}: "
            f"{budget_text(total, used_after_weights, peak_activations, utilization, graphs_allowance)} "
            f"(raise --gpu-memory-utilization, lower --max-num-batched-tokens, --max-num-seqs or "
            f"--worker-max-model-len (serve: --max-model-len), or set --kv-cache-memory)")
    return budget
