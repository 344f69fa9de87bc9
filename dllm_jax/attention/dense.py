"""Dense attention: the default every model layer calls, and what sparse policies replace.

Layout (contract): q [B, L, Hq, D], k/v [B, S, Hkv, D], Hq % Hkv == 0; output [B, L, Hq, D].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dense_implementation(dtype, head_dim: int) -> str:
    """'cudnn' (flash attention) on a GPU for bf16/fp16 and head_dim the kernel supports, else 'xla'.

    cuDNN has no fp32 path, so fp32 (numerics runs) always uses XLA.
    """
    on_gpu = jax.default_backend() == "gpu"
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if on_gpu and half and head_dim <= 128 and head_dim % 8 == 0 else "xla"


def dense_attention(q, k, v, *, key_mask=None, scale=None, implementation=None):
    """Softmax attention of every query over every key, bidirectional.

    Args:
      q: [B, L, Hq, D] queries.
      k, v: [B, S, Hkv, D] keys and values.
      key_mask: optional bool [B, S], False for keys no query may attend (padding).
      scale: logit scale, default 1/sqrt(D).
      implementation: 'cudnn' or 'xla'; default chosen by `dense_implementation`.
    Returns:
      [B, L, Hq, D] in q's dtype.
    """
    if implementation is None:
        implementation = dense_implementation(q.dtype, q.shape[-1])
    mask = None if key_mask is None else key_mask[:, None, None, :]  # [B, 1, 1, S]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation=implementation)
