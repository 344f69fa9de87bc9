"""LLaDA2 block-diffusion generation as one compiled loop (the official `LLaDA2MoeModelLM.generate`).

The official sampler (facts: dllm_jax/configs/llada2.0-mini/README.md), for one prompt of P tokens:
  * steps = min(steps, gen_length // minimal_topk); the sequence is ceil((P + gen_length) / block_length)
    blocks of masks with the prompt written in; decoding starts at block P // block_length (its first
    P % block_length tokens are prompt);
  * per block, at most `steps` forwards, stopping early once the block has no mask; forward j samples
    every block position (greedy when temperature == 0 and neither top-k nor top-p filters: argmax, the
    confidence its softmax probability; otherwise logits / T when T > 0 and T != 1, top-k, top-p,
    softmax, one multinomial draw, the confidence the drawn token's probability after filtering) and
    commits, among the block's masked positions, every one of confidence > threshold if there are at
    least n[j] of them, else the min(n[j], masks left) most confident (n: block_length // steps per
    step, the remainder on the first steps);
  * after a block: stop if an eos appears anywhere in the generated part so far; the answer is the
    prompt and the generated tokens up to and including the first eos (else gen_length of them).
The official code runs a full forward over every block so far under the block-diffusion mask at every
step; the block-causal mask makes the keys and values of finished blocks final, so here they live in a
KV cache (prefill of the complete prompt blocks, then one block forward per step and a commit per block,
the commit riding on the next block's first step: `dllm_jax.models.llada2.commit_and_step`). That is
exact: tested token for token against a port of the official sampler. `eos_early_stop` (the official
option) only ends a block's steps sooner once an eos with no mask before it is committed: the returned
tokens are the same, so it is not an option here.

Batches: rows are prompts of one length (no padding), all at the same positions; each row keeps its own
masks, step count, random stream and stop; a row whose block is finished waits (its forwards discarded,
SPARSE policy mode) until every row is finished: the loops are `dllm_jax.generate.sdar`'s (`denoise_block`,
`decode_blocks`) run with this module's `SAMPLER`. Random draws: the uniforms of row b's t-th denoising
forward are `uniform(fold_in(key(seed), t), [1, block_length])`, the token the first whose cumulative
probability reaches u * total (an inverse-CDF multinomial draw).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax import validation as check
from dllm_jax.attention import kv_rows, methods
from dllm_jax.attention.policy import AttentionPolicy, Dense
from dllm_jax.config import LLaDA2Config
from dllm_jax.families import TP_SPLIT, Family
from dllm_jax.generate.progress import progress_bar, tick
from dllm_jax.generate.requests import (ProbeLoop, as_array, cache_dtype_of, check_context, check_prompt,
                                        make_options, on_devices, on_mesh, rows_on_mesh, until_stop)
from dllm_jax.generate.sampling import (RowSampling, against_rows, commit_top, row_sampling, sample_tokens,
                                        sample_tokens_per_row, top_k_bound, transfer_counts)
from dllm_jax.generate.block_loop import BlockSampler, SlotLoop, cache_capacity, decode_blocks
from dllm_jax.generate.sdar import PROMPT_BUCKET
from dllm_jax.models import hf_names
from dllm_jax.models import llada2 as llada2_model
from dllm_jax.sharding import shard_kv_cache, to_host, tracing_on


@dataclasses.dataclass(frozen=True, kw_only=True)
class LLaDA2Options:
    """Options of LLaDA2 generation (the official generate's arguments). top_k=0 and top_p=1.0 stand for the
    official None (no filter). The sampling values (temperature, top_k, top_p, threshold) are inputs of the
    compiled loop (`RowSampling`): a new value compiles nothing, a top_k past 64 only a loop with a larger bound
    (`top_k_bound`); a new gen_length, block_length, steps or minimal_topk compiles a new loop."""

    gen_length: int = 2048
    block_length: int = 32
    steps: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    threshold: float = 0.95
    minimal_topk: int = 1
    kv_cache_dtype: str = "auto"  # "fp8": the KV cache in e4m3 with per-position scales (dense attention)

    def __post_init__(self):
        def store(name, value):
            object.__setattr__(self, name, value)

        for name in ("gen_length", "block_length", "steps", "minimal_topk"):
            store(name, check.integer(name, getattr(self, name)))
        if self.minimal_topk > self.gen_length:
            raise ValueError(f"minimal_topk={self.minimal_topk} exceeds gen_length={self.gen_length}: the official "
                             "code would run min(steps, gen_length // minimal_topk) = 0 steps and decode nothing")
        store("temperature", check.real("temperature", self.temperature, low=0,
                                        hint=" (0 is greedy: argmax, as the official sampler)"))
        store("top_k", check.integer("top_k", self.top_k, minimum=0, hint=" (0 turns the filter off)"))
        store("top_p", check.real("top_p", self.top_p, low=0, high=1, low_open=True))
        store("threshold", check.real("threshold", self.threshold, low=0, high=1))
        kv_rows.check_kv_cache_dtype(self.kv_cache_dtype)

    def sampling(self, batch: int) -> RowSampling:
        """The sampling values in every row of a batch: the loop's traced inputs."""
        return row_sampling(batch, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                            threshold=self.threshold)

    def structure(self, vocab_size: int) -> "LLaDA2Options":
        """The options as the compiled loop sees them with `sampling`'s values traced: those values replaced by one
        canonical set (options that differ only in them are one static argument), top_k by its static bound."""
        return dataclasses.replace(self, temperature=0.0, top_p=1.0, threshold=0.0,
                                   top_k=top_k_bound(self.top_k, vocab_size))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 and self.top_k == 0 and self.top_p >= 1.0

    @property
    def effective_steps(self) -> int:
        return min(self.steps, self.gen_length // self.minimal_topk)


def sample(logits, u, options: LLaDA2Options):
    """(tokens, confidences) of logits [B, n, V] as the official `_sample_with_temperature_topk_topp`."""
    if options.greedy:
        return argmax_tokens(logits)
    # T = 0 with a filter samples at T = 1 in the official code (it divides only when T > 0)
    temperature = options.temperature if options.temperature > 0 else 1.0
    return sample_tokens(logits, u, temperature=temperature, top_k=options.top_k, top_p=options.top_p)


def transfer_mask(mask_index, confidence, count, threshold):
    """bool [B, n]: every masked position of confidence > threshold (a number, or float32 [B] per row) if there
    are >= count of them, else the min(count, masks) most confident masked ones (ties: lower position)."""
    count = jnp.broadcast_to(count, mask_index.shape[:1])
    confidence = jnp.where(mask_index, confidence, -jnp.inf)
    high = confidence > against_rows(threshold)
    top = commit_top(confidence, jnp.minimum(count, jnp.sum(mask_index, axis=1)))
    return jnp.where(jnp.sum(high, axis=1, keepdims=True) >= count[:, None], high, top)


def schedule(options: LLaDA2Options, config: LLaDA2Config, n: int):
    """The official transfer counts: the block's n tokens spread over `effective_steps` forwards."""
    return transfer_counts(n, options.effective_steps)


def argmax_tokens(logits):
    """(argmax tokens, their unfiltered softmax probabilities) of logits [..., V]: the official greedy step."""
    tokens = jnp.argmax(logits, axis=-1)
    return tokens, jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), tokens[..., None], axis=-1)[..., 0]


