"""`dllm-jax bench`: attention kernels and end-to-end generation steps on the current device.

Two sections, both written to <out>/bench_<device>_<date>.{json,md} (bench_<device>_<date>_2, _3, ... for
later runs of the day: a result is never replaced):
  attention   dense attention of the platform (cuDNN on a GPU, XLA elsewhere) against our flash,
              block-sparse and column-sparse kernels at several densities (random per-row patterns),
              batch 1, bf16, bidirectional; ratio = dense time / time (> 1 is faster). Off a GPU the
              Pallas kernels only run interpreted, so their jnp references are timed instead, and
              the table says so.
  generate    the public `generate` loop with random weights, dense and every method of the family,
              time per model forward (a LLaDA denoising step; an SDAR block step or commit) from the
              second call (the first compiles); speed-up = dense time / time.
"""

from __future__ import annotations

import datetime
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

from dllm_jax.bench.attention import attention_markdown, attention_rows, on_gpu
from dllm_jax.bench.generation import generate_rows, generation_markdown
from dllm_jax.bench.models import model_family, timed_method_names
from dllm_jax.bench.results import write_results


def markdown(meta: dict, attention: list[dict], generation: list[dict]) -> list[str]:
    """The results file: a title naming device, jax and date, then each section's table."""
    lines = [f"# dllm-jax bench — {meta['device']}, jax {meta['jax']}, {meta['date']}", ""]
    if attention:
        lines += attention_markdown(attention)
    if generation:
        lines += generation_markdown(generation)
    return lines


def check_methods(names, models) -> None:
    """A ValueError naming a method that is unknown, or that applies to none of the models' families."""
    if names is None:
        return
    from dllm_jax.attention.methods import method_names

    unknown = sorted(set(names) - {"dense", *method_names()})
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known: {['dense', *method_names()]}")
    families = {model_family(name) for name in models}
    applying = set().union(*(timed_method_names(f) for f in families))
    if set(names) - applying:
        raise ValueError(f"method(s) {sorted(set(names) - applying)} apply to none of the models' families "
                         f"{sorted(families)} (they take {sorted(applying)})")


def run(*, out: Path, sections, lengths=None, densities=(0.5, 0.3, 0.1), models=None, context=None,
        new_tokens=None, layers=None, heads: int = 32, head_dim: int = 128, dtype="bfloat16", repeats: int = 5,
        progress: bool = False, methods=None) -> Path:
    """Runs the chosen sections with device-sized defaults and writes the results; returns the .md path.
    `methods`: the generate section's method names ("dense" included; None: every method of each model's family)."""
    gpu = on_gpu()
    lengths = lengths or ([4096, 16384] if gpu else [256, 512])
    models = models or (["llada-8b-instruct", "sdar-8b-chat"] if gpu else ["tiny-llada", "tiny-sdar"])
    context = context or (8192 if gpu else 256)
    new_tokens = new_tokens or (128 if gpu else 32)
    check_methods(methods, models)
    if new_tokens % 2 or new_tokens >= context:
        raise ValueError(f"--new-tokens must be even and smaller than --context, got {new_tokens} and {context}")
    heads = heads if gpu else min(heads, 4)
    device = jax.devices()[0].device_kind
    print(f"dllm-jax bench on {device} (jax {jax.__version__}, {jax.default_backend()})", flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas Triton backend warns on use
        attention = (attention_rows(lengths, densities, heads=heads, head_dim=head_dim, repeats=repeats)
                     if "attention" in sections else [])
        generation = (generate_rows(models, context=context, new_tokens=new_tokens, layers=layers,
                                    dtype=jnp.dtype(dtype), progress=progress, methods=methods)
                      if "generate" in sections else [])
    meta = dict(benchmark="bench", device=device, backend=jax.default_backend(), jax=jax.__version__,
                date=datetime.date.today().isoformat(), sections=list(sections), lengths=list(lengths),
                densities=list(densities), models=list(models), context=context, new_tokens=new_tokens,
                layers=layers, dtype=str(dtype), methods=None if methods is None else list(methods))
    return write_results(out, meta, attention + generation, markdown(meta, attention, generation), keep_existing=True)
