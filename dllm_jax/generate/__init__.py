"""Generation: one compiled loop per model family (`generate` dispatches on the model)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from dllm_jax import validation
from dllm_jax.attention.methods import check_family, make_method
from dllm_jax.attention.policy import AttentionPolicy, Dense, check_policy
from dllm_jax.attention.sharded import Sharded

from dllm_jax.generate import dream as gen_dream
from dllm_jax.generate import llada2 as gen_llada2
from dllm_jax.generate import sdar as gen_sdar
from dllm_jax.generate.dream import DreamOptions
from dllm_jax.generate.llada2 import LLaDA2Options
from dllm_jax.generate.llada import LLaDAOptions, check_prompt, generate_llada_fast_jit, generate_llada_jit
from dllm_jax.generate.progress import progress_bar, tick
from dllm_jax.generate.sdar import SDAROptions
from dllm_jax.models.dream import Dream
from dllm_jax.models.llada import LLaDA
from dllm_jax.models.llada2 import LLaDA2
from dllm_jax.models.sdar import SDAR
from dllm_jax.sharding import batch_sharding, to_host


def generate(model, prompt_ids, *, attention_mask=None, seed: int = 0, method=None, progress: bool = False,
             return_nfe: bool = False, **options):
    """Generates with `model` from int32 prompt_ids [B, P]; returns int32 [B, P + gen_length].

    LLaDA options (all static: changing one recompiles; prompt shape changes recompile too):
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
    SDAR options (static): max_new_tokens=128, denoising_steps=4,
      remasking="low_confidence_dynamic" | "low_confidence_static" | "sequential",
      confidence_threshold=0.85, temperature=1.0, top_k=0, top_p=1.0; block length from the config.
      One prompt [1, P] without attention_mask (the official sampler's case) returns int32 [1, n]:
      the prompt and the generated tokens, cut after the first stop token (config.eos_token_ids),
      else after the last decoded block. A batch [B, P], left-padded as `attention_mask` [B, P]
      says (1 = token, 0 = padding), runs in the same compiled loop and returns int32
      [B, P + max_new_tokens] in the same layout: row b's padding, prompt and generated tokens,
      then config.pad_token_id after its stop token or its last decoded block. Each row keeps its
      own block alignment (positions count from its first token), progress and stop, and equals the
      one-prompt call on that row (same options and seed) as far as both reach. denoising_steps <= block_size: a block of block_size tokens is decoded in at
      most block_size steps (the schedule gives later steps 0 tokens), so more would silently run
      fewer. See `dllm_jax.generate.sdar`.
      Infilling: the complete prompt blocks are prefilled into the KV cache and never denoised, so a
      mask id there is refused (with its positions). Mask ids in the trailing partial prompt block
      (positions P - P % block_size .. P - 1) are infilled: that block is the first one decoded, and
      its masks are predicted with the generated ones, as the official sampler does. Like the
      official sampler, a step commits its n[j] (about block_size / denoising_steps) positions
      without a mask guard: once fewer masks than n[j] remain, prompt tokens of that block can
      be replaced (only with denoising_steps < block_size, where n[j] > 1).
    Dream options (static; `dllm_jax.generate.dream`, the official `diffusion_generate`): max_new_tokens=128,
      steps=128, eps=1e-3, alg="origin" | "maskgit_plus" | "topk_margin" | "entropy", alg_temp=0.0,
      temperature=0.0, top_p=1.0, top_k=0 (1.0 / 0: off). Returns int32 [B, P + max_new_tokens] (no stop:
      the tokens after the first EOS are Dream's padding). `attention_mask` [B, P] (padding anywhere, as the
      official code: positions count real tokens, padding keys are hidden; dense attention only). Mask ids
      in the prompt are infilled (the same number in every row).
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
    if isinstance(method, str):
        method = make_method(method)
    method = Dense() if method is None else method
    check_policy(method)
    mesh = getattr(model, "mesh", None)
    if isinstance(model, LLaDA):
        opts, prompt_ids, method = prepare_llada(model, prompt_ids, attention_mask, method, options)
        if opts.fast:
            check_fast(model.config, prompt_ids, method, opts)
        method = on_devices(mesh, method, prompt_ids.shape[1] + opts.gen_length)
        mask = None if attention_mask is None else np.asarray(attention_mask, np.int32)
        placed_ids, placed_mask = on_mesh(mesh, prompt_ids, mask)  # the host arrays stay for the checks
        if opts.fast:
            with progress_bar(opts.steps, "LLaDA denoising (at most)", progress) as run_id:
                out, nfe = generate_llada_fast_jit(model.params(), placed_ids, placed_mask, seed, np.int32(run_id),
                                                   config=model.config, options=opts, policy=method,
                                                   on_step=tick if progress else None)
                return (to_host(out), int(nfe)) if return_nfe else to_host(out)
        with progress_bar(opts.steps, "LLaDA denoising", progress) as run_id:
            out = generate_llada_jit(model.params(), placed_ids, placed_mask, seed,
                                     np.int32(run_id), config=model.config, options=opts,
                                     prompt_has_masks=bool((prompt_ids == model.config.mask_token_id).any()),
                                     policy=method, on_step=tick if progress else None)
            return (to_host(out), opts.steps * (2 if opts.cfg_scale > 0 else 1)) if return_nfe else to_host(out)
    if isinstance(model, SDAR):
        if return_nfe:
            raise ValueError("return_nfe=True is for LLaDA models (SDAR's forwards per block follow its schedule)")
        opts, prompt_ids, mask, blocks = prepare_sdar(model, prompt_ids, attention_mask, method, options)
        method = on_devices(mesh, method, None)
        placed_ids, placed_mask = on_mesh(mesh, prompt_ids, mask)
        with progress_bar(blocks, "SDAR blocks", progress) as run_id:
            x, end = gen_sdar.generate_sdar_jit(model.params(), placed_ids, placed_mask, seed,
                                                np.int32(run_id), config=model.config, options=opts,
                                                policy=method, on_step=tick if progress else None, mesh=mesh)
            x, end = to_host(x), to_host(end)
        lengths = np.full(len(x), prompt_ids.shape[1]) if mask is None else mask.sum(axis=1)
        rows = gen_sdar.trim(x, end, lengths, set(model.config.eos_token_ids))
        if mask is None and len(rows) == 1:
            return np.stack(rows)
        return gen_sdar.left_padded(rows, prompt_ids, np.ones_like(prompt_ids) if mask is None else mask,
                                    prompt_ids.shape[1] + opts.max_new_tokens, model.config.pad_token_id)
    if isinstance(model, Dream):
        if return_nfe:
            raise ValueError("return_nfe=True is for LLaDA models (Dream runs exactly `steps` forwards)")
        opts, prompt_ids, method = prepare_dream(model, prompt_ids, attention_mask, method, options)
        method = on_devices(mesh, method, prompt_ids.shape[1] + opts.max_new_tokens)
        mask = None if attention_mask is None else np.asarray(attention_mask, np.int32)
        placed_ids, placed_mask = on_mesh(mesh, prompt_ids, mask)
        with progress_bar(opts.steps, "Dream denoising", progress) as run_id:
            out = gen_dream.generate_dream_jit(
                model.params(), placed_ids, placed_mask, seed, np.int32(run_id), config=model.config, options=opts,
                prompt_has_masks=bool((prompt_ids == model.config.mask_token_id).any()), policy=method,
                on_step=tick if progress else None)
            return to_host(out)
    if isinstance(model, LLaDA2):
        return generate_llada2(model, prompt_ids, attention_mask, seed, method, mesh, progress, return_nfe, options)
    raise ValueError(f"generate supports LLaDA, SDAR, Dream and LLaDA2 models, got {type(model).__name__}")


def generate_llada2(model, prompt_ids, attention_mask, seed, method, mesh, progress, return_nfe, options: dict):
    """LLaDA2 (dllm_jax.generate.llada2): options gen_length=2048, block_length=32, steps=32 (per block),
    temperature=0.0 (greedy), top_k=0, top_p=1.0, threshold=0.95, minimal_topk=1; block diffusion with a
    prefix KV cache, so MAGE and FlashBlock run on it as on SDAR. Prompts of one length; one prompt returns
    int32 [1, n] (prompt + answer up to and including the first eos), a batch int32 [B, P + gen_length]
    with config.pad_token_id after each row's eos."""
    if return_nfe:
        raise ValueError("return_nfe=True is for LLaDA models (LLaDA2's forwards per block follow its schedule)")
    opts, prompt_ids, blocks = prepare_llada2(model, prompt_ids, attention_mask, method, options)
    method = on_devices(mesh, method, None)
    placed_ids, _ = on_mesh(mesh, prompt_ids, None)
    with progress_bar(blocks, "LLaDA2 blocks", progress) as run_id:
        x, _ = gen_llada2.generate_llada2_jit(model.params(), placed_ids, seed, np.int32(run_id), config=model.config,
                                              options=opts, policy=method, on_step=tick if progress else None,
                                              mesh=mesh)
        x = to_host(x)
    rows = gen_llada2.answers(x, prompt_ids.shape[1], opts, model.config.eos_token_id)
    if len(rows) == 1:
        return np.stack(rows)
    out = np.full((len(rows), prompt_ids.shape[1] + opts.gen_length), model.config.pad_token_id, np.int32)
    for b, row in enumerate(rows):
        out[b, :len(row)] = row
    return out


def prepare_llada2(model, prompt_ids, attention_mask, method, options: dict):
    """Checks an LLaDA2 request (method family, options, prompt, context) before anything compiles;
    returns (LLaDA2Options, int32 prompt_ids, the number of blocks decoded)."""
    check_family(method, "LLaDA2")
    opts = make_options(LLaDA2Options, "LLaDA2", options)
    prompt_ids = as_array("prompt_ids", prompt_ids)
    check_prompt(model.config, prompt_ids, attention_mask)
    gen_llada2.check_request(model.config, prompt_ids, attention_mask, opts)
    check_context(model.config, prompt_ids.shape[1], opts.gen_length)
    p, bl = prompt_ids.shape[1], opts.block_length
    return opts, prompt_ids.astype(np.int32), -(-(p + opts.gen_length) // bl) - p // bl


def prepare_dream(model, prompt_ids, attention_mask, method, options: dict):
    """Checks a Dream request (method, options, prompt, padding, context) before anything compiles;
    returns (DreamOptions, int32 prompt_ids, the method bound to this generation's schedule)."""
    check_family(method, "Dream")
    opts = make_options(DreamOptions, "Dream", options)
    prompt_ids = as_array("prompt_ids", prompt_ids)
    check_prompt(model.config, prompt_ids, attention_mask)
    gen_dream.check_request(model.config, prompt_ids, attention_mask, method, opts)
    check_context(model.config, prompt_ids.shape[-1], opts.max_new_tokens)
    method = method.bind(total_steps=opts.steps, prompt_length=prompt_ids.shape[1], gen_length=opts.max_new_tokens)
    return opts, prompt_ids.astype(np.int32), method


def on_devices(mesh, method: AttentionPolicy, length: int | None) -> AttentionPolicy:
    """`method` run per device of `mesh` (unchanged without one); ValueError unless the sequence of
    `length` positions splits over "sp" into whole rows of the method's pattern (None: the family has
    no sequence parallelism)."""
    if mesh is None:
        return method
    sp = mesh.shape["sp"]
    if sp > 1 and length is None:
        raise ValueError(f"the mesh's sp={sp} splits LLaDA's full-sequence forwards; SDAR's block steps take tp "
                         "and dp only")
    if sp > 1 and length % (sp * method.query_block):
        raise ValueError(f"sp={sp} needs the sequence (prompt + gen_length = {length}) to be a multiple of "
                         f"{sp * method.query_block} (sp x the method's query block of {method.query_block}): "
                         "pad the prompt on the left (attention_mask) or change gen_length")
    return Sharded(method, mesh)


def on_mesh(mesh, prompt_ids: np.ndarray, mask):
    """The prompt (and mask) with rows over the mesh's "dp" axis (unchanged without a mesh); ValueError
    unless dp divides the batch."""
    if mesh is None:
        return prompt_ids, mask
    dp = mesh.shape["dp"]
    if prompt_ids.shape[0] % dp:
        raise ValueError(f"the batch of {prompt_ids.shape[0]} prompts must be a multiple of the mesh's dp={dp}")
    sharding = batch_sharding(mesh, 2)
    return jax.device_put(prompt_ids, sharding), None if mask is None else jax.device_put(mask, sharding)


def prepare_llada(model, prompt_ids, attention_mask, method, options: dict):
    """Checks a LLaDA request (method family, options, prompt, context) before anything compiles;
    returns (LLaDAOptions, int32 prompt_ids, the method bound to this generation's schedule)."""
    check_family(method, "LLaDA")
    opts = make_options(LLaDAOptions, "LLaDA", options)
    prompt_ids = as_array("prompt_ids", prompt_ids)
    check_prompt(model.config, prompt_ids, attention_mask)
    check_context(model.config, prompt_ids.shape[-1], opts.gen_length)
    # methods whose schedule depends on the generation (SparseD, PulseCol, SpargeAttn) fix it here
    method = method.bind(total_steps=opts.steps, prompt_length=prompt_ids.shape[1], gen_length=opts.gen_length)
    return opts, prompt_ids.astype(np.int32), method


def check_fast(config, prompt_ids: np.ndarray, method, opts: LLaDAOptions) -> None:
    """What Fast-dLLM decoding (cache= / threshold=) supports: prompts without mask ids, and with a
    cache a policy that attends over a cached window (Dense, SparseD, PulseCol)."""
    if opts.cache is not None and type(method).attend_window is AttentionPolicy.attend_window:
        raise ValueError(f"cache={opts.cache!r} (Fast-dLLM) runs with dense attention, SparseD or PulseCol, got "
                         f"method {type(method).__name__}: it has no attention over a cached window "
                         "(threshold= alone works with every LLaDA method)")
    if (prompt_ids == config.mask_token_id).any():
        raise ValueError(f"prompt_ids hold the mask id {config.mask_token_id}: infilling is not supported with cache= or "
                         "threshold= (Fast-dLLM decodes the answer blocks only)")


def prepare_sdar(model, prompt_ids, attention_mask, method, options: dict):
    """Checks an SDAR request (method family, options, left-padded prompts, context) before anything
    compiles; returns (SDAROptions, int32 prompt_ids, int32 attention_mask or None, the number of
    decoding iterations)."""
    check_family(method, "SDAR")
    opts = make_options(SDAROptions, "SDAR", options)
    prompt_ids = as_array("prompt_ids", prompt_ids)
    check_prompt(model.config, prompt_ids, attention_mask)
    mask = None if attention_mask is None else np.asarray(attention_mask).astype(np.int32)
    lengths = check_left_padding(mask) if mask is not None else np.full(prompt_ids.shape[0], prompt_ids.shape[1])
    check_sdar_request(model.config, prompt_ids, lengths, opts)
    for row, length in enumerate(lengths):
        check_context(model.config, int(length), opts.max_new_tokens, row=None if mask is None else row)
    bs = model.config.block_size
    blocks = max(-(-(int(n) + opts.max_new_tokens) // bs) - int(n) // bs for n in lengths)
    return opts, prompt_ids.astype(np.int32), mask, blocks


def check_left_padding(mask: np.ndarray) -> np.ndarray:
    """The real prompt length of each row of a 0/1 attention_mask [B, P] that must be left padding
    (0...0 1...1) with at least one token; ValueError naming the first bad row otherwise."""
    lengths = mask.sum(axis=1)
    for row, (values, length) in enumerate(zip(mask, lengths)):
        if length == 0:
            raise ValueError(f"attention_mask row {row} is all padding: every prompt needs at least one token")
        if values[mask.shape[1] - length:].min() == 0:
            raise ValueError(f"attention_mask row {row} is not left padding (zeros, then ones): "
                             f"{values.tolist()[:40]}{' ...' if mask.shape[1] > 40 else ''}; SDAR prompts are "
                             "left-padded, each row's tokens contiguous at the end")
    return lengths


def as_array(name: str, value) -> np.ndarray:
    try:
        return np.asarray(value)
    except ValueError as e:  # ragged nested lists
        raise ValueError(f"{name} must be a rectangular [batch, length] array of token ids: {e}") from None


def check_sdar_request(config, prompt_ids: np.ndarray, lengths, options: SDAROptions) -> None:
    """What SDAR's sampler needs of options and prompts together (see `generate`'s docstring);
    `lengths` are the rows' real prompt lengths (their tokens at the end of each row)."""
    bs = config.block_size
    if options.denoising_steps > bs:
        raise ValueError(f"denoising_steps={options.denoising_steps} exceeds the model's block_size={bs}: a block "
                         f"is fully decoded within {bs} steps (the schedule gives the steps after that 0 tokens); "
                         f"pass denoising_steps <= {bs}")
    if options.top_k > config.vocab_size:
        raise ValueError(f"top_k={options.top_k} exceeds the vocabulary (vocab_size={config.vocab_size})")
    width = prompt_ids.shape[1]
    for row, p in enumerate(int(n) for n in lengths):
        tokens = prompt_ids[row, width - p:]
        committed = p - p % bs
        positions = np.flatnonzero(tokens[:committed] == config.mask_token_id)
        if positions.size:
            where = ("prompt_ids hold" if len(lengths) == 1 and p == width else
                     f"prompt row {row} holds (positions counted from its first token)")
            raise ValueError(
                f"{where} the mask token id {config.mask_token_id} at positions {positions.tolist()[:10]}, inside "
                f"the complete prompt blocks (positions 0..{committed - 1}, block_size={bs}): those are prefilled into "
                f"the KV cache and never denoised, so a mask there cannot be filled in. Only the trailing partial "
                f"block can be infilled" + (f" (positions {committed}..{p - 1})" if committed < p else
                                            " (this prompt has none: its length is a multiple of block_size)"))


def check_context(config, prompt_length: int, new_tokens: int, *, row: int | None = None) -> None:
    """Prompt + generated tokens must fit the positions the model was trained on (`row`: the batch
    row the prompt is, named in the error).

    RoPE itself would run past them, but the model has never seen such positions, so the answer
    quality is undefined; long-context experiments (the sparse-attention papers run LLaDA at 64k)
    pass a config with a larger max_position_embeddings, e.g. via `load_model` on a checkpoint
    whose config.json says so, or call the compiled loops in dllm_jax.generate.* directly.
    """
    limit = config.max_position_embeddings
    which = "the prompt" if row is None else f"prompt row {row}"
    if prompt_length > limit:
        raise ValueError(f"{which} has {prompt_length} tokens, longer than the model's context of {limit} "
                         "positions (config max_position_embeddings)")
    if prompt_length + new_tokens > limit:
        raise ValueError(f"{which} ({prompt_length} tokens) + {new_tokens} new tokens = {prompt_length + new_tokens} "
                         f"exceeds the model's context of {limit} positions (config max_position_embeddings): "
                         "shorten the prompt or generate fewer tokens")


def make_options(cls, family: str, options: dict):
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise ValueError(f"unknown {family} generate options {unknown}; valid: {sorted(valid)}")
    return cls(**options)


__all__ = ["DreamOptions", "LLaDA2Options", "LLaDAOptions", "SDAROptions", "generate"]
