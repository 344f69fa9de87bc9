"""LLaDA masked-diffusion generation as one compiled loop (the official `generate()` of ML-GSAI/LLaDA).

The answer region [P, P + gen_length) starts fully masked and is filled block by block (semi-
autoregressive); inside a block, each of `steps / num_blocks` steps runs the whole sequence through
the model, predicts every masked position, and commits the most confident predictions (or random
ones) following the per-block transfer schedule. All blocks x steps run in one `lax.scan`.

Random numbers (reproducible from `seed`): step t (0-based, over all blocks) draws its Gumbel
uniforms as `uniform(fold_in(fold_in(key(seed), 0), t), [B, L, V])` and its random-remasking
confidences as `uniform(fold_in(fold_in(key(seed), 1), t), [B, L])`, both float32 in [0, 1).
The official code draws the Gumbel noise in float64; JAX runs with 32-bit floats unless x64 is
enabled globally, so the noise here is float32 and the sampled token can differ from a float64 draw
only where two candidates' perturbed scores agree to ~1e-7 relative.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dllm_jax import validation as check
from dllm_jax.attention import methods
from dllm_jax.attention.policy import AttentionPolicy, Dense, Mode
from dllm_jax.config import LLaDAConfig
from dllm_jax.families import Family
from dllm_jax.generate.progress import progress_bar, tick
from dllm_jax.generate.requests import (ProbeLoop, as_array, check_context, check_prompt, full_sequence_probe,
                                        make_options, on_devices, on_mesh, rows_on_mesh)
from dllm_jax.generate.sampling import (RowSampling, commit_top, factor_counts, gumbel_argmax, row_sampling,
                                        transfer_counts)
from dllm_jax.models import hf_names, layers
from dllm_jax.models import llada as llada_model
from dllm_jax.sharding import DECODER_AXES, to_host

REMASKING = ("low_confidence", "random")
CACHES = ("prefix", "dual")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LLaDAOptions:
    """Options of LLaDA generation; see `generate_llada`. The sampling values (temperature, remasking, and
    Fast-dLLM's threshold or factor where one is set) are inputs of the compiled loop (`RowSampling`): a new value
    compiles nothing. The others set the loop's shapes and structure (whether a threshold or a factor is set among them):
    a new one compiles a new loop."""

    gen_length: int = 128
    steps: int = 128
    block_length: int = 128
    temperature: float = 0.0
    cfg_scale: float = 0.0
    remasking: str = "low_confidence"
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False
    padding: str = "ignore"
    cache: str | None = None
    threshold: float | None = None
    factor: float | None = None
    cache_refresh: int = 0

    def __post_init__(self):
        def store(name, value):  # canonical int / float / bool: equal options hash equal as static jit arguments
            object.__setattr__(self, name, value)

        for name in ("gen_length", "steps", "block_length"):
            store(name, check.integer(name, getattr(self, name)))
        check.choice("remasking", self.remasking, REMASKING)
        check.choice("padding", self.padding, llada_model.PADDING_MODES)
        # T scales the Gumbel noise (0: greedy argmax; a negative T inverts it: a draw from no distribution);
        # the CFG logits are uncond + (cfg_scale + 1)(cond - uncond), computed only when cfg_scale > 0
        store("temperature", check.real("temperature", self.temperature, low=0))
        store("cfg_scale", check.real("cfg_scale", self.cfg_scale, low=0, hint=" (0 turns guidance off)"))
        for name in ("logits_eos_inf", "confidence_eos_eot_inf"):
            store(name, check.flag(name, getattr(self, name)))
        if self.gen_length % self.block_length:
            raise ValueError(f"gen_length={self.gen_length} must be a multiple of block_length={self.block_length}"
                             + (" (block_length defaults to 128, as in the official generate; pass block_length="
                                "gen_length for a single block)" if self.block_length == 128 else ""))
        if self.steps > self.gen_length:  # each step is a full forward: a billion of them would run
            raise ValueError(f"steps={self.steps} exceeds gen_length={self.gen_length}: a step unmasks at least one "
                             f"of the gen_length masks, so the {self.steps - self.gen_length} steps past them would "
                             f"unmask none; pass steps <= {self.gen_length}")
        if self.steps % self.num_blocks:
            raise ValueError(f"steps={self.steps} must be a multiple of the number of blocks "
                             f"(gen_length / block_length = {self.num_blocks})")
        if self.cache is not None:
            check.choice("cache", self.cache, CACHES)
        if self.threshold is not None:
            store("threshold", check.real("threshold", self.threshold, low=0, high=1))
        if self.factor is not None:
            store("factor", check.real("factor", self.factor, low=0))
            if self.threshold is not None:
                raise ValueError(f"threshold={self.threshold} and factor={self.factor} are two parallel-decoding rules: "
                                 "pass one")
        store("cache_refresh", check.integer("cache_refresh", self.cache_refresh, minimum=0))
        if self.cache_refresh and self.cache is None:
            raise ValueError(f"cache_refresh={self.cache_refresh} needs cache='prefix' or 'dual' (it says how often "
                             "a block's steps recompute the cache)")
        if self.fast and self.cfg_scale > 0:
            raise ValueError("cfg_scale > 0 is not supported with cache=, threshold= or factor= (Fast-dLLM decoding) yet")

    def sampling(self, batch: int) -> RowSampling:
        """The sampling values in every row of a batch: the loop's traced inputs."""
        return row_sampling(batch, temperature=self.temperature, threshold=self.threshold or 0.0,
                            factor=self.factor or 0.0, remasking=REMASKING.index(self.remasking))

    def structure(self, vocab_size: int) -> "LLaDAOptions":
        """The options as the compiled loop sees them with `sampling`'s values traced: those values replaced by one
        canonical set (options that differ only in them are one static argument); whether a threshold or a factor
        is set stays."""
        del vocab_size  # LLaDA's sampler has no top-k bound
        return dataclasses.replace(self, temperature=0.0, threshold=None if self.threshold is None else 0.0,
                                   factor=None if self.factor is None else 1.0, remasking=REMASKING[0])

    @property
    def fast(self) -> bool:
        """Fast-dLLM decoding: a KV cache, confidence-aware parallel decoding, or both (`generate_llada_fast`)."""
        return self.cache is not None or self.parallel

    @property
    def parallel(self) -> bool:
        """Confidence-aware parallel decoding (threshold= or factor=) instead of the schedule."""
        return self.threshold is not None or self.factor is not None

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks


@struct.dataclass
class StepCarry:
    """The carry of the scan over denoising steps."""

    x: jax.Array  # int32 [B, P + gen_length]: the sequence being denoised
    counts: jax.Array  # int32 [B, steps_per_block]: the current block's transfer schedule
    policy_state: Any  # the attention policy's per-layer state (leading layer axis)


def generate_llada(params, prompt_ids, attention_mask, seed, run_id=0, rows: RowSampling | None = None, *,
                   config: LLaDAConfig, options: LLaDAOptions, prompt_has_masks: bool = False,
                   policy: AttentionPolicy = Dense(), on_step=None, return_policy_state: bool = False):
    """The whole generation, traceable as one function. Returns int32 [B, P + gen_length].

    prompt_ids int32 [B, P] (left-padded if rows differ); attention_mask [B, P] or None. `rows` (traced;
    `LLaDAOptions.sampling`): each row's temperature, with `options` then as `LLaDAOptions.structure` gives them;
    None: the options' own values.
    `on_step(run_id, step)` (static), if given, is called on the host after every step.
    Unless `prompt_has_masks` (static), logits are computed for the answer region only: no other
    position is masked, so no other prediction can be committed. `policy` (static) routes every
    attention call through an attention policy (Dense() by default) whose per-layer state rides in
    the loop carry. `return_policy_state` (static) also returns the policy's final per-layer state
    (for diagnostics: dllm_jax.analysis).
    """
    b, p = prompt_ids.shape
    o = options
    rows = o.sampling(b) if rows is None else rows
    mask_id = config.mask_token_id
    total = p + o.gen_length
    x = jnp.concatenate([prompt_ids.astype(jnp.int32), jnp.full((b, o.gen_length), mask_id, jnp.int32)], axis=1)
    prompt_index = x != mask_id
    if attention_mask is not None:
        attention_mask = jnp.concatenate([attention_mask.astype(jnp.int32), jnp.ones((b, o.gen_length), jnp.int32)], 1)
    positions = jnp.arange(total)
    key = jax.random.key(seed)
    gumbel_key, random_key = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
    logits_from = 0 if prompt_has_masks else p
    model = functools.partial(llada_model.forward, config=config, policy=policy, padding=o.padding,
                              logits_from=logits_from)
    positions = positions[logits_from:]
    policy_rows = 2 * b if o.cfg_scale > 0 else b  # guidance runs the unconditional rows beside them

    def logits_of(x, policy_state, t):
        if o.cfg_scale > 0:
            unconditional = jnp.where(prompt_index, mask_id, x)
            mask = None if attention_mask is None else jnp.concatenate([attention_mask, attention_mask])
            both, policy_state = model(params, jnp.concatenate([x, unconditional]), mask, policy_state, t)
            cond, uncond = both[:b], both[b:]
            return uncond + (o.cfg_scale + 1) * (cond - uncond), policy_state
        return model(params, x, attention_mask, policy_state, t)

    def step(carry: StepCarry, t):
        x = carry.x
        block, i = t // o.steps_per_block, t % o.steps_per_block
        block_end = p + (block + 1) * o.block_length
        in_block = (positions >= block_end - o.block_length) & (positions < block_end)
        mask_index = x[:, logits_from:] == mask_id
        # the schedule of a block comes from its mask count at the block's first step
        counts = jnp.where(i == 0, transfer_counts(jnp.sum(mask_index & in_block, axis=1), o.steps_per_block),
                           carry.counts)
        logits, policy_state = logits_of(x, carry.policy_state, t)
        logits = suppress_eos(logits, o, config)
        x0 = gumbel_argmax(logits, rows.temperature, jax.random.fold_in(gumbel_key, t), total)
        x0_p = token_confidence(logits, x0, o, config, rows,
                                lambda: jax.random.uniform(jax.random.fold_in(random_key, t), (b, total),
                                                           jnp.float32)[:, logits_from:])
        x0_p = jnp.where(positions[None, :] >= block_end, -jnp.inf, x0_p)
        x0 = jnp.where(mask_index, x0, x[:, logits_from:])
        confidence = jnp.where(mask_index, x0_p, -jnp.inf)
        transfer = commit_top(confidence, counts[:, i])
        x = x.at[:, logits_from:].set(jnp.where(transfer, x0, x[:, logits_from:]))
        if on_step is not None:
            # a count needs no ordering, and an unordered callback adds no sync point per step
            jax.debug.callback(on_step, run_id, t, ordered=False)
        return StepCarry(x=x, counts=counts, policy_state=policy_state), None

    carry = StepCarry(x=x, counts=jnp.zeros((b, o.steps_per_block), jnp.int32),
                      policy_state=llada_model.init_policy_state(policy, config, policy_rows, total))
    carry, _ = jax.lax.scan(step, carry, jnp.arange(o.steps, dtype=jnp.int32))
    return (carry.x, carry.policy_state) if return_policy_state else carry.x


def suppress_eos(logits, o: LLaDAOptions, config: LLaDAConfig):
    """logits_eos_inf: EOS can never be predicted."""
    return logits.at[..., config.eos_token_id].set(-jnp.inf) if o.logits_eos_inf else logits


def token_confidence(logits, x0, o: LLaDAOptions, config: LLaDAConfig, rows: RowSampling, random_confidence):
    """The confidence of each predicted token x0 [B, n] under each row's remasking rule (`rows.remasking`, an index
    into REMASKING): its softmax probability ("low_confidence"), or `random_confidence()` ("random", uniforms
    [B, n]); the EOS rule reads each row's temperature (`rows.temperature`)."""
    if o.confidence_eos_eot_inf:
        # generate.py: `logits_with_noise[..., EOS] = logits[..., EoT] = -inf`. The confidence
        # softmax reads `logits`, so EoT confidence becomes 0; at T=0 add_gumbel_noise returns
        # `logits` itself, the two names alias, and EOS confidence becomes 0 as well.
        logits = logits.at[..., config.eot_token_id].set(-jnp.inf)
        eos = config.eos_token_id
        logits = logits.at[..., eos].set(jnp.where((rows.temperature == 0)[:, None], -jnp.inf, logits[..., eos]))
    probs = jax.nn.softmax(logits, axis=-1)
    confidence = jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]
    # the uniforms are [B, n], drawn whether or not a row remasks at random (a constant rule folds the choice away)
    return jnp.where((rows.remasking == REMASKING.index("random"))[:, None], random_confidence(), confidence)


