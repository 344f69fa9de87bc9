"""SDAR block-diffusion generation as one compiled loop (JetAstra/SDAR `block_diffusion_generate`).

The complete prompt blocks are prefilled into the KV cache; then each block (the first one may
hold the prompt's trailing tokens) is denoised by repeated block steps against the cache, a step
committing n[j] tokens by the remasking strategy, until no mask is left; the block is then
appended to the cache (the commit). Generation stops after the block in which a stop token appears.

The commit is a forward of the finished block (its K/V for the cache). It rides on the next block's
first step: one forward over both blocks, the finished one attending as its own commit forward
would (the block-causal mask keeps the next block out of its view), the next one as its first
step would (`sdar_model.commit_and_step`). That reads the weights once instead of twice per block
(4 forwards per block of 4 steps instead of 5) with the same results; the last block's commit, which
nothing reads, is not run. Blocks run in a `lax.scan` (iterations after every row stopped are skipped by
`lax.cond`), steps in a `lax.while_loop` (their number per block is dynamic).

Batches: rows are left-padded prompts ([B, P] with an attention mask). Each row keeps its own
block alignment, so the loop works in row-local coordinates: row b's tokens are shifted left by its
padding (position j = its j-th real token), its cache fills from position 0, and its blocks start at
multiples of the block size from its first real token. Iteration i of the scan decodes each row's
i-th block (rows whose prompts end in different blocks sit at different positions: the block steps
take per-row positions and cache lengths). Within a block all rows step together; a row whose
block is finished waits (its forwards are discarded, its policy state kept: it runs the SPARSE
mode) until every row is finished or the step limit is reached, and then all rows commit in one
forward. A row commits with the mode its own step count gives, and draws its random numbers from
its own counter, so every row computes exactly what generating it alone computes. A row that has
decoded its last block or stopped idles until the batch ends.

Sampling follows generate.py: logits / T (if T != 1), top-k, top-p (the first token always kept),
softmax, one draw per position; the confidence is the drawn token's probability after filtering.
The draw is by inverse CDF from uniforms `uniform(fold_in(key(seed), t), [1, n])` per row, t counting
that row's denoising forwards from 0 (commit forwards draw nothing). Ties in confidence (e.g. top_k=1, where
every probability is 1) are broken towards the lower position; torch.topk leaves that order
unspecified.

The loops themselves (`denoise_block`: one block's steps; `decode_blocks`: the scan over blocks) are
`dllm_jax.generate.block_loop`'s, shared by every block-diffusion family; this module gives them SDAR's
`BlockSampler` (`SDAR_SAMPLER`) and `SlotLoop` (`SLOTS`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax import quantize
from dllm_jax import validation as check
from dllm_jax.attention import kv_rows, methods
from dllm_jax.attention.policy import AttentionPolicy, Dense
from dllm_jax.config import SDARConfig
from dllm_jax.families import Family
from dllm_jax.generate.block_loop import BlockSampler, SlotLoop, cache_capacity, decode_blocks, trim
from dllm_jax.generate.progress import progress_bar, tick
from dllm_jax.generate.requests import (ProbeLoop, answer_window, as_array, cache_dtype_of, check_context,
                                        check_prompt, make_options, on_devices, on_mesh, rows_on_mesh)
from dllm_jax.generate.sampling import (SDAR_REMASKING, RowSampling, row_sampling, sample_tokens, sample_tokens_per_row,
                                        top_k_bound, transfer_counts, transfer_mask)
from dllm_jax.models import block_diffusion, hf_names, layers
from dllm_jax.models import sdar as sdar_model
from dllm_jax.sharding import DECODER_AXES, shard_kv_cache, to_host

# `generate` left-pads prompts to a multiple of this many positions (masked out: rows run in their own coordinates,
# so a padded row decodes what it would alone, as batched rows do): prompts of nearby lengths share one compiled
# loop instead of one each (an evaluation's prompts differ by a few tokens; each program costs tens of seconds to
# compile at 8B), for at most PROMPT_BUCKET - 1 positions of prefill more
PROMPT_BUCKET = 64
REMASKING = SDAR_REMASKING  # in the order of RowSampling.remasking's indices


@dataclasses.dataclass(frozen=True, kw_only=True)
class SDAROptions:
    """Options of SDAR generation; see `generate_sdar`. The sampling values (temperature, top_k, top_p,
    confidence_threshold, remasking) are inputs of the compiled loop (`RowSampling`): a new value compiles nothing,
    a top_k past 64 only a loop with a larger bound (`top_k_bound`). The others set the loop's shapes: a new
    max_new_tokens or denoising_steps compiles a new loop."""

    max_new_tokens: int = 128
    denoising_steps: int = 4
    remasking: str = "low_confidence_dynamic"
    confidence_threshold: float = 0.85
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    kv_cache_dtype: str = "auto"  # "fp8": the KV cache in e4m3 with per-position scales (dense attention)

    def __post_init__(self):
        def store(name, value):  # canonical int / float: equal options hash equal as static jit arguments
            object.__setattr__(self, name, value)

        for name in ("max_new_tokens", "denoising_steps"):
            store(name, check.integer(name, getattr(self, name)))
        check.choice("remasking", self.remasking, REMASKING)
        # the sampler divides the logits by T (T = inf would flatten them to uniform, NaN poisons them);
        # top_k = 0 and top_p = 1 switch the filters off; the threshold is compared with probabilities
        store("temperature", check.real("temperature", self.temperature, low=0, low_open=True,
                                        hint=" (the official sampler divides the logits by it; top_k=1 is greedy)"))
        store("top_k", check.integer("top_k", self.top_k, minimum=0, hint=" (0 turns the filter off)"))
        store("top_p", check.real("top_p", self.top_p, low=0, high=1, low_open=True))
        store("confidence_threshold", check.real("confidence_threshold", self.confidence_threshold, low=0, high=1))
        kv_rows.check_kv_cache_dtype(self.kv_cache_dtype)

    def sampling(self, batch: int) -> RowSampling:
        """The sampling values in every row of a batch: the loop's traced inputs."""
        return row_sampling(batch, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                            threshold=self.confidence_threshold, remasking=REMASKING.index(self.remasking))

    def structure(self, vocab_size: int) -> "SDAROptions":
        """The options as the compiled loop sees them with `sampling`'s values traced: those values replaced by one
        canonical set (options that differ only in them are one static argument), top_k by its static bound."""
        return dataclasses.replace(self, temperature=1.0, top_p=1.0, confidence_threshold=0.0,
                                   top_k=top_k_bound(self.top_k, vocab_size), remasking=REMASKING[0])