def sample_rows(logits, u, options: LLaDA2Options, rows: RowSampling):
    """`sample` with each row's own temperature, top-p and top-k (`generate`'s traced values, or a serving slot's
    request's; the options' top_k is their static bound): a row is greedy where `options | {"temperature": t,
    "top_p": p, "top_k": k}` would be (its argmax), else it samples as that would. Where every row is greedy the
    draw is not computed."""
    greedy = (rows.temperature == 0) & (rows.top_k == 0) & (rows.top_p >= 1.0)
    tokens, probs = argmax_tokens(logits)

    def sampled(logits):
        drawn, drawn_p = sample_tokens_per_row(logits, u, temperature=jnp.where(rows.temperature > 0,
                                                                               rows.temperature, 1.0),
                                               top_k=rows.top_k, max_top_k=options.top_k, top_p=rows.top_p,
                                               keep_max=jnp.zeros_like(greedy))
        return jnp.where(greedy[:, None], tokens, drawn), jnp.where(greedy[:, None], probs, drawn_p)

    return jax.lax.cond(jnp.all(greedy), lambda logits: (tokens, probs), sampled, logits)


def commit(logits, u, mask_index, count, options: LLaDA2Options, rows: RowSampling | None = None):
    """The official step: sample every block position (`sample`, or `sample_rows` with per-row `rows`: `generate`'s
    traced values or a serving engine's), commit by `transfer_mask` (at the rows' own thresholds where given)."""
    if rows is None:
        (x0, x0_p), threshold = sample(logits, u, options), options.threshold
    else:
        (x0, x0_p), threshold = sample_rows(logits, u, options, rows), rows.threshold
    return x0, transfer_mask(mask_index, x0_p, count, threshold)


