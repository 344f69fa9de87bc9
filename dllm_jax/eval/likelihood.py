"""Log-likelihood of an answer given a prompt for a masked-diffusion model (LLaDA), estimated as the official LLaDA
evaluation estimates it (its lm-evaluation-harness model): Monte Carlo over masked copies of the answer.

A masked-diffusion model has no exact likelihood; its training bound is, for an answer of T tokens after the prompt,

    log p(answer | prompt) >= E_x [ sum over the x masked answer positions of log p_theta(token | masked sequence) ] * T / x

with x uniform in 1..T and the x positions uniform among the answer's. One draw is a batch of `batch_size` rows
whose mask counts are stratified over 1..T (a random start k, then evenly spaced, wrapped: x_i = ((round(k + i T /
rows) - 1) mod T) + 1); each row's masked positions are a uniform choice of x_i. The estimate is the mean over
`mc_num / batch_size` draws of minus the rows' summed cross-entropy (each masked position weighted T / x_i) over
the rows. The official defaults: mc_num 128, batch_size 32. The draws come from a NumPy generator of `seed`, so
an estimate is reproducible; `masked_log_likelihood` takes given masks (a test compares them with the official
formula's).

`greedy_answer` is the official `is_greedy` check: whether decoding the answer region one token per step,
most confident first, from the prompt alone gives the answer (LLaDA's own low-confidence schedule at
gen_length = steps = T, which `generate` runs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax import validation as check
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
    logits float [B, T, V] of the answer positions, targets int [T], masks bool [B, T]."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(log_probs, jnp.broadcast_to(targets, masks.shape)[..., None], axis=-1)[..., 0]
    weight = masks.shape[1] / masks.sum(axis=1, keepdims=True)
    return -(jnp.where(masks, picked, 0.0) * weight).sum() / masks.shape[0]


def masked_log_likelihood(model, prompt_ids, answer_ids, masks) -> float:
    """Minus the weighted cross-entropy of one batch of answer masks (bool [rows, T]): one term of the estimate."""
    prompt_ids, answer_ids = np.asarray(prompt_ids, np.int32), np.asarray(answer_ids, np.int32)
    rows, p = len(masks), len(prompt_ids)
    ids = np.tile(np.concatenate([prompt_ids, answer_ids]), (rows, 1))
    ids[:, p:] = np.where(masks, model.config.mask_token_id, ids[:, p:])
    logits = model(ids)[:, p:]
    return -float(weighted_nll(logits, jnp.asarray(answer_ids), jnp.asarray(masks)))


def log_likelihood(model, prompt_ids, answer_ids, *, mc_num: int = MC_NUM, batch_size: int = BATCH_SIZE,
                   seed: int = 0) -> float:
    """The Monte-Carlo estimate of log p(answer_ids | prompt_ids) (module docstring) from `seed`'s draws.
    ValueError for an empty prompt or answer, or mc_num not a multiple of batch_size."""
    batch_size = check.integer("batch_size", batch_size, minimum=1)
    mc_num = check.integer("mc_num", mc_num, minimum=batch_size)
    if mc_num % batch_size:
        raise ValueError(f"mc_num={mc_num} must be a multiple of batch_size={batch_size} (each draw is a batch)")
    answer_ids = np.asarray(answer_ids)
    if len(np.asarray(prompt_ids)) == 0 or len(answer_ids) == 0:
        raise ValueError("log_likelihood needs a prompt and an answer of at least one token each")
    rng = np.random.default_rng(seed)
    draws = [masked_log_likelihood(model, prompt_ids, answer_ids, mask_draw(rng, batch_size, len(answer_ids)))
             for _ in range(mc_num // batch_size)]
    return float(np.mean(draws))


def greedy_answer(model, prompt_ids, answer_ids) -> bool:
    """Whether the answer is what decoding its region one token per step, most confident first, gives."""
    n = len(answer_ids)
    out = generate(model, np.asarray(prompt_ids, np.int32)[None], gen_length=n, steps=n, block_length=n)
    return bool((np.asarray(out)[0, len(prompt_ids):] == np.asarray(answer_ids)).all())


__all__ = ["BATCH_SIZE", "MC_NUM", "greedy_answer", "log_likelihood", "mask_draw", "masked_log_likelihood"]
