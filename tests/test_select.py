"""dllm_jax.attention.select: the radix-threshold and tile-tournament top k, and the Pallas kernel's, equal lax.top_k's
positions, sorted, on rows built to hold ties, infinities, signed zeros and more picks than distinct values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from dllm_jax.attention.select import top_k_positions

KINDS = ["normal", "few values", "masked", "specials", "all -inf"]


def reference(x, k):
    return np.sort(np.asarray(jax.lax.top_k(x, k)[1]), axis=-1)


def rows(rng, kind: str, shape) -> np.ndarray:
    if kind == "normal":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "few values":  # ties at the k-th value, taken from the lowest positions
        return rng.integers(-3, 3, shape).astype(np.float32)
    if kind == "masked":  # a ranked prefix, -inf after it (MAGE's rows with fewer than k prefix positions)
        x = rng.random(shape).astype(np.float32)
        x[..., shape[-1] // 3:] = -np.inf
        return x
    if kind == "specials":
        values = np.array([0.0, -0.0, 1e-30, -1e-30, 1e-45, np.inf, -np.inf, 3.0], np.float32)
        return rng.choice(values, shape)
    return np.full(shape, -np.inf, np.float32)  # "all -inf"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", [1, 4, 8])
def test_threshold_gives_the_positions_of_lax_top_k(rng, kind, bits):
    for shape, k in [((3, 257), 1), ((3, 257), 40), ((2, 3, 100), 100), ((5, 64), 63)]:
        x = rows(rng, kind, shape)
        got = np.asarray(top_k_positions(jnp.asarray(x), k, method="threshold", bits=bits))
        np.testing.assert_array_equal(got, reference(x, k), err_msg=f"{kind} {shape} k={k}")
        assert got.dtype == np.int32 and got.shape == shape[:-1] + (k,)


def test_bfloat16_scores_and_the_sort_method(rng):
    x = jnp.asarray(rng.standard_normal((4, 300)), jnp.bfloat16)  # bf16 has many ties
    want = reference(x, 50)
    np.testing.assert_array_equal(top_k_positions(x, 50, method="threshold"), want)
    np.testing.assert_array_equal(top_k_positions(x, 50), want)  # "sort", the default


@pytest.mark.parametrize("kind", KINDS)
def test_sort_by_chunks_gives_the_positions_of_lax_top_k(rng, kind):
    """Rows longer than `chunk` (one not a multiple of it: the last chunk padded with -inf) ranked by chunks, with
    k below, at and past the chunk; ties, -inf and signed zeros included."""
    for shape, k, chunk in [((3, 1000), 40, 64), ((2, 3, 1000), 64, 64), ((2, 1000), 100, 64), ((4, 1024), 1, 128)]:
        x = rows(rng, kind, shape)
        got = np.asarray(top_k_positions(jnp.asarray(x), k, chunk=chunk))
        np.testing.assert_array_equal(got, reference(x, k), err_msg=f"{kind} {shape} k={k} chunk={chunk}")
        assert got.dtype == np.int32


@pytest.mark.parametrize("kind", KINDS)
def test_tiles_give_the_positions_of_lax_top_k(rng, kind):
    """The tournament over tile maxima, one level (1000 / 8 = 125 tiles for k = 40) and two (2000 / 4 = 500 maxima,
    then 125 for k = 100), rows not a multiple of the tile (the last one padded), k at the number of tiles, rows
    too short to tile; ties, -inf and signed zeros included."""
    for shape, k, tile in [((3, 1000), 40, 8), ((2, 2000), 100, 4), ((2, 3, 1001), 64, 8), ((4, 1024), 1, 16),
                           ((2, 64), 8, 8), ((2, 60), 9, 8)]:
        x = rows(rng, kind, shape)
        got = np.asarray(top_k_positions(jnp.asarray(x), k, method="tiles", tile=tile))
        np.testing.assert_array_equal(got, reference(x, k), err_msg=f"{kind} {shape} k={k} tile={tile}")
        assert got.dtype == np.int32 and got.shape == shape[:-1] + (k,)


def test_jitted_with_the_row_count_traced_through_vmap(rng):
    x = jnp.asarray(rng.standard_normal((6, 2, 90)), jnp.float32)
    got = jax.jit(jax.vmap(lambda r: top_k_positions(r, 7, method="threshold")))(x)
    np.testing.assert_array_equal(got, reference(x, 7))


@pytest.mark.parametrize("kwargs,message", [(dict(k=0), "k=0 must be in 1..16"), (dict(k=17), "k=17 must be in"),
                                            (dict(k=4, bits=3), "bits=3 must divide 32"),
                                            (dict(k=4, method="heap"), "method='heap' is not one of"),
                                            (dict(k=4, chunk=0), "chunk=0 must be a positive int"),
                                            (dict(k=4, method="tiles", tile=1), "tile=1 must be an int >= 2")])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        top_k_positions(jnp.zeros((2, 16)), **kwargs)


# (shape, k, chunk, max_held) for the kernel, small chunks and registers taking every path on short rows: tiles of 8
# and whole chunks then a partial one; tiles of 16 (3000 / 8 = 375 maxima do not fit in 256); whole chunks only,
# k = 1; a row shorter than a chunk with fewer tiles than k; k = S
KERNEL_CASES = [((1000,), 40, 64, 512), ((3000,), 16, 64, 256), ((1024,), 1, 64, 256), ((60,), 9, 16, 256),
                ((40,), 40, 16, 512)]


def kernel_rows(rng, length: int):
    """[kinds, 2, length]: two rows of each kind."""
    return jnp.asarray(np.stack([rows(rng, kind, (2, length)) for kind in KINDS]))


@pytest.mark.parametrize("shape,k,chunk,max_held", KERNEL_CASES)
def test_kernel_gives_the_positions_of_lax_top_k(rng, shape, k, chunk, max_held):
    """Every kind of row at once (interpret mode)."""
    x = kernel_rows(rng, shape[-1])
    got = np.asarray(pk.top_k_positions(x, k, chunk=chunk, max_held=max_held, interpret=True))
    np.testing.assert_array_equal(got, reference(x, k))
    assert got.dtype == np.int32 and got.shape == x.shape[:-1] + (k,)


def test_the_kernel_is_not_a_selection_method():
    """MAGE selects with "sort", "tiles" or "threshold"; the Pallas kernel is a benchmark's comparison."""
    with pytest.raises(ValueError, match="method='kernel' is not one of"):
        top_k_positions(jnp.zeros((2, 300)), 20, method="kernel")


