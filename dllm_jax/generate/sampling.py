"""Sampling helpers of the denoising loops: how many tokens a step commits, which ones, and the
token draws. Pure functions of arrays; the loops (generate/llada.py, generate/sdar.py) hold the
schedules and random keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


def transfer_counts(masked, steps: int):
    """Tokens to commit at each of `steps` steps when `masked` (int, or int32 [B]) tokens are masked:
    masked // steps, plus one on the first masked % steps steps (both official
    get_num_transfer_tokens). Returns int32 [..., steps]."""
    masked = jnp.asarray(masked)
    base = masked // steps
    extra = masked % steps
    return base[..., None] + (jnp.arange(steps) < extra[..., None]).astype(jnp.int32)


def commit_top(confidence, count):
    """bool [B, L]: in each row, the `count[b]` positions of highest confidence (ties: lowest index)."""
    order = jnp.argsort(-confidence, axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1, stable=True)
    return rank < count[:, None]


def factor_counts(confidence, factor):
    """int32 [B]: how many positions Fast-dLLM's factor rule (`get_transfer_index_dynamic`) commits per
    row, from confidence [B, L] (-inf where nothing may be committed); `factor` a number or float32 [B] per row.

    With the row's n candidates sorted by confidence c_1 >= ... >= c_n, the i-th (i >= 2) must reach
    1 - factor / (i + 1); the first is always taken. The count is the number taken before the first
    one that falls short, except that the official loop commits all n when none falls short or
    when only the n-th does (its `top_i == len(threshs) - 1` case)."""
    n = jnp.sum(confidence > -jnp.inf, axis=-1)
    ranked = -jnp.sort(-confidence, axis=-1)
    i = jnp.arange(confidence.shape[-1])
    short = (ranked < 1.0 - against_rows(factor) / (i + 2.0)) & (i >= 1) & (i < n[:, None])
    first = jnp.where(jnp.any(short, axis=-1), jnp.argmax(short, axis=-1), n)
    return jnp.where(first >= n - 1, n, first).astype(jnp.int32)


def gumbel_argmax(logits, temperature, key, total: int):
    """Each row's argmax of exp(l) / (-log u)^T at its own temperature (float32 [B]), computed as
    argmax(l - T log(-log u)) (same argmax, no overflow); a row at temperature 0 takes the argmax of its logits.

    logits [B, n, V] are the last n of `total` positions; the uniforms are drawn for all `total` positions (so the
    random stream does not depend on which positions get logits), and only when some row samples: they are the
    costly part of a step ([B, total, V])."""
    greedy = jnp.argmax(logits, axis=-1)

    def noisy(logits):
        b, n, v = logits.shape
        u = jax.random.uniform(key, (b, total, v), jnp.float32)[:, total - n:]
        drawn = jnp.argmax(logits - temperature[:, None, None] * jnp.log(-jnp.log(u)), axis=-1)
        return jnp.where((temperature > 0)[:, None], drawn, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), noisy, lambda logits: greedy, logits)


def sample_tokens(logits, u, *, temperature: float, top_k: int, top_p: float):
    """(tokens, probabilities of the drawn tokens after filtering) for logits [..., V], u [...] in [0, 1):
    logits / T (if T != 1), top-k, top-p (the first token always kept), softmax, inverse-CDF draw."""
    if temperature != 1.0:
        logits = logits / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        logits = jnp.where(outside_nucleus(logits, top_p), -jnp.inf, logits)
    return inverse_cdf_draw(logits, u)


def outside_nucleus(logits, top_p):
    """bool [..., V]: the tokens top-p filtering removes (past the smallest set of the most likely whose
    probability reaches top_p; the first is always kept). top_p: a number, or broadcast against logits."""
    order = jnp.argsort(-logits, axis=-1, stable=True)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    remove = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1) > top_p
    remove = jnp.concatenate([jnp.zeros_like(remove[..., :1]), remove[..., :-1]], axis=-1)
    return jnp.take_along_axis(remove, jnp.argsort(order, axis=-1), axis=-1)  # back to vocab order


def inverse_cdf_draw(logits, u):
    """(tokens, their probabilities) drawn from softmax(logits [..., V]) at uniforms u [...] (inverse CDF)."""
    probs = jax.nn.softmax(logits, axis=-1)
    cdf = jnp.cumsum(probs, axis=-1)
    tokens = jnp.argmax(cdf >= u[..., None] * cdf[..., -1:], axis=-1)
    return tokens, jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]


# SDAR's remasking rules, in the order of `RowSampling.remasking`'s indices (the first is the Options' default)
SDAR_REMASKING = ("low_confidence_dynamic", "low_confidence_static", "sequential")

# the smallest static bound of a traced top-k: every top-k up to it shares one compiled loop (the selection of
# that many candidates runs only in steps where some row asks for a top-k)
MIN_TOP_K_BOUND = 64


@struct.dataclass
class RowSampling:
    """The sampling values of each row, inputs of the compiled loop rather than part of its program (a new value
    compiles nothing): a temperature, a top-p, a top-k, a confidence threshold and Fast-dLLM's factor per row (a
    `generate` call's values in every row, or a serving slot's request's own): float32 [B], float32 [B], int32 [B]
    (0: no top-k filter; at most the loop's static bound), float32 [B], float32 [B]. A family reads the ones its
    sampler has. What a temperature of 0 means is the family's (its sampler's `commit`: SDAR's greedy top-k 1,
    LLaDA2's and LLaDA's argmax). `remasking` int32 [B] is each row's remasking rule, an index into its family's
    tuple of rules (`REMASKING` of generate/sdar.py and generate/llada.py: the rules that share shapes)."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    threshold: jax.Array
    factor: jax.Array
    remasking: jax.Array


