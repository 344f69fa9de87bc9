"""Dream generation as one compiled loop: the official `diffusion_generate` (the `_sample` loop of the
Dream model repository's generation_utils.py).

The prompt is followed by `max_new_tokens` mask ids; each of `steps` steps runs the whole sequence,
shifts the logits one position right (position i reads logits[i - 1], position 0 its own), predicts
every masked position and commits some of them:
  * timesteps t = linspace(1, eps, steps + 1) (float32); step i goes from t[i] to s = t[i + 1].
  * alg="origin": each masked position is committed with probability 1 - s / t (1 at the last step),
    with a token sampled from its (filtered) distribution.
  * alg="maskgit_plus" / "topk_margin" / "entropy": every masked position gets a token (sampled, or
    the argmax at temperature 0) and a confidence: the token's probability, top1 - top2 probability,
    or the negative entropy sum p log(p + 1e-10); then int(m * (1 - s / t)) of them are committed
    (all remaining at the last step), m = the batch's masked positions / batch size: the most confident
    ones, or with alg_temp > 0 a draw without replacement from softmax(confidence / alg_temp).
  * the distribution: logits / temperature (if temperature > 0), then top-p (the first token always
    kept), then top-k, the removed logits set to float32's lowest value, then softmax.
All steps run in one `lax.scan`.

Random numbers (reproducible from `seed`): step i draws `step_uniforms(seed, i, shape)`: float32
uniforms [B, L] for the token draws (inverse CDF of each position's distribution), for origin's
transfer decisions, and for alg_temp's selection (Gumbel top-k: the same distribution as torch's
multinomial without replacement). The official code draws with torch's generators; only the
distributions are the same.

The timesteps are computed on the host, bit for bit as torch.linspace (`timesteps`; tested against it
for 1..1100 steps and five eps, 1..400 in the suite), and the commit count in float32 as torch does (tested).
Departures, each refused or documented: rows with different numbers of masks (mask ids inside prompts) are
refused, since the official batched count then commits unmasked positions of some rows; ties between
equal confidences commit the lowest position (torch.topk leaves the order unspecified). Not ported:
the user hooks (generation_tokens_hook_func, generation_logits_hook_func), output_history and
num_return_sequences (repeat the prompt rows instead).
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
from dllm_jax.attention.policy import AttentionPolicy, Dense
from dllm_jax.config import DreamConfig
from dllm_jax.families import Family
from dllm_jax.generate.progress import progress_bar, tick
from dllm_jax.generate.requests import (ProbeLoop, as_array, check_context, check_prompt, full_sequence_probe,
                                        make_options, on_devices, on_mesh, rows_on_mesh)
from dllm_jax.generate.sampling import (RowSampling, commit_top, outside_nucleus, row_sampling, row_top_k_floor,
                                        top_k_bound)
from dllm_jax.models import dream as dream_model
from dllm_jax.models import hf_names, layers
from dllm_jax.models.llada import init_policy_state
from dllm_jax.sharding import DECODER_AXES, to_host

ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")
LOWEST = float(np.finfo(np.float32).min)  # the official filters' masked_fill value (torch.finfo(dtype).min)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DreamOptions:
    """Options of Dream generation; see the module docstring. The sampling values (temperature, top_p, top_k) are
    inputs of the compiled loop (`RowSampling`): a new value compiles nothing, a top_k past 64 only a loop with a
    larger bound (`top_k_bound`); a new max_new_tokens, steps, eps, alg or alg_temp compiles a new loop.

    The official defaults, except steps (512 there, with max_length 20): max_new_tokens=128, steps=128;
    steps <= max_new_tokens (a step past the last mask would be a forward that commits nothing).
    top_p=1.0 and top_k=0 are "off" (the official None); alg_temp=0.0 is the official None / 0.
    """

    max_new_tokens: int = 128
    steps: int = 128
    eps: float = 1e-3
    alg: str = "origin"
    alg_temp: float = 0.0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        def store(name, value):  # canonical int / float: equal options hash equal as static jit arguments
            object.__setattr__(self, name, value)

        store("max_new_tokens", check.integer("max_new_tokens", self.max_new_tokens))
        store("steps", check.integer("steps", self.steps))
        if self.steps > self.max_new_tokens:  # each step is a full forward: a billion of them would run
            raise ValueError(f"steps={self.steps} exceeds max_new_tokens={self.max_new_tokens}: the steps past the "
                             f"{self.max_new_tokens}th would unmask no token of the answer (each is a full forward); "
                             f"pass steps <= {self.max_new_tokens}")
        check.choice("alg", self.alg, ALGS)
        # eps is the last timestep: in (0, 1); 0 would make the last ratio s / t exactly 0
        store("eps", check.real("eps", self.eps, low=0, high=1, low_open=True, high_open=True))
        store("alg_temp", check.real("alg_temp", self.alg_temp, low=0, hint=" (0: the most confident, no draw)"))
        store("temperature", check.real("temperature", self.temperature, low=0, hint=" (0: argmax)"))
        store("top_p", check.real("top_p", self.top_p, low=0, high=1, low_open=True, hint=" (1: off)"))
        store("top_k", check.integer("top_k", self.top_k, minimum=0, hint=" (0: off)"))
        if self.alg == "origin" and self.alg_temp:
            raise ValueError(f"alg_temp={self.alg_temp} applies to the confidence-based algs (maskgit_plus, "
                             "topk_margin, entropy); alg='origin' commits random positions")

    def sampling(self, batch: int) -> RowSampling:
        """The sampling values in every row of a batch: the loop's traced inputs."""
        return row_sampling(batch, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    def structure(self, vocab_size: int) -> "DreamOptions":
        """The options as the compiled loop sees them with `sampling`'s values traced: those values replaced by one
        canonical set (options that differ only in them are one static argument), top_k by its static bound."""
        return dataclasses.replace(self, temperature=0.0, top_p=1.0, top_k=top_k_bound(self.top_k, vocab_size))


def timesteps(steps: int, eps: float) -> np.ndarray:
    """float32 [steps + 1]: torch.linspace(1, eps, steps + 1) bit for bit: a float32 step (end - start) /
    (n - 1), then start + i * step below the halfway index and end - (n - 1 - i) * step from it, each a
    fused multiply-add (one rounding; exact here in float64, then rounded once to float32). That is what
    torch's CPU kernel returns (its vectorized arange) and what its CUDA kernel compiles to (nvcc
    contracts a * b + c to an FMA by default); with two roundings 22 of 100 entries of linspace(1, 0.01,
    100) differ by an ulp, enough to change a commit count."""
    n = steps + 1
    start, end = np.float32(1.0), np.float32(eps)
    step = np.float64((end - start) / np.float32(max(n - 1, 1)))
    i = np.arange(n, dtype=np.float64)
    low = np.float64(start) + step * i
    high = np.float64(end) - step * (n - 1 - i)
    return np.where(i < n // 2, low, high).astype(np.float32)


def transfer_ratios(steps: int, eps: float) -> np.ndarray:
    """float32 [steps]: 1 - s / t of every step, in float32 as the official code computes it; the
    last step's is 1 (everything left is committed)."""
    t = timesteps(steps, eps)
    ratios = np.float32(1.0) - t[1:] / t[:-1]
    ratios[-1] = np.float32(1.0)
    return ratios.astype(np.float32)


def transfer_count(masked_total, batch: int, ratio, last):
    """int32: how many positions each row commits: int(m * ratio) with m = masked_total / batch in
    float32 (the official `mask_index.sum() / mask_index.shape[0]`), int(m) at the last step."""
    m = masked_total.astype(jnp.float32) / jnp.float32(batch)
    return jnp.where(last, m, m * ratio).astype(jnp.int32)  # truncation toward zero, as int()


def step_uniforms(seed, step, shape) -> dict:
    """The step's float32 uniforms [B, L] in [0, 1): token draws, origin transfers, alg_temp selection."""
    key = jax.random.fold_in(jax.random.key(seed), step)
    return {name: jax.random.uniform(jax.random.fold_in(key, i), shape, jnp.float32)
            for i, name in enumerate(("token", "transfer", "select"))}


def filtered_probs(logits, rows: RowSampling, max_top_k: int):
    """The official sample_tokens' distribution with each row's values (`rows`; top_k at most the static
    `max_top_k`): / temperature (where > 0), top-p, top-k, softmax (float32). The nucleus and the top-k selection
    are computed only where some row asks for them."""
    logits = logits / jnp.where(rows.temperature > 0, rows.temperature, 1.0)[:, None, None]

    def nucleus(logits):
        removed = outside_nucleus(logits, rows.top_p[:, None, None]) & (rows.top_p < 1.0)[:, None, None]
        return jnp.where(removed, LOWEST, logits)

    logits = jax.lax.cond(jnp.any(rows.top_p < 1.0), nucleus, lambda logits: logits, logits)
    logits = jnp.where(logits < row_top_k_floor(logits, rows.top_k, max_top_k), LOWEST, logits)
    return jax.nn.softmax(logits, axis=-1)


def tokens_and_confidence(probs, u, o: DreamOptions, temperature):
    """(tokens, confidence) of probs [B, n, V]: a draw by inverse CDF with uniforms u [B, n] in the rows at
    temperature (float32 [B]) > 0, the argmax in the others; the confidence of `o.alg`."""
    tokens = jnp.argmax(probs, axis=-1)

    def drawn(probs):
        cdf = jnp.cumsum(probs, axis=-1)
        return jnp.where((temperature > 0)[:, None], jnp.argmax(cdf >= u[..., None] * cdf[..., -1:], axis=-1), tokens)

    tokens = jax.lax.cond(jnp.any(temperature > 0), drawn, lambda probs: tokens, probs)
    if o.alg == "topk_margin":
        top2 = jax.lax.top_k(probs, 2)[0]
        return tokens, top2[..., 0] - top2[..., 1]
    if o.alg == "entropy":
        return tokens, jnp.sum(probs * jnp.log(probs + 1e-10), axis=-1)
    return tokens, jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]


def select_positions(confidence, count, u, alg_temp: float):
    """bool [B, n]: per row the `count` positions of highest confidence (-inf where not masked), or
    with alg_temp > 0 `count` drawn without replacement from softmax(confidence / alg_temp) (Gumbel
    top-k with uniforms u)."""
    if alg_temp > 0:
        scores = jax.nn.log_softmax(confidence / alg_temp, axis=-1)
        confidence = jnp.where(jnp.isfinite(scores), scores - jnp.log(-jnp.log(u)), -jnp.inf)
    return commit_top(confidence, jnp.broadcast_to(count, confidence.shape[:1]))


@struct.dataclass
class DreamCarry:
    """The carry of the scan over denoising steps."""

    x: jax.Array  # int32 [B, P + max_new_tokens]: the sequence being denoised
    policy_state: Any  # the attention policy's per-layer state (leading layer axis)


def generate_dream(params, prompt_ids, attention_mask, seed, run_id=0, rows: RowSampling | None = None, *,
                   config: DreamConfig, options: DreamOptions, prompt_has_masks: bool = False,
                   policy: AttentionPolicy = Dense(), on_step=None, return_policy_state: bool = False):
    """The whole generation, traceable as one function. Returns int32 [B, P + max_new_tokens]. `rows` (traced;
    `DreamOptions.sampling`): each row's temperature, top-p and top-k, with `options` then as
    `DreamOptions.structure` gives them; None: the options' own values.

    prompt_ids int32 [B, P] (left-padded if rows differ); attention_mask [B, P] or None (the official
    cumsum positions and hidden padding keys, `dllm_jax.models.dream`). Unless `prompt_has_masks`
    (static), logits are computed from position P - 1 on only (after the shift, the answer region's).
    `on_step(run_id, step)` (static), if given, is called on the host after every step.
    `return_policy_state` (static) also returns the policy's final per-layer state: (tokens, state),
    for diagnostics (dllm_jax.analysis); the tokens are the same either way.
    """
    b, p = prompt_ids.shape
    o = options
    rows = o.sampling(b) if rows is None else rows
    mask_id = config.mask_token_id
    total = p + o.max_new_tokens
    x = jnp.concatenate([prompt_ids.astype(jnp.int32), jnp.full((b, o.max_new_tokens), mask_id, jnp.int32)], axis=1)
    if attention_mask is not None:
        attention_mask = jnp.concatenate([attention_mask.astype(jnp.int32),
                                          jnp.ones((b, o.max_new_tokens), jnp.int32)], axis=1)
    start = 0 if prompt_has_masks else p  # the first position that can be masked
    model = functools.partial(dream_model.forward, config=config, policy=policy, logits_from=max(start - 1, 0))
    ratios = jnp.asarray(transfer_ratios(o.steps, o.eps))

    def shifted_logits(x, policy_state, i):
        logits, policy_state = model(params, x, attention_mask, policy_state, i)
        if start == 0:  # position 0 keeps its own logits (the official cat(logits[:, :1], logits[:, :-1]))
            return jnp.concatenate([logits[:, :1], logits[:, :-1]], axis=1), policy_state
        return logits[:, :-1], policy_state  # positions start - 1 .. total - 2 predict start .. total - 1

    def step(carry: DreamCarry, i):
        region = carry.x[:, start:]
        masked = region == mask_id
        logits, policy_state = shifted_logits(carry.x, carry.policy_state, i)
        u = step_uniforms(seed, i, (b, total))
        u = {name: value[:, start:] for name, value in u.items()}
        tokens, confidence = tokens_and_confidence(filtered_probs(logits, rows, o.top_k), u["token"], o,
                                                   rows.temperature)
        if o.alg == "origin":
            transfer = masked & (u["transfer"] < ratios[i])
            region = jnp.where(transfer, tokens, region)
        else:
            count = transfer_count(jnp.sum(masked), b, ratios[i], i == o.steps - 1)
            chosen = select_positions(jnp.where(masked, confidence, -jnp.inf), count, u["select"], o.alg_temp)
            region = jnp.where(chosen, jnp.where(masked, tokens, mask_id), region)
        if on_step is not None:
            jax.debug.callback(on_step, run_id, i, ordered=False)
        return DreamCarry(x=carry.x.at[:, start:].set(region), policy_state=policy_state), None

    carry = DreamCarry(x=x, policy_state=init_policy_state(policy, config, b, total))
    carry, _ = jax.lax.scan(step, carry, jnp.arange(o.steps, dtype=jnp.int32))
    return (carry.x, carry.policy_state) if return_policy_state else carry.x


generate_dream_jit = jax.jit(generate_dream, static_argnames=("config", "options", "prompt_has_masks", "policy",
                                                              "on_step", "return_policy_state"))


def check_request(config: DreamConfig, prompt_ids: np.ndarray, attention_mask, method, options: DreamOptions) -> None:
    """What Dream's sampler needs of prompts, masks and method together (before anything compiles)."""
    if options.top_k > config.vocab_size:
        raise ValueError(f"top_k={options.top_k} exceeds the vocabulary (vocab_size={config.vocab_size})")
    masks = (prompt_ids == config.mask_token_id).sum(axis=1)
    if len(set(masks.tolist())) > 1:
        raise ValueError(f"prompt rows hold different numbers of mask ids {masks.tolist()} (mask id "
                         f"{config.mask_token_id}): Dream's official sampler commits the same count in every row, "
                         "which would re-mask unmasked tokens of the rows with fewer; generate them separately")
    padded = attention_mask is not None and not np.asarray(attention_mask).all()
    if padded and not isinstance(method, Dense):
        raise ValueError(f"{type(method).__name__} takes no padding mask: generate left-padded Dream prompts with "
                         "dense attention (method=None), or prompts of one length")


# --- the family's request: checks, run, probes (dllm_jax.families names these) ----------------------

def prepare(model, prompt_ids, attention_mask, method, options: dict):
    """Checks a Dream request (options, prompt, padding, context) before anything compiles; returns
    (DreamOptions, int32 prompt_ids, the method bound to this generation's schedule)."""
    opts = make_options(DreamOptions, "Dream", options)
    prompt_ids = as_array("prompt_ids", prompt_ids)
    check_prompt(model.config, prompt_ids, attention_mask)
    check_request(model.config, prompt_ids, attention_mask, method, opts)
    check_context(model.config, prompt_ids.shape[-1], opts.max_new_tokens)
    method = method.bind(total_steps=opts.steps, prompt_length=prompt_ids.shape[1], gen_length=opts.max_new_tokens)
    return opts, prompt_ids.astype(np.int32), method


def run(model, prompt_ids, attention_mask, seed: int, method, progress: bool, return_nfe: bool, options: dict):
    """`dllm_jax.generate.generate` for a Dream model (its docstring); `method` is a checked policy."""
    if return_nfe:
        raise ValueError("return_nfe=True is for LLaDA models (Dream runs exactly `steps` forwards)")
    mesh = model.mesh
    opts, prompt_ids, method = prepare(model, prompt_ids, attention_mask, method, options)
    method = on_devices(mesh, method, prompt_ids.shape[1] + opts.max_new_tokens)
    mask = None if attention_mask is None else np.asarray(attention_mask, np.int32)
    placed_ids, placed_mask = on_mesh(mesh, prompt_ids, mask)
    sampling = rows_on_mesh(mesh, opts.sampling(len(prompt_ids)))
    with progress_bar(opts.steps, "Dream denoising", progress) as run_id:
        out = generate_dream_jit(
            model.params(), placed_ids, placed_mask, seed, np.int32(run_id), sampling, config=model.config,
            options=opts.structure(model.config.vocab_size),
            prompt_has_masks=bool((prompt_ids == model.config.mask_token_id).any()), policy=method,
            on_step=tick if progress else None)
        return to_host(out)


def probe_loop(model, prompt_ids, method, options: dict) -> ProbeLoop:
    """The loop `dllm_jax.analysis.analyze` probes: one policy call per step and layer."""
    return full_sequence_probe(model, prompt_ids, method, options, prepare=prepare, loop=generate_dream_jit)


FAMILY = Family(name="dream", config_class=DreamConfig, model_class=dream_model.Dream, options_class=DreamOptions,
                prepare=prepare, run=run, probe_loop=probe_loop, answer_option="max_new_tokens",
                method_kind=methods.BIDIRECTIONAL, param_shapes=layers.lm_param_shapes, hf_rules=hf_names.DREAM_RULES,
                param_axes=DECODER_AXES | {"qkv_bias": ("tp",)})  # the bias splits like qkv_proj's columns
