"""Dense attention: the default every model layer calls, and what sparse policies replace.

Layout (contract): q [B, L, Hq, D], k/v [B, S, Hkv, D], Hq % Hkv == 0; output [B, L, Hq, D].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul_precision(dtype):
    """HIGHEST for fp32 (XLA would otherwise use TF32 on NVIDIA GPUs), DEFAULT for bf16/fp16."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def dense_implementation(dtype, head_dim: int) -> str:
    """'cudnn' (flash attention) on a GPU for bf16/fp16 and head_dim the kernel supports, else 'xla'.

    cuDNN has no fp32 path, so fp32 (numerics runs) always uses XLA.
    """
    on_gpu = jax.default_backend() == "gpu"
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if on_gpu and half and head_dim <= 128 and head_dim % 8 == 0 else "xla"


def xla_attention(q, k, v, *, key_mask=None, scale=None):
    """Plain softmax(q kᵀ·scale) v with fp32 logits and softmax; GQA by grouping query heads.

    A row whose keys are all masked gets a uniform softmax (as torch with a finfo.min bias).
    """
    b, n, hq, d = q.shape
    hkv = k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    precision = matmul_precision(q.dtype)
    qg = q.reshape(b, n, hkv, hq // hkv, d)
    logits = jnp.einsum("blkgd,bskd->bkgls", qg, k, preferred_element_type=jnp.float32,
                        precision=precision) * scale  # [B, Hkv, G, L, S]
    if key_mask is not None:
        logits = jnp.where(key_mask[:, None, None, None, :], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgls,bskd->blkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32,
                     precision=precision)
    return out.reshape(b, n, hq, d).astype(q.dtype)


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
    if implementation == "xla":
        return xla_attention(q, k, v, key_mask=key_mask, scale=scale)
    if implementation != "cudnn":
        raise ValueError(f"implementation must be 'cudnn' or 'xla', got {implementation!r}")
    mask = None
    if key_mask is not None:
        # cuDNN takes a mask only as a full [B, 1, L, S] bias (it rejects a broadcast query axis);
        # left padding rules out its key_value_seq_lengths, which assumes the pads are on the right.
        b, n, s = q.shape[0], q.shape[1], k.shape[1]
        mask = jnp.broadcast_to(key_mask[:, None, None, :], (b, 1, n, s))
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="cudnn")
