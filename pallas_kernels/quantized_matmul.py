"""x @ w.T for few rows of x and a weight held in one byte per value (int8 or FP8 e4m3) with a float32 scale per
output channel: decode's GEMM, which reads every weight once and does little arithmetic on it.

Layout (the contract, `dllm_jax.quantize`'s inference layout):
  x [M, K] bfloat16 or float16, M <= MAX_ROWS (the rows are padded to one 16-row tile);
  w [N, K] int8 or float8_e4m3fn (the contracted axis minor);
  scale [N] float32.
  out [M, N] in x's dtype: (x @ w.T) * scale, accumulated in float32.
Grid (N / block_n, split_k): each program streams its block_n rows of w over its 1/split_k of K in block_k
steps, casts each tile to x's dtype in registers and multiplies it on the tensor cores (the weight never exists
in memory as a bf16 tensor). With split_k = 1 the program applies the scale and writes the output; otherwise
it writes float32 partial sums that one small XLA fusion adds, scales and casts.

Why a kernel: XLA's own weight-only GEMM (the 1-byte weight cast inside its Triton GEMM fusion) reads the 36
SDAR-8B layers' weights at 78% of the copy bandwidth where bf16 reaches 93% (H100), and at one to a few rows the
GEMM is all weight read. `dllm_jax.quantize.linear` does not run it (benchmarks/quantized_gemm.py compares the two): end to end, SDAR-8B
generation is slower with it than with XLA's GEMM (docs/quantization.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as c

X_DTYPES = c.DTYPES[:2]  # bfloat16, float16: the rows a 1-byte weight multiplies
BLOCK_M = 16  # the smallest tensor-core tile's rows; x is padded to it
MAX_ROWS = BLOCK_M


def _kernel(x_ref, w_ref, s_ref, o_ref, *, block_k: int, steps: int, scaled: bool):
    def body(i, acc):
        ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        a = x_ref[:, ks]
        b = w_ref[:, ks].astype(a.dtype)
        return acc + jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape[-2:], jnp.float32))
    if scaled:
        o_ref[...] = (acc * s_ref[...][None, :]).astype(o_ref.dtype)
    else:
        o_ref[0] = acc


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "split_k", "num_warps", "num_stages",
                                             "interpret"))
def _quantized_matmul(x, w, scale, *, block_n, block_k, split_k, num_warps, num_stages, interpret):
    m, k = x.shape
    n = w.shape[0]
    x = c.pad_axis(x, 0, BLOCK_M)
    span = k // split_k
    kernel = functools.partial(_kernel, block_k=block_k, steps=span // block_k, scaled=split_k == 1)
    if split_k == 1:
        out_shape = jax.ShapeDtypeStruct((BLOCK_M, n), x.dtype)
        out_spec = pl.BlockSpec((BLOCK_M, block_n), lambda j, s: (0, j))
    else:
        out_shape = jax.ShapeDtypeStruct((split_k, BLOCK_M, n), jnp.float32)
        out_spec = pl.BlockSpec((1, BLOCK_M, block_n), lambda j, s: (s, 0, j))
    out = pl.pallas_call(
        kernel,
        grid=(n // block_n, split_k),
        in_specs=[
            pl.BlockSpec((BLOCK_M, span), lambda j, s: (0, s)),
            pl.BlockSpec((block_n, span), lambda j, s: (j, s)),
            pl.BlockSpec((block_n,), lambda j, s: (j,)),
        ],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=c.compiler_params(64, num_warps if num_warps is not None else 4,
                                          num_stages if num_stages is not None else 4),
        interpret=interpret,
        name="quantized_matmul",
    )(x, w, scale)
    if split_k > 1:
        out = (jnp.sum(out, axis=0) * scale).astype(x.dtype)
    return out[:m]


def fits(x_shape, w_shape, *, block_n: int, block_k: int, split_k: int = 1) -> bool:
    """Whether the kernel takes these shapes with these tiles: at most MAX_ROWS rows, N whole blocks of block_n,
    K whole steps of block_k in each of split_k parts (no tile runs past the weight: nothing is padded)."""
    (m, k), (n, kw) = x_shape, w_shape
    return 0 < m <= MAX_ROWS and k == kw and n % block_n == 0 and k % (split_k * block_k) == 0


def check_quantized(x, w, scale, *, block_n: int | None = None, block_k: int = 16, split_k: int = 1) -> None:
    """ValueError for inputs outside the contract (and, with block_n, for shapes its tiles do not take)."""
    if x.ndim != 2 or w.ndim != 2 or scale.shape != (w.shape[0],):
        raise ValueError(f"quantized_matmul takes x [M, K], w [N, K] and scale [N], got {x.shape}, {w.shape} and "
                         f"{scale.shape}")
    if jnp.dtype(x.dtype) not in X_DTYPES:
        raise ValueError(f"x.dtype={x.dtype} is not one of {[str(d) for d in X_DTYPES]}")
    if jnp.dtype(w.dtype) not in c.BYTE_WEIGHT_DTYPES:
        raise ValueError(f"w.dtype={w.dtype} is not one of {[str(d) for d in c.BYTE_WEIGHT_DTYPES]}")
    if scale.dtype != jnp.float32:
        raise ValueError(f"scale must be float32, got {scale.dtype}")
    if block_n is None:
        return
    if not isinstance(split_k, int) or split_k < 1:
        raise ValueError(f"split_k={split_k!r} must be a positive int")
    if not fits(x.shape, w.shape, block_n=block_n, block_k=block_k, split_k=split_k):
        raise ValueError(f"x {x.shape} @ w {w.shape}.T does not fit the tiles: needs 1..{MAX_ROWS} rows, the same K, "
                         f"N a multiple of block_n={block_n} and K a multiple of split_k * block_k = "
                         f"{split_k * block_k}")


def quantized_matmul(x, w, scale, *, block_n: int = 16, block_k: int = 512, split_k: int = 1, interpret=False,
                     num_warps=None, num_stages=None):
    """(x [M, K] @ w [N, K].T) * scale [N] -> [M, N] in x.dtype, float32 accumulation; w int8 or FP8 e4m3. See the
    module docstring for the contract. block_n, block_k: weight rows and columns per step (powers of two >= 16);
    split_k: parts of K computed by separate programs (more programs for a small N); num_warps, num_stages:
    tuning."""
    for name, value in (("block_n", block_n), ("block_k", block_k)):
        c.check_block(name, value)
    check_quantized(x, w, scale, block_n=block_n, block_k=block_k, split_k=split_k)
    return _quantized_matmul(x, w, scale, block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps,
                             num_stages=num_stages, interpret=interpret)


def quantized_matmul_reference(x, w, scale, *, block_n: int = 16, block_k: int = 512, split_k: int = 1,
                               interpret=False, num_warps=None, num_stages=None):
    """The same function in jnp: the weight cast to x's dtype, a float32 product, the scale, x's dtype."""
    del block_n, block_k, split_k, interpret, num_warps, num_stages
    check_quantized(x, w, scale)
    out = jax.lax.dot_general(x, w.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (out * scale).astype(x.dtype)
