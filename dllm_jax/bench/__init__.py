"""Benchmarks on the current device: `dllm-jax bench` (`run`) and the one harness of the studies in
benchmarks/*.py.

  timing.py      the one timer: `call_times` (per burst), `time_calls` (its median), `time_carried`
                 (calls that thread state), `median_min_max`
  results.py     the one results writer: `write_results` (JSON + Markdown), `results_stem`, `claim_stem` (_2, _3, ...)
  tables.py      the one Markdown table (`markdown_table`) and the shared cell formats (`fmt`, `cell`)
  profile.py     GPU kernel time from a profiler trace (`kernel_profile`, `traced_kernels`, `profiled_attention_share`)
  models.py      random-weight models (`model_for`) and the methods timed per family (`family_methods`)
  attention.py   `dllm-jax bench`'s attention section
  generation.py  `dllm-jax bench`'s generate section
  command.py     `dllm-jax bench` itself: `run(out=..., sections=...)` writes both sections' results

Random weights come from `dllm_jax.testing.random_params`.
"""

from dllm_jax.bench.attention import attention_rows, on_gpu, random_lists
from dllm_jax.bench.generation import generate_rows
from dllm_jax.bench.models import family_methods, model_for
from dllm_jax.bench.profile import ATTENTION_KERNEL, kernel_profile, profiled_attention_share, traced_kernels
from dllm_jax.bench.results import claim, claim_stem, results_stem, write_results
from dllm_jax.bench.command import markdown, run
from dllm_jax.bench.tables import cell, fmt, markdown_table
from dllm_jax.bench.timing import call_times, median_min_max, time_calls, time_carried

__all__ = ["ATTENTION_KERNEL", "attention_rows", "call_times", "cell", "claim", "claim_stem", "results_stem",
           "family_methods", "fmt", "generate_rows", "kernel_profile", "markdown", "markdown_table", "median_min_max",
           "model_for",
           "on_gpu", "profiled_attention_share", "random_lists", "run", "time_calls", "time_carried", "traced_kernels",
           "write_results"]