@struct.dataclass
class FastCarry:
    """The carry of Fast-dLLM decoding: the sequence, the cache, and the counters."""

    x: jax.Array  # int32 [B, P + gen_length]
    cache: Any  # llada_model.KVCache of the whole sequence; None without a cache
    counts: jax.Array  # int32 [B, steps_per_block]: the block's transfer schedule (threshold=None)
    i: jax.Array  # int32: the step within the block
    nfe: jax.Array  # int32: model forwards so far
    policy_state: Any  # the attention policy's per-layer state (leading layer axis)
    has_pattern: jax.Array  # bool: a full forward has built the policy's pattern (ESTIMATE)


def generate_llada_fast(params, prompt_ids, attention_mask, seed, run_id=0, rows: RowSampling | None = None, *,
                        config: LLaDAConfig, options: LLaDAOptions, policy: AttentionPolicy = Dense(), on_step=None):
    """Fast-dLLM decoding (NVlabs/Fast-dLLM llada/generate.py) as one compiled loop: (int32 [B, P +
    gen_length], int32 number of model forwards). `rows` (traced; `LLaDAOptions.sampling`): each row's
    temperature, threshold and factor, with `options` then as `LLaDAOptions.structure` gives them; None: the
    options' own values.

    Blocks run in a `lax.scan`; a block's steps in a `lax.while_loop` that stops once no row has a
    mask left in the block (the official `while True`). A block's first step (and, with
    cache_refresh=k, every k-th) runs the full sequence and stores every layer's keys and values;
    its other steps run, against that cache, the block and everything after it with the cached
    prefix ("prefix") or the block alone with the cached prefix and suffix ("dual"); without a
    cache every step is a full forward. A step commits the block's schedule (threshold=None, as the
    original sampler) or, with a threshold, each row's most confident masked position plus every
    other one whose confidence is at least the threshold (the official `get_transfer_index`), or with a
    factor as many as the official factor rule allows (`get_transfer_index_dynamic`, `factor_counts`).
    Positions past the block never change, as in the official code. A block stops after steps_per_block
    steps (schedule) or block_length steps (threshold, factor) even if masks are left, which happens only when
    the model predicts the mask id itself. Unlike the official cached loops, no forward runs after a
    step that filled the block (same tokens, one forward fewer per such block). Random draws (temperature > 0,
    remasking="random") come from `fold_in(key(seed), 0 or 1)` folded with the forward count, over
    the block's positions.

    A sparse `policy` (SparseD, PulseCol; bound to `steps` forwards) follows its schedule over the
    forward count: forward n runs in `policy.mode(n)`. A pattern is built (ESTIMATE) by full
    forwards only, over the whole sequence; a cached forward applies it to its window's rows
    (`policy.attend_window`) in SPARSE mode and attends densely otherwise, and so does any forward
    before the first pattern exists (a SPARSE full forward then builds it instead).
    """
    b, p = prompt_ids.shape
    o, bl = options, options.block_length
    rows = o.sampling(b) if rows is None else rows
    mask_id = config.mask_token_id
    x = jnp.concatenate([prompt_ids.astype(jnp.int32), jnp.full((b, o.gen_length), mask_id, jnp.int32)], axis=1)
    if attention_mask is not None:
        attention_mask = jnp.concatenate([attention_mask.astype(jnp.int32), jnp.ones((b, o.gen_length), jnp.int32)], 1)
    key = jax.random.key(seed)
    gumbel_key, random_key = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
    full = functools.partial(llada_model.forward_caching, config=config, policy=policy, padding=o.padding,
                             logits_from=p)
    window = functools.partial(llada_model.forward_window, config=config, policy=policy, padding=o.padding)
    sparse = int(Mode.SPARSE)

    def block_logits(carry: FastCarry, start):
        """(logits of the block [B, bl, V], cache, policy_state, has_pattern) from a full or a cached forward."""
        mode = jnp.asarray(policy.mode(carry.nfe), jnp.int32)

        def full_forward(_):
            if o.cache is None:  # every forward is full: `forward` follows the policy's own schedule
                logits, states = llada_model.forward(params, carry.x, attention_mask, carry.policy_state, carry.nfe,
                                                     config=config, policy=policy, padding=o.padding, logits_from=p)
                cache, has_pattern = carry.cache, carry.has_pattern
            else:
                full_mode = jnp.where((mode == sparse) & ~carry.has_pattern, int(Mode.ESTIMATE), mode)
                has_pattern = carry.has_pattern | (full_mode == int(Mode.ESTIMATE))
                logits, cache, states = full(params, carry.x, attention_mask, carry.policy_state, full_mode)
            return jax.lax.dynamic_slice_in_dim(logits, start - p, bl, axis=1), cache, states, has_pattern

        def cached_forward(_):
            window_mode = jnp.where((mode == sparse) & carry.has_pattern, sparse, int(Mode.DENSE))
            if o.cache == "dual":
                ids = jax.lax.dynamic_slice_in_dim(carry.x, start, bl, axis=1)
                logits = window(params, ids, start, carry.cache, attention_mask, carry.policy_state, window_mode)
            else:
                # the answer region [P, end) in one static shape; positions before the block keep their cache
                logits = window(params, carry.x[:, p:], p, carry.cache, attention_mask, carry.policy_state,
                                window_mode, keep_below=start)
                logits = jax.lax.dynamic_slice_in_dim(logits, start - p, bl, axis=1)
            return logits, carry.cache, carry.policy_state, carry.has_pattern

        if o.cache is None:
            return full_forward(None)
        refresh = carry.i == 0
        if o.cache_refresh:
            refresh |= carry.i % o.cache_refresh == 0
        return jax.lax.cond(refresh, full_forward, cached_forward, None)

    def step(carry: FastCarry, start):
        logits, cache, policy_state, has_pattern = block_logits(carry, start)
        logits = suppress_eos(logits, o, config)
        current = jax.lax.dynamic_slice_in_dim(carry.x, start, bl, axis=1)
        masked = current == mask_id
        draws = jax.random.fold_in(gumbel_key, carry.nfe)
        x0 = gumbel_argmax(logits, rows.temperature, draws, bl)
        x0_p = token_confidence(logits, x0, o, config, rows, lambda: jax.random.uniform(
            jax.random.fold_in(random_key, carry.nfe), (b, bl), jnp.float32))
        confidence = jnp.where(masked, x0_p, -jnp.inf)
        if o.factor is not None:
            transfer = commit_top(confidence, factor_counts(confidence, rows.factor))
        elif o.threshold is None:
            transfer = commit_top(confidence, carry.counts[:, carry.i])
        else:
            transfer = commit_top(confidence, jnp.ones((b,), jnp.int32)) | (confidence >= rows.threshold[:, None])
        transfer &= masked
        x = jax.lax.dynamic_update_slice_in_dim(carry.x, jnp.where(transfer, x0, current), start, axis=1)
        if on_step is not None:
            jax.debug.callback(on_step, run_id, carry.nfe, ordered=False)
        return carry.replace(x=x, cache=cache, i=carry.i + 1, nfe=carry.nfe + 1, policy_state=policy_state,
                             has_pattern=has_pattern)

    def block(carry: FastCarry, index):
        start = p + index * bl
        masked = jax.lax.dynamic_slice_in_dim(carry.x, start, bl, axis=1) == mask_id
        carry = carry.replace(counts=transfer_counts(jnp.sum(masked, axis=1), o.steps_per_block),
                              i=jnp.zeros((), jnp.int32))

        def unfinished(carry: FastCarry):
            # the bound only binds if the model predicts the mask id itself (a committed mask stays a
            # mask): where the official loops would raise (schedule) or never end (threshold)
            limit = bl if o.parallel else o.steps_per_block
            return jnp.any(jax.lax.dynamic_slice_in_dim(carry.x, start, bl, axis=1) == mask_id) & (carry.i < limit)

        return jax.lax.while_loop(unfinished, functools.partial(step, start=start), carry), None

    cache = None if o.cache is None else llada_model.init_kv_cache(config, b, p + o.gen_length, params["embed"].dtype)
    carry = FastCarry(x=x, cache=cache,
                      counts=jnp.zeros((b, o.steps_per_block), jnp.int32), i=jnp.zeros((), jnp.int32),
                      nfe=jnp.zeros((), jnp.int32),
                      policy_state=llada_model.init_policy_state(policy, config, b, p + o.gen_length),
                      has_pattern=jnp.zeros((), bool))
    carry, _ = jax.lax.scan(block, carry, jnp.arange(o.num_blocks, dtype=jnp.int32))
    return carry.x, carry.nfe


