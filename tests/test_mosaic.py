"""The Mosaic GPU (Hopper) kernels: backend choice, the block-mass math, SparseD's fused estimation,
CUDA lowering on CPU, and (marker `gpu`) the kernels against their dense references on the device.

CPU tests check what needs no GPU: `mosaic.choose` and `Tiling` validation, the public entry points'
errors, the identities behind `flash_block_mass` (its LSE, pooled scores and suffix renormalisation)
on the dense reference, and that the three kernel variants lower for CUDA under an abstract H100
(which runs Mosaic's own lowering and catches its errors without a device). GPU tests compare the
compiled kernels with the fp32 references on fresh random inputs; NaN in K and Inf in V past kv_len
must not reach any output.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

import pallas_kernels as pk
from dllm_jax.attention import kernels, sparsed
from pallas_kernels import mosaic
from test_kernels import BF16, F32, assert_attention_close, assert_scores_close, index_lists, qkv

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Triton backend warns on use

F16 = jnp.float16
ON_GPU = jax.default_backend() == "gpu"
# what a device without a Hopper GPU does (the CPU CI); on a GPU the `gpu` tests cover the other side
cpu_only = pytest.mark.skipif(ON_GPU, reason="asserts the behaviour without a Hopper GPU")
O_REL = 2e-2     # bf16 / f16 output: ||o - ref|| / ||ref||
LSE_REL = 1e-3   # LSE and mass: the same over the finite entries
MASS_TOL = 1e-5  # fp32 identities on the dense reference


def choose(backend, q, **kwargs):
    kwargs.setdefault("scale", q.shape[-1] ** -0.5)
    kwargs.setdefault("interpret", False)
    kwargs.setdefault("triton_knobs", False)
    return mosaic.choose(backend, q, name="test", **kwargs)


def spec(b, nq, hq, d, dtype=BF16):
    """A query of this shape and dtype: all that the backend choice looks at."""
    return jax.ShapeDtypeStruct((b, nq, hq, d), dtype)


# ---- A. CPU: backend choice and validation ----

@cpu_only
def test_choose_without_hopper():
    q = spec(1, 256, 4, 128)
    assert choose("auto", q) == "triton"
    assert choose("triton", q) == "triton"
    with pytest.raises(ValueError, match=f"Hopper \\(sm90\\) GPU.*{re.escape(jax.devices()[0].device_kind)}"):
        choose("mosaic", q)


@pytest.mark.parametrize("q,extra,reason", [
    (spec(1, 256, 4, 64, F32), {}, "dtype float32"),
    (spec(1, 256, 4, 32), {}, "head_dim 32"),
    (spec(1, 256, 4, 64), {"block_q": 64, "block_kv": 128}, "block_q=64"),
    (spec(1, 256, 4, 64), {"block_q": 128, "block_kv": 32}, "block_kv=32"),
    (spec(1, 256, 4, 64), {"interpret": True}, "no interpret mode"),
    (spec(1, 256, 4, 64), {"scale": -1.0}, "scale -1.0"),
], ids=["float32", "head_dim_32", "block_q_64", "block_kv_32", "interpret", "negative_scale"])
def test_choose_names_why_mosaic_cannot_run(q, extra, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        choose("mosaic", q, **extra)
    assert choose("auto", q, **extra) == "triton"  # "auto" falls back on any device
    assert choose("triton", q, **extra) == "triton"


def test_choose_auto_takes_triton_for_knobs_and_short_queries():
    assert choose("auto", spec(1, 256, 4, 64), triton_knobs=True) == "triton"
    assert choose("auto", spec(1, mosaic.AUTO_MIN_QUERIES - 1, 4, 64)) == "triton"


def test_choose_rejects_an_unknown_backend():
    with pytest.raises(ValueError, match="backend='pallas' is not one of"):
        choose("pallas", spec(1, 256, 4, 64))


@pytest.mark.parametrize("tiling,head_dim,message", [
    (mosaic.Tiling(block_q=128), 128, "block_q=128 must be 64"),
    (mosaic.Tiling(block_kv=32), 128, "block_kv=32 must be 64 or 128"),
    (mosaic.Tiling(block_kv=256), 64, "block_kv=256 must be 64 or 128"),
    (mosaic.Tiling(stages=1), 128, "stages=1 must lie in 2..4"),
    (mosaic.Tiling(stages=5), 128, "stages=5 must lie in 2..4"),
    (mosaic.Tiling(block_kv=128, stages=4), 256, "bytes of shared memory at head_dim 256"),
])
def test_tiling_check_rejects(tiling, head_dim, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiling.check(head_dim, 2)


def test_default_tilings_fit():
    for d in (64, 128, 192, 256):
        tiling = mosaic.default_tiling(d)
        tiling.check(d, 2)
        assert tiling.smem_bytes(d, 2) <= mosaic.SMEM_BYTES


# ---- A. CPU: the public entry points ----

def small_bf16(rng, nq=256, nk=300):
    return qkv(rng, 1, nq, nk, 4, 2, 64, BF16)


def one_block_lists():
    """A valid block-sparse pattern for `small_bf16`'s 256 queries: key block 0 for every row."""
    return jnp.zeros((1, 4, 2, 1), jnp.int32), jnp.ones((1, 4, 2), jnp.int32)


