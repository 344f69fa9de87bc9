"""What every family's `generate` checks and does alike before and around its compiled loop: the prompt,
the options, the context, the placement on a mesh; and `ProbeLoop`, what a family's loop offers the
pattern probes of `dllm_jax.analysis`. The family modules (llada, sdar, dream, llada2) build their
`prepare` / `run` / `probe_loop` from these; `dllm_jax.families` names them per family."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from dllm_jax.attention import kv_rows
from dllm_jax.attention.policy import AttentionPolicy, Dense
from dllm_jax.attention.sharded import Sharded
from dllm_jax.models.layers import check_inputs
from dllm_jax.sharding import batch_sharding


@dataclasses.dataclass(frozen=True)
class ProbeLoop:
    """A family's compiled loop as the analysis probes run it (`dllm_jax.analysis`)."""

    method: AttentionPolicy  # the method as generate runs it (bound to this generation's schedule)
    calls: int  # policy calls per layer: the steps (bidirectional), at most blocks x (steps + 1) (block diffusion)
    run: Callable[[AttentionPolicy, Any], tuple]  # (probe, seed) -> (tokens, the probe's per-layer state)


def until_stop(tokens, stop_ids) -> np.ndarray:
    """`tokens` cut after the first of `stop_ids` (which is kept), else all of them: a row's generated
    tokens as every family, the server and the CLI return them."""
    tokens = np.asarray(tokens)
    hits = np.flatnonzero(np.isin(tokens, list(stop_ids)))
    return tokens[:hits[0] + 1] if hits.size else tokens


def answer_window(length: int, block_size: int | None = None) -> int:
    """The answer region generation decodes for answers of up to `length` tokens (EOS included): that
    many for LLaDA (block_size None), whole blocks of `block_size` for SDAR, which denoises a block as
    one. Training pads answers to this window too (`dllm_jax.train`), so it sees what generation sees."""
    return length if block_size is None else -(-length // block_size) * block_size


def full_sequence_probe(model, prompt_ids, method, options: dict, *, prepare: Callable, loop: Callable) -> ProbeLoop:
    """The probe loop of a bidirectional family (LLaDA, Dream): `prepare` checks the request, `loop` is the
    family's jitted generate loop; one policy call per step and layer."""
    opts, prompt_ids, method = prepare(model, prompt_ids, None, method, options)
    has_masks = bool((prompt_ids == model.config.mask_token_id).any())

    def run_probe(probe, seed):
        return loop(model.params(), prompt_ids, None, seed, np.int32(0), config=model.config, options=opts,
                    prompt_has_masks=has_masks, policy=probe, return_policy_state=True)

    return ProbeLoop(method, opts.steps, run_probe)


def check_prompt(config, prompt_ids: np.ndarray, attention_mask) -> None:
    """Checks prompt_ids [B, P] (non-empty; integer ids in [0, vocab_size)) and attention_mask [B, P]
    (0/1 or bool) on the host with numpy (`check_inputs`): a refused prompt costs no transfer,
    tracing or compilation."""
    if prompt_ids.ndim != 2 or 0 in prompt_ids.shape:
        raise ValueError(f"prompt_ids must be [batch>0, length>0], got shape {prompt_ids.shape}")
    check_inputs(config, prompt_ids, attention_mask, name="prompt_ids")


def as_array(name: str, value) -> np.ndarray:
    try:
        return np.asarray(value)
    except ValueError as e:  # ragged nested lists
        raise ValueError(f"{name} must be a rectangular [batch, length] array of token ids: {e}") from None


def make_options(cls, family: str, options: dict):
    """`cls(**options)` (a family's options dataclass); ValueError naming unknown options and the valid ones
    (`family`: the family's label, for the message)."""
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise ValueError(f"unknown {family} generate options {unknown}; valid: {sorted(valid)}")
    return cls(**options)


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


def rows_on_mesh(mesh, rows):
    """A tree of per-row arrays [B] (the rows' sampling values) over the mesh's "dp" axis, as `on_mesh` places the
    prompts (unchanged without a mesh)."""
    return rows if mesh is None else jax.device_put(rows, batch_sharding(mesh, 1))


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


def cache_dtype_of(kv_cache_dtype: str, policy, model_dtype, mesh=None):
    """The dtype the KV cache is made in for the option `kv_cache_dtype` (`kv_rows.cache_dtype`); ValueError where a
    float8 cache meets what cannot read it: an attention method other than dense (their kernels read plain rows) or
    a mesh."""
    if kv_cache_dtype == "fp8" and mesh is not None:
        raise ValueError("kv_cache_dtype='fp8' runs on one device; a sharded model keeps its cache in the model's "
                         "dtype (use kv_cache_dtype='auto' with mesh=)")
    if kv_cache_dtype == "fp8" and type(policy) is not Dense:
        raise ValueError(f"kv_cache_dtype='fp8' runs with dense attention; {type(policy).__name__} reads a cache in "
                         "the model's dtype (use kv_cache_dtype='auto' with a method)")
    return kv_rows.cache_dtype(kv_cache_dtype, model_dtype)
