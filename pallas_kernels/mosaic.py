"""FlashAttention-3-style attention for Hopper (sm90) in Pallas Mosaic GPU: one warp-specialised
kernel behind `flash_attention`, `block_sparse_attention` and `flash_block_mass` when they run on a
Hopper GPU (`backend="auto"` or `"mosaic"`).

Each CTA owns 2 * block_q query rows of one (batch, query head): two compute warpgroups of block_q
rows each run QK^T and P.V on the tensor cores (wgmma, fp32 accumulators in registers) and take
turns on the softmax; a third warpgroup issues the TMA loads of the K/V tiles into a ring of
`stages` shared-memory slots, one tile ahead per free slot. What differs between the entry points
is only which key tiles a CTA walks:
  dense:        tiles 0 .. ceil(kv_len / block_kv) - 1;
  block-sparse: the tiles its index row lists (`count` of them); the row is read from global
                memory by the loader and by the compute warpgroups, one scalar per step.
Keys at or past kv_len get -inf logits (a static `masked` flag adds that select only where a tail
or kv_len exists); values there are zeroed by the wrapper, so NaN or Inf cannot leak.

`flash_block_mass` also writes, per query row and key tile, the natural-log mass
log(sum over the tile of exp(logit)): from the row sums the softmax already computes, so SparseD's
pooled block scores (over all keys, and over any suffix of key tiles with its own softmax) come out
of the same pass as the attention output, with no second pass over Q K^T.

Units as in the package: logits in base 2 inside (exp2 with scale * log2(e) folded into one FMA);
every LSE and mass leaving the kernel is a natural log, float32, -inf where no key was seen.
Supported: bf16 / f16, head_dim a multiple of 64 up to 256, any Nq / Nk (tails are padded), GQA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _common as c

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SMEM_BYTES = 227 * 1024  # sm90 per-block shared-memory limit
COMPUTE_WGS = 2


@dataclasses.dataclass(frozen=True)
class Tiling:
    """block_q: query rows per compute warpgroup (a CTA takes 2 * block_q); block_kv: keys per TMA
    tile; stages: K/V tiles in flight (shared-memory ring depth)."""

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2

    def smem_bytes(self, head_dim: int, itemsize: int) -> int:
        """What the kernel allocates: Q/O and the K/V ring, the LSE and mass staging rows, and Mosaic's
        reduction scratch (2 KiB by default) plus barriers and alignment (0.5 KiB)."""
        tiles = (COMPUTE_WGS * self.block_q + 2 * self.stages * self.block_kv) * head_dim * itemsize
        return tiles + 4 * COMPUTE_WGS * self.block_q * 3 + 2048 + 512

    def check(self, head_dim: int, itemsize: int) -> None:
        if self.block_q != 64:
            raise ValueError(f"Mosaic tiling block_q={self.block_q} must be 64 (one wgmma row tile)")
        if self.block_kv not in (64, 128):
            # 256-key tiles hold 128 fp32 logits per thread next to the accumulator: register spills
            raise ValueError(f"Mosaic tiling block_kv={self.block_kv} must be 64 or 128")
        if not 2 <= self.stages <= 4:
            raise ValueError(f"Mosaic tiling stages={self.stages} must lie in 2..4")
        if self.smem_bytes(head_dim, itemsize) > SMEM_BYTES:
            raise ValueError(f"Mosaic tiling {self} needs {self.smem_bytes(head_dim, itemsize)} bytes of "
                             f"shared memory at head_dim {head_dim}; the limit is {SMEM_BYTES}")


def default_tiling(head_dim: int) -> Tiling:
    """Measured best on H200 at 16k-64k (the tiling sweep in benchmarks/results/attention_issue18_*):
    64 x 128, 2 stages; head_dim 256 only fits 64-key tiles."""
    return Tiling(block_kv=64) if head_dim > 128 else Tiling()


# What a kernel entry's `backend` takes: which of its two implementations runs. The project-wide
# vocabulary (reference / xla / cudnn / triton / mosaic / interpret / auto) is dllm_jax.attention.backends,
# which resolves to "mosaic" or "triton" before calling an entry; "auto" here serves direct callers.
BACKENDS = ("auto", "mosaic", "triton")
AUTO_MIN_QUERIES = 128  # below one CTA's rows the padded Mosaic tile wastes most of its work: Triton


def is_hopper() -> bool:
    """True when the default device is a Hopper (sm90) NVIDIA GPU: wgmma, which the kernel is built
    on, exists there only (Blackwell has tcgen05 instead)."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return False
    try:
        return 9.0 <= float(getattr(device, "compute_capability", "0")) < 10.0
    except ValueError:
        return False