@cpu_only
def test_entry_points_refuse_mosaic_without_hopper(rng):
    q, k, v = small_bf16(rng)
    idx, cnt = one_block_lists()
    with pytest.raises(ValueError, match="flash_attention: the Mosaic GPU kernel needs a Hopper"):
        pk.flash_attention(q, k, v, backend="mosaic")
    with pytest.raises(ValueError, match="flash_attention: the Mosaic GPU kernel needs a Hopper"):
        pk.flash_attention(q, k, v, tiling=mosaic.Tiling())  # a tiling asks for the Mosaic kernel
    with pytest.raises(ValueError, match="block_sparse_attention: the Mosaic GPU kernel needs a Hopper"):
        pk.block_sparse_attention(q, k, v, idx, cnt, block_q=128, block_kv=128, backend="mosaic")
    with pytest.raises(ValueError, match="flash_block_mass: the Mosaic GPU kernel needs a Hopper"):
        pk.flash_block_mass(q, k, v, block_kv=128)


def test_entry_points_reject_a_bogus_backend(rng):
    q, k, v = small_bf16(rng)
    idx, cnt = one_block_lists()
    with pytest.raises(ValueError, match="flash_attention: backend='bogus'"):
        pk.flash_attention(q, k, v, backend="bogus")
    with pytest.raises(ValueError, match="block_sparse_attention: backend='bogus'"):
        pk.block_sparse_attention(q, k, v, idx, cnt, block_q=128, block_kv=128, backend="bogus")


def test_flash_block_mass_names_what_it_cannot_take(rng):
    q, k, v = small_bf16(rng)
    with pytest.raises(ValueError, match="flash_block_mass: the Mosaic GPU kernel has no interpret mode"):
        pk.flash_block_mass(q, k, v, block_kv=128, interpret=True)
    with pytest.raises(ValueError, match="flash_block_mass: the Mosaic GPU kernel does not support dtype float32"):
        pk.flash_block_mass(*(x.astype(F32) for x in (q, k, v)), block_kv=128)


def test_auto_with_interpret_runs_triton_and_matches_the_reference(rng):
    q, k, v = qkv(rng, 2, 130, 100, 2, 1, 64, BF16)  # >= 128 queries: only interpret keeps it off Mosaic
    kv_len = jnp.asarray([100, 37])
    out = pk.flash_attention(q, k, v, kv_len=kv_len, return_lse=True, interpret=True, backend="auto")
    assert_attention_close(out, pk.flash_attention_reference(q, k, v, kv_len=kv_len, return_lse=True), BF16)


# ---- A. CPU: the block-mass identities on the dense reference ----

B, NQ, NK, HQ, HKV, D = 3, 70, 150, 4, 2, 64
BLOCK_Q, BLOCK_KV = 16, 32  # Nq, Nk not multiples of them
KV_LEN = jnp.asarray([NK, 37, 0])  # full, a short one ending inside tile 1, empty


@pytest.fixture
def mass_inputs(rng):
    q, k, v = qkv(rng, B, NQ, NK, HQ, HKV, D, F32)
    o, lse, mass = pk.flash_block_mass_reference(q, k, v, block_kv=BLOCK_KV, kv_len=KV_LEN)
    return (q, k, v), (o, lse, mass)


