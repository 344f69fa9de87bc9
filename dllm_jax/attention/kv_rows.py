"""A KV cache layer's rows in one of two storage forms: plain arrays [B, S, Hkv, D] in the model's dtype, or
`QuantizedRows`: float8 e4m3 elements with one float32 scale per (row, position, KV head), written by
quantizing each new position as it enters the cache and read by the split-KV kernel, which applies the scales
in registers (`pallas_kernels.split_kv_attention(k_scale=, v_scale=)`): a long cache is read at one byte per
element instead of two. Every other reader dequantizes the layer first (`dense_rows`).

`kv_cache_dtype` ("auto": the model's dtype; "fp8": quantized rows) is the option that chooses; an init
function given `FP8` as the cache dtype makes quantized rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dllm_jax import quantize
from pallas_kernels import split_kv

KV_CACHE_DTYPES = ("auto", "fp8")
FP8 = split_kv.KV_DTYPE  # the cache dtype that stands for quantized rows


def quantize_rows(x):
    """Rows x [B, n, Hkv, D] as (float8 data, float32 scales [B, n, Hkv]): each (position, KV head) over its
    absmax, as the weights are per output channel (`dllm_jax.quantize.quantize_weight`; the dot with a query sums
    over D)."""
    return quantize.quantize_weight(x, (3,), "fp8")


@struct.dataclass
class QuantizedRows:
    """One layer's keys or values: data float8_e4m3fn [B, S, Hkv, D], scale float32 [B, S, Hkv]; position s of
    KV head h of row b holds data[b, s, h] * scale[b, s, h]."""

    data: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple:
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype


def check_kv_cache_dtype(value) -> str:
    """`value` if it is one of KV_CACHE_DTYPES; ValueError naming the choices otherwise."""
    if isinstance(value, str) and value in KV_CACHE_DTYPES:
        return value
    raise ValueError(f"kv_cache_dtype={value!r} is not one of {KV_CACHE_DTYPES} ('auto': the model's dtype; "
                     "'fp8': e4m3 with a scale per position and KV head)")


def cache_dtype(kv_cache_dtype: str, model_dtype):
    """The dtype an init function takes for a cache of `kv_cache_dtype`: the model's, or FP8."""
    return FP8 if check_kv_cache_dtype(kv_cache_dtype) == "fp8" else model_dtype


def zeros(shape: tuple, dtype):
    """An empty layer: zeros of `dtype`, or quantized rows (zeros, scale 1) where dtype is FP8."""
    if jnp.dtype(dtype) == FP8:
        return QuantizedRows(data=jnp.zeros(shape, FP8), scale=jnp.ones(shape[:-1], jnp.float32))
    return jnp.zeros(shape, dtype)


def write_rows(buffer, new, start):
    """buffer [B, S, ...] with new [B, n, Hkv, D] written at positions start[b]..start[b]+n-1 of each row b
    (quantized where the buffer is)."""
    put = jax.vmap(lambda row, x, s: jax.lax.dynamic_update_slice_in_dim(row, x, s, axis=0))
    if isinstance(buffer, QuantizedRows):
        data, scale = quantize_rows(new)
        return QuantizedRows(data=put(buffer.data, data, start), scale=put(buffer.scale, scale, start))
    return put(buffer, new.astype(buffer.dtype), start)


def write_span(buffer, new, start):
    """buffer [B, S, ...] with new [B, n, Hkv, D] written at positions start..start+n-1 of every row."""
    put = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x, start, axis=1)  # noqa: E731
    if isinstance(buffer, QuantizedRows):
        data, scale = quantize_rows(new)
        return QuantizedRows(data=put(buffer.data, data), scale=put(buffer.scale, scale))
    return put(buffer, new.astype(buffer.dtype))


def dense_rows(rows, dtype):
    """A layer's rows as a plain array of `dtype` (quantized rows dequantized: a copy of the layer)."""
    if isinstance(rows, QuantizedRows):
        return quantize.dequantize(rows.data, rows.scale, (3,), dtype)
    return rows