generate_llada_fast_jit = jax.jit(generate_llada_fast, static_argnames=("config", "options", "policy", "on_step"))


STATIC = ("config", "options", "prompt_has_masks", "policy", "on_step", "return_policy_state")
generate_llada_jit = jax.jit(generate_llada, static_argnames=STATIC)



# --- the family's request: checks, run, probes (dllm_jax.families names these) ----------------------

def prepare(model, prompt_ids, attention_mask, method, options: dict):
    """Checks a LLaDA request (options, prompt, context) before anything compiles; returns (LLaDAOptions,
    int32 prompt_ids, the method bound to this generation's schedule)."""
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


def run(model, prompt_ids, attention_mask, seed: int, method, progress: bool, return_nfe: bool, options: dict):
    """`dllm_jax.generate.generate` for a LLaDA model (its docstring); `method` is a checked policy."""
    mesh = model.mesh
    opts, prompt_ids, method = prepare(model, prompt_ids, attention_mask, method, options)
    if opts.fast:
        check_fast(model.config, prompt_ids, method, opts)
    method = on_devices(mesh, method, prompt_ids.shape[1] + opts.gen_length)
    mask = None if attention_mask is None else np.asarray(attention_mask, np.int32)
    placed_ids, placed_mask = on_mesh(mesh, prompt_ids, mask)  # the host arrays stay for the checks
    sampling = rows_on_mesh(mesh, opts.sampling(len(prompt_ids)))
    structure = opts.structure(model.config.vocab_size)
    if opts.fast:
        with progress_bar(opts.steps, "LLaDA denoising (at most)", progress) as run_id:
            out, nfe = generate_llada_fast_jit(model.params(), placed_ids, placed_mask, seed, np.int32(run_id),
                                               sampling, config=model.config, options=structure, policy=method,
                                               on_step=tick if progress else None)
            return (to_host(out), int(nfe)) if return_nfe else to_host(out)
    with progress_bar(opts.steps, "LLaDA denoising", progress) as run_id:
        out = generate_llada_jit(model.params(), placed_ids, placed_mask, seed, np.int32(run_id), sampling,
                                 config=model.config, options=structure,
                                 prompt_has_masks=bool((prompt_ids == model.config.mask_token_id).any()),
                                 policy=method, on_step=tick if progress else None)
        return (to_host(out), opts.steps * (2 if opts.cfg_scale > 0 else 1)) if return_nfe else to_host(out)


def probe_loop(model, prompt_ids, method, options: dict) -> ProbeLoop:
    """The loop `dllm_jax.analysis.analyze` probes: one policy call per step and layer."""
    return full_sequence_probe(model, prompt_ids, method, options, prepare=prepare, loop=generate_llada_jit)


def eval_options(answer_length: int, config: LLaDAConfig, given: dict) -> dict:
    """Greedy decoding of one token per step over one block (`dllm_jax.eval.evaluate`'s defaults); a
    given gen_length sets the default steps and block_length."""
    length = given.get("gen_length", answer_length)
    return dict(gen_length=length, steps=length, block_length=length, temperature=0.0)


FAMILY = Family(name="llada", config_class=LLaDAConfig, model_class=llada_model.LLaDA, options_class=LLaDAOptions,
                prepare=prepare, run=run, probe_loop=probe_loop, answer_option="gen_length", remasking=REMASKING,
                method_kind=methods.BIDIRECTIONAL, param_shapes=layers.lm_param_shapes, hf_rules=hf_names.LLADA_RULES,
                param_axes=DECODER_AXES, eval_options=eval_options, likelihood="masked")