def test_mass_sums_to_the_attention_lse(mass_inputs):
    (q, k, v), (o, lse, mass) = mass_inputs
    assert mass.shape == (B, HQ, -(-NK // BLOCK_KV), NQ) and mass.dtype == jnp.float32
    ref = pk.flash_attention_reference(q, k, v, kv_len=KV_LEN, return_lse=True)
    assert_attention_close((o, lse), ref, F32)
    total = np.asarray(jax.nn.logsumexp(mass, axis=2))
    np.testing.assert_array_equal(np.isneginf(total), np.isneginf(np.asarray(ref[1])))
    live = np.isfinite(total)
    np.testing.assert_allclose(total[live], np.asarray(ref[1])[live], rtol=MASS_TOL, atol=MASS_TOL)


def test_mass_is_minus_inf_exactly_for_tiles_without_a_valid_key(mass_inputs):
    _, (_, _, mass) = mass_inputs
    starts = np.arange(mass.shape[2]) * BLOCK_KV
    empty = starts[None, :] >= np.asarray(KV_LEN)[:, None]  # [B, tiles]
    assert empty.tolist() == [[False] * 5, [False, False, True, True, True], [True] * 5]
    expected = np.broadcast_to(empty[:, None, :, None], mass.shape)
    np.testing.assert_array_equal(np.isneginf(np.asarray(mass)), expected)
    assert np.isfinite(np.asarray(mass)[~expected]).all()


def test_pooled_scores_equal_block_scores(mass_inputs):
    (q, k, _), (_, lse, mass) = mass_inputs
    pooled = pk.pooled_block_scores(mass, lse, block_q=BLOCK_Q, block_kv=BLOCK_KV)
    ref = pk.block_scores_reference(q, k, lse, block_q=BLOCK_Q, block_kv=BLOCK_KV, kv_len=KV_LEN)
    assert_scores_close(pooled, ref)
    assert not np.asarray(pooled[2]).any(), "a row with kv_len 0 (lse -inf) must contribute 0"
    assert np.isneginf(np.asarray(lse[2])).all()


@pytest.mark.parametrize("first", [1, 3])
def test_suffix_scores_equal_block_scores_over_the_suffix(mass_inputs, first):
    (q, k, v), (_, _, mass) = mass_inputs
    start = first * BLOCK_KV
    shifted = jnp.maximum(KV_LEN - start, 0)
    _, lse_suffix = pk.flash_attention_reference(q, k[:, start:], v[:, start:], kv_len=shifted, return_lse=True)
    got_lse = np.asarray(pk.suffix_lse(mass, first))
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(np.asarray(lse_suffix)))
    live = np.isfinite(got_lse)
    np.testing.assert_allclose(got_lse[live], np.asarray(lse_suffix)[live], rtol=MASS_TOL, atol=MASS_TOL)
    pooled = pk.pooled_block_scores(mass[:, :, first:], pk.suffix_lse(mass, first), block_q=BLOCK_Q,
                                    block_kv=BLOCK_KV)
    ref = pk.block_scores_reference(q, k[:, start:], lse_suffix, block_q=BLOCK_Q, block_kv=BLOCK_KV, kv_len=shifted)
    assert_scores_close(pooled, ref)
    no_keys = np.asarray(shifted) == 0  # row 2 always; row 1 (kv_len 37) when the suffix starts past it
    assert no_keys.tolist() == [False, first > 1, True]
    assert not np.asarray(pooled)[no_keys].any()


# ---- A. CPU: SparseD's selection from the mass ----

@pytest.mark.parametrize("n,prefill_len,block_size,select", [
    (100, 40, 16, 0.3),   # N not a multiple of the block, boundary block inside the prompt
    (130, 64, 32, 0.5),   # prompt ends on a block boundary
    (96, 96, 32, 0.2),    # no generation block: last = nb - 1
    (70, 10, 16, 1.0),    # select everything
])
def test_select_blocks_from_mass_equals_select_blocks(rng, n, prefill_len, block_size, select):
    q, k, v = qkv(rng, 2, n, n, 4, 2, 64, F32)
    _, lse, mass = pk.flash_block_mass_reference(q, k, v, block_kv=block_size)
    got = sparsed.select_blocks_from_mass(mass, lse, prefill_len=prefill_len, block_size=block_size, select=select)
    want = sparsed.select_blocks(q, k, prefill_len=prefill_len, block_size=block_size, select=select,
                                 backend="reference")
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@cpu_only
@pytest.mark.parametrize("backend", ["auto", "reference", "interpret", "triton"])
def test_runs_block_mass_is_false_without_hopper(backend):
    assert not kernels.runs_block_mass(spec(1, 256, 4, 128), 128, None, backend)


def test_runs_block_mass_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match="backend='pallas' is not one of"):
        kernels.runs_block_mass(spec(1, 256, 4, 128), 128, None, "pallas")


# ---- A. CPU: the kernels lower for CUDA (Mosaic's own lowering runs; no device needed) ----

