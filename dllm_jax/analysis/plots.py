"""matplotlib views of a PatternReport: one heat map (layers x steps, mean over batch and heads) per
metric. matplotlib is an optional dependency (`pip install dllm-jax[analysis]`)."""

from __future__ import annotations

import warnings

import numpy as np


def _heatmap(values, title: str, ax=None, vmin=None, vmax=None):
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install 'dllm-jax[analysis]'") from e
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4))
    with warnings.catch_warnings():  # the first step has no Jaccard value: an all-NaN column is expected
        warnings.simplefilter("ignore", RuntimeWarning)
        grid = np.nanmean(values, axis=(2, 3))  # [layers, steps]
    image = ax.imshow(grid, aspect="auto", origin="lower", vmin=vmin, vmax=vmax, cmap="viridis")
    ax.set_xlabel("denoising step")
    ax.set_ylabel("layer")
    ax.set_title(title)
    ax.figure.colorbar(image, ax=ax)
    return ax


def plot_recall(report, ax=None):
    """Recall of the kept pattern against each step's oracle top-k."""
    return _heatmap(report.recall, f"recall vs oracle: {type(report.method).__name__}", ax, 0.0, 1.0)


def plot_jaccard(report, ax=None):
    """Jaccard similarity of the oracle pattern between consecutive steps."""
    return _heatmap(report.jaccard, "oracle pattern: Jaccard with the previous step", ax, 0.0, 1.0)


def plot_error(report, ax=None):
    """Relative L1 error of the attention output against dense attention."""
    return _heatmap(report.l1, f"relative L1 error vs dense: {type(report.method).__name__}", ax, 0.0, None)


def plot_head_patterns(report, layer: int = 0, batch: int = 0, heads=None, fig=None):
    """Per-head heat maps at the report's snapshot step: exact attention (top row, log scale) and the
    fraction of each cell the method kept (bottom row; blank for methods without a pattern mask).
    Queries on the vertical axis, keys on the horizontal one, both pooled to the snapshot grid."""
    try:
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install 'dllm-jax[analysis]'") from e
    if not 0 <= layer < report.attention.shape[0]:
        raise ValueError(f"layer={layer} is not a layer of this report (0..{report.attention.shape[0] - 1})")
    heads = list(range(min(8, report.attention.shape[2]))) if heads is None else list(heads)
    if fig is None:
        fig = plt.figure(figsize=(2.2 * len(heads), 4.6))
    axes = fig.subplots(2, len(heads), squeeze=False)
    attention = report.attention[layer, batch]
    floor = max(float(attention[attention > 0].min(initial=1.0)), 1e-8)
    for col, head in enumerate(heads):
        image = axes[0, col].imshow(np.maximum(attention[head], floor), norm=LogNorm(vmin=floor, vmax=attention.max()),
                                    cmap="magma", aspect="auto", interpolation="nearest")
        axes[0, col].set_title(f"head {head}", fontsize=9)
        axes[1, col].imshow(report.kept[layer, batch, head], vmin=0.0, vmax=1.0, cmap="Blues", aspect="auto",
                            interpolation="nearest")
        for ax in axes[:, col]:
            ax.set_xticks([])
            ax.set_yticks([])
    axes[0, 0].set_ylabel("exact attention\n(queries)")
    axes[1, 0].set_ylabel("kept by method\n(queries)")
    fig.colorbar(image, ax=axes[0, :].tolist(), shrink=0.8)
    fig.suptitle(f"{type(report.method).__name__}: layer {layer}, step {report.snapshot_step} (keys →)")
    return fig
