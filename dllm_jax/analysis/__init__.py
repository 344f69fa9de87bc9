"""Pattern diagnostics for sparse-attention methods: recall against the per-step oracle, Jaccard
similarity of the oracle pattern over steps, output error against dense attention, and plots
(bidirectional LLaDA and Dream: `analyze`; SDAR and LLaDA2 block diffusion: `analyze_blocks`);
SpargeAttn's per-head calibration (`calibrate_llada`, `save_calibration`)."""

from dllm_jax.analysis.blocks import BlockProbe, BlockReport, analyze_blocks
from dllm_jax.analysis.calibration import Calibration, calibrate, calibrate_llada, save_calibration
from dllm_jax.analysis.patterns import PatternReport, Probe, analyze
from dllm_jax.analysis.plots import plot_error, plot_head_patterns, plot_jaccard, plot_recall

__all__ = ["BlockProbe", "BlockReport", "Calibration", "calibrate", "calibrate_llada", "save_calibration", "PatternReport", "Probe", "analyze", "analyze_blocks", "plot_error", "plot_head_patterns", "plot_jaccard", "plot_recall"]