SAMPLER = BlockSampler(schedule=schedule, commit=commit, commit_and_step=llada2_model.commit_and_step,
                       block_step=llada2_model.block_step)


def generate_llada2(params, prompt_ids, seed, run_id=0, prompt_length=None, rows: RowSampling | None = None, *,
                    config: LLaDA2Config, options: LLaDA2Options, policy: AttentionPolicy = Dense(), on_step=None,
                    return_policy_state: bool = False, mesh=None):
    """The whole generation, traceable as one function: prompt_ids int32 [B, P] (no padding) ->
    (x int32 [B, width], stopped bool [B]); x holds the prompt, the decoded blocks and masks after a
    row's stop. width = ceil((P + gen_length) / block_length) * block_length. `prompt_length` (int32, traced;
    None: P): the prompt's length when prompt_ids holds mask ids after it (`run` pads prompts to a multiple of
    PROMPT_BUCKET so that nearby lengths share one program); every row has that length. `rows` (traced;
    `LLaDA2Options.sampling`): the rows' sampling values, with `options` then as `LLaDA2Options.structure` gives
    them; None: the options' own values, static. `on_step(run_id, i)`
    (static, optional) runs on the host after every decoded block. With `return_policy_state` (static),
    the final per-layer policy state comes third (for diagnostics: dllm_jax.analysis)."""
    with tracing_on(mesh):  # the routed experts run per device (dllm_jax.models.moe)
        o, bl = options, options.block_length
        b, n = prompt_ids.shape
        p = n if prompt_length is None else prompt_length
        width = -(-(n + o.gen_length) // bl) * bl
        first, num_blocks = p // bl, -(-(p + o.gen_length) // bl)
        x = jnp.full((b, width), config.mask_token_id, jnp.int32).at[:, :n].set(prompt_ids.astype(jnp.int32))
        params = llada2_model.inference(params, config)
        cache = llada2_model.init_cache(config, b, cache_capacity(width, bl),
                                        cache_dtype_of(o.kv_cache_dtype, policy, params["embed"].dtype, mesh))
        cache = shard_kv_cache(cache, mesh)
        # every row at the same positions: the shared scan with one prompt length, first and last block
        per_row = functools.partial(jnp.full, (b,), dtype=jnp.int32)
        if n // bl:  # the complete prompt blocks (a dynamic count of chunks: none where first is 0)
            cache = llada2_model.prefill(params, x[:, :n // bl * bl], cache, per_row(first * bl), config=config,
                                         block_length=bl)
        # a traced length: the most blocks any length of the bucket decodes (one ending just past a block boundary
        # needs one more than its share of the answer); a row's extra iterations idle
        iterations = num_blocks - first if prompt_length is None else -(-(bl - 1 + o.gen_length) // bl)
        policy_state = llada2_model.init_policy_state(policy, config, b, width, block_length=bl)
        carry = decode_blocks(params, x, cache, policy_state, jax.random.key(seed), lengths=per_row(p),
                              first=per_row(first), last=per_row(num_blocks), iterations=iterations, block_length=bl,
                              stop_ids=jnp.asarray([config.eos_token_id], jnp.int32), config=config, options=o,
                              policy=policy, sampler=SAMPLER, on_step=on_step, run_id=run_id, rows=rows)
        if return_policy_state:
            return carry.x, carry.stopped, carry.policy_state
        return carry.x, carry.stopped


STATIC = ("config", "options", "policy", "on_step", "return_policy_state", "mesh")
generate_llada2_jit = jax.jit(generate_llada2, static_argnames=STATIC)


def answers(x: np.ndarray, prompt_length: int, options: LLaDA2Options, eos_id: int) -> list[np.ndarray]:
    """Host-side: each row's prompt and generated tokens up to and including its first eos, else
    gen_length of them (the official return, with the prompt in front)."""
    return [np.concatenate([row[:prompt_length], until_stop(row[prompt_length:prompt_length + options.gen_length],
                                                            (eos_id,))]) for row in np.asarray(x)]


def check_request(config: LLaDA2Config, prompt_ids: np.ndarray, attention_mask, options: LLaDA2Options) -> None:
    """What the LLaDA2 sampler supports: prompts of one length without mask ids, within the context."""
    if attention_mask is not None and not np.all(np.asarray(attention_mask) != 0):
        raise ValueError("LLaDA2 generation takes prompts of one length (no padding): attention_mask must be all "
                         "ones or None; generate prompts of different lengths separately")
    if options.top_k > config.vocab_size:
        raise ValueError(f"top_k={options.top_k} exceeds the vocabulary (vocab_size={config.vocab_size})")
    masks = np.argwhere(prompt_ids == config.mask_token_id)
    if masks.size:
        raise ValueError(f"prompt_ids hold the mask id {config.mask_token_id} at [row, position] "
                         f"{masks[:5].tolist()}: the official sampler denoises the answer blocks only")


# --- the family's request: checks, run, probes (dllm_jax.families names these) ----------------------

def prepare(model, prompt_ids, attention_mask, method, options: dict):
    """Checks an LLaDA2 request (options, prompt, context) before anything compiles; returns (LLaDA2Options,
    int32 prompt_ids, the number of blocks decoded)."""
    opts = make_options(LLaDA2Options, "LLaDA2", options)
    prompt_ids = as_array("prompt_ids", prompt_ids)
    check_prompt(model.config, prompt_ids, attention_mask)
    check_request(model.config, prompt_ids, attention_mask, opts)
    check_context(model.config, prompt_ids.shape[1], opts.gen_length)
    p, bl = prompt_ids.shape[1], opts.block_length
    return opts, prompt_ids.astype(np.int32), -(-(p + opts.gen_length) // bl) - p // bl


def run(model, prompt_ids, attention_mask, seed: int, method, progress: bool, return_nfe: bool, options: dict):
    """`dllm_jax.generate.generate` for an LLaDA2 model: options gen_length=2048, block_length=32, steps=32
    (per block), temperature=0.0 (greedy), top_k=0, top_p=1.0, threshold=0.95, minimal_topk=1; block
    diffusion with a prefix KV cache, so MAGE and FlashBlock run on it as on SDAR. Prompts of one length;
    one prompt returns int32 [1, n] (prompt + answer up to and including the first eos), a batch int32
    [B, P + gen_length] with config.pad_token_id after each row's eos."""
    if return_nfe:
        raise ValueError("return_nfe=True is for LLaDA models (LLaDA2's forwards per block follow its schedule)")
    mesh = model.mesh
    opts, prompt_ids, blocks = prepare(model, prompt_ids, attention_mask, method, options)
    method = on_devices(mesh, method, None)
    p = prompt_ids.shape[1]
    # mask ids after the prompt up to a multiple of PROMPT_BUCKET: the loop decodes from the prompt's own length
    # (traced), so nearby lengths share one program
    padded = np.pad(prompt_ids, ((0, 0), (0, -p % PROMPT_BUCKET)), constant_values=model.config.mask_token_id)
    placed_ids, _ = on_mesh(mesh, padded, None)
    sampling = rows_on_mesh(mesh, opts.sampling(len(placed_ids)))
    with progress_bar(blocks, "LLaDA2 blocks", progress) as run_id:
        x, _ = generate_llada2_jit(model.params(), placed_ids, seed, np.int32(run_id), np.int32(p), sampling,
                                   config=model.config, options=opts.structure(model.config.vocab_size),
                                   policy=method, on_step=tick if progress else None, mesh=mesh)
        x = to_host(x)
    rows = answers(x, p, opts, model.config.eos_token_id)
    if len(rows) == 1:
        return np.stack(rows)
    out = np.full((len(rows), p + opts.gen_length), model.config.pad_token_id, np.int32)
    for b, row in enumerate(rows):
        out[b, :len(row)] = row
    return out


def slot_check(config: LLaDA2Config, prompt_ids: np.ndarray, max_new_tokens: int, options: LLaDA2Options) -> None:
    """`SlotLoop.check_request` for LLaDA2: `check_request`'s refusals, and an answer length whose forwards per
    block differ from the engine's (the official schedule runs min(steps, gen_length // minimal_topk) of them: a
    slot engine compiled for one count cannot give such a request what generate gives it)."""
    check_request(config, prompt_ids, None, options)
    steps = min(options.steps, max_new_tokens // options.minimal_topk)
    if steps != options.effective_steps:
        shortest = options.effective_steps * options.minimal_topk
        raise ValueError(f"max_new_tokens={max_new_tokens}: LLaDA2 then runs min(steps, max_new_tokens // "
                         f"minimal_topk) = {steps} forwards per block, the engine {options.effective_steps}; ask for "
                         f"at least {shortest} tokens (or serve with steps={steps})")


def options_block_length(config: LLaDA2Config, options: LLaDA2Options) -> int:
    return options.block_length


SLOTS = SlotLoop(sampler=SAMPLER, loop_params=llada2_model.inference, init_cache=llada2_model.init_cache,
                 prefill=llada2_model.prefill, init_policy_state=llada2_model.init_policy_state,
                 block_length=options_block_length, check_request=slot_check, greedy=(), cuts_answer=True)


def probe_loop(model, prompt_ids, method, options: dict) -> ProbeLoop:
    """The loop `dllm_jax.analysis.analyze_blocks` probes."""
    opts, prompt_ids, blocks = prepare(model, prompt_ids, None, method, options)

    def run_probe(probe, seed):
        tokens, _, state = generate_llada2_jit(model.params(), prompt_ids, seed, np.int32(0), config=model.config,
                                               options=opts, policy=probe, return_policy_state=True)
        return tokens, state

    return ProbeLoop(method, blocks * (opts.effective_steps + 1), run_probe)


FAMILY = Family(name="llada2", config_class=LLaDA2Config, model_class=llada2_model.LLaDA2, options_class=LLaDA2Options,
                prepare=prepare, run=run, probe_loop=probe_loop, answer_option="gen_length", method_kind=methods.BLOCK,
                param_shapes=llada2_model.param_shapes, hf_rules=hf_names.LLADA2_RULES,
                hf_expected=hf_names.llada2_expected, prepare_params=llada2_model.prepare_params,
                to_module_tree=llada2_model.to_module_tree, param_axes=llada2_model.PARAM_AXES,
                quantized=llada2_model.QUANTIZED, likelihood="block",
                tp_split=TP_SPLIT + ("moe_intermediate_size",),  # the experts' hidden dimension splits too
                slots=SLOTS)
