"""Generation: one compiled loop per model family; `generate` looks the model's family up
(`dllm_jax.families`) and runs its `run` (dllm_jax.generate.llada, .sdar, .dream, .llada2, .diffusion_gemma)."""

from __future__ import annotations

from dllm_jax import families  # the registry imports this package's family modules: read at call time
from dllm_jax import validation
from dllm_jax.generate.diffusion_gemma import DiffusionGemmaOptions
from dllm_jax.generate.dream import DreamOptions
from dllm_jax.generate.llada import LLaDAOptions
from dllm_jax.generate.llada2 import LLaDA2Options
from dllm_jax.generate.sdar import SDAROptions


def generate(model, prompt_ids, *, attention_mask=None, seed: int = 0, method=None, progress: bool = False,
             return_nfe: bool = False, **options):
    """Generates with `model` from int32 prompt_ids [B, P]; returns int32 [B, P + gen_length].

    The family's options (`dllm_jax.families.family_of(model).options_class`):
    Which options are traced (a new value compiles nothing: the sampling values) and which static (a new value
    compiles a new loop), per family: docs/generation.md. A new prompt shape compiles a new loop.
    LLaDA options:
      gen_length=128, steps=128, block_length=128, temperature=0.0, cfg_scale=0.0,
      remasking="low_confidence" | "random", logits_eos_inf=False, confidence_eos_eot_inf=False,
      padding="ignore" | "mask", cache=None | "prefix" | "dual", threshold=None | float in [0, 1],
      factor=None | float > 0,
      cache_refresh=0. `attention_mask` [B, P] marks real prompt tokens (left padding);
      `seed` is a traced argument (no recompilation). See `dllm_jax.generate.llada`.
      Infilling: mask ids (config.mask_token_id) inside the prompt are predicted and filled in with
      the answer, as LLaDA's official generate does (not with cache= or threshold=). They take commits
      from the answer's schedule
      (which counts only each block's own masks, as the official code), so a prompt with k mask
      ids returns k mask ids, in the answer or the prompt.
    SDAR options: max_new_tokens=128, denoising_steps=4,
      remasking="low_confidence_dynamic" | "low_confidence_static" | "sequential",
      confidence_threshold=0.85, temperature=1.0, top_k=0, top_p=1.0; block length from the config.
      One prompt [1, P] without attention_mask (the official sampler's case) returns int32 [1, n]:
      the prompt and the generated tokens, cut after the first stop token (config.stop_ids),
      else after the last decoded block. A batch [B, P], left-padded as `attention_mask` [B, P]
      says (1 = token, 0 = padding), runs in the same compiled loop and returns int32
      [B, P + max_new_tokens] in the same layout: row b's padding, prompt and generated tokens,
      then config.pad_token_id after its stop token or its last decoded block. Each row keeps its
      own block alignment (positions count from its first token), progress and stop, and equals the
      one-prompt call on that row (same options and seed) as far as both reach. Prompts are
      left-padded to a multiple of sdar.PROMPT_BUCKET positions inside, so nearby lengths share one
      compiled loop. denoising_steps <= block_size: a block of block_size tokens is decoded in at
      most block_size steps (the schedule gives later steps 0 tokens), so more would silently run
      fewer. See `dllm_jax.generate.sdar`.
      Infilling: the complete prompt blocks are prefilled into the KV cache and never denoised, so a
      mask id there is refused (with its positions). Mask ids in the trailing partial prompt block
      (positions P - P % block_size .. P - 1) are infilled: that block is the first one decoded, and
      its masks are predicted with the generated ones, as the official sampler does. Like the
      official sampler, a step commits its n[j] (about block_size / denoising_steps) positions
      without a mask guard: once fewer masks than n[j] remain, prompt tokens of that block can
      be replaced (only with denoising_steps < block_size, where n[j] > 1).
    LLaDA2 options (`dllm_jax.generate.llada2.run`): gen_length=2048, block_length=32, steps=32 (per
      block), temperature=0.0, top_k=0, top_p=1.0, threshold=0.95, minimal_topk=1; prompts of one length.
    Dream options (`dllm_jax.generate.dream`, the official `diffusion_generate`): max_new_tokens=128,
      steps=128, eps=1e-3, alg="origin" | "maskgit_plus" | "topk_margin" | "entropy", alg_temp=0.0,
      temperature=0.0, top_p=1.0, top_k=0 (1.0 / 0: off). Returns int32 [B, P + max_new_tokens] (no stop:
      the tokens after the first EOS are Dream's padding). `attention_mask` [B, P] (padding anywhere, as the
      official code: positions count real tokens, padding keys are hidden; dense attention only). Mask ids
      in the prompt are infilled (the same number in every row).
    DiffusionGemma options (`dllm_jax.generate.diffusion_gemma.run`, transformers' names and defaults):
      max_new_tokens=256, max_denoising_steps=48, entropy_bound=0.1, t_min=0.4, t_max=0.8, stability_threshold=1,
      confidence_threshold=0.005 (None: no adaptive stopping). Canvases of config.canvas_length uniformly random
      tokens are denoised after the prompt (it has no mask token and always samples: `seed` decides the draws).
      Returns int32 [B, P + max_new_tokens]: the prompt as given, then each row's first max_new_tokens tokens, the
      pad id after its stop id. `attention_mask` [B, P] marks each row's prompt tokens (padding anywhere). Dense
      attention or MAGE (on the global layers' cached prefix); progress per canvas; no return_nfe.
    Fast-dLLM (NVlabs/Fast-dLLM, LLaDA; `dllm_jax.generate.llada.generate_llada_fast`): `cache="prefix"`
      reuses every layer's keys and values of the positions before the block from the block's first
      step, `cache="dual"` those after it too (the block's later steps then run the block alone);
      `cache_refresh=k` also recomputes the cache every k-th step of a block (1: every step, exact).
      `factor=f` (instead of threshold) commits the i-th most confident masked position while its
      confidence reaches 1 - f / (i + 1) (the official `get_transfer_index_dynamic`).
      `threshold=x` commits, per step, each row's most confident masked position of the block plus every
      other one of confidence >= x, and a block's steps end once it has no mask left (fewer forwards).
      With a cache, `method` is dense, SparseD or PulseCol (its pattern, built by full forwards, is
      applied to the cached steps' windows); threshold= alone takes every LLaDA method. No cfg_scale,
      no mask ids in the prompt. The defaults (None) are the original sampler. `return_nfe=True` (LLaDA) returns (ids, number of model forwards).
    `method=None` is dense attention; a name ("sparsed", "mage", ...) is the method with its
    defaults (`dllm_jax.attention.methods.make_method`); otherwise an attention policy (dllm_jax.attention.policy)
    whose per-layer state rides in the loop carry: `dllm_jax.SparseD(...)`, `dllm_jax.PulseCol(...)` or
    `dllm_jax.SpargeAttn(...)` for LLaDA and Dream (generation without padding masks); `dllm_jax.MAGE(...)`, `dllm_jax.FlashBlock(...)` or
    `dllm_jax.FlashBlock(..., inner=dllm_jax.MAGE(...))` for SDAR.
    A model loaded with `mesh=` (dllm_jax.sharding) runs the same loops sharded: prompt rows are placed
    over the mesh's "dp" axis (dp must divide the batch).
    `progress=True` shows a tqdm bar advanced from inside the compiled loop (per step for LLaDA,
    per block for SDAR). `seed`: an int in [-2**31, 2**31) (`dllm_jax.validation.seed` says why not wider).
    Every argument is checked on the host before anything is traced: a bad one raises a ValueError
    that names it.
    """
    seed = validation.seed(seed)
    family = families.model_family(model)
    method = family.policy(method)
    return family.run(model, prompt_ids, attention_mask, seed, method, progress, return_nfe, options)


__all__ = ["DiffusionGemmaOptions", "DreamOptions", "LLaDA2Options", "LLaDAOptions", "SDAROptions", "generate"]