H100 = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu",
                                                            num_cores=132))
CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @(\w+)\(.*\} : \((.*)\) -> \((.*)\)\s*$", re.M)


def lower_for_h100(f, *args) -> str:
    with jax.sharding.use_abstract_mesh(H100):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def tensor(shape, dtype) -> str:
    return f"tensor<{'x'.join(map(str, shape))}x{dtype}>"


def mosaic_kernel_calls(text: str):
    """(operand types, result types) of each Mosaic GPU custom call in a lowered module."""
    calls = [m for m in CUSTOM_CALL.finditer(text) if m.group(1).startswith("mosaic_gpu")]
    return [(m.group(2).split(", "), m.group(3).split(", ")) for m in calls]


@pytest.mark.parametrize("variant", ["dense_mass_kv_len", "dense_no_kv_len", "sparse_per_kv_head"])
def test_mosaic_kernels_lower_for_cuda(variant):
    b, n, hq, hkv, d = 2, 300, 4, 2, 128
    pad_q, n_kb = 384, 3  # CTAs of two warpgroups x 64 query rows; 128-key tiles
    q, kv, lengths = sds((b, n, hq, d), BF16), sds((b, n, hkv, d), BF16), sds((b,), jnp.int32)
    with_mass = variant == "dense_mass_kv_len"
    if variant == "sparse_per_kv_head":
        lists = (sds((b, hkv, n_kb, 2), jnp.int32), sds((b, hkv, n_kb), jnp.int32))
        f = functools.partial(mosaic.block_sparse, scale=0.1, block_q=128, block_kv=128, has_kv_len=True)
    else:
        lists = ()
        f = functools.partial(mosaic.attention, scale=0.1, has_kv_len=with_mass, with_mass=with_mass)
    calls = mosaic_kernel_calls(lower_for_h100(f, q, kv, kv, *lists, lengths))
    assert len(calls) == 1, f"expected one Mosaic GPU kernel, found {calls}"
    operands, results = calls[0]
    kv_padded = tensor((b, n_kb * 128, hkv, d), "bf16")
    assert operands == [tensor((b,), "i32"), *(tensor(x.shape, "i32") for x in lists),
                        tensor((b, pad_q, hq, d), "bf16"), kv_padded, kv_padded]
    mass = [tensor((b, hq, n_kb, pad_q), "f32")] if with_mass else []
    assert results == [tensor((b, pad_q, hq, d), "bf16"), tensor((b, hq, pad_q), "f32"), *mass]


def test_lowered_kernel_is_hopper_code():
    """The serialized kernel issues tensor-core wgmma and TMA bulk-tensor loads (sm90 instructions)."""
    q, kv = sds((1, 256, 2, 64), BF16), sds((1, 256, 1, 64), BF16)
    text = lower_for_h100(functools.partial(mosaic.attention, scale=0.1, has_kv_len=False), q, kv, kv,
                          sds((1,), jnp.int32))
    assert "wgmma.mma_async" in text and "cp.async.bulk.tensor.shared.cluster.global" in text


@pytest.mark.parametrize("nk,width", [(128, 1), (100, 1), (64, 3)])
def test_mosaic_kernels_lower_with_fewer_tiles_than_ring_slots(nk, width):
    """One key tile (or one listed tile) against a 2-slot K/V ring: the loader's first loads stay in bounds."""
    q, kv = sds((1, 256, 2, 64), BF16), sds((1, nk, 2, 64), BF16)
    lengths = sds((1,), jnp.int32)
    idx, cnt = sds((1, 2, 2, width), jnp.int32), sds((1, 2, 2), jnp.int32)
    dense = lower_for_h100(lambda q, k, v, n: mosaic.attention(q, k, v, n, scale=0.125, has_kv_len=False),
                           q, kv, kv, lengths)
    sparse = lower_for_h100(lambda q, k, v, i, c, n: mosaic.block_sparse(
        q, k, v, i, c, n, scale=0.125, block_q=128, block_kv=64, has_kv_len=False), q, kv, kv, idx, cnt, lengths)
    assert len(mosaic_kernel_calls(dense)) == len(mosaic_kernel_calls(sparse)) == 1


# ---- B. GPU: the compiled kernels against the references ----

