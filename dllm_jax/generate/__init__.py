"""Generation: one compiled loop per model family (`generate` dispatches on the model)."""

from __future__ import annotations

import dataclasses

import numpy as np

from dllm_jax.attention.methods import check_family, make_method
from dllm_jax.attention.policy import check_policy

from dllm_jax.generate import sdar as gen_sdar
from dllm_jax.generate.llada import LLaDAOptions, check_prompt, generate_llada_jit
from dllm_jax.generate.progress import progress_bar, tick
from dllm_jax.generate.sdar import SDAROptions
from dllm_jax.models.llada import LLaDA
from dllm_jax.models.sdar import SDAR


def generate(model, prompt_ids, *, attention_mask=None, seed: int = 0, method=None, progress: bool = False,
             **options):
    """Generates with `model` from int32 prompt_ids [B, P]; returns int32 [B, P + gen_length].

    LLaDA options (all static: changing one recompiles; prompt shape changes recompile too):
      gen_length=128, steps=128, block_length=128, temperature=0.0, cfg_scale=0.0,
      remasking="low_confidence" | "random", logits_eos_inf=False, confidence_eos_eot_inf=False,
      padding="ignore" | "mask". `attention_mask` [B, P] marks real prompt tokens (left padding);
      `seed` is a traced argument (no recompilation). See `dllm_jax.generate.llada`.
    SDAR options (static): max_new_tokens=128, denoising_steps=4,
      remasking="low_confidence_dynamic" | "low_confidence_static" | "sequential",
      confidence_threshold=0.85, temperature=1.0, top_k=0, top_p=1.0; block length from the config.
      Batch 1 without padding, as the official sampler. Returns int32 [1, n]: the prompt and the
      generated tokens, cut after the first stop token (config.eos_token_ids), else after the last
      decoded block. See `dllm_jax.generate.sdar`.
    `method=None` is dense attention; a name ("sparsed", "mage", ...) is the method with its
    defaults (`dllm_jax.attention.methods.make_method`); otherwise an attention policy (dllm_jax.attention.policy)
    whose per-layer state rides in the loop carry: `dllm_jax.SparseD(...)`, `dllm_jax.PulseCol(...)` or
    `dllm_jax.SpargeAttn(...)` for LLaDA (generation without padding masks); `dllm_jax.MAGE(...)`, `dllm_jax.FlashBlock(...)` or
    `dllm_jax.FlashBlock(..., inner=dllm_jax.MAGE(...))` for SDAR.
    `progress=True` shows a tqdm bar advanced from inside the compiled loop (per step for LLaDA,
    per block for SDAR).
    """
    if isinstance(method, str):
        method = make_method(method)
    if method is not None:
        check_policy(method)
    if isinstance(model, LLaDA):
        opts, prompt_ids, method = prepare_llada(model, prompt_ids, attention_mask, method, options)
        mask = None if attention_mask is None else np.asarray(attention_mask, np.int32)
        with progress_bar(opts.steps, "LLaDA denoising", progress) as run_id:
            out = generate_llada_jit(model.params(), prompt_ids, mask, np.int32(seed),
                                     np.int32(run_id), config=model.config, options=opts,
                                     prompt_has_masks=bool((prompt_ids == model.config.mask_token_id).any()),
                                     policy=method, on_step=tick if progress else None)
            return np.asarray(out)
    if isinstance(model, SDAR):
        opts, prompt_ids, blocks = prepare_sdar(model, prompt_ids, attention_mask, method, options)
        with progress_bar(blocks, "SDAR blocks", progress) as run_id:
            x, end = gen_sdar.generate_sdar_jit(model.params(), prompt_ids, np.int32(seed),
                                                np.int32(run_id), config=model.config, options=opts,
                                                policy=method, on_step=tick if progress else None)
            x, end = np.asarray(x), int(end)
        rows = gen_sdar.trim(x, end, prompt_ids.shape[1], set(model.config.eos_token_ids))
        return np.stack(rows)
    raise ValueError(f"generate supports LLaDA and SDAR models, got {type(model).__name__}")


def prepare_llada(model, prompt_ids, attention_mask, method, options: dict):
    """Checks a LLaDA request (method family, options, prompt, context) before anything compiles;
    returns (LLaDAOptions, int32 prompt_ids, the method bound to this generation's schedule)."""
    check_family(method, "LLaDA")
    opts = make_options(LLaDAOptions, "LLaDA", options)
    prompt_ids = np.asarray(prompt_ids)
    check_prompt(model.config, prompt_ids, attention_mask)
    check_context(model.config, prompt_ids.shape[-1], opts.gen_length)
    if hasattr(method, "bind"):  # methods whose schedule depends on the generation (SparseD, PulseCol)
        method = method.bind(total_steps=opts.steps, prompt_length=prompt_ids.shape[1], gen_length=opts.gen_length)
    return opts, prompt_ids.astype(np.int32), method


def prepare_sdar(model, prompt_ids, attention_mask, method, options: dict):
    """Checks an SDAR request (method family, options, one unpadded prompt, context) before anything
    compiles; returns (SDAROptions, int32 prompt_ids, the number of blocks to decode)."""
    check_family(method, "SDAR")
    opts = make_options(SDAROptions, "SDAR", options)
    if attention_mask is not None:
        raise ValueError("SDAR generation takes unpadded prompts (the official sampler has no padding)")
    prompt_ids = np.asarray(prompt_ids)
    if prompt_ids.ndim != 2 or prompt_ids.shape[0] != 1:
        raise ValueError(f"SDAR generation runs one prompt at a time (batch 1), got shape {prompt_ids.shape}")
    check_prompt(model.config, prompt_ids, None)
    check_context(model.config, prompt_ids.shape[-1], opts.max_new_tokens)
    bs, p = model.config.block_size, prompt_ids.shape[1]
    return opts, prompt_ids.astype(np.int32), -(-(p + opts.max_new_tokens) // bs) - p // bs


def check_context(config, prompt_length: int, new_tokens: int) -> None:
    """Prompt + generated tokens must fit the positions the model was trained on.

    RoPE itself would run past them, but the model has never seen such positions, so the answer
    quality is undefined; long-context experiments (the sparse-attention papers run LLaDA at 64k)
    pass a config with a larger max_position_embeddings, e.g. via `load_model` on a checkpoint
    whose config.json says so, or call the compiled loops in dllm_jax.generate.* directly.
    """
    limit = config.max_position_embeddings
    if prompt_length > limit:
        raise ValueError(f"the prompt has {prompt_length} tokens, longer than the model's context of {limit} "
                         "positions (config max_position_embeddings)")
    if prompt_length + new_tokens > limit:
        raise ValueError(f"prompt ({prompt_length} tokens) + {new_tokens} new tokens = {prompt_length + new_tokens} "
                         f"exceeds the model's context of {limit} positions (config max_position_embeddings): "
                         "shorten the prompt or generate fewer tokens")


def make_options(cls, family: str, options: dict):
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise ValueError(f"unknown {family} generate options {unknown}; valid: {sorted(valid)}")
    return cls(**options)


__all__ = ["LLaDAOptions", "SDAROptions", "generate"]
