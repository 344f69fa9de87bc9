"""Fast-dLLM decoding for LLaDA (generate's cache= / threshold= / cache_refresh=): exact where it must be,
equal to a PyTorch port of the official sampler where it approximates, and refused where unsupported."""

import functools
from pathlib import Path

import numpy as np
import pytest

from dllm_jax import eval as dev
import jax
import jax.numpy as jnp

from dllm_jax import PulseCol, SparseD, generate, load_model
from dllm_jax.attention.policy import Mode
from dllm_jax.attention.pulsecol import num_keep, select_columns
from dllm_jax.attention.sparsed import select_blocks
from dllm_jax.testing import tiny_llada_config, tiny_sdar_config

LLADA = tiny_llada_config()
OPTIONS = dict(gen_length=16, steps=16, block_length=8)


@pytest.fixture
def model(tiny_model):
    return tiny_model(LLADA, 3)


def prompts(rng, batch=2, length=11):
    return rng.integers(3, LLADA.mask_token_id, (batch, length)).astype(np.int32)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_cache_refreshed_every_step_equals_the_exact_sampler(model, rng, cache):
    ids = prompts(rng)
    exact = generate(model, ids, **OPTIONS)
    out, nfe = generate(model, ids, cache=cache, cache_refresh=1, return_nfe=True, **OPTIONS)
    np.testing.assert_array_equal(out, exact)
    assert nfe == OPTIONS["steps"]


def test_a_cache_refreshed_every_step_equals_the_exact_sampler_with_padding_masked(model, rng):
    ids = prompts(rng)
    mask = np.ones_like(ids)
    mask[0, :4] = 0
    options = dict(OPTIONS, padding="mask")
    exact = generate(model, ids, attention_mask=mask, **options)
    out = generate(model, ids, attention_mask=mask, cache="dual", cache_refresh=1, **options)
    np.testing.assert_array_equal(out, exact)


def test_a_threshold_no_confidence_reaches_commits_one_token_per_step_like_the_exact_sampler(model, rng):
    # random weights: no confidence is 1, so only each step's most confident position is committed,
    # which is what the exact sampler does with steps = gen_length
    ids = prompts(rng)
    out, nfe = generate(model, ids, threshold=1.0, return_nfe=True, **OPTIONS)
    np.testing.assert_array_equal(out, generate(model, ids, **OPTIONS))
    assert nfe == OPTIONS["gen_length"]


def test_threshold_zero_fills_each_block_in_one_forward(model, rng):
    ids = prompts(rng)
    out, nfe = generate(model, ids, threshold=0.0, return_nfe=True, **OPTIONS)
    assert nfe == OPTIONS["gen_length"] // OPTIONS["block_length"]
    assert not (out == LLADA.mask_token_id).any()
    # the exact sampler with one step per block also commits every position of a block at its argmax
    np.testing.assert_array_equal(out, generate(model, ids, **dict(OPTIONS, steps=2)))


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cached_decoding_leaves_no_mask_and_keeps_the_prompt(model, rng, cache):
    ids = prompts(rng)
    out, nfe = generate(model, ids, cache=cache, threshold=0.5, return_nfe=True, **OPTIONS)
    np.testing.assert_array_equal(out[:, :ids.shape[1]], ids)
    assert not (out == LLADA.mask_token_id).any()
    assert OPTIONS["gen_length"] // OPTIONS["block_length"] <= nfe <= OPTIONS["gen_length"]


@pytest.mark.parametrize("options, message", [
    (dict(cache="full"), "cache must be one of"),
    (dict(threshold=1.5), "threshold"),
    (dict(cache_refresh=2), "cache_refresh=2 needs cache="),
    (dict(cache="dual", cfg_scale=1.0), "cfg_scale > 0 is not supported"),
    (dict(threshold=0.9, factor=1.0), "two parallel-decoding rules"),
    (dict(factor=-1.0), "factor"),
    (dict(cache="dual", method="mage"), "MAGE is a method for SDAR models"),
    (dict(cache="dual", method="sparge"), "got method SpargeAttn: it has no attention over a cached window"),
])
def test_unsupported_fast_decoding_is_refused_before_compiling(model, rng, options, message):
    with pytest.raises(ValueError, match=message):
        generate(model, prompts(rng), **OPTIONS, **options)