def sdar_schedule(options: SDAROptions, config: SDARConfig, n: int):
    """SDAR's transfer counts: the block size spread over `denoising_steps` forwards."""
    return transfer_counts(config.block_size, options.denoising_steps)


def sdar_commit(logits, u, mask_index, count, options: SDAROptions, rows: RowSampling | None = None):
    """SDAR's step: sample every position (generate.py's sampler), commit by the remasking strategy. `rows`
    (`generate`'s traced values, or a serving engine's per slot): each row's own temperature, top-p, top-k,
    confidence threshold and remasking rule in place of the options' (whose top_k is then the static bound of the
    rows'), temperature 0 meaning greedy (top-k 1, as `options | {"top_k": 1}` decodes). A top-k of 1 keeps each
    position's largest logit, as the filter does, without selecting the bound's candidates."""
    if rows is None:
        x0, x0_p = sample_tokens(logits, u, temperature=options.temperature, top_k=options.top_k, top_p=options.top_p)
    else:
        keep_max = (rows.temperature == 0) | (rows.top_k == 1)
        x0, x0_p = sample_tokens_per_row(logits, u, temperature=jnp.where(rows.temperature == 0, 1.0, rows.temperature),
                                         top_k=jnp.where(keep_max, 0, rows.top_k), max_top_k=options.top_k,
                                         top_p=rows.top_p, keep_max=keep_max)
        return x0, transfer_mask(rows.remasking, mask_index, x0_p, count, rows.threshold)
    return x0, transfer_mask(options.remasking, mask_index, x0_p, count, options.confidence_threshold)


SDAR_SAMPLER = BlockSampler(schedule=sdar_schedule, commit=sdar_commit, commit_and_step=sdar_model.commit_and_step,
                            block_step=sdar_model.block_step)


