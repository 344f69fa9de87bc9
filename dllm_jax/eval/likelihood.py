"""Log-likelihood of an answer given a prompt for a masked-diffusion model (LLaDA), estimated as the official LLaDA
evaluation estimates it (its lm-evaluation-harness model): Monte Carlo over masked copies of the answer; and for a
block-diffusion model (SDAR / TraDo, LLaDA2) the same estimate block by block.

A masked-diffusion model has no exact likelihood; its training bound is, for an answer of T tokens after the prompt,

    log p(answer | prompt) >= E_x [ sum over the x masked answer positions of log p_theta(token | masked sequence) ] * T / x

with x uniform in 1..T and the x positions uniform among the answer's. One draw is a batch of `batch_size` rows
whose mask counts are stratified over 1..T (a random start k, then evenly spaced, wrapped: x_i = ((round(k + i T /
rows) - 1) mod T) + 1); each row's masked positions are a uniform choice of x_i. The estimate is the mean over
`mc_num / batch_size` draws of minus the rows' summed cross-entropy (each masked position weighted T / x_i) over
the rows. The official defaults: mc_num 128, batch_size 32. The draws come from a NumPy generator of `seed`, so
an estimate is reproducible; `masked_log_likelihood` takes given masks (a test compares them with the official
formula's).

A block-diffusion model factors the answer over the blocks it decodes (blocks of the config's `block_size` from the
sequence's first position: the prompt's last block may hold the answer's first tokens). Each block's tokens are
masked-diffusion given every earlier position clean, so

    log p(answer | prompt) = sum over blocks k of log p(answer tokens in block k | everything before them)

and each term is bounded, and estimated, as above with T = T_k, the answer tokens in block k, masked among
themselves while every other position stays clean: `mc_num / batch_size` draws per block. Under the block-causal mask
the positions after block k do not reach its logits, so each row is the whole sequence with one block's answer tokens
masked (one program for every block).

`greedy_answer` is the official `is_greedy` check: whether decoding the answer region one token per step,
most confident first, from the prompt alone gives the answer (the family's evaluation options: for LLaDA its own
low-confidence schedule at gen_length = steps = T, which `generate` runs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax import validation as check
from dllm_jax.families import FAMILIES, family_of
from dllm_jax.generate import generate

MC_NUM = 128  # the official evaluation's defaults
BATCH_SIZE = 32


def mask_draw(rng: np.random.Generator, rows: int, answer_length: int) -> np.ndarray:
    """One draw of the estimator's masks: bool [rows, answer_length], row i masking x_i positions (module
    docstring), each row's chosen uniformly."""
    k = int(rng.integers(1, answer_length + 1))
    counts = np.round(np.linspace(k, k + (rows - 1) * (answer_length / rows), rows)).astype(np.int64)
    counts = (counts - 1) % answer_length + 1
    masks = np.zeros((rows, answer_length), bool)
    for row, count in enumerate(counts):
        masks[row, rng.permutation(answer_length)[:count]] = True
    return masks


@jax.jit
def weighted_nll(logits, targets, masks):
    """Sum over rows and masked positions of -log p(target) * T / (the row's masked count), over the rows:
    logits float [B, T, V] of the scored positions, targets int [T], masks bool [B, T]."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(log_probs, jnp.broadcast_to(targets, masks.shape)[..., None], axis=-1)[..., 0]
    weight = masks.shape[1] / masks.sum(axis=1, keepdims=True)
    return -(jnp.where(masks, picked, 0.0) * weight).sum() / masks.shape[0]


def masked_log_likelihood(model, prompt_ids, answer_ids, masks, positions=None) -> float:
    """Minus the weighted cross-entropy of one batch of masks (bool [rows, T]) over the answer positions `positions`
    (int, T of them, indices into the answer; None: all of it), every other position clean: one term of the
    estimate."""
    prompt_ids, answer_ids = np.asarray(prompt_ids, np.int32), np.asarray(answer_ids, np.int32)
    positions = np.arange(len(answer_ids)) if positions is None else np.asarray(positions)
    rows, p = len(masks), len(prompt_ids)
    ids = np.tile(np.concatenate([prompt_ids, answer_ids]), (rows, 1))
    scored = p + positions
    ids[:, scored] = np.where(masks, model.config.mask_token_id, ids[:, scored])
    logits = model(ids)[:, scored]
    return -float(weighted_nll(logits, jnp.asarray(answer_ids[positions]), jnp.asarray(masks)))


def answer_blocks(model, prompt_length: int, answer_length: int) -> list[np.ndarray]:
    """The answer positions (indices into the answer) each estimate term masks, as the model's family estimates
    (`Family.likelihood`): all of them for a masked-diffusion model, those of each block (blocks of `block_size`
    from the sequence's start) for a block-diffusion one; a ValueError for a family without an estimate (Dream's
    logits predict the token after each position, which this estimate does not shift)."""
    answer = np.arange(answer_length)
    family = family_of(model.config)
    if family.likelihood is None:
        supported = ", ".join(f.label for f in FAMILIES.values() if f.likelihood is not None)
        raise ValueError(f"log-likelihoods are estimated for {supported} models, not {type(model).__name__} "
                         "(generate_until tasks work for every family)")
    if family.likelihood == "masked":
        return [answer]
    blocks = (prompt_length + answer) // model.config.block_size
    return [answer[blocks == block] for block in np.unique(blocks)]


def log_likelihood(model, prompt_ids, answer_ids, *, mc_num: int = MC_NUM, batch_size: int = BATCH_SIZE,
                   seed: int = 0) -> float:
    """The Monte-Carlo estimate of log p(answer_ids | prompt_ids) (module docstring) from `seed`'s draws: for a
    block-diffusion model the sum of its blocks' estimates. ValueError for an empty prompt or answer, or mc_num
    not a multiple of batch_size."""
    batch_size = check.integer("batch_size", batch_size, minimum=1)
    mc_num = check.integer("mc_num", mc_num, minimum=batch_size)
    if mc_num % batch_size:
        raise ValueError(f"mc_num={mc_num} must be a multiple of batch_size={batch_size} (each draw is a batch)")
    answer_ids = np.asarray(answer_ids)
    if len(np.asarray(prompt_ids)) == 0 or len(answer_ids) == 0:
        raise ValueError("log_likelihood needs a prompt and an answer of at least one token each")
    blocks = answer_blocks(model, len(np.asarray(prompt_ids)), len(answer_ids))
    rng = np.random.default_rng(seed)
    total = 0.0
    for positions in blocks:
        draws = [masked_log_likelihood(model, prompt_ids, answer_ids, mask_draw(rng, batch_size, len(positions)),
                                       positions) for _ in range(mc_num // batch_size)]
        total += float(np.mean(draws))
    return total


def greedy_answer(model, prompt_ids, answer_ids) -> bool:
    """Whether the answer is what decoding its region one token per step, most confident first, gives (the
    family's evaluation options; ValueError for a family without them)."""
    family = family_of(model.config)
    if family.eval_options is None:
        raise ValueError(f"the greedy check decodes with the family's evaluation options; {family.label} has none")
    n, p = len(answer_ids), len(prompt_ids)
    out = generate(model, np.asarray(prompt_ids, np.int32)[None], **family.eval_options(n, model.config, {}))
    return bool((np.asarray(out)[0, p:p + n] == np.asarray(answer_ids)).all())


__all__ = ["BATCH_SIZE", "MC_NUM", "answer_blocks", "greedy_answer", "log_likelihood", "mask_draw", "masked_log_likelihood"]
