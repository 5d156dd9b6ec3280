"""PNG plots of the evaluation and benchmark results (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from .atomic import replaced  # noqa: E402
from .bench import LongRow  # noqa: E402
from .evaluation import PplResult  # noqa: E402
from .longdoc import LongdocTrial, mean_scores  # noqa: E402


def save(fig, path: Path) -> None:
    """The figure as a PNG at ``path``, whole or as it was (``atomic.replaced``)."""
    with replaced(path) as f:
        fig.savefig(f, format="png", dpi=110)


def plot_ppl(results: dict[str, PplResult], tokens: int, path: Path, title: str = "") -> Path:
    """Perplexity against budget (as compression: tokens / cells), one line per configuration (labels
    are "<name>@<cells>"), the full cache dashed."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_policy: dict[str, list[tuple[float, float]]] = {}
    for label, r in results.items():
        if label != "full":
            by_policy.setdefault(label.split("@")[0], []).append((r.budget.compression(tokens), r.ppl))
    for name, points in sorted(by_policy.items()):
        points.sort()
        ax.plot(
            [x for x, _ in points],
            [y for _, y in points],
            marker="o",
            label=name,
            linewidth=2.5 if name == "ahakv" else 1.2,
        )
    ax.axhline(results["full"].ppl, color="black", linestyle="--", label="full cache")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("compression (tokens / cells)")
    ax.set_ylabel("streaming perplexity")
    ax.set_title(title or f"perplexity vs budget, {tokens} tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)
    return path


def plot_long_run(rows: list[LongRow], path: Path, title: str = "") -> Path:
    """KV memory and decode tokens/s against context length, full cache vs budget."""
    fig, (mem, tps) = plt.subplots(1, 2, figsize=(10, 4))
    for label in dict.fromkeys(r.label for r in rows):
        run = [r for r in rows if r.label == label]
        x = [r.context for r in run]
        (line,) = mem.plot(x, [r.kv_bytes_used / 2**20 for r in run], marker="o", label=f"{label} (in use)")
        colour = line.get_color()  # one colour per run in both panels
        allocated = [r.kv_bytes_allocated / 2**20 for r in run]
        mem.plot(x, allocated, linestyle=":", color=colour, label=f"{label} (allocated)")
        tps.plot(x, [r.decode_tps for r in run], marker="o", color=colour, label=label)
    for ax in (mem, tps):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    mem.set_ylabel("KV cache (MiB)")
    tps.set_ylabel("decode tokens/s")
    fig.suptitle(title or "long run: full cache vs budget")
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)
    return path


def plot_longdoc(trials: list[LongdocTrial], path: Path, title: str = "") -> Path:
    """A heatmap of the mean score: one row per configuration (the full cache on top), one column per
    task x prompt length, each cell annotated."""
    labels, columns, means = mean_scores(trials)
    grid = np.full((len(labels), len(columns)), np.nan)
    for i, label in enumerate(labels):
        for j, (task, n) in enumerate(columns):
            grid[i, j] = means.get((label, task, n), np.nan)
    # wide enough for the row labels (8 pt: ~0.07 in a character), the cells, the colour bar and the title: at one
    # column the labels and the title were cut ("otive" for "...+query adaptive")
    title = title or "long documents: mean score"
    width = max(0.07 * max(map(len, labels)) + 0.9 * len(columns) + 1.8, 0.085 * len(title) + 0.6)
    fig, ax = plt.subplots(figsize=(width, 1.2 + 0.4 * len(labels)))
    im = ax.imshow(grid, cmap="viridis", vmin=0, vmax=1, aspect="auto")
    for i in range(len(labels)):
        for j in range(len(columns)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.0%}", ha="center", va="center", fontsize=8,
                        color="black" if grid[i, j] > 0.6 else "white")  # fmt: skip
    ax.set_xticks(range(len(columns)), [f"{task}\n{n}" for task, n in columns], fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    fig.colorbar(im, ax=ax, label="mean score")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)
    return path


QUANT_MARKERS = {"q8_0": "s", "q5_0": "^", "q4_0": "v"}  # a frontier line's marker by its KV type (f16: "o")
# with several policies in one frontier, a layout's line style and marker (its colour is the policy's)
LAYOUT_STYLES = {"shared": ("--", "x"), "natural": ("-", "o"), "uniform": (":", "s"), "pyramid": ("-.", "^"),
                 "adaptive": ("-", "D")}  # fmt: skip


def plot_frontier(rows: list[dict], full_ppl: float, trimmed_bytes: int, path: Path, title: str = "") -> Path:
    """Perplexity and mean KL from the full cache against allocated KV bytes (benchmarks/layer_budgets.py):
    one line per policy and layer allocation (rows with "policy", "layer_budgets", "budget_bytes", "ppl",
    "kl"), the full cache's perplexity and llama.cpp's trimmed cache's bytes as reference lines. Rows of one policy:
    a colour per layout, a layout named "shared..." dashed, one ending in a quantized KV type marked by it; of
    several: a colour per policy and a line style and marker per layout (``LAYOUT_STYLES``)."""
    one_policy = len({r["policy"] for r in rows}) == 1  # then each layout its own colour, else each policy
    fig, (ppl, kl) = plt.subplots(1, 2, figsize=(11 if one_policy else 14, 4.5))
    colours = {}
    for policy, layers in dict.fromkeys((r["policy"], r["layer_budgets"]) for r in rows):
        hue = layers if one_policy else policy
        run = sorted((r for r in rows if (r["policy"], r["layer_budgets"]) == (policy, layers)),
                     key=lambda r: r["budget_bytes"])  # fmt: skip
        mib = [r["budget_bytes"] / 2**20 for r in run]
        if one_policy:
            marker = next((m for kv, m in QUANT_MARKERS.items() if layers.endswith(kv)), "o")
            linestyle = "--" if layers.startswith("shared") else "-"
        else:
            linestyle, marker = LAYOUT_STYLES.get(layers.split()[0], ("-", "o"))
        style = {"linestyle": linestyle, "marker": marker, "linewidth": 2.5 if policy == "ahakv" else 1.2}
        if hue in colours:
            style["color"] = colours[hue]
        (line,) = ppl.plot(mib, [r["ppl"] for r in run], label=f"{policy} {layers}", **style)
        colours[hue] = line.get_color()
        kl.plot(mib, [r["kl"] for r in run], **(style | {"color": colours[hue]}))
    ppl.axhline(full_ppl, color="black", linestyle=":", label="full cache")
    for ax, name in ((ppl, "streaming perplexity"), (kl, "mean KL from the full cache (nats)")):
        ax.axvline(trimmed_bytes / 2**20, color="grey", linestyle=":", label="llama.cpp trimmed cache")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("allocated KV (MiB)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    kl.set_yscale("log")
    fig.suptitle(title or "perplexity and KL against allocated KV bytes")
    if one_policy:
        ppl.legend(fontsize=7, ncol=2)
        fig.tight_layout()
    else:  # many lines: the legend to the right of both plots, not over them
        fig.legend(*ppl.get_legend_handles_labels(), loc="center right", fontsize=7)
        fig.tight_layout(rect=(0, 0, 0.8, 1))
    save(fig, path)
    plt.close(fig)
    return path
