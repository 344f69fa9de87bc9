"""Routed experts of a mixture-of-experts layer as two grouped GEMMs over row tiles.

The T * k token copies (token t routed to experts idx[t, :]) are sorted by expert into a buffer where
each expert's rows are padded to whole tiles of `block_m`; `pallas_kernels.grouped_matmul` multiplies
every tile by its expert's weights (on a GPU; `jax.lax.ragged_dot` elsewhere, the kernel's reference),
so each touched expert's weights are read about once and nothing is computed for the others.

On a mesh (`dllm_jax.sharding`: the experts' hidden dimension over "tp", token rows over "dp") the
routed experts run per device in a `shard_map`, because XLA cannot partition the kernel and would
otherwise gather every expert's weights to every device: each device dispatches its own rows to its
slice of every expert, and the slices' down projections are summed over "tp" (the layer's one
all-reduce, as in a Megatron MLP).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from dllm_jax.attention.kernels import call
from dllm_jax.models.layers import swiglu_gate


def tile_rows(copies: int, num_experts: int) -> int:
    """block_m: 16 rows while an expert gets about one tile's worth of copies or fewer (decoding), up to
    64 when they are many (prefill), where a taller tile reads each weight block for more rows."""
    per_expert = copies // num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def dispatch(idx, num_experts: int, block_m: int):
    """(row of each token copy [T * k] in the tile-padded expert-sorted buffer, expert of each tile
    [tiles]; num_experts marks unused tiles). The buffer size is static: T * k rows plus at most
    block_m - 1 padding rows per expert that has copies."""
    copies = idx.size
    flat = idx.reshape(-1)
    sizes = jnp.bincount(flat, length=num_experts)
    padded = (sizes + block_m - 1) // block_m * block_m
    order = jnp.argsort(flat, stable=True)
    expert = flat[order]
    rank = jnp.arange(copies) - (jnp.cumsum(sizes) - sizes)[expert]
    rows = jnp.zeros((copies,), jnp.int32).at[order].set((jnp.cumsum(padded) - padded)[expert] + rank)
    tiles = -(-(copies + min(num_experts, copies) * (block_m - 1)) // block_m)
    tile_expert = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(tiles) * block_m, side="right")
    return rows, tile_expert.astype(jnp.int32), tiles * block_m


@functools.partial(jax.named_call, name="routed_experts")
def routed_experts(x, idx, weights, gate_up, down, *, gate_up_scale=None, down_scale=None, backend: str = "auto",
                   mesh=None, gate=swiglu_gate):
    """sum_j weights[:, j] * expert_{idx[:, j]}(x) for tokens x [T, d]: gated experts with interleaved
    gate/up columns gate_up [E, d, 2 Im] and down [E, Im, d]; idx int32 [T, k], weights fp32 [T, k]. `gate`
    makes [.., 2 Im] interleaved gate/up products into [.., Im] (SwiGLU's by default; it must map 0 to 0: the
    padding rows).
    Quantized experts (`dllm_jax.quantize`) come stored [E, out, in] with their float32 scales [E, out]
    (`gate_up_scale`, `down_scale`). Returns fp32 [T, d]. `backend` as `dllm_jax.attention.kernels` takes it.
    With a `mesh` (axes "dp", "sp", "tp"; a Mesh or the AbstractMesh of `jax.sharding.get_abstract_mesh()`),
    each device takes its "dp" rows and its "tp" slice of the experts' hidden dimension (T must split over
    "dp")."""
    quantized = gate_up_scale is not None
    if mesh is not None and mesh.shape["dp"] * mesh.shape["tp"] > 1:
        def per_device(x, idx, weights, gate_up, down, *scales):
            named = dict(zip(("gate_up_scale", "down_scale"), scales))
            return jax.lax.psum(routed_experts(x, idx, weights, gate_up, down, backend=backend, gate=gate, **named),
                                "tp")

        rows = P("dp", None)
        if quantized:  # [E, out, in]: gate/up's output columns and down's input rows are the hidden dimension
            specs, scales = (P(None, "tp", None), P(None, None, "tp"), P(None, "tp"), P(None, None)), (
                gate_up_scale, down_scale)
        else:
            specs, scales = (P(None, None, "tp"), P(None, "tp", None)), ()
        return jax.shard_map(per_device, mesh=mesh, out_specs=rows, in_specs=(rows, rows, rows, *specs))(
            x, idx, weights, gate_up, down, *scales)
    t, k = idx.shape
    block_m = tile_rows(t * k, gate_up.shape[0])
    rows, tile_expert, buffer_rows = dispatch(idx, gate_up.shape[0], block_m)
    copies = jnp.zeros((buffer_rows, x.shape[1]), x.dtype).at[rows].set(jnp.repeat(x, k, axis=0))
    grouped = functools.partial(call, pk.grouped_matmul, pk.grouped_matmul_reference, backend, block_m=block_m)
    h = grouped(copies, gate_up, tile_expert, w_scale=gate_up_scale)
    h = gate(h)  # padding rows stay 0
    y = grouped(h, down, tile_expert, w_scale=down_scale)[rows].reshape(t, k, -1)
    return jnp.sum(y.astype(jnp.float32) * weights[..., None], axis=1)