def unsupported(q, *, scale: float, block_q: int | None = None, block_kv: int | None = None) -> str | None:
    """Why the Mosaic kernel cannot take these inputs, or None when it can. block_q / block_kv: a
    block-sparse pattern's blocks (block_q must be one CTA's 128 rows, block_kv one TMA tile)."""
    d = q.shape[-1]
    if jnp.dtype(q.dtype) not in DTYPES:
        return f"dtype {q.dtype} (the Mosaic kernel takes bfloat16 or float16)"
    if d % 64 or d > 256:
        return f"head_dim {d} (the Mosaic kernel takes multiples of 64 up to 256)"
    if scale <= 0:
        return f"scale {scale} (the Mosaic kernel folds a positive scale into its row maximum)"
    if block_q is not None and block_q != COMPUTE_WGS * 64:
        return f"block_q={block_q} (the Mosaic kernel's query tile is {COMPUTE_WGS * 64} rows)"
    if block_kv is not None:
        try:
            Tiling(block_kv=block_kv).check(d, jnp.dtype(q.dtype).itemsize)
        except ValueError as e:
            return str(e)
    return None


def choose(backend: str, q, *, scale: float, interpret: bool, triton_knobs: bool, name: str,
           block_q: int | None = None, block_kv: int | None = None) -> str:
    """'mosaic' or 'triton' for `backend`: "auto" takes Mosaic on Hopper when it supports the inputs,
    no Triton tuning knob was given, and there is at least one CTA of queries; "mosaic" insists
    (ValueError naming why it cannot); "triton" forces the Triton kernel (also the interpret path)."""
    if backend not in BACKENDS:
        raise ValueError(f"{name}: backend={backend!r} is not one of {BACKENDS}")
    if backend == "triton":
        return "triton"
    why = unsupported(q, scale=scale, block_q=block_q, block_kv=block_kv)
    if backend == "mosaic":
        if interpret:
            raise ValueError(f"{name}: the Mosaic GPU kernel has no interpret mode; use backend='triton'")
        if why:
            raise ValueError(f"{name}: the Mosaic GPU kernel does not support {why}")
        if not is_hopper():
            raise ValueError(f"{name}: the Mosaic GPU kernel needs a Hopper (sm90) GPU, the default device is "
                             f"{jax.devices()[0].device_kind}")
        return "mosaic"
    use = not (interpret or triton_knobs or why) and q.shape[1] >= AUTO_MIN_QUERIES and is_hopper()
    return "mosaic" if use else "triton"


