"""FlashBlock alone and around MAGE: the LSE merge of the external and internal parts, the official
refresh schedule inside the compiled loop, exactness when it always refreshes, the residual set, and
the combination's output error against MAGE alone on the same inputs."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from dllm_jax import generate, load_model
from dllm_jax.analysis import analyze_blocks
from dllm_jax.attention.flashblock import FlashBlock, complement_indices
from dllm_jax.attention.mage import MAGE, select_prefix
from dllm_jax.attention.policy import Mode
from dllm_jax.testing import tiny_sdar_config, write_hf_checkpoint
from sdar_methods_testing import OPTIONS, check_generate_command, masked_attention

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("prefix", [0, 37])
def test_external_and_internal_parts_merge_to_full_attention(rng, dtype, tol, prefix):
    n, hq, hkv, cap = 4, 8, 2, 48
    q = jnp.asarray(rng.standard_normal((2, n, hq, 32)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((2, cap, hkv, 32)), dtype) for _ in range(2))
    o_out, lse_out = pk.split_kv_attention_reference(q, k, v, kv_len=prefix, return_lse=True)
    o_in, lse_in = pk.flash_attention_reference(q, k[:, prefix:prefix + n], v[:, prefix:prefix + n], return_lse=True)
    merged, lse = pk.merge_attention(o_out, lse_out, o_in, lse_in)
    full, full_lse = pk.split_kv_attention_reference(q, k, v, kv_len=prefix + n, return_lse=True)
    np.testing.assert_allclose(np.asarray(merged, np.float32), np.asarray(full, np.float32), atol=tol)
    np.testing.assert_allclose(lse, full_lse, atol=1e-4)
    expected = masked_attention(q, k, v, np.arange(cap) < prefix + n)
    np.testing.assert_allclose(np.asarray(merged, np.float32), expected, atol=tol)


def test_reuse_step_merges_the_stored_external_part_with_fresh_block_attention(rng):
    n, hq, hkv, prefix, cap = 4, 4, 2, 30, 40
    q0, q1 = (jnp.asarray(rng.standard_normal((1, n, hq, 16)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((1, cap, hkv, 16)), jnp.float32) for _ in range(2))
    fb = FlashBlock(tau=2)
    state = fb.init_state(batch=1, num_heads=hq, num_kv_heads=hkv, q_len=n, kv_len=cap, head_dim=16)
    kv_len = jnp.int32(prefix + n)
    out0, state = fb.attend(q0, k, v, state, jnp.int32(Mode.ESTIMATE), kv_len=kv_len)
    np.testing.assert_allclose(out0, masked_attention(q0, k, v, np.arange(cap) < prefix + n), atol=1e-5)
    k1 = k.at[:, prefix:prefix + n].set(jnp.asarray(rng.standard_normal((1, n, hkv, 16)), jnp.float32))  # block changed
    out1, _ = fb.attend(q1, k1, v, state, jnp.int32(Mode.SPARSE), kv_len=kv_len)
    # stale external part: the step-0 queries over the prefix; fresh internal part: q1 over the new block
    o_out, lse_out = pk.split_kv_attention_reference(q0, k, v, kv_len=prefix, return_lse=True)
    o_in, lse_in = pk.flash_attention_reference(q1, k1[:, prefix:prefix + n], v[:, prefix:prefix + n], return_lse=True)
    np.testing.assert_allclose(out1, pk.merge_attention_reference(o_out, lse_out, o_in, lse_in)[0], atol=1e-5)
    assert np.abs(np.asarray(out1) - masked_attention(q1, k1, v, np.arange(cap) < prefix + n)).max() > 1e-3


@pytest.mark.parametrize("prefix,k", [(30, 8), (5, 8), (0, 4), (12, 12)])
def test_complement_lists_exactly_the_unselected_prefix_positions(rng, prefix, k):
    cap = 40
    q = jnp.asarray(rng.standard_normal((2, 4, 4, 16)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((2, cap, 2, 16)), jnp.float32)
    indices = select_prefix(q, cache, prefix_len=prefix, k=k)
    left_out, counts = complement_indices(indices, jnp.int32(prefix), cap)
    for b in range(2):
        for h in range(2):
            chosen = set(np.asarray(indices)[b, h, :min(k, prefix)].tolist())
            expected = [i for i in range(prefix) if i not in chosen]
            assert int(counts[b, h]) == len(expected)
            assert np.asarray(left_out)[b, h, :len(expected)].tolist() == expected


def test_block_mode_follows_the_official_rule():
    fb = FlashBlock(tau=2)
    mode = lambda step, unmasked, commit=False: int(fb.block_mode(jnp.int32(step), unmasked=jnp.int32(unmasked),
                                                                  commit=jnp.bool_(commit)))
    assert mode(0, 0) == Mode.ESTIMATE
    assert mode(1, 1) == Mode.SPARSE and mode(1, 2) == Mode.REFRESH and mode(3, 5) == Mode.REFRESH
    assert mode(4, 0, commit=True) == Mode.DENSE
    assert int(FlashBlock(tau=0).block_mode(jnp.int32(3), unmasked=jnp.int32(0), commit=False)) == Mode.REFRESH
    assert int(FlashBlock(tau=None).block_mode(jnp.int32(3), unmasked=jnp.int32(9), commit=False)) == Mode.SPARSE


def test_bad_configs_are_rejected():
    with pytest.raises(ValueError, match="tau"):
        FlashBlock(tau=-1)
    with pytest.raises(ValueError, match="MAGE"):
        FlashBlock(inner="mage")
    with pytest.raises(ValueError, match="kv_len"):
        FlashBlock().attend(*(jnp.zeros((1, 4, 2, 8)),) * 3, FlashBlock().init_state(
            batch=1, num_heads=2, num_kv_heads=2, q_len=4, kv_len=4, head_dim=8), Mode.SPARSE)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(tiny_sdar_config(num_layers=3), seed=5)


def test_always_refreshing_generates_the_dense_tokens(model, rng):
    prompt = rng.integers(0, 170, (1, 10))
    dense = generate(model, prompt, **OPTIONS)
    np.testing.assert_array_equal(generate(model, prompt, method=FlashBlock(tau=0), **OPTIONS), dense)
    combined = FlashBlock(tau=0, inner=MAGE(k=3, exact_layers=0))  # a selection smaller than the prefix
    np.testing.assert_array_equal(generate(model, prompt, method=combined, **OPTIONS), dense)
    everything = FlashBlock(tau=None, inner=MAGE(k=64, exact_layers=0))  # nothing left to cache
    np.testing.assert_array_equal(generate(model, prompt, method=everything, **OPTIONS), dense)


def test_interpret_kernels_match_the_references_in_the_loop(model, rng):
    """FlashBlock around MAGE calls every kernel FlashBlock alone calls (the split-KV pass, the gathered pass that
    `block_attention` runs with an empty selection) through its own backend; MAGE's own kernels run in interpret mode
    in test_mage's loop test. FlashBlock alone in interpret mode (another ~5 s program to compile) adds no kernel call."""
    prompt = rng.integers(0, 170, (1, 9))
    method = FlashBlock(tau=2, inner=MAGE(k=4, exact_layers=1))
    reference = generate(model, prompt, method=method, **OPTIONS)
    np.testing.assert_array_equal(
        generate(model, prompt, method=dataclasses.replace(method, backend="interpret"), **OPTIONS), reference)


