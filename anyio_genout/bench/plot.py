"""The PNG: delivered tokens/s and client CPU per token against concurrency.

One line per backend of ours, one for the floor and one per vLLM event loop (matplotlib with
the Agg backend; nothing is shown on screen).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .spec import Result

__all__ = ["plot"]

_STYLE = {
    "ours/asyncio": ("tab:blue", "o", "-"),
    "ours/uvloop": ("tab:green", "s", "-"),
    "ours/trio": ("tab:purple", "^", "-"),
    "floor": ("black", "x", "--"),
    "vLLM/asyncio": ("tab:red", "D", ":"),
    "vLLM/uvloop": ("tab:orange", "v", ":"),
}


def _series(results: Sequence[Result]) -> dict[str, list[tuple[int, float, float]]]:
    lines: dict[str, list[tuple[int, float, float]]] = {}
    for r in results:
        if r.get("workload") != "throughput" or "error" in r or r.get("profile"):
            continue
        if r.get("impl") == "ours":
            label = f"ours/{r['backend']}"
        elif r.get("impl") == "vllm":
            label = f"vLLM/{r.get('loop') or r['backend']}"
        else:
            label = "floor"
        tps, cpu = r.get("tokens_per_s"), r.get("cpu_us_per_token")
        if isinstance(tps, int | float) and isinstance(cpu, int | float):
            lines.setdefault(label, []).append((int(r["concurrency"]), float(tps), float(cpu)))
    return {label: sorted(points) for label, points in lines.items()}


def plot(results: Sequence[Result], vllm: Sequence[Result] | None, path: str,
         title: str = "") -> str | None:
    """Write the plot to ``path``; returns the path, or None if there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = _series([*results, *(vllm or [])])
    if not lines:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    ticks: set[int] = set()
    for label, points in sorted(lines.items()):
        color, marker, style = _STYLE.get(label, ("gray", ".", "-"))
        xs = [p[0] for p in points]
        ticks.update(xs)
        left.plot(xs, [p[1] / 1000 for p in points], marker=marker, linestyle=style,
                  color=color, label=label)
        right.plot(xs, [p[2] for p in points], marker=marker, linestyle=style, color=color,
                   label=label)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks))
        ax.set_xticklabels([str(t) for t in sorted(ticks)])
        ax.set_xlabel("concurrent streams")
        ax.grid(True, which="both", alpha=0.3)
    left.set_yscale("log")
    left.set_ylabel("delivered tokens/s (thousands, log)")
    left.set_title("throughput")
    right.set_yscale("log")
    right.set_ylabel("client CPU per token (us, log)")
    right.set_title("client cost")
    right.legend(fontsize="small")
    if title:
        fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return str(target)