def test_mask_ids_in_the_prompt_are_refused_with_a_cache(model, rng):
    ids = prompts(rng)
    ids[0, 3] = LLADA.mask_token_id
    with pytest.raises(ValueError, match="infilling is not supported"):
        generate(model, ids, cache="prefix", **OPTIONS)


def test_return_nfe_is_for_llada(tiny_model, rng):
    sdar = tiny_model(tiny_sdar_config(), 0)
    with pytest.raises(ValueError, match="return_nfe=True is for LLaDA"):
        generate(sdar, rng.integers(3, 100, (1, 8)), return_nfe=True, max_new_tokens=4)


def test_the_exact_sampler_reports_its_steps_as_forwards(model, rng):
    assert generate(model, prompts(rng), return_nfe=True, **OPTIONS)[1] == OPTIONS["steps"]


SPARSE_METHODS = [SparseD(select=0.3, block_size=16, skip=0.2), PulseCol(sparsity=0.6, group_size=16, refreshes=2)]


@pytest.mark.parametrize("method", SPARSE_METHODS, ids=["sparsed", "pulsecol"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_sparse_method_with_a_cache_refreshed_every_step_equals_its_exact_sampler(model, rng, method, cache):
    # every forward is full: the method's schedule and patterns are those of its exact sampler
    ids = prompts(rng, length=21)
    np.testing.assert_array_equal(generate(model, ids, method=method, cache=cache, cache_refresh=1, **OPTIONS),
                                  generate(model, ids, method=method, **OPTIONS))


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_pattern_keeping_every_key_gives_the_dense_cached_decoding(model, rng, cache):
    ids = prompts(rng, length=21)
    dense = generate(model, ids, cache=cache, **OPTIONS)
    for method in (SparseD(select=1.0, block_size=16, skip=0.0), PulseCol(sparsity=0.0, group_size=16, refreshes=1)):
        np.testing.assert_array_equal(generate(model, ids, method=method, cache=cache, **OPTIONS), dense)


@pytest.mark.parametrize("method", SPARSE_METHODS, ids=["sparsed", "pulsecol"])
def test_sparse_cached_decoding_with_a_threshold_leaves_no_mask(model, rng, method):
    ids = prompts(rng, length=21)
    out, nfe = generate(model, ids, method=method, cache="dual", threshold=0.5, return_nfe=True, **OPTIONS)
    np.testing.assert_array_equal(out[:, :ids.shape[1]], ids)
    assert not (out == LLADA.mask_token_id).any()
    assert OPTIONS["gen_length"] // OPTIONS["block_length"] <= nfe <= OPTIONS["gen_length"]


@functools.partial(jax.jit, static_argnames=("method",))
def full_attention(method, q, k, v, state, mode):
    """method.attend over the whole sequence, compiled once per (method, shapes) for every window case
    (called eagerly, its lax.cond compiled anew in each case)."""
    return method.attend(q, k, v, state, mode)[0]


@functools.partial(jax.jit, static_argnames=("method",))
def window_attention(method, q, k, v, state, mode, start):
    """method.attend_window as one program per (method, window shape): eagerly, each of its operations
    compiles on its own (about 80 small programs per case)."""
    return method.attend_window(q, k, v, state, mode, start=start)


@pytest.mark.parametrize("start,width", [(0, 16), (37, 16), (48, 32), (70, 20), (5, 85), (89, 1)])
def test_a_window_attends_like_its_rows_of_the_full_sparse_attention(rng, start, width):
    """attend_window on positions start .. start + width - 1 equals those rows of the full sequence's
    sparse attention under the same pattern: aligned, unaligned, straddling blocks, at the end."""
    n, hq, hkv, d = 90, 4, 2, 16
    q = jnp.asarray(rng.standard_normal((2, n, hq, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, n, hkv, d)), jnp.float32) for _ in range(2))
    sparse = jnp.int32(Mode.SPARSE)
    sparsed = SparseD(select=0.3, block_size=16).bind(total_steps=10, prompt_length=50)
    pulsecol = PulseCol(sparsity=0.7, group_size=16).bind(total_steps=10)
    for method, state in ((sparsed, select_blocks(q, k, prefill_len=50, block_size=16, select=0.3)),
                          (pulsecol, select_columns(q, k, group_size=16, num_keep=num_keep(n, 0.7)))):
        full = full_attention(method, q, k, v, state, sparse)
        window = window_attention(method, q[:, start:start + width], k, v, state, sparse, jnp.int32(start))
        np.testing.assert_allclose(window, full[:, start:start + width], atol=1e-5, err_msg=type(method).__name__)
        dense = full_attention(method, q, k, v, state, jnp.int32(Mode.DENSE if method is sparsed else Mode.ESTIMATE))
        window = window_attention(method, q[:, start:start + width], k, v, state, jnp.int32(Mode.DENSE),
                                  jnp.int32(start))
        np.testing.assert_allclose(window, dense[:, start:start + width], atol=1e-5, err_msg=type(method).__name__)


TRAINED = Path(__file__).parent.parent / "checkpoints" / "tiny-llada-tasks"


@pytest.fixture(scope="module")
def reference():
    """(our float32 model, the PyTorch reference) of the trained tiny LLaDA: confident predictions that
    exercise the threshold, and never the mask id (random weights predict it, and the official loops
    then fail or never stop)."""
    from tests.torch_reference import llama_reference

    return load_model(TRAINED, dtype="float32", progress=False), llama_reference(TRAINED)


@pytest.mark.parametrize("cache", [None, "dual"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 3.0])
def test_the_factor_rule_equals_a_port_of_the_official_sampler(reference, cache, factor):
    from tests.torch_fastdllm import fast_generate

    ours, torch_model = reference
    ids = np.stack([s.prompt_ids for s in dev.make_samples("sanity", 64, 2, 12, dev.load_tokenizer(TRAINED))])
    options = dict(gen_length=16, steps=8, block_length=8)
    expected, _ = fast_generate(torch_model, ids, mask_id=ours.config.mask_token_id, factor=factor, cache=cache,
                                **options)
    np.testing.assert_array_equal(generate(ours, ids, cache=cache, factor=factor, **options), expected)


def test_factor_counts_follow_the_official_loop(rng):
    import torch

    from dllm_jax.generate.sampling import factor_counts
    from tests.torch_fastdllm import factor_count

    rows = [rng.uniform(0, 1, 8) for _ in range(40)] + [
        np.array([0.2] + [-np.inf] * 7),                  # one candidate
        np.array([0.99, 0.98, 0.97, 0.1] + [-np.inf] * 4),  # only the last falls short: all are taken
        np.array([0.99, 0.2, 0.97, 0.96, 0.95, 0.9, 0.9, 0.9]),
        np.full(8, 0.999),                                 # none falls short
    ]
    for factor in (0.2, 1.0, 2.5):
        confidence = np.stack(rows).astype(np.float32)
        expected = [factor_count(torch.sort(torch.as_tensor(r[r > -np.inf]), descending=True)[0], factor) for r in confidence]
        np.testing.assert_array_equal(factor_counts(jnp.asarray(confidence), factor), expected)


@pytest.mark.parametrize("cache", [None, "prefix", "dual"])
@pytest.mark.parametrize("threshold", [None, 0.9])
def test_fast_decoding_equals_a_port_of_the_official_sampler(reference, cache, threshold):
    from tests.torch_fastdllm import fast_generate

    if cache is None and threshold is None:
        pytest.skip("the original sampler: tests/test_generate_llada.py")
    ours, torch_model = reference
    tokenizer = dev.load_tokenizer(TRAINED)
    ids = np.stack([s.prompt_ids for s in dev.make_samples("sanity", 64, 2, 11, tokenizer)])
    options = dict(gen_length=16, steps=8, block_length=8)
    expected, official_nfe = fast_generate(torch_model, ids, mask_id=ours.config.mask_token_id, threshold=threshold,
                                           cache=cache, **options)
    out, nfe = generate(ours, ids, cache=cache, threshold=threshold, return_nfe=True, **options)
    np.testing.assert_array_equal(out, expected)
    # the official cached loops run one more forward after a block's first step even when that step
    # filled the block (it changes nothing); this loop checks first
    assert official_nfe - (options["gen_length"] // options["block_length"] if cache else 0) <= nfe <= official_nfe
    if threshold is not None:
        assert nfe < options["steps"]  # a trained model commits several tokens per step