def generate_sdar(params, prompt_ids, attention_mask, seed, run_id=0, rows: RowSampling | None = None, *,
                  config: SDARConfig, options: SDAROptions, policy: AttentionPolicy = Dense(), on_step=None,
                  return_policy_state: bool = False, mesh=None):
    """The whole generation, traceable as one function.

    prompt_ids int32 [B, P], left-padded as `attention_mask` [B, P] (1 = token, 0 = padding; None:
    no padding) says. `on_step(run_id, block)` (static), if given, is called on the host after every
    decoding iteration. `rows` (traced; `SDAROptions.sampling`): the rows' sampling values, with `options` then
    as `SDAROptions.structure` gives them; None: the options' own values, static. `policy` (static, Dense() by
    default) routes the block steps' attention
    through an attention policy; its per-layer state rides in the carry and its mode is chosen per
    forward by `policy.block_mode` (the prefill stays dense).
    Returns (x int32 [B, width], end int32 [B]) in row-local coordinates (module docstring): row b's
    prompt (without its padding) and its decoded blocks in x[b, :end[b]]; after a stop the rest is
    left as masks. width = ceil((P + max_new_tokens) / bl) * bl. With `return_policy_state`, the
    final per-layer policy state comes third (for diagnostics).
    """
    o, bl = options, config.block_size
    b, p = prompt_ids.shape
    if attention_mask is None:
        lengths = jnp.full((b,), p, jnp.int32)
        iterations = -(-(p + o.max_new_tokens) // bl) - p // bl
    else:
        lengths = jnp.sum(attention_mask != 0, axis=1, dtype=jnp.int32)
        # a row whose prompt ends just past a block boundary needs one block more than its share
        iterations = -(-(bl - 1 + o.max_new_tokens) // bl)
    width = -(-(p + o.max_new_tokens) // bl) * bl
    columns = jnp.arange(width)[None, :] + (p - lengths)[:, None]  # row-local j -> padded column
    shifted = jnp.take_along_axis(prompt_ids.astype(jnp.int32), jnp.minimum(columns, p - 1), axis=1)
    x = jnp.where(columns < p, shifted, config.mask_token_id)
    first = lengths // bl  # each row's first decoded block (its trailing prompt tokens, if any)
    last = -(-(lengths + o.max_new_tokens) // bl)  # one past its last block
    cache = block_diffusion.init_cache(config, b, cache_capacity(width, bl),
                                       cache_dtype_of(o.kv_cache_dtype, policy, params["embed"].dtype, mesh))
    cache = shard_kv_cache(cache, mesh)  # rows over "dp", KV heads over "tp" on a sharded model
    params = block_diffusion.unrolled(params, config)
    prefill_width = p // bl * bl
    if prefill_width:
        cache = sdar_model.prefill(params, x[:, :prefill_width], cache, first * bl, config=config)
    carry = decode_blocks(params, x, cache, block_diffusion.init_policy_state(policy, config, b, width),
                          jax.random.key(seed), lengths=lengths, first=first, last=last, iterations=iterations,
                          block_length=bl, stop_ids=jnp.asarray(config.eos_token_ids, jnp.int32), config=config,
                          options=o, policy=policy, sampler=SDAR_SAMPLER, on_step=on_step, run_id=run_id, rows=rows)
    if return_policy_state:
        return carry.x, carry.decoded, carry.policy_state
    return carry.x, carry.decoded


STATIC = ("config", "options", "policy", "on_step", "return_policy_state", "mesh")
generate_sdar_jit = jax.jit(generate_sdar, static_argnames=STATIC)
# the same program for FP8 weights at batches whose every GEMM is FP8 x FP8 (quantize.cublas_gemms)
generate_sdar_cublas_jit = jax.jit(generate_sdar, static_argnames=STATIC, compiler_options=quantize.CUBLAS_GEMMS)


def program(config: SDARConfig, batch: int):
    """The jitted generation for `batch` rows of `config`'s model: generate_sdar_cublas_jit where a block's
    denoising step multiplies FP8 weights by enough rows that every GEMM is FP8 x FP8, else generate_sdar_jit."""
    return generate_sdar_cublas_jit if quantize.cublas_gemms(config.quantize, batch * config.block_size) else \
        generate_sdar_jit


def left_padded(rows, prompt_ids, attention_mask, width: int, pad_id: int):
    """Host-side: int32 [B, width], row b = its prompt's padding as given, then rows[b], then pad_id."""
    out = np.full((len(rows), width), pad_id, np.int32)
    for b, row in enumerate(rows):
        pad = int(prompt_ids.shape[1] - np.sum(attention_mask[b] != 0))
        out[b, :pad] = prompt_ids[b, :pad]
        kept = row[: width - pad]
        out[b, pad: pad + len(kept)] = kept
    return out


# --- the family's request: checks, run, probes (dllm_jax.families names these) ----------------------

def prepare(model, prompt_ids, attention_mask, method, options: dict):
    """Checks an SDAR request (options, left-padded prompts, context) before anything compiles; returns
    (SDAROptions, int32 prompt_ids, int32 attention_mask or None, the number of decoding iterations)."""
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


def run(model, prompt_ids, attention_mask, seed: int, method, progress: bool, return_nfe: bool, options: dict):
    """`dllm_jax.generate.generate` for an SDAR model (its docstring); `method` is a checked policy."""
    if return_nfe:
        raise ValueError("return_nfe=True is for LLaDA models (SDAR's forwards per block follow its schedule)")
    mesh = model.mesh
    opts, prompt_ids, mask, blocks = prepare(model, prompt_ids, attention_mask, method, options)
    method = on_devices(mesh, method, None)
    placed_ids, placed_mask = on_mesh(mesh, *bucketed(prompt_ids, mask))
    sampling = rows_on_mesh(mesh, opts.sampling(len(placed_ids)))
    with progress_bar(blocks, "SDAR blocks", progress) as run_id:
        generation = program(model.config, len(placed_ids))
        x, end = generation(model.params(), placed_ids, placed_mask, seed, np.int32(run_id), sampling,
                            config=model.config, options=opts.structure(model.config.vocab_size), policy=method,
                            on_step=tick if progress else None, mesh=mesh)
        x, end = to_host(x), to_host(end)
    lengths = np.full(len(x), prompt_ids.shape[1]) if mask is None else mask.sum(axis=1)
    rows = trim(x, end, lengths, set(model.config.stop_ids))
    if mask is None and len(rows) == 1:
        return np.stack(rows)
    return left_padded(rows, prompt_ids, np.ones_like(prompt_ids) if mask is None else mask,
                       prompt_ids.shape[1] + opts.max_new_tokens, model.config.pad_token_id)


def bucketed(prompt_ids: np.ndarray, mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(ids, attention mask) left-padded to the next multiple of PROMPT_BUCKET positions (padding: id 0, mask 0)."""
    b, p = prompt_ids.shape
    pad = -p % PROMPT_BUCKET
    mask = np.ones((b, p), np.int32) if mask is None else mask
    return np.pad(prompt_ids, ((0, 0), (pad, 0))), np.pad(mask, ((0, 0), (pad, 0)))


def slot_check(config: SDARConfig, prompt_ids: np.ndarray, max_new_tokens: int, options: SDAROptions) -> None:
    """`SlotLoop.check_request` for SDAR: what `check_sdar_request` refuses in one unpadded prompt."""
    del max_new_tokens  # any length: SDAR's schedule is per block
    check_sdar_request(config, prompt_ids, [prompt_ids.shape[1]], options)


def config_block_size(config: SDARConfig, options: SDAROptions) -> int:
    return config.block_size


SLOTS = SlotLoop(sampler=SDAR_SAMPLER, loop_params=block_diffusion.unrolled, init_cache=block_diffusion.init_cache,
                 prefill=sdar_model.prefill, init_policy_state=block_diffusion.init_policy_state,
                 block_length=config_block_size, check_request=slot_check, greedy=(("top_k", 1),), cuts_answer=False)


def probe_loop(model, prompt_ids, method, options: dict) -> ProbeLoop:
    """The loop `dllm_jax.analysis.analyze_blocks` probes."""
    opts, prompt_ids, _, blocks = prepare(model, prompt_ids, None, method, options)

    def run_probe(probe, seed):
        tokens, _, state = generate_sdar_jit(model.params(), prompt_ids, None, seed, np.int32(0), config=model.config,
                                             options=opts, policy=probe, return_policy_state=True)
        return tokens, state

    # each block: its first forward carries the previous block's commit (two calls), then the later steps
    return ProbeLoop(method, blocks * (opts.denoising_steps + 1), run_probe)


def eval_options(answer_length: int, config: SDARConfig, given: dict) -> dict:
    """Greedy decoding of one token per step (`dllm_jax.eval.evaluate`'s defaults: top_k=1, static
    remasking, denoising_steps = block_size) over whole blocks holding `answer_length` tokens."""
    bs = config.block_size
    return dict(max_new_tokens=answer_window(answer_length, bs), denoising_steps=bs, top_k=1,
                remasking="low_confidence_static")


FAMILY = Family(name="sdar", config_class=SDARConfig, model_class=sdar_model.SDAR, options_class=SDAROptions,
                prepare=prepare, run=run, probe_loop=probe_loop, answer_option="max_new_tokens", remasking=REMASKING,
                method_kind=methods.BLOCK, param_shapes=layers.lm_param_shapes, hf_rules=hf_names.SDAR_RULES,
                param_axes=DECODER_AXES, eval_options=eval_options, likelihood="block", stops_field="eos_token_ids",
                slots=SLOTS)
