"""Grouped matrix multiply over row tiles (the routed experts of a mixture of experts): tile t of x
(rows t*block_m .. (t+1)*block_m - 1) is multiplied by the weights of its group, w[tile_groups[t]].

Layout (the contract):
  x [M, K], M a multiple of block_m: rows grouped by weight, each group's rows padded to whole tiles;
  w [G, K, N]; or, quantized (`w_scale` given), w [G, N, K] in int8 or FP8 e4m3 with w_scale float32 [G, N]: the
      contracted axis minor, as `dllm_jax.quantize` stores a quantized weight; each tile is cast to x's dtype in
      registers and the product scaled per output column in the epilogue;
  tile_groups int32 [M // block_m]: nondecreasing; a value >= G marks an unused tile (they come last):
      its output rows are 0. A group may own no tile.
Grid (tiles, N / block_n): each program reads its tile's group id, skips unused tiles, and
accumulates x_tile @ w[g][:, n-block] in float32 over K in block_k steps. Tiles of one group sit next
to each other in the grid, so a group's weight blocks are read from HBM about once and from L2 after.

Why a kernel: XLA's `jax.lax.ragged_dot` on the GPU (jax 0.11.2) costs ~2.6 us per row (84 ms for
LLaDA2.0-mini's 32k token copies at 4k tokens), far from the weight-read bound
(benchmarks/results/families_*).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import _common as c


def _kernel(g_ref, x_ref, w_ref, *refs, num_groups, block_k, precision, quantized):
    s_ref, o_ref = refs if quantized else (None, *refs)
    group = g_ref[0]

    @pl.when(group >= num_groups)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(group < num_groups)
    def _():
        def body(i, acc):
            ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
            a = x_ref[:, ks]
            if quantized:  # w [G, block_n, K]: contract both minor axes
                b = w_ref[group, :, ks].astype(a.dtype)
                return acc + jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            b = w_ref[group, ks, :]
            return acc + jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)

        acc = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, body, jnp.zeros(o_ref.shape, jnp.float32))
        if quantized:
            acc = acc * s_ref[group, :][None, :]
        o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_warps", "num_stages",
                                             "interpret"))
def _grouped_matmul(x, w, tile_groups, scale, *, block_m, block_n, block_k, num_warps, num_stages, interpret):
    m, k = x.shape
    quantized = scale is not None
    g, n = (w.shape[0], w.shape[1]) if quantized else (w.shape[0], w.shape[2])
    k_pad, n_pad = c.cdiv(k, block_k) * block_k, c.cdiv(n, block_n) * block_n
    x = c.pad_axis(x, 1, k_pad)
    if quantized:
        w = c.pad_axis(c.pad_axis(w, 2, k_pad), 1, n_pad)
        w_spec = pl.BlockSpec((g, block_n, k_pad), lambda t, j: (0, j, 0))
        scale_specs, scales = [pl.BlockSpec((g, block_n), lambda t, j: (0, j))], [c.pad_axis(scale, 1, n_pad)]
    else:
        w = c.pad_axis(c.pad_axis(w, 1, k_pad), 2, n_pad)
        w_spec = pl.BlockSpec((g, k_pad, block_n), lambda t, j: (0, 0, j))
        scale_specs, scales = [], []
    precision = c.EXACT_F32 if x.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, num_groups=g, block_k=block_k, precision=precision, quantized=quantized)
    out = pl.pallas_call(
        kernel,
        grid=(m // block_m, n_pad // block_n),
        in_specs=[
            pl.BlockSpec((1,), lambda t, j: (t,)),
            pl.BlockSpec((block_m, k_pad), lambda t, j: (t, 0)),
            w_spec,
            *scale_specs,
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((m, n_pad), x.dtype),
        compiler_params=c.compiler_params(128, num_warps if num_warps is not None else 4,
                                          num_stages if num_stages is not None else 3),
        interpret=interpret,
        name="grouped_matmul",
    )(tile_groups, x, w, *scales)
    return out[:, :n]


def check_grouped(x, w, tile_groups, block_m: int, scale=None) -> None:
    """ValueError for inputs outside the contract (the group order only on concrete inputs)."""
    if scale is not None:
        if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[2] or scale.shape != w.shape[:2]:
            raise ValueError(f"a quantized grouped_matmul takes x [M, K], w [G, N, K] and scale [G, N], got "
                             f"{x.shape}, {w.shape} and {scale.shape}")
        if jnp.dtype(w.dtype) not in c.BYTE_WEIGHT_DTYPES or scale.dtype != jnp.float32:
            raise ValueError(f"a quantized w is int8 or float8_e4m3fn with a float32 scale, got {w.dtype} and "
                             f"{scale.dtype}")
        if jnp.dtype(x.dtype) not in c.DTYPES[:2]:
            raise ValueError(f"x.dtype={x.dtype}: a quantized weight multiplies bfloat16 or float16 rows")
    elif x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_matmul takes x [M, K] and w [G, K, N], got {x.shape} and {w.shape}")
    elif jnp.dtype(x.dtype) not in c.DTYPES or x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype of {[str(d) for d in c.DTYPES]}, got {x.dtype} and {w.dtype}")
    if x.shape[0] % block_m:
        raise ValueError(f"x has {x.shape[0]} rows: not whole tiles of block_m={block_m}")
    if tile_groups.shape != (x.shape[0] // block_m,) or not jnp.issubdtype(tile_groups.dtype, jnp.integer):
        raise ValueError(f"tile_groups must be int [{x.shape[0] // block_m}] (one per tile), got "
                         f"{tile_groups.dtype}{list(tile_groups.shape)}")
    if c.is_concrete(tile_groups):
        groups = np.asarray(tile_groups)
        if (groups < 0).any() or (np.diff(groups) < 0).any():
            raise ValueError("tile_groups must be nonnegative and nondecreasing (rows grouped by weight, unused "
                             "tiles last)")


def grouped_matmul(x, w, tile_groups, *, block_m: int, block_n: int = 128, block_k: int = 64, w_scale=None,
                   interpret=False, num_warps=None, num_stages=None):
    """x [M, K] @ w[tile_groups[t]] per row tile t of block_m rows -> [M, N] in x.dtype (float32
    accumulation); unused tiles (group >= G) give 0. With `w_scale`, w is a quantized [G, N, K] and each
    product is (x_tile @ w[g].T) * w_scale[g]. See the module docstring for the contract.

    block_m: rows per tile, a power of two >= 16; block_n, block_k: output columns and reduction steps
    per program (powers of two >= 16; K and N are zero-padded to them). num_warps, num_stages: tuning.
    """
    for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        c.check_block(name, value)
    check_grouped(x, w, tile_groups, block_m, w_scale)
    return _grouped_matmul(x, w, tile_groups.astype(jnp.int32), w_scale, block_m=block_m, block_n=block_n,
                           block_k=block_k, num_warps=num_warps, num_stages=num_stages, interpret=interpret)


def grouped_matmul_reference(x, w, tile_groups, *, block_m: int, block_n: int = 128, block_k: int = 64,
                             w_scale=None, interpret=False, num_warps=None, num_stages=None):
    """The same function through `jax.lax.ragged_dot`: group g owns block_m rows per tile it is named in
    (the tiles come in group order), rows of unused tiles are past every group and come out 0. A quantized
    w is cast to x's dtype and each row's product scaled by its group's scale, as the kernel does."""
    del block_n, block_k, interpret, num_warps, num_stages
    check_grouped(x, w, tile_groups, block_m, w_scale)
    g = w.shape[0]
    sizes = block_m * jnp.bincount(jnp.minimum(tile_groups, g), length=g + 1)[:g]
    weights = w if w_scale is None else jnp.swapaxes(w, 1, 2).astype(x.dtype)
    out = jax.lax.ragged_dot(x, weights, sizes.astype(jnp.int32), preferred_element_type=jnp.float32,
                             precision=c.EXACT_F32 if x.dtype == jnp.float32 else None)
    if w_scale is not None:
        row_group = jnp.repeat(jnp.minimum(tile_groups, g - 1), block_m, total_repeat_length=x.shape[0])
        out = out * w_scale[row_group]
    used = jnp.arange(x.shape[0]) < jnp.sum(sizes)
    return jnp.where(used[:, None], out, 0).astype(x.dtype)
