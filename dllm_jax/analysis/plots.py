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
