"""DiffusionGemma's sampler as one jitted loop: canvases after the prompt, each denoised from uniform noise.

For each canvas of `canvas_length` tokens (as many as `max_new_tokens` needs), as transformers'
`DiffusionGemmaGenerationMixin.generate` runs it:

  * the canvas starts as uniformly random tokens;
  * each denoising step (at most `max_denoising_steps`, counted down N..1) runs the decoder over the canvas
    against the encoder's cache, conditioned on the previous step's logits (none at the first step), divides the
    logits by the step's temperature (linear from t_max at step N to t_min at step 0), samples every position,
    and accepts the sampled tokens at the positions of lowest entropy while their entropies, summed without the
    largest, stay within `entropy_bound`; the other positions are re-noised with random tokens;
  * a row stops denoising once its argmax canvas has not changed for `stability_threshold` steps and its mean
    entropy is below `confidence_threshold` (its canvas, argmax and logits are then frozen while other rows go on);
  * the argmax canvas is appended; a row whose canvas holds a stop id is finished (tokens after the stop become
    the pad id, its later canvases all pad); the canvas is encoded into the cache (causal, as the prompt) before
    the next one.

Each row runs in its own coordinates (its prompt at positions 0..len-1, its canvases right after it), so a row's
tokens are those of generating it alone. Random draws come from one key: canvas k's initial tokens, and step j's
uniforms (one per position, sampling by the inverse of the distribution's CDF) and re-noising tokens
(`initial_canvas`, `step_draws`), the same for every row; or from a key per row (keys [B]: each row draws what it
draws alone with its key, so requests with their own seeds share a batch).

`dllm_jax.generate.generate` runs it for a `DiffusionGemma` model through this module's registry entry (`FAMILY`:
`prepare` checks a request, `run` lays the answers out as every family's generate does); `generate` below is the
same loop on a parameter tree and lists of prompts.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dllm_jax import quantize
from dllm_jax import validation as check
from dllm_jax.attention import methods
from dllm_jax.attention.mage import MAGE
from dllm_jax.attention.policy import Dense
from dllm_jax.diffusion_gemma_config import DiffusionGemmaConfig
from dllm_jax.families import Family
from dllm_jax.generate.progress import progress_bar, tick
from dllm_jax.generate.requests import as_array, check_context, check_prompt, make_options
from dllm_jax.models import diffusion_gemma_weights as weights
from dllm_jax.models import hf_names
from dllm_jax.models.diffusion_gemma import DiffusionGemma, decode, decode_mage, encode, init_cache, init_selection


# prompt positions encoded per pass (`encode_prompt`): bounds the prefill's attention scores
PREFILL_CHUNK = 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiffusionGemmaOptions:
    """The sampler's options, with transformers' names and defaults (`DiffusionGemmaGenerationConfig`).
    `confidence_threshold=None` turns adaptive stopping off (every canvas runs all its steps)."""

    max_new_tokens: int = 256
    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float | None = 0.005

    def __post_init__(self):
        check.integer("max_new_tokens", self.max_new_tokens, minimum=1)
        check.integer("max_denoising_steps", self.max_denoising_steps, minimum=1)
        check.real("entropy_bound", self.entropy_bound, low=0, low_open=True)
        check.real("t_min", self.t_min, low=0)
        check.real("t_max", self.t_max, low=0)
        if self.t_max <= self.t_min:
            raise ValueError(f"t_max={self.t_max} must be above t_min={self.t_min} (the schedule runs t_max -> t_min)")
        check.integer("stability_threshold", self.stability_threshold, minimum=0)
        if self.confidence_threshold is not None:
            check.real("confidence_threshold", self.confidence_threshold, low=0, low_open=True)

    def canvases(self, canvas_length: int) -> int:
        return math.ceil(self.max_new_tokens / canvas_length)

    def structure(self) -> "DiffusionGemmaOptions":
        """The options the compiled loop is built for: max_new_tokens (its canvases) and stability_threshold (the
        shape of its history); the others at their defaults, since they reach the loop as `sampling()`."""
        return DiffusionGemmaOptions(max_new_tokens=self.max_new_tokens, stability_threshold=self.stability_threshold)

    def sampling(self) -> "CanvasSampling":
        """The values the loop takes as inputs (`CanvasSampling`): a new value compiles nothing."""
        return CanvasSampling.of(self)


@struct.dataclass
class CanvasSampling:
    """The sampler's values as inputs of the compiled loop, each a scalar array. t_range is t_max - t_min, taken
    in float64 before the cast (as the schedule computed it from the options' numbers); confidence_threshold is
    -inf where adaptive stopping is off (no mean entropy is below it)."""

    steps: jax.Array  # int32: max_denoising_steps
    entropy_bound: jax.Array  # float32
    t_min: jax.Array  # float32
    t_range: jax.Array  # float32
    confidence_threshold: jax.Array  # float32

    @classmethod
    def of(cls, options: DiffusionGemmaOptions) -> "CanvasSampling":
        threshold = -np.inf if options.confidence_threshold is None else options.confidence_threshold
        return cls(steps=np.int32(options.max_denoising_steps), entropy_bound=np.float32(options.entropy_bound),
                   t_min=np.float32(options.t_min), t_range=np.float32(options.t_max - options.t_min),
                   confidence_threshold=np.float32(threshold))


def temperature(sampling: CanvasSampling, step):
    """The temperature of denoising step `step` (0-based: the first is the schedule's step N, at t_max)."""
    return sampling.t_min + sampling.t_range * (sampling.steps - step) / sampling.steps


def canvas_key(key, canvas):
    return jax.random.fold_in(key, canvas)


def initial_canvas(key, canvas, config: DiffusionGemmaConfig):
    """int32 [C]: canvas `canvas`'s starting tokens."""
    return jax.random.randint(jax.random.fold_in(canvas_key(key, canvas), 0), (config.canvas_length,), 0,
                              config.vocab_size, jnp.int32)


def step_draws(key, canvas, step, config: DiffusionGemmaConfig):
    """(float32 uniforms [C] that sample each position, int32 [C] re-noising tokens) of denoising step `step`."""
    sample_key, noise_key = jax.random.split(jax.random.fold_in(canvas_key(key, canvas), step + 1))
    return (jax.random.uniform(sample_key, (config.canvas_length,), jnp.float32),
            jax.random.randint(noise_key, (config.canvas_length,), 0, config.vocab_size, jnp.int32))


def per_row(draw, key):
    """draw(key): from one key (the same draws for every row), or from each row's own key (keys [B]: the draws get a
    leading row axis)."""
    return draw(key) if key.ndim == 0 else jax.vmap(draw)(key)


def inverse_cdf(probs, uniforms):
    """int32 [..., C]: the token whose CDF interval holds each uniform (probs [..., C, V])."""
    below = jnp.cumsum(probs, axis=-1) < uniforms[..., None]
    return jnp.minimum(jnp.sum(below, axis=-1), probs.shape[-1] - 1).astype(jnp.int32)


def entropy(logits):
    """float32 [..., C]: the entropy of each position's distribution softmax(logits)."""
    log_p = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)


def accepted_positions(token_entropy, bound: float):
    """bool [B, C]: the lowest-entropy positions whose entropies, summed without the largest of them, are within
    `bound` (an upper bound on their joint mutual information: tokens accepted together are about independent)."""
    order = jnp.argsort(token_entropy, axis=-1, stable=True)
    ranked = jnp.take_along_axis(token_entropy, order, axis=-1)
    within = jnp.cumsum(ranked, axis=-1) - ranked <= bound
    rows = jnp.arange(token_entropy.shape[0])[:, None]
    return jnp.zeros_like(within).at[rows, order].set(within)


@struct.dataclass
class DenoiseCarry:
    """One canvas's denoising loop."""

    current: jax.Array  # int32 [B, C]: the canvas the next step denoises
    argmax: jax.Array  # int32 [B, C]: the last step's most likely tokens
    logits: jax.Array  # [B, C, V]: the last step's tempered logits (the next step's self-conditioning)
    history: jax.Array  # int32 [stability_threshold, B, C]: the argmax canvases of the last steps (-1: none yet)
    done: jax.Array  # bool [B]: the row stopped denoising
    forwards: jax.Array  # int32 [B]: decoder forwards each row needed (not counting those after it stopped)
    cache: object  # the encoder's cache (the decoder writes the canvas's keys and values in its scratch slots)
    step: jax.Array  # int32 []: steps run
    selection: dict | None = None  # MAGE's selection per sparse layer, made at the canvas's first step (`decode_mage`)


@struct.dataclass
class CanvasCarry:
    """The loop over canvases."""

    cache: object
    out: jax.Array  # int32 [B, canvases * C]: the canvases so far (pad after)
    forwards: jax.Array  # int32 [B]: decoder forwards each row needed
    finished: jax.Array  # bool [B]: the row generated a stop id
    canvas: jax.Array  # int32 []: canvases run


def denoise_step(params, s: DenoiseCarry, key, canvas, sampling: CanvasSampling, *, config: DiffusionGemmaConfig,
                 options: DiffusionGemmaOptions, backend: str, method) -> DenoiseCarry:
    if method is None:
        logits, cache = decode(params, s.current, s.cache, s.logits, config=config, backend=backend,
                               conditioned=s.step > 0)
        selection = None
    else:
        logits, cache, selection = decode_mage(params, s.current, s.cache, s.logits, s.selection, config=config,
                                               method=method, backend=backend, conditioned=s.step > 0,
                                               select=s.step == 0)
    tempered = logits / temperature(sampling, s.step)
    uniforms, noise = per_row(lambda k: step_draws(k, canvas, s.step, config), key)
    sampled = inverse_cdf(jax.nn.softmax(tempered, axis=-1), uniforms)
    token_entropy = entropy(tempered)
    accept = accepted_positions(token_entropy, sampling.entropy_bound)
    current = jnp.where(accept, sampled, noise)  # the accepted tokens, the rest re-noised
    argmax = jnp.argmax(tempered, axis=-1).astype(jnp.int32)
    frozen = s.done[:, None]
    current, argmax = jnp.where(frozen, s.current, current), jnp.where(frozen, s.argmax, argmax)
    tempered = jnp.where(frozen[..., None], s.logits.astype(tempered.dtype), tempered)
    done, history = s.done, s.history
    stable = jnp.all(history == argmax[None], axis=(0, 2))  # no history (threshold 0): stable
    if options.stability_threshold:
        history = jnp.concatenate([history[1:], argmax[None]], axis=0)
    # this step's entropies serve every row: a frozen row (whose logits are last step's) is done already
    done = done | (stable & (jnp.mean(token_entropy, axis=-1) < sampling.confidence_threshold))
    return DenoiseCarry(current=current, argmax=argmax, logits=tempered.astype(s.logits.dtype), history=history,
                        done=done, forwards=s.forwards + ~s.done, cache=cache, step=s.step + 1, selection=selection)


def denoise_canvas(params, cache, key, canvas, finished, sampling: CanvasSampling, *, config: DiffusionGemmaConfig,
                   options: DiffusionGemmaOptions, backend: str, method):
    """(int32 argmax canvas [B, C], cache, int32 [B] forwards each row needed) of canvas `canvas` after each row's
    last denoising step (a row `finished` before it needs none). With `method` (a MAGE) the first step attends
    exactly and selects; the later steps attend to its selection."""
    b, c = cache.length.shape[0], config.canvas_length
    start = jnp.broadcast_to(per_row(lambda k: initial_canvas(k, canvas, config), key), (b, c))
    dtype = params["embed"].dtype
    s = DenoiseCarry(current=start, argmax=start, logits=jnp.zeros((b, c, config.vocab_size), dtype),
                     history=jnp.full((options.stability_threshold, b, c), -1, jnp.int32),
                     done=jnp.zeros((b,), bool), forwards=jnp.zeros((b,), jnp.int32), cache=cache, step=jnp.int32(0),
                     selection=None if method is None else init_selection(config, method, b))
    step = functools.partial(denoise_step, params, key=key, canvas=canvas, sampling=sampling, config=config,
                             options=options, backend=backend, method=method)
    s = jax.lax.while_loop(lambda s: (s.step < sampling.steps) & ~jnp.all(s.done), step, s)
    # a finished row's forwards are discarded (its canvas becomes pad): they are not counted, as transformers counts
    return s.argmax, s.cache, jnp.where(finished, 0, s.forwards)


def finalize(tokens, finished, *, stop_ids: tuple[int, ...], pad_id: int):
    """(canvas tokens [B, C] with the pad id after each row's first stop id and everywhere in rows finished
    before, finished rows [B])."""
    is_stop = jnp.isin(tokens, jnp.asarray(stop_ids, jnp.int32)) if stop_ids else jnp.zeros(tokens.shape, bool)
    seen = jnp.cumsum(is_stop, axis=1)
    after_stop = (seen > 0) & ~((seen == 1) & is_stop)
    tokens = jnp.where(finished[:, None] | after_stop, pad_id, tokens)
    return tokens, finished | jnp.any(is_stop, axis=1)


def encode_prompt(params, prompt, lengths, cache, *, config: DiffusionGemmaConfig, backend: str, chunk: int):
    """The cache after prompt [B, P] (`lengths` [B] real tokens per row), encoded `chunk` positions at a time: a
    pass's attention holds [B, H, chunk, cache length] scores, not [B, H, P, cache length] (at a 4k prompt and batch
    16, 18 GiB per global layer), and a sliding layer reads its window of the cache. The cache must hold
    ceil(P / chunk) * chunk positions (a chunk past a row's prompt writes its scratch slots)."""
    b, p = prompt.shape
    if p <= chunk:
        return encode(params, prompt, cache, lengths, config=config, backend=backend)
    pieces = -(-p // chunk)
    padded = jnp.pad(prompt, ((0, 0), (0, pieces * chunk - p)))

    def piece(i, cache):
        ids = jax.lax.dynamic_slice_in_dim(padded, i * chunk, chunk, axis=1)
        return encode(params, ids, cache, jnp.clip(lengths - i * chunk, 0, chunk), config=config, backend=backend)

    return jax.lax.fori_loop(0, pieces, piece, cache)


def generate_canvases(params, prompt, lengths, key, sampling: CanvasSampling | None = None, *,
                      config: DiffusionGemmaConfig, options: DiffusionGemmaOptions,
                      stop_ids: tuple[int, ...], pad_id: int, backend: str = "auto",
                      prefill_chunk: int = PREFILL_CHUNK, method=None, on_canvas=None, run_id=0):
    """(int32 [B, canvases * C] generated tokens, int32 [] canvases run, int32 [B] decoder forwards each row needed)
    after prompt [B, P] (row b's real tokens first, `lengths` [B] of them; the rest ignored), encoded
    `prefill_chunk` positions at a time, sampled with `sampling` (traced: `DiffusionGemmaOptions.sampling`; None:
    the options' own values, as constants of the program); `method`: None (dense) or a MAGE on the canvases' global
    layers (`decode_mage`). `on_canvas(run_id, canvas)` (static), if given, is called on the host after every canvas
    (`dllm_jax.generate.progress.tick`: a progress bar). Jit-compatible: the loops are `lax.while_loop`s."""
    b, p = prompt.shape
    c, canvases = config.canvas_length, options.canvases(config.canvas_length)
    sampling = CanvasSampling.of(options) if sampling is None else sampling
    encoded = p if p <= prefill_chunk else -(-p // prefill_chunk) * prefill_chunk
    cache = init_cache(config, b, encoded + canvases * c, params["embed"].dtype)
    cache = encode_prompt(params, prompt, lengths, cache, config=config, backend=backend, chunk=prefill_chunk)

    def one_canvas(s: CanvasCarry) -> CanvasCarry:
        tokens, cache, forwards = denoise_canvas(params, s.cache, key, s.canvas, s.finished, sampling, config=config,
                                                 options=options, backend=backend, method=method)
        tokens, finished = finalize(tokens, s.finished, stop_ids=stop_ids, pad_id=pad_id)
        if canvases > 1:  # the next canvas attends to this one, encoded as the prompt was (the last one's is unused)
            cache = encode(params, tokens, cache, config=config, backend=backend)
        out = jax.lax.dynamic_update_slice_in_dim(s.out, tokens, s.canvas * c, axis=1)
        if on_canvas is not None:
            jax.debug.callback(on_canvas, run_id, s.canvas, ordered=False)
        return CanvasCarry(cache=cache, out=out, forwards=s.forwards + forwards, finished=finished,
                           canvas=s.canvas + 1)

    s = CanvasCarry(cache=cache, out=jnp.full((b, canvases * c), pad_id, jnp.int32),
                    forwards=jnp.zeros((b,), jnp.int32), finished=jnp.zeros((b,), bool), canvas=jnp.int32(0))
    s = jax.lax.while_loop(lambda s: (s.canvas < canvases) & ~jnp.all(s.finished), one_canvas, s)
    return s.out, s.canvas, s.forwards


STATIC = ("config", "options", "stop_ids", "pad_id", "backend", "prefill_chunk", "method", "on_canvas")
generate_canvases_jit = jax.jit(generate_canvases, static_argnames=STATIC)
# the same program for FP8 weights where every GEMM is FP8 x FP8 (quantize.cublas_gemms)
generate_canvases_cublas_jit = jax.jit(generate_canvases, static_argnames=STATIC,
                                       compiler_options=quantize.CUBLAS_GEMMS)


def program(config: DiffusionGemmaConfig, batch: int, prompt_width: int):
    """The jitted generation for `batch` prompts of `prompt_width` positions: generate_canvases_cublas_jit where
    FP8 weights meet enough rows in every pass (the prompt's first chunk, each canvas) that every GEMM is FP8 x FP8,
    else generate_canvases_jit."""
    rows = batch * min(prompt_width, config.canvas_length, PREFILL_CHUNK)
    return generate_canvases_cublas_jit if quantize.cublas_gemms(config.quantize, rows) else generate_canvases_jit


def generate(params, prompts, *, config: DiffusionGemmaConfig, options: DiffusionGemmaOptions, seed=0,
             stop_ids: tuple[int, ...] = (), pad_id: int = 0, backend: str = "auto", method=None,
             progress: bool = False) -> list[np.ndarray]:
    """Each prompt (a list of int token ids) followed by its generated canvases, as transformers' `generate`
    returns a prompt alone: the canvases run until every row stopped (a row's tokens past its stop id, and its
    canvases after it, are `pad_id`). One jitted loop for the batch; `seed`: an int (every row's draws) or one per
    prompt (each row what it gets alone with its own); `method`: None (dense) or a `MAGE`; `progress`: a tqdm bar
    advanced after every canvas from inside the loop."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, each of at least one token")
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    ids = np.zeros((len(prompts), int(lengths.max())), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = prompt
    if ids.min() < 0 or ids.max() >= config.vocab_size:
        raise ValueError(f"token ids must be in [0, {config.vocab_size}), got [{ids.min()}, {ids.max()}]")
    if np.ndim(seed) == 0:
        key = jax.random.key(seed)
    elif len(seed) == len(prompts):
        key = jax.vmap(jax.random.key)(np.asarray(seed, np.int32))
    else:
        raise ValueError(f"seed holds {len(seed)} seeds for {len(prompts)} prompts: give an int or one per prompt")
    run = program(config, *ids.shape)
    with progress_bar(options.canvases(config.canvas_length), "DiffusionGemma canvases", progress) as run_id:
        out, ran, _ = run(params, ids, lengths, key, options.sampling(), config=config,
                          options=options.structure(),
                          stop_ids=tuple(int(i) for i in stop_ids), pad_id=int(pad_id), backend=backend, method=method,
                          on_canvas=tick if progress else None, run_id=np.int32(run_id))
        out, ran = np.asarray(out), int(ran)
    out = out[:, :ran * config.canvas_length]
    return [np.concatenate([np.asarray(prompt, np.int32), row]) for prompt, row in zip(prompts, out)]


# --- the registry's entry ------------------------------------------------------------------------------------

def prepare(model, prompt_ids, attention_mask, method, options: dict):
    """(DiffusionGemmaOptions, each row's prompt tokens) of a request, checked on the host: the options, the
    prompt ids [B, P], attention_mask [B, P] (1: a token, 0: padding anywhere; each row's tokens are its prompt,
    at positions 0..n-1), each row's prompt and canvases within the context, and the attention (`method`: Dense or
    MAGE, on the global layers' cached prefix)."""
    if type(method) not in (Dense, MAGE):
        raise ValueError(f"method={type(method).__name__}: DiffusionGemma's canvases attend densely or with MAGE "
                         "(method='mage') on their global layers; use one of those")
    opts = make_options(DiffusionGemmaOptions, "DiffusionGemma", options)
    prompt_ids = as_array("prompt_ids", prompt_ids)
    check_prompt(model.config, prompt_ids, attention_mask)
    mask = np.ones(prompt_ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    rows = [row[keep] for row, keep in zip(prompt_ids, mask)]
    generated = opts.canvases(model.config.canvas_length) * model.config.canvas_length
    for b, row in enumerate(rows):
        if not len(row):
            raise ValueError(f"attention_mask row {b} marks no token: every prompt needs at least one")
        check_context(model.config, len(row), generated, row=b if len(rows) > 1 else None)
    return opts, rows


def run(model, prompt_ids, attention_mask, seed, method, progress, return_nfe, options: dict):
    """`dllm_jax.generate.generate` for a DiffusionGemma model: options max_new_tokens=256, max_denoising_steps=48,
    entropy_bound=0.1, t_min=0.4, t_max=0.8, stability_threshold=1, confidence_threshold=0.005 (None: no adaptive
    stopping), transformers' names and defaults. Returns int32 [B, P + max_new_tokens]: each row's prompt_ids as
    given, then its first max_new_tokens generated tokens (whole canvases of config.canvas_length are decoded),
    config.pad_token_id after its first stop id (config.stop_ids). Rows are generated in one loop, each as it is
    alone with the same seed; `seed` may also be one int per row (`Family.row_seeds`: the lockstep server batches
    requests with their own seeds), each row then what it is alone with its own."""
    if return_nfe:
        raise ValueError("return_nfe=True is for LLaDA models (DiffusionGemma's forwards per row follow its adaptive "
                         "stopping)")
    opts, rows = prepare(model, prompt_ids, attention_mask, method, options)
    config = model.config
    out = generate(model.params(), [row.tolist() for row in rows], config=config, options=opts, seed=seed,
                   stop_ids=config.stop_ids, pad_id=config.pad_token_id,
                   method=None if type(method) is Dense else method, progress=progress)
    b, p = np.shape(prompt_ids)
    ids = np.full((b, p + opts.max_new_tokens), config.pad_token_id, np.int32)
    ids[:, :p] = np.asarray(prompt_ids)
    for r, (prompt, row) in enumerate(zip(rows, out)):
        new = row[len(prompt):][:opts.max_new_tokens]
        ids[r, p:p + len(new)] = new
    return ids


def probe_loop(model, prompt_ids, method, options: dict):
    raise ValueError("DiffusionGemma has no loop for the pattern probes (dllm-jax analyze covers the LLaDA and SDAR "
                     "loops)")


FAMILY = Family(name="diffusiongemma", config_class=DiffusionGemmaConfig, model_class=DiffusionGemma,
                options_class=DiffusionGemmaOptions, prepare=prepare, run=run, probe_loop=probe_loop,
                answer_option="max_new_tokens", method_kind=methods.CANVAS, param_shapes=weights.param_shapes,
                hf_rules=hf_names.DIFFUSION_GEMMA_RULES, hf_expected=hf_names.diffusion_gemma_expected,
                hf_skipped=hf_names.DIFFUSION_GEMMA_SKIPPED, prepare_params=weights.prepare_params, row_seeds=True,
                to_module_tree=weights.to_module_tree, executions=("unrolled",), quantized=weights.QUANTIZED,
                param_axes=None, tp_split=(),
                stops_field="eos_token_ids")
