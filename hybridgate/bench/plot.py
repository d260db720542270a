"""The PNG of `bench serve` and `bench sim`: goodput and p99 TTFT against offered load, one line per
layout and policy (matplotlib, headless Agg backend)."""

from __future__ import annotations


def plot_report(report: dict, path: str, title: str = "") -> None:
    """Two panels over the sweep (or, without one, the capacity runs) of every layout × policy in `report`.
    Raises ValueError naming --plot when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot: needs matplotlib (pip install 'matplotlib>=3.8')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    layouts = report["layouts"]
    for layout, entry in layouts.items():
        for policy, r in entry["policies"].items():
            runs = sorted(r["sweep"] or r["capacity_runs"], key=lambda x: x["rate"])
            if not runs:
                continue
            name = policy if len(layouts) == 1 else f"{policy} ({layout})"
            rates = [x["rate"] for x in runs]
            left.plot(rates, [x["goodput"] for x in runs], marker="o", label=name)
            right.plot(rates, [x["ttft_p99"] if x["ttft_p99"] is not None else float("nan") for x in runs],
                       marker="o", label=name)
    left.set(xlabel="offered load (requests/s)", ylabel="goodput (requests/s meeting both SLOs)")
    right.set(xlabel="offered load (requests/s)", ylabel="p99 TTFT (s)", yscale="log")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