@pytest.mark.parametrize("steps,expected", [
    (4, [Mode.ESTIMATE, Mode.SPARSE, Mode.REFRESH, Mode.SPARSE, Mode.DENSE]),  # one token per step
    (2, [Mode.ESTIMATE, Mode.REFRESH, Mode.DENSE]),  # two tokens per step: every later step refreshes
])
def test_loop_counts_unmasked_tokens_since_the_last_refresh(model, rng, steps, expected):
    prompt = rng.integers(0, 170, (1, 8))
    report = analyze_blocks(model, prompt, FlashBlock(tau=2), max_new_tokens=12, denoising_steps=steps, top_k=1,
                            remasking="low_confidence_static")
    blocks = np.split(report.modes, np.flatnonzero(report.step == 0)[1:])
    assert len(blocks) == 3
    for modes in blocks[:-1]:
        assert modes.tolist() == [int(m) for m in expected]
    assert blocks[-1].tolist() == [int(m) for m in expected[:-1]]  # the last block's commit is not run
    refreshed = report.modes != Mode.SPARSE
    np.testing.assert_array_less(report.l1[:, refreshed], 1e-5)  # full steps are exact
    if Mode.SPARSE in expected:
        assert np.nanmin(report.l1[:, report.modes == Mode.SPARSE]) > 0  # reuse steps use a stale part


def test_combination_is_closer_to_exact_than_mage_alone(model, rng):
    prompt = rng.integers(0, 170, (1, 24))
    options = dict(max_new_tokens=16, denoising_steps=4, top_k=1, remasking="low_confidence_static")
    errors = {}
    for name, method in (("MAGE(k=4)", MAGE(k=4, exact_layers=0)),
                         ("FlashBlock(2, MAGE(k=4))", FlashBlock(tau=2, inner=MAGE(k=4, exact_layers=0))),
                         ("FlashBlock(None, MAGE(k=4))", FlashBlock(tau=None, inner=MAGE(k=4, exact_layers=0)))):
        errors[name] = analyze_blocks(model, prompt, method, **options).summary()
    print("\nmean relative L1 of attention outputs vs exact, later steps, same (dense) trajectory:")
    for name, s in errors.items():
        print(f"  {name:28s} l1 = {s['l1']:.4f}  recall = {s['recall']:.3f}  sparse / refresh steps = "
              f"{s['sparse_steps']} / {s['refresh_steps']}")
    mage = errors["MAGE(k=4)"]["l1"]
    assert errors["FlashBlock(2, MAGE(k=4))"]["l1"] < mage
    assert errors["FlashBlock(None, MAGE(k=4))"]["l1"] < mage
    assert errors["FlashBlock(2, MAGE(k=4))"]["recall"] == errors["MAGE(k=4)"]["recall"]  # the same selection