@pytest.mark.parametrize("kwargs,message", [
    (dict(k=0), "k=0 must be an int in 1..100"), (dict(k=101), "k=101 must be an int in"),
    (dict(k=4, chunk=48), "chunk=48 must be a power of two"), (dict(k=4, max_held=8), "max_held=8 must be"),
    (dict(k=33, max_held=256), "ranks at most 256 keys above its bound in registers: k=33")])
def test_kernel_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        pk.top_k_positions(jnp.zeros((2, 100)), **kwargs)
    with pytest.raises(ValueError, match="scores must be float32"):
        pk.top_k_positions(jnp.zeros((2, 100), jnp.bfloat16), 4)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,k,chunk,max_held", KERNEL_CASES + [((131200,), 512, 4096, 16384),
                                                                   ((131072,), 512, 4096, 16384),
                                                                   ((32768,), 1024, 4096, 16384)])
def test_kernel_on_the_gpu(rng, shape, k, chunk, max_held):
    """Natively: the cases above and MAGE's rows at 128k (the capacity `generate` allocates, and 2**17) and 32k."""
    x = kernel_rows(rng, shape[-1])
    got = np.asarray(pk.top_k_positions(x, k, chunk=chunk, max_held=max_held))
    np.testing.assert_array_equal(got, reference(x, k))