def require_hopper():
    if not mosaic.is_hopper():
        pytest.fail(f"the Mosaic tests need a Hopper (sm90) GPU, got {jax.devices()[0].device_kind}")


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_log_close(x, ref, what):
    """Same -inf pattern, finite elsewhere, relative norm error <= LSE_REL over the finite entries."""
    x, ref = np.asarray(x), np.asarray(ref)
    assert x.dtype == np.float32 and x.shape == ref.shape
    np.testing.assert_array_equal(np.isneginf(x), np.isneginf(ref), err_msg=f"{what}: -inf entries differ")
    live = np.isfinite(ref)
    assert np.isfinite(x[live]).all(), f"{what}: non-finite where the reference is finite"
    err = rel_err(x[live], ref[live]) if live.any() else 0.0
    assert err <= LSE_REL, f"{what} error {err:.2e} > {LSE_REL:.0e}"


def assert_close(out, ref):
    (o, lse), (o_ref, lse_ref) = out, ref
    assert o.dtype == o_ref.dtype and o.shape == o_ref.shape
    o = np.asarray(o, np.float32)
    assert np.isfinite(o).all(), "poison or an unwritten element reached the output"
    err = rel_err(o, np.asarray(o_ref, np.float32))
    assert err <= O_REL, f"output error {err:.2e} > {O_REL:.0e}"
    assert_log_close(lse, lse_ref, "lse")


def poison_past(k, v, kv_len):
    """NaN in K and +Inf in V at every key at or past kv_len (the kernels must ignore them)."""
    if kv_len is None:
        return k, v
    past = (jnp.arange(k.shape[1])[None, :] >= kv_len[:, None])[:, :, None, None]
    return jnp.where(past, jnp.nan, k).astype(k.dtype), jnp.where(past, jnp.inf, v).astype(v.dtype)


def gpu_inputs(rng, b, nq, nk, hq, hkv, d, dtype, kv_len):
    q, k, v = qkv(rng, b, nq, nk, hq, hkv, d, dtype)
    lengths = None if kv_len is None else jnp.asarray(kv_len, jnp.int32)
    return (q, *poison_past(k, v, lengths)), lengths


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("d,hq,hkv,nq,nk,kv_len", [
    (64, 8, 2, 300, 1000, None),        # GQA, tails on both axes, no kv_len
    (128, 8, 2, 200, 333, [0, 250]),    # an empty row, a length inside a tile
    (256, 4, 4, 64, 129, [129, 70]),    # MHA, head_dim 256 (64-key tiles), fewer queries than a CTA
    (128, 4, 4, 300, 1000, [1000, 512]),  # a length on a tile boundary
    (64, 8, 2, 256, 512, [511, 1]),     # exact multiples, one key only
    (128, 4, 2, 200, 128, None),        # a single key tile, fewer than the K/V ring's slots
])
def test_flash_mosaic_matches_the_reference(rng, dtype, d, hq, hkv, nq, nk, kv_len):
    require_hopper()
    (q, k, v), lengths = gpu_inputs(rng, 2, nq, nk, hq, hkv, d, dtype, kv_len)
    out = pk.flash_attention(q, k, v, kv_len=lengths, return_lse=True, backend="mosaic")
    assert_close(out, pk.flash_attention_reference(q, k, v, kv_len=lengths, return_lse=True))


@pytest.mark.gpu
@pytest.mark.parametrize("d,tiling", [(128, mosaic.Tiling(block_kv=64, stages=4)),
                                      (64, mosaic.Tiling(block_kv=128, stages=3))])
def test_flash_mosaic_tilings(rng, d, tiling):
    require_hopper()
    (q, k, v), lengths = gpu_inputs(rng, 2, 300, 700, 4, 2, d, BF16, [700, 300])
    out = pk.flash_attention(q, k, v, kv_len=lengths, return_lse=True, tiling=tiling)
    assert_close(out, pk.flash_attention_reference(q, k, v, kv_len=lengths, return_lse=True))