def test_mage_recall_is_one_when_the_selection_is_the_oracle(model, rng):
    prompt = rng.integers(0, 170, (1, 16))
    report = analyze_blocks(model, prompt, MAGE(k=4, exact_layers=1), max_new_tokens=8, denoising_steps=4, top_k=1)
    first = report.step == 0
    np.testing.assert_allclose(report.recall[1:, first], 1.0)  # step 1's oracle is the selection
    assert np.isnan(report.recall[0]).all()  # the exact layer selects nothing
    later = report.later()
    assert np.all((report.recall[1:, later] >= 0) & (report.recall[1:, later] <= 1))


def test_flashblock_on_llada_is_a_clear_error(tmp_path, rng):
    from dllm_jax.testing import tiny_llada_config

    llada = load_model(write_hf_checkpoint(tmp_path, tiny_llada_config()), dtype="float32", progress=False)
    with pytest.raises(ValueError, match="SDAR"):
        generate(llada, rng.integers(0, 100, (1, 8)), gen_length=8, steps=8, block_length=8, method=FlashBlock())


@pytest.mark.gpu
@pytest.mark.parametrize("inner", [None, MAGE(k=256, exact_layers=0)])
def test_pallas_policy_matches_the_reference_on_gpu(rng, inner):
    """Every mode of a block (first step, reuse, refresh, commit) through the Pallas kernels at SDAR-8B
    head shapes (32 query / 8 KV heads, d = 128, a 32-token block, bf16) against the jnp references."""
    import jax

    if jax.default_backend() != "gpu":
        pytest.fail("gpu-marked tests need a GPU; deselect them with -m 'not gpu' on CPU machines")
    n, hq, hkv, d, prefix, cap = 32, 32, 8, 128, 5000, 5100
    k, v = (jnp.asarray(rng.standard_normal((1, cap, hkv, d)), jnp.bfloat16) for _ in range(2))
    kv_len = jnp.int32(prefix + n)
    results = {}
    for backend in ("auto", "reference"):
        fb = FlashBlock(tau=2, inner=inner, backend=backend)
        fb = dataclasses.replace(fb, inner=None if inner is None else dataclasses.replace(inner, backend=backend))
        state = fb.init_state(batch=1, num_heads=hq, num_kv_heads=hkv, q_len=n, kv_len=cap, head_dim=d)
        step_rng = np.random.default_rng(0)
        outs = []
        for mode in (Mode.ESTIMATE, Mode.SPARSE, Mode.REFRESH, Mode.SPARSE, Mode.DENSE):
            q = jnp.asarray(step_rng.standard_normal((1, n, hq, d)), jnp.bfloat16)
            out, state = jax.jit(fb.attend)(q, k, v, state, jnp.int32(mode), kv_len=kv_len)
            outs.append(np.asarray(out, np.float32))
        results[backend] = outs
    for got, expected in zip(results["auto"], results["reference"]):
        assert np.isfinite(got).all()
        assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 2e-2


def test_cli_method_flags():
    from dllm_jax.cli import build_parser
    from dllm_jax.cli.methods import method_from_args

    def parse(*flags):
        return method_from_args(build_parser().parse_args(["generate", "--model", "m", "--prompt", "p", *flags]))

    assert parse("--method", "flashblock") == FlashBlock(tau=2)
    assert parse("--method", "flashblock", "--tau", "none") == FlashBlock(tau=None)
    assert parse("--method", "flashblock+mage", "--tau", "3", "--mage-k", "64", "--exact-layers", "1") == \
        FlashBlock(tau=3, inner=MAGE(k=64, exact_layers=1))
    for bad in (["--method", "flashblock", "--mage-k", "4"], ["--method", "mage", "--tau", "2"]):
        with pytest.raises(ValueError, match="does not apply"):
            parse(*bad)
    with pytest.raises(SystemExit):  # argparse rejects the value itself
        parse("--method", "flashblock", "--tau", "two")


def test_generate_command_with_flashblock_and_mage(tmp_path, capsys):
    check_generate_command(tmp_path, capsys, ["--method", "flashblock+mage", "--tau", "2", "--mage-k", "4",
                                              "--exact-layers", "1"], FlashBlock(tau=2, inner=MAGE(k=4, exact_layers=1)))
