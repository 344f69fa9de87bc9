"""The generate loops the probes run in: one small runner per model family, in two tables (the
bidirectional families for `analyze`, the block-diffusion ones for `analyze_blocks`). A runner checks
the request exactly as `dllm_jax.generate.generate` does and returns a `Loop`: the method as generate
runs it, the number of policy calls per layer the probe must make room for, and the family's compiled
loop with `return_policy_state=True` under a given probe policy."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import numpy as np

from dllm_jax.attention.policy import AttentionPolicy


@dataclasses.dataclass(frozen=True)
class Loop:
    method: AttentionPolicy  # the method as generate runs it (bound to this generation's schedule)
    calls: int  # policy calls per layer: the steps (bidirectional), at most blocks x (steps + 1) (block diffusion)
    run: Callable[[AttentionPolicy, Any], tuple]  # (probe, seed) -> (tokens, the probe's per-layer state)


def _bidirectional(model, prompt_ids, method, options: dict, *, family: str) -> Loop:
    """LLaDA and Dream: the same loop contract (one policy call per step and layer)."""
    from dllm_jax.generate import dream, llada, prepare_dream, prepare_llada

    prepare, loop = {"llada": (prepare_llada, llada.generate_llada_jit),
                     "dream": (prepare_dream, dream.generate_dream_jit)}[family]
    opts, prompt_ids, method = prepare(model, prompt_ids, None, method, options)
    has_masks = bool((prompt_ids == model.config.mask_token_id).any())

    def run(probe, seed):
        return loop(model.params(), prompt_ids, None, seed, np.int32(0), config=model.config, options=opts,
                    prompt_has_masks=has_masks, policy=probe, return_policy_state=True)

    return Loop(method, opts.steps, run)


def _sdar(model, prompt_ids, method, options: dict) -> Loop:
    from dllm_jax.generate import prepare_sdar
    from dllm_jax.generate.sdar import generate_sdar_jit

    opts, prompt_ids, _, blocks = prepare_sdar(model, prompt_ids, None, method, options)

    def run(probe, seed):
        tokens, _, state = generate_sdar_jit(model.params(), prompt_ids, None, seed, np.int32(0), config=model.config,
                                             options=opts, policy=probe, return_policy_state=True)
        return tokens, state

    # each block: its first forward carries the previous block's commit (two calls), then the later steps
    return Loop(method, blocks * (opts.denoising_steps + 1), run)


def _llada2(model, prompt_ids, method, options: dict) -> Loop:
    from dllm_jax.generate import prepare_llada2
    from dllm_jax.generate.llada2 import generate_llada2_jit

    opts, prompt_ids, blocks = prepare_llada2(model, prompt_ids, None, method, options)

    def run(probe, seed):
        tokens, _, state = generate_llada2_jit(model.params(), prompt_ids, seed, np.int32(0), config=model.config,
                                               options=opts, policy=probe, return_policy_state=True)
        return tokens, state

    return Loop(method, blocks * (opts.effective_steps + 1), run)


# config.family -> (name, runner)
BIDIRECTIONAL = {"llada": ("LLaDA", functools.partial(_bidirectional, family="llada")),
                 "dream": ("Dream", functools.partial(_bidirectional, family="dream"))}
BLOCK_DIFFUSION = {"sdar": ("SDAR", _sdar), "llada2": ("LLaDA2", _llada2)}


def loop_for(table: dict, caller: str, model, prompt_ids, method, options: dict) -> Loop:
    """The `Loop` of `model`'s family from `table`; ValueError for a model of no family there."""
    family = getattr(getattr(model, "config", None), "family", None)
    if family not in table:
        names = " and ".join(name for name, _ in table.values())
        other, use = (BLOCK_DIFFUSION, "analyze_blocks") if table is BIDIRECTIONAL else (BIDIRECTIONAL, "analyze")
        hint = f" ({' and '.join(name for name, _ in other.values())} models: {use})" if family in other else ""
        raise ValueError(f"{caller} takes {names} models, got {type(model).__name__}{hint}")
    return table[family][1](model, prompt_ids, method, options)