def row_sampling(batch: int, *, temperature: float, top_p: float = 1.0, top_k: int = 0, threshold: float = 0.0,
                 factor: float = 0.0, remasking: int = 0) -> RowSampling:
    """One call's values in every row of a batch, as host arrays (the jitted loop's traced inputs)."""
    full = lambda value, dtype: np.full((batch,), value, dtype)  # noqa: E731
    return RowSampling(temperature=full(temperature, np.float32), top_p=full(top_p, np.float32),
                       top_k=full(top_k, np.int32), threshold=full(threshold, np.float32),
                       factor=full(factor, np.float32), remasking=full(remasking, np.int32))


def top_k_bound(top_k: int, vocab_size: int) -> int:
    """The static bound of a traced top-k: MIN_TOP_K_BOUND, or the next power of two that holds `top_k`, at most the
    vocabulary; so the top-k values a user sweeps share one program (a bound past 64 is its own program)."""
    return min(max(MIN_TOP_K_BOUND, 1 << max(top_k - 1, 0).bit_length()), vocab_size)


def row_top_k_floor(logits, top_k, max_top_k: int):
    """[B, n, 1]: each row's k-th largest logit (logits [B, n, V], top_k int32 [B] in [0, max_top_k]), -inf where
    top_k is 0: the value `sample_tokens`' top-k filter keeps logits from. The k-th of the `max_top_k` largest is
    exactly the k-th largest, so a row gets what `top_k=k` alone gives it; the selection runs only when some row
    asks for it."""
    none = jnp.full_like(logits[..., :1], -jnp.inf)
    if max_top_k == 0:
        return none

    def floor(logits):
        largest = jax.lax.top_k(logits, max_top_k)[0]
        kth = jnp.take_along_axis(largest, jnp.clip(top_k - 1, 0, max_top_k - 1)[:, None, None], axis=-1)
        return jnp.where((top_k > 0)[:, None, None], kth, none)

    return jax.lax.cond(jnp.any(top_k > 0), floor, lambda logits: none, logits)


def sample_tokens_per_row(logits, u, *, temperature, top_k, max_top_k: int, top_p, keep_max):
    """`sample_tokens` with a temperature, a top-k and a top-p per row of logits [B, n, V] (float32 [B], int32 [B]
    at most the static `max_top_k`, float32 [B]) and, in the rows where `keep_max` (bool [B]), the top-k 1 filter in
    place of the row's top-k. Every row computes what `sample_tokens` computes with its values alone: a temperature
    of 1 divides by 1, which leaves the logits as they are, and the nucleus filter (computed only when some row
    asks for it) is kept only where top_p < 1."""
    logits = logits / temperature[:, None, None]
    kth = row_top_k_floor(logits, top_k, max_top_k)
    kth = jnp.where(keep_max[:, None, None], jnp.max(logits, axis=-1, keepdims=True), kth)
    logits = jnp.where(logits < kth, -jnp.inf, logits)

    def nucleus(logits):
        removed = outside_nucleus(logits, top_p[:, None, None]) & (top_p < 1.0)[:, None, None]
        return jnp.where(removed, -jnp.inf, logits)

    logits = jax.lax.cond(jnp.any(top_p < 1.0), nucleus, lambda logits: logits, logits)
    return inverse_cdf_draw(logits, u)


def against_rows(value):
    """A value to combine with per-position values [B, n] (a confidence threshold, a factor): a number as it is, a
    float32 [B] per row as [B, 1]."""
    return value[:, None] if jnp.ndim(value) else value


def transfer_mask(strategy, mask_index, x0_p, count, threshold):
    """bool [B, n]: the positions an SDAR step commits under remasking `strategy`: one of SDAR_REMASKING
    ("low_confidence_dynamic", "low_confidence_static", "sequential"), or int32 [B], each row's index into it;
    `count` int32 scalar or [B] per row; `threshold` a number or float32 [B] per row."""
    count = jnp.broadcast_to(count, mask_index.shape[:1])
    if not isinstance(strategy, str):  # each row's own rule: the three masks are [B, n] each, computed for every row
        masks = [transfer_mask(name, mask_index, x0_p, count, threshold) for name in SDAR_REMASKING]
        return jnp.select([strategy[:, None] == i for i in range(len(masks) - 1)], masks[:-1], masks[-1])
    if strategy == "sequential":
        n = mask_index.shape[1]
        first = jnp.argmax(mask_index, axis=1)[:, None]
        pos = jnp.arange(n)[None, :]
        return (pos >= first) & (pos < first + count[:, None])
    confidence = jnp.where(mask_index, x0_p, -jnp.inf)
    top = commit_top(confidence, count)
    if strategy == "low_confidence_static":
        return top
    high = confidence > against_rows(threshold)
    return jnp.where(jnp.sum(high, axis=1, keepdims=True) >= count[:, None], high, top)
