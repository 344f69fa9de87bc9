"""The one random model of a throughput run alive at a time."""

from __future__ import annotations

import gc
import time

import jax.numpy as jnp
from dllm_jax.bench import model_for

from .plan import Plan


def held_model(held: dict, family: str, plan: Plan):
    """The random model of `family` ("sdar" or "llada"), built once; building one drops the other (two
    8B models and a long cache would not fit together)."""
    if family not in held:
        for other in list(held):
            del held[other]
        gc.collect()
        if family == "sdar":
            context = max(max(plan.sdar_prompts) + plan.sdar_new_tokens, plan.long_prompt) + 64
            name = plan.sdar_model
        else:
            context = plan.llada_prompt + max(gen for _, gen, _ in plan.llada_runs)
            name = plan.llada_model
        start = time.perf_counter()
        # only the options the plan sets: the baseline's model_for takes neither execution nor quantize
        loading = {key: value for key, value in (("execution", plan.execution), ("quantize", plan.quantize))
                   if value is not None}
        held[family] = model_for(name, layers=None, context=context, dtype=jnp.bfloat16, **loading)
        print(f"{name}: random weights in {time.perf_counter() - start:.1f} s", flush=True)
    return held[family]
