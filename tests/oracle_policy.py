"""A test-only attention policy: exact ("oracle") top-k key blocks per query block.

At step 0 (ESTIMATE) it attends densely and records, per query block, the `keep` key blocks that
received the most attention probability (summed over heads); at later steps (SPARSE) it attends only
to those blocks. Its state (int32 [B, query blocks, keep]) must therefore survive from step 0 to
every later step of the compiled loop, for every layer separately.
"""

import dataclasses

import jax
import jax.numpy as jnp

from dllm_jax.attention.dense import combined_mask, dense_attention
from dllm_jax.attention.policy import AttentionPolicy, Mode


@dataclasses.dataclass(frozen=True)
class OracleTopK(AttentionPolicy):
    block: int = 4
    keep: int = 1

    def init_state(self, *, batch, num_heads, num_kv_heads, q_len, kv_len, head_dim):
        return jnp.zeros((batch, -(-q_len // self.block), self.keep), jnp.int32)

    def blocks(self, length):
        return -(-length // self.block)

    def mode(self, step):
        return jnp.where(step == 0, int(Mode.ESTIMATE), int(Mode.SPARSE))

    def block_scores(self, q, k, masks):
        b, n, hq, d = q.shape
        k = jnp.repeat(k, hq // k.shape[2], axis=2)
        logits = jnp.einsum("blhd,bshd->bhls", q, k, precision="highest") * d ** -0.5
        s = k.shape[1]
        allowed = combined_mask(masks.get("key_mask"), None, masks.get("kv_len"), n, s)
        if allowed is not None:
            logits = jnp.where(allowed, logits, -jnp.inf)
        probs = jax.nn.softmax(logits, axis=-1).sum(axis=1)  # [B, L, S]
        probs = jnp.pad(probs, ((0, 0), (0, -n % self.block), (0, -s % self.block)))
        nq, nk = self.blocks(n), self.blocks(s)
        return probs.reshape(b, nq, self.block, nk, self.block).sum(axis=(2, 4))  # [B, nq, nk]

    def attend(self, q, k, v, state, mode, **masks):
        n = q.shape[1]

        def estimate(_):
            scores = self.block_scores(q, k, masks)
            return dense_attention(q, k, v, **masks), jax.lax.top_k(scores, self.keep)[1].astype(jnp.int32)

        def sparse(_):
            s = k.shape[1]
            chosen = jax.nn.one_hot(state, self.blocks(s), dtype=bool).any(axis=-2)  # [B, nq, nk]
            mask = jnp.repeat(jnp.repeat(chosen, self.block, axis=1), self.block, axis=2)[:, :n, :s]
            return dense_attention(q, k, v, mask=mask, **masks), state

        # SDAR block steps pass one mode per row; the tests that use this policy generate one row
        return jax.lax.cond(jnp.any(jnp.asarray(mode) == int(Mode.ESTIMATE)), estimate, sparse, None)