def _kernel(*refs, schedule, masked, with_mass, tiling, scale_log2, head_dim, group, idx_group, dtype):
    bq, bkv, stages = tiling.block_q, tiling.block_kv, tiling.stages
    if schedule == "sparse":
        kvlen_ref, idx_ref, cnt_ref, q_ref, k_ref, v_ref, *rest = refs
    else:
        kvlen_ref, q_ref, k_ref, v_ref, *rest = refs
        idx_ref = cnt_ref = None
    if with_mass:
        o_ref, lse_ref, mass_ref, scratch = rest
    else:
        (o_ref, lse_ref, scratch), mass_ref = rest, None
    smem, ready, consumed, q_barriers, schedule_barrier = scratch
    qo_smem2, k_smem, v_smem, lse_smem2, mass_smem2 = smem
    k_ready, v_ready = ready
    k_consumed, v_consumed = consumed

    batch = lax.axis_index("batch")
    q_head = lax.axis_index("heads")
    q_tile = lax.axis_index("q_seq")
    wg = lax.axis_index("wg")
    kv_len = kvlen_ref[batch]
    if schedule == "sparse":
        row = (batch, lax.div(q_head, jnp.int32(idx_group)), q_tile)
        n_steps = cnt_ref[row]

        def block_of(step):
            return idx_ref[row + (step,)]
    else:
        n_steps = lax.div(kv_len + (bkv - 1), jnp.int32(bkv))

        def block_of(step):
            return step

    def schedule_sync():
        plgpu.barrier_arrive(schedule_barrier)
        plgpu.barrier_wait(schedule_barrier)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        qo_smem = qo_smem2.at[wg]
        q_start = q_tile * (COMPUTE_WGS * bq) + wg * bq
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_start, bq), q_head], qo_smem, q_barriers.at[wg])
        plgpu.barrier_wait(q_barriers.at[wg])

        m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((bq, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        @pl.when(n_steps > 0)
        def _():
            plgpu.barrier_wait(k_ready.at[0])

        pl.when(wg == 1)(schedule_sync)

        def kv_step(step, carry, *, with_mask):
            acc, m_i, l_i = carry
            slot = lax.rem(step, jnp.int32(stages))

            def compute_qk(acc_ref):
                plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                schedule_sync()
                return acc_ref[...]

            qk = pl.run_scoped(compute_qk, plgpu.ACC((bq, bkv), jnp.float32))
            plgpu.barrier_arrive(k_consumed.at[slot])
            if with_mask:
                limit = kv_len - block_of(step) * bkv
                kv_ids = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA)
                qk = jnp.where(kv_ids < limit, qk, -jnp.inf)
            tile_max = qk.max(axis=1) * scale_log2
            m_new = jnp.maximum(m_i, tile_max)
            # a row that has seen only masked keys keeps m = -inf: shift by 0 there (exp2 gives 0, not NaN)
            shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if with_mask else m_new
            alpha = jnp.exp2(m_i - shift)
            p = jnp.exp2(qk * scale_log2 - lax.broadcast_in_dim(shift, qk.shape, [0]))
            acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
            row_sum = p.sum(axis=1)
            l_i = l_i * alpha + row_sum
            p16 = p.astype(dtype)
            if with_mass:
                # a tile far below the running maximum underflows to row_sum 0: report its largest
                # logit then (within log(block_kv) of its mass; -inf only for a fully masked tile)
                mass = jnp.where(row_sum > 0.0, jnp.log(row_sum) + shift * c.LN2, tile_max * c.LN2)
                mass_slot = mass_smem2.at[wg, lax.rem(step, jnp.int32(2))]
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the slot's store of two steps ago
                mass_slot[...] = mass
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(mass_slot, mass_ref.at[batch, q_head, block_of(step), pl.ds(q_start, bq)])
            acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
            plgpu.barrier_arrive(schedule_barrier)
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_wait(schedule_barrier)

            def compute_pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                nxt = step + 1

                @pl.when(nxt < n_steps)
                def _():
                    plgpu.barrier_wait(k_ready.at[lax.rem(nxt, jnp.int32(stages))])

            acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_consumed.at[slot])
            return acc, m_new, l_i

        carry = (acc, m_i, l_i)
        if schedule == "dense" and masked:
            n_full = lax.div(kv_len, jnp.int32(bkv))
            carry = lax.fori_loop(0, n_full, functools.partial(kv_step, with_mask=False), carry)
            carry = lax.fori_loop(n_full, n_steps, functools.partial(kv_step, with_mask=True), carry)
        else:
            carry = lax.fori_loop(0, n_steps, functools.partial(kv_step, with_mask=masked), carry)
        acc, m_i, l_i = carry
        pl.when(wg == 0)(schedule_sync)

        empty = l_i == 0.0
        safe_l = jnp.where(empty, 1.0, l_i)
        acc *= lax.broadcast_in_dim(1.0 / safe_l, acc.shape, [0])
        qo_smem[...] = acc.astype(dtype)
        lse_smem = lse_smem2.at[wg]
        lse_smem[...] = jnp.where(empty, -jnp.inf, m_i * c.LN2 + jnp.log(safe_l))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[batch, pl.ds(q_start, bq), q_head])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, q_head, pl.ds(q_start, bq)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _loader():
        plgpu.set_max_registers(40, action="decrease")
        kv_head = lax.div(q_head, jnp.int32(group))

        def load(step, slot, *, reuse: bool):
            """K and V of `step` into `slot`; a reused slot first waits for both warpgroups to release it."""
            rows = (batch, pl.ds(block_of(step) * bkv, bkv), kv_head)
            if reuse:
                plgpu.barrier_wait(k_consumed.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
            if reuse:
                plgpu.barrier_wait(v_consumed.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

        # the first tiles, as many as the ring holds and the schedule can list (static bounds)
        for i in range(min(stages, idx_ref.shape[-1] if schedule == "sparse" else k_ref.shape[1] // bkv)):
            pl.when(i < n_steps)(functools.partial(load, i, i, reuse=False))

        @pl.loop(0, jnp.maximum(n_steps - stages, 0))
        def _(step):
            load(step + stages, lax.rem(step, jnp.int32(stages)), reuse=True)


@functools.partial(jax.jit, static_argnames=("scale", "tiling", "has_kv_len", "with_mass", "sparse"))
def _call(q, k, v, kv_len, indices, counts, *, scale, tiling, has_kv_len, with_mass, sparse):
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    masked = has_kv_len or nk % tiling.block_kv != 0  # any key at or past kv_len (a given one, or the padding)
    rows = COMPUTE_WGS * tiling.block_q
    nq_pad, nk_pad = c.cdiv(nq, rows) * rows, c.cdiv(nk, tiling.block_kv) * tiling.block_kv
    q = c.pad_axis(q, 1, nq_pad)
    k, v = c.pad_axis(k, 1, nk_pad), c.pad_axis(v, 1, nk_pad)
    if has_kv_len:  # ignored keys' values are zeroed once here (the kernel feeds V to wgmma from smem as loaded)
        v = jnp.where((jnp.arange(nk_pad)[None, :] < kv_len[:, None])[:, :, None, None], v, jnp.zeros_like(v))
    n_kb = nk_pad // tiling.block_kv
    dtype = q.dtype
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = [
        (
            plgpu.SMEM((COMPUTE_WGS, tiling.block_q, d), dtype, transforms=transforms),
            plgpu.SMEM((tiling.stages, tiling.block_kv, d), dtype, transforms=transforms),
            plgpu.SMEM((tiling.stages, tiling.block_kv, d), dtype, transforms=transforms),
            plgpu.SMEM((COMPUTE_WGS, tiling.block_q), jnp.float32),
            plgpu.SMEM((COMPUTE_WGS, 2, tiling.block_q), jnp.float32),
        ),
        (plgpu.Barrier(num_barriers=tiling.stages),) * 2,
        (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=tiling.stages),) * 2,
        plgpu.Barrier(num_barriers=COMPUTE_WGS),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS),
    ]
    out_type = [jax.ShapeDtypeStruct((b, nq_pad, hq, d), dtype),
                jax.ShapeDtypeStruct((b, hq, nq_pad), jnp.float32)]
    if with_mass:
        out_type.append(jax.ShapeDtypeStruct((b, hq, n_kb, nq_pad), jnp.float32))
    idx_group = hq // indices.shape[1] if sparse else 1
    kernel = functools.partial(
        _kernel, schedule="sparse" if sparse else "dense", masked=masked, with_mass=with_mass, tiling=tiling,
        scale_log2=scale * c.LOG2E, head_dim=d, group=hq // hkv, idx_group=idx_group, dtype=dtype)

    def entry(*refs):
        pl.run_scoped(lambda *s: kernel(*refs, s), *scratch, collective_axes="wg")

    operands = (kv_len, indices, counts, q, k, v) if sparse else (kv_len, q, k, v)
    outs = plgpu.kernel(
        entry,
        out_type=out_type,
        grid=(hq, nq_pad // rows, b),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(*operands)
    o, lse = outs[0][:, :nq], outs[1][:, :, :nq]
    if not with_mass:
        return o, lse, None
    # tiles past kv_len were never visited (their slots are unwritten): they hold no mass
    visited = jnp.arange(n_kb)[None, :] < ((kv_len + tiling.block_kv - 1) // tiling.block_kv)[:, None]
    mass = jnp.where(visited[:, None, :, None], outs[2][..., :nq], -jnp.inf)
    return o, lse, mass


def attention(q, k, v, kv_len, *, scale: float, has_kv_len: bool, tiling: Tiling | None = None,
              with_mass: bool = False):
    """Dense attention on the Mosaic kernel: (o, lse, mass or None). Inputs are checked by the caller;
    kv_len int32 [B]; has_kv_len: whether the caller gave one (else it is Nk and nothing needs zeroing)."""
    tiling = tiling or default_tiling(q.shape[-1])
    tiling.check(q.shape[-1], jnp.dtype(q.dtype).itemsize)
    return _call(q, k, v, kv_len, None, None, scale=scale, tiling=tiling, has_kv_len=has_kv_len,
                 with_mass=with_mass, sparse=False)


def block_sparse(q, k, v, indices, counts, kv_len, *, scale: float, block_q: int, block_kv: int,
                 has_kv_len: bool, stages: int | None = None):
    """Block-sparse attention on the Mosaic kernel: (o, lse). The pattern's block_q must be 128 (one
    CTA: two warpgroups of 64 rows) and block_kv 64 or 128 (one TMA tile)."""
    why = unsupported(q, scale=scale, block_q=block_q, block_kv=block_kv)
    if why:
        raise ValueError(f"block_sparse_attention: the Mosaic GPU kernel does not support {why}")
    tiling = Tiling(block_kv=block_kv, stages=stages or default_tiling(q.shape[-1]).stages)
    tiling.check(q.shape[-1], jnp.dtype(q.dtype).itemsize)
    o, lse, _ = _call(q, k, v, kv_len, indices, counts, scale=scale, tiling=tiling, has_kv_len=has_kv_len,
                      with_mass=False, sparse=True)
    return o, lse
