"""Pattern diagnostics for sparse-attention methods: recall against the per-step oracle, Jaccard
similarity of the oracle pattern over steps, output error against dense attention, and plots."""

from dllm_jax.analysis.patterns import PatternReport, Probe, analyze
from dllm_jax.analysis.plots import plot_error, plot_jaccard, plot_recall

__all__ = ["PatternReport", "Probe", "analyze", "plot_error", "plot_jaccard", "plot_recall"]
