"""Training objectives of the two families, as pure jit-able functions of (params, batch, key).

Both are masked-diffusion losses (LLaDA, arXiv 2502.09992; BD3-LM, arXiv 2503.09573): a masking ratio
t ~ U(eps, 1) is drawn, each loss-eligible token is replaced by the mask token with probability t, and
the cross-entropy of the original token at every masked position is weighted by 1/t (the ELBO weight
of the linear schedule). Normalisation (both losses, LLaDA's official SFT recipe):

    loss = 1/B * sum_b [ sum_{i masked in row b} CE(b, i) / t(b, i) ] / max(1, n_b)

with n_b the number of loss-eligible positions of row b (`loss_mask`). Its expectation over the masking
is the mean CE per eligible token, so at initialisation it is about log(vocab_size). For pretraining-style
batches (every position eligible, no padding) it is LLaDA's pretraining loss (sum / (B * L)).

  * `llada_loss`: one t per row; the model sees the whole noisy row bidirectionally.
  * `sdar_loss`: block diffusion in ONE forward over [x_t ; x_0] (BD3-LM's two copies): one t per
    block (as BD3-LM), every noisy block attends bidirectionally to itself and to the clean copy of
    the blocks before it, the clean copy attends block-causally to itself; see `two_copy_mask`.

Both forwards attend in query chunks (dllm_jax.train.attention): no [L, L] or [2L, 2L] scores or masks,
so the same losses train at 16k-32k tokens; `chunk=None` materialises the masks instead (the reference).

With `stratified=True` the n ratios of a batch (its rows, or all its blocks) are not iid but one
stratified draw (low-discrepancy t, as MDLM's variance reduction): one point in each of the n intervals
[eps + (1-eps) k/n, eps + (1-eps) (k+1)/n), the intervals dealt out in a random order. Each t is still
U(eps, 1), so the loss keeps its expectation; a batch covers [eps, 1) evenly, which lowers the
variance of the 1/t weights between batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import struct

from dllm_jax.attention.policy import Dense, Mode
from dllm_jax.config import LLaDAConfig, SDARConfig
from dllm_jax.models import llada
from dllm_jax.models.layers import decoder_stack, lm_head, rope_tables
from dllm_jax.train.attention import CHUNK, padded_attention, two_copy_attention


@struct.dataclass
class Noised:
    """One draw of the forward (noising) process."""

    tokens: jax.Array  # int32 [B, L]: the input with masked positions set to the mask id
    masked: jax.Array  # bool [B, L]: positions replaced (only where loss_mask is set)
    t: jax.Array  # float32 [B, L]: the masking ratio that applied at each position


@struct.dataclass
class LossMetrics:
    """Scalars of one loss evaluation (float32)."""

    loss: jax.Array  # the weighted objective (module docstring)
    ce: jax.Array  # mean unweighted cross-entropy over masked positions (about log V at init)
    masked: jax.Array  # number of masked positions in the batch
    eligible: jax.Array  # number of loss-eligible positions in the batch


def stratified_uniform(key, n: int):
    """float32 [n] in [0, 1): (k_i + u) / n for one u ~ U(0, 1) and a random permutation k of 0..n-1,
    so interval [k/n, (k+1)/n) holds exactly one point (the set of (u' + i/n) mod 1 for u' = u/n)."""
    u_key, order_key = jax.random.split(key)
    k = jax.random.permutation(order_key, n).astype(jnp.float32)
    x = (k + jax.random.uniform(u_key, ())) / n
    # float32 rounding can carry k + u up to k + 1: keep every point inside its own interval (and below 1)
    return jnp.clip(x, k / n, jnp.nextafter((k + 1) / n, jnp.float32(0)))


def row_ratios(key, batch: int, length: int, *, eps: float, stratified: bool = False):
    """float32 [B, L]: one t ~ U(eps, 1) per row, repeated along the row (LLaDA); with `stratified`,
    the B rows' t are one stratified draw (`stratified_uniform`) instead of iid."""
    if stratified:
        u = stratified_uniform(key, batch)[:, None]
    else:
        u = jax.random.uniform(key, (batch, 1))
    t = eps + (1.0 - eps) * u
    return jnp.broadcast_to(t, (batch, length))


def block_ratios(key, batch: int, length: int, *, block_size: int, eps: float, stratified: bool = False):
    """float32 [B, L]: one t ~ U(eps, 1) per block of `block_size` positions (the last may be partial);
    with `stratified`, the B * blocks t of the batch are one stratified draw (`stratified_uniform`)."""
    blocks = -(-length // block_size)
    if stratified:
        u = stratified_uniform(key, batch * blocks).reshape(batch, blocks)
    else:
        u = jax.random.uniform(key, (batch, blocks))
    t = eps + (1.0 - eps) * u
    return jnp.repeat(t, block_size, axis=1)[:, :length]


def mask_tokens(tokens, loss_mask, t, key, *, mask_token_id: int) -> Noised:
    """Replaces each eligible position (loss_mask True) of tokens [B, L] by the mask id with
    probability t [B, L], independently; ineligible positions are never masked."""
    masked = (jax.random.uniform(key, tokens.shape) < t) & loss_mask.astype(bool)
    return Noised(tokens=jnp.where(masked, mask_token_id, tokens), masked=masked, t=t)


def weighted_loss(logits, targets, noised: Noised, loss_mask) -> tuple[jax.Array, LossMetrics]:
    """The normalised 1/t-weighted CE of the module docstring, from float32 logits [B, L, V] of the
    noisy input and the clean targets [B, L]."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)  # [B, L]
    masked = noised.masked.astype(jnp.float32)
    eligible = loss_mask.astype(jnp.float32).sum(axis=1)  # [B]
    per_row = (ce * masked / noised.t).sum(axis=1) / jnp.maximum(eligible, 1.0)
    loss = per_row.mean()
    count = masked.sum()
    metrics = LossMetrics(loss=loss, ce=(ce * masked).sum() / jnp.maximum(count, 1.0), masked=count,
                          eligible=eligible.sum())
    return loss, metrics


def llada_loss(logits_fn, params, tokens, loss_mask, key, *, mask_token_id: int, eps: float = 1e-3,
               stratified: bool = False):
    """LLaDA's masked-diffusion loss of tokens int32 [B, L] (module docstring).

    Args:
      logits_fn: `logits_fn(params, noisy_tokens [B, L]) -> float32 logits [B, L, V]` (bidirectional,
        no shift: logits[i] predicts token i), e.g. `llada.forward(...)[0]`.
      loss_mask: bool/0-1 [B, L]: where masking (and so the loss) may happen: the answer for SFT,
        every non-pad position for pretraining.
      key: PRNG key; one t ~ U(eps, 1) per row, then the per-position masking draws.
      stratified: the rows' t as one stratified draw (`row_ratios`), not iid.
    Returns:
      (scalar loss, LossMetrics).
    """
    t_key, mask_key = jax.random.split(key)
    t = row_ratios(t_key, *tokens.shape, eps=eps, stratified=stratified)
    noised = mask_tokens(tokens, loss_mask, t, mask_key, mask_token_id=mask_token_id)
    return weighted_loss(logits_fn(params, noised.tokens), tokens, noised, loss_mask)


def two_copy_mask(length: int, block_size: int):
    """bool [2L, 2L]: who may attend whom over [x_t (positions 0..L-1) ; x_0 (L..2L-1)] (BD3-LM).

    With block(i) = (i mod L) // block_size, query q may attend key k iff
      * both noisy: block(k) == block(q) (bidirectional inside the block being denoised);
      * q noisy, k clean: block(k) < block(q) (the clean context before the block);
      * both clean: block(k) <= block(q) (SDAR's own block-causal mask, building that context);
      * q clean, k noisy: never.
    """
    block = (jnp.arange(2 * length) % length) // block_size
    noisy = jnp.arange(2 * length) < length
    same, before = block[:, None] == block[None, :], block[None, :] < block[:, None]
    q_noisy, k_noisy = noisy[:, None], noisy[None, :]
    return jnp.where(q_noisy, jnp.where(k_noisy, same, before), ~k_noisy & (same | before))


def two_copy_logits(params, noisy, clean, *, config: SDARConfig, chunk: int | None = CHUNK):
    """float32 logits [B, L, V] of the noisy copy noisy [B, L], in one forward over [noisy ; clean]
    under `two_copy_mask`'s rule; both copies sit at positions 0..L-1 (the same RoPE angles), so noisy
    block b sees exactly what SDAR's block-causal forward shows block b of clean[:b] ++ noisy block b.

    `chunk`: queries per chunk of `attention.two_copy_attention` (no [2L, 2L] array, what training at
    long contexts needs); None attends through the materialised `two_copy_mask` (the reference).
    Runs the model's pure layer functions (`decoder_stack`, `lm_head`) with this module's attention and
    positions, since `sdar.forward` builds its own [L, L] mask over positions 0..L-1.
    """
    length = noisy.shape[1]
    ids = jnp.concatenate([noisy, clean], axis=1)
    positions = jnp.concatenate([jnp.arange(length), jnp.arange(length)])
    cos, sin = rope_tables(positions, config.head_dim, config.rope_theta)
    if chunk is None:
        mask = two_copy_mask(length, config.block_size)

        def attend(q, k, v, state, layer):
            return Dense().attend(q, k, v, state, Mode.DENSE, mask=mask)
    else:
        def attend(q, k, v, state, layer):
            return two_copy_attention(q, k, v, block_size=config.block_size, chunk=chunk), state

    x, _ = decoder_stack(params["layers"], params["embed"][ids], cos, sin, attend, config)
    return lm_head(params, x[:, :length], config)


def llada_logits(params, ids, lengths, *, config: LLaDAConfig, chunk: int | None = CHUNK):
    """float32 logits [B, L, V] of LLaDA's training forward over ids [B, L], each row's keys at or beyond
    lengths int32 [B] hidden from every query (`llada.forward(padding="mask")`). `chunk` as in
    `two_copy_logits` (`attention.padded_attention`; None: the [B, L] key mask through the model's Dense)."""
    if chunk is None:
        return llada.forward(params, ids, jnp.arange(ids.shape[1]) < lengths[:, None], config=config,
                             padding="mask")[0]

    def attend(q, k, v, state, layer):
        return padded_attention(q, k, v, lengths, chunk=chunk), state

    return llada.logits_through(params, ids, attend, (), config=config, logits_from=0)[0]


def sdar_loss(params, tokens, loss_mask, key, *, config: SDARConfig, eps: float = 1e-3, stratified: bool = False,
              chunk: int | None = CHUNK):
    """SDAR's block-diffusion loss of tokens int32 [B, L] (module docstring): one t per block of
    `config.block_size` (`stratified`: one stratified draw over all the batch's blocks), eligible
    positions (loss_mask) masked with their block's t, one forward of `two_copy_logits` (its `chunk`), CE
    of the masked positions weighted by 1/t. Returns (scalar loss, LossMetrics).
    """
    t_key, mask_key = jax.random.split(key)
    t = block_ratios(t_key, *tokens.shape, block_size=config.block_size, eps=eps, stratified=stratified)
    noised = mask_tokens(tokens, loss_mask, t, mask_key, mask_token_id=config.mask_token_id)
    logits = two_copy_logits(params, noised.tokens, tokens, config=config, chunk=chunk)
    return weighted_loss(logits, tokens, noised, loss_mask)