@pytest.mark.gpu
def test_auto_chooses_mosaic_for_supported_inputs_only(rng):
    require_hopper()
    assert choose("auto", spec(1, 256, 4, 128)) == "mosaic"
    assert choose("auto", spec(1, 256, 4, 64, F16), block_q=128, block_kv=64) == "mosaic"
    assert choose("auto", spec(1, 256, 4, 64, F32)) == "triton"
    assert choose("auto", spec(1, 256, 4, 32)) == "triton"
    assert choose("auto", spec(1, 127, 4, 64)) == "triton"
    assert choose("auto", spec(1, 256, 4, 64), block_q=64, block_kv=64) == "triton"
    assert kernels.runs_block_mass(spec(1, 256, 4, 128), 128, None, "auto")
    assert not kernels.runs_block_mass(spec(1, 256, 4, 128), 32, None, "auto")
    (q, k, v), lengths = gpu_inputs(rng, 2, 256, 300, 4, 2, 128, BF16, [300, 100])
    out = pk.flash_attention(q, k, v, kv_len=lengths, return_lse=True)  # auto: Mosaic here
    assert_close(out, pk.flash_attention_reference(q, k, v, kv_len=lengths, return_lse=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("block_kv", [64, 128])
@pytest.mark.parametrize("per_kv_head", [False, True], ids=["per_q_head", "per_kv_head"])
def test_block_sparse_mosaic_matches_the_reference(rng, dtype, block_kv, per_kv_head):
    require_hopper()
    b, nq, nk, hq, hkv, d = 2, 300, 700, 8, 2, 128
    kv_len = [nk, nk - 150]  # row 1: listed blocks partly and wholly past kv_len
    (q, k, v), lengths = gpu_inputs(rng, b, nq, nk, hq, hkv, d, dtype, kv_len)
    n_kb, width = -(-nk // block_kv), min(-(-nk // block_kv), 7)
    # counts at random in 0..width, the first row 0 and the second the full width; garbage padding
    idx, cnt = index_lists(rng, (b, hkv if per_kv_head else hq, -(-nq // 128)), n_kb, width)
    # one row of batch 1 lists the last blocks: the one kv_len cuts and those wholly past it
    idx, cnt = np.asarray(idx).copy(), np.asarray(cnt).copy()
    idx[1, 0, 0], cnt[1, 0, 0] = np.arange(n_kb - width, n_kb), width
    assert kv_len[1] % block_kv and kv_len[1] // block_kv in idx[1, 0, 0]
    args = (q, k, v, jnp.asarray(idx), jnp.asarray(cnt))
    kwargs = dict(block_q=128, block_kv=block_kv, kv_len=lengths, return_lse=True)
    out = pk.block_sparse_attention(*args, backend="mosaic", **kwargs)
    assert_close(out, pk.block_sparse_attention_reference(*args, **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,block_kv,kv_len", [
    (BF16, 128, 128, None),
    (F16, 64, 64, [333, 0]),
    (BF16, 256, 64, [100, 333]),
    (BF16, 128, 64, [200, 129]),
])
def test_flash_block_mass_matches_the_reference(rng, dtype, d, block_kv, kv_len):
    require_hopper()
    (q, k, v), lengths = gpu_inputs(rng, 2, 300, 333, 8, 2, d, dtype, kv_len)
    o, lse, mass = pk.flash_block_mass(q, k, v, block_kv=block_kv, kv_len=lengths)
    o_ref, lse_ref, mass_ref = pk.flash_block_mass_reference(q, k, v, block_kv=block_kv, kv_len=lengths)
    assert_close((o, lse), (o_ref, lse_ref))
    assert mass.shape == (2, 8, -(-333 // block_kv), 300)
    assert_log_close(mass, mass_ref, "mass")


@pytest.mark.gpu
@pytest.mark.parametrize("n,prefill_len", [(640, 300), (1000, 1000)])
def test_sparsed_fused_scores_match_block_scores(rng, n, prefill_len):
    require_hopper()
    block = 128
    q, k, v = qkv(rng, 1, n, n, 8, 2, 128, BF16)
    assert kernels.runs_block_mass(q, block, None, "auto")
    o, lse, mass = kernels.block_mass(q, k, v, block, None, "auto")
    _, lse_ref = pk.flash_attention_reference(q, k, v, return_lse=True)
    assert_log_close(lse, lse_ref, "lse")
    pooled = pk.pooled_block_scores(mass, lse, block_q=block, block_kv=block)
    ref = pk.block_scores_reference(q, k, lse_ref, block_q=block, block_kv=block)
    assert rel_err(pooled, ref) <= LSE_REL, f"pooled score error {rel_err(pooled, ref):.2e}"
    last = sparsed.boundary_block(n, prefill_len, block)
    gen = pk.pooled_block_scores(mass[:, :, last:], pk.suffix_lse(mass, last), block_q=block, block_kv=block)
    _, lse_gen = pk.flash_attention_reference(q, k[:, last * block:], v[:, last * block:], return_lse=True)
    gen_ref = pk.block_scores_reference(q, k[:, last * block:], lse_gen, block_q=block, block_kv=block)
    assert rel_err(gen, gen_ref) <= LSE_REL, f"generation score error {rel_err(gen, gen_ref):.2e}"
