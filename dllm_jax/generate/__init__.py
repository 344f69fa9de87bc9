"""Generation: one compiled loop per model family (`generate` dispatches on the model)."""

from __future__ import annotations

import dataclasses

import numpy as np

from dllm_jax.generate.llada import LLaDAOptions, check_prompt, generate_llada_jit
from dllm_jax.models.llada import LLaDA
from dllm_jax.models.sdar import SDAR


def generate(model, prompt_ids, *, attention_mask=None, seed: int = 0, method=None, **options):
    """Generates with `model` from int32 prompt_ids [B, P]; returns int32 [B, P + gen_length].

    LLaDA options (all static: changing one recompiles; prompt shape changes recompile too):
      gen_length=128, steps=128, block_length=128, temperature=0.0, cfg_scale=0.0,
      remasking="low_confidence" | "random", logits_eos_inf=False, confidence_eos_eot_inf=False,
      padding="ignore" | "mask". `attention_mask` [B, P] marks real prompt tokens (left padding);
      `seed` is a traced argument (no recompilation). See `dllm_jax.generate.llada`.
    `method=None` is dense attention (sparse methods arrive with their issues).
    """
    if method is not None:
        raise ValueError(f"method={method!r}: no sparse attention methods are available yet; use method=None")
    prompt_ids = np.asarray(prompt_ids)
    if isinstance(model, LLaDA):
        valid = {f.name for f in dataclasses.fields(LLaDAOptions)}
        unknown = sorted(set(options) - valid)
        if unknown:
            raise ValueError(f"unknown LLaDA generate options {unknown}; valid: {sorted(valid)}")
        opts = LLaDAOptions(**options)
        check_prompt(model.config, prompt_ids, attention_mask)
        mask = None if attention_mask is None else np.asarray(attention_mask, np.int32)
        return generate_llada_jit(model.params(), prompt_ids.astype(np.int32), mask, np.int32(seed),
                                  config=model.config, options=opts)
    if isinstance(model, SDAR):
        raise ValueError("SDAR block-diffusion generation is not implemented yet (issue 4)")
    raise ValueError(f"generate supports LLaDA and SDAR models, got {type(model).__name__}")


__all__ = ["LLaDAOptions", "generate"]
