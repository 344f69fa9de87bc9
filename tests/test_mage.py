"""MAGE: the prefix selection against a numpy version of the paper's Eq. 3, the sparse step against
attention under the explicit mask, and exactness when everything is kept."""

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

from dllm_jax import generate
from dllm_jax.attention.flashblock import FlashBlock
from dllm_jax.attention.mage import MAGE, select_prefix, selection_of
from dllm_jax.attention.policy import Mode
from dllm_jax.testing import jaxpr_equations, tiny_sdar_config
from sdar_methods_testing import OPTIONS, check_generate_command, masked_attention

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def mage_numpy(q, k_cache, prefix_len, k, softmax_over="prefix"):
    """Eq. 3: mean over the G query heads and the block's queries of softmax(q K^T / sqrt(d)) over the
    N = prefix_len prefix keys (A in R^{G x B x N}); top-k prefix positions per KV head, ascending.
    softmax_over="prefix+block": the softmax over the prefix + block keys instead (the earlier rule)."""
    q, kc = np.asarray(q, np.float64), np.asarray(k_cache, np.float64)
    b, n, hq, d = q.shape
    hkv, total = kc.shape[2], prefix_len + (n if softmax_over == "prefix+block" else 0)
    out = np.zeros((b, hkv, min(k, prefix_len)), int)
    for bi in range(b):
        for g in range(hkv):
            probs = []
            for h in range(g * hq // hkv, (g + 1) * hq // hkv):
                s = q[bi, :, h] @ kc[bi, :total, g].T / math.sqrt(d)
                p = np.exp(s - s.max(-1, keepdims=True))
                probs.append(p / p.sum(-1, keepdims=True))
            score = np.mean(probs, axis=(0, 1))[:prefix_len]
            out[bi, g] = np.sort(np.argsort(-score, kind="stable")[:min(k, prefix_len)])
    return out


@pytest.mark.parametrize("select_by", ["threshold", "tiles", "sort"])
@pytest.mark.parametrize("n,hq,hkv,prefix,k", [(4, 4, 2, 60, 8), (8, 8, 2, 100, 32), (4, 4, 4, 5, 8), (16, 4, 1, 40, 40)])
def test_select_prefix_matches_eq3(rng, n, hq, hkv, prefix, k, select_by):
    q = jnp.asarray(rng.standard_normal((2, n, hq, 32)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((2, prefix + n + 7, hkv, 32)), jnp.float32)  # 7 unused slots
    got = np.asarray(select_prefix(q, cache, prefix_len=prefix, k=k, select_by=select_by))
    expected = mage_numpy(q, cache, prefix, k)
    count = min(k, prefix)
    np.testing.assert_array_equal(got[..., :count], expected)
    assert (got[..., count:] == got[..., count - 1:count]).all()  # padding repeats the last pick
    assert got.dtype == np.int32 and got.shape == (2, hkv, k)


def test_the_policy_selects_by_eq3_and_optionally_by_the_earlier_rule(rng):
    """MAGE's first step (prefix part + block part merged by LSE, the prefix LSE feeding the scores, made
    from the prefix pass's logits or from the keys read again) selects what Eq. 3 selects;
    softmax_over="prefix+block" what the earlier rule selects."""
    n, hq, hkv, prefix, cap, k = 4, 4, 2, 45, 56, 6
    q = jnp.asarray(rng.standard_normal((2, n, hq, 32)), jnp.float32)
    kc, vc = (jnp.asarray(rng.standard_normal((2, cap, hkv, 32)), jnp.float32) for _ in range(2))
    kv_len = jnp.int32(prefix + n)
    for softmax_over, scores_from in itertools.product(("prefix", "prefix+block"), ("logits", "probs", "keys")):
        mage = MAGE(k=k, exact_layers=0, softmax_over=softmax_over, scores_from=scores_from)
        state = mage.init_state(batch=2, num_heads=hq, num_kv_heads=hkv, q_len=n, kv_len=cap, head_dim=32)
        out, (selection, _) = mage.attend(q, kc, vc, state, jnp.int32(Mode.ESTIMATE), kv_len=kv_len)
        indices = selection.indices
        np.testing.assert_array_equal(indices, mage_numpy(q, kc, prefix, k, softmax_over))
        np.testing.assert_array_equal(mage.select(q, kc, kv_len), indices)  # computes its own LSE
        np.testing.assert_allclose(out, masked_attention(q, kc, vc, np.arange(cap) < prefix + n), atol=1e-5)


def test_eq3_differs_from_the_prefix_plus_block_ranking():
    """Query 0 looks mostly at the block, and in the prefix at position 0; query 1 looks at the prefix,
    preferring position 1 less sharply. Eq. 3 normalises each query over the prefix, so query 0's
    preference counts in full and position 0 wins; over prefix + block, query 0's prefix mass is
    tiny and position 1 wins."""
    d, prefix, n = 16, 10, 2
    q = np.zeros((1, n, 1, d), np.float32)
    q[0, 0, 0, 0], q[0, 1, 0, 1] = 4.0, 4.0
    cache = np.zeros((1, prefix + n, 1, d), np.float32)
    cache[0, 0, 0, 0], cache[0, 1, 0, 1] = 8.0, 6.0  # logits 8 and 6 after the 1/sqrt(16) scale
    cache[0, prefix, 0, 0] = 16.0  # block key: logit 16 for query 0, 0 for query 1
    eq3, earlier = mage_numpy(q, cache, prefix, 1), mage_numpy(q, cache, prefix, 1, "prefix+block")
    assert eq3.ravel().tolist() == [0] and earlier.ravel().tolist() == [1]  # the case separates the rules
    got = select_prefix(jnp.asarray(q), jnp.asarray(cache), prefix_len=prefix, k=1)
    np.testing.assert_array_equal(got, eq3)
    got = select_prefix(jnp.asarray(q), jnp.asarray(cache), prefix_len=prefix, k=1, softmax_over="prefix+block")
    np.testing.assert_array_equal(got, earlier)
    with pytest.raises(ValueError, match="softmax_over='block'"):
        MAGE(softmax_over="block")
    with pytest.raises(ValueError, match=r"MAGE.scores_from must be one of \('logits', 'probs', 'keys'\), got 'lse'"):
        MAGE(scores_from="lse")
    with pytest.raises(ValueError, match="logits together with the LSE"):
        select_prefix(jnp.asarray(q), jnp.asarray(cache), prefix_len=prefix, k=1, logits=jnp.zeros((1, 1, 2, 12)))


def test_sparse_step_attends_to_the_selection_and_the_block(rng):
    n, hq, hkv, prefix, cap = 4, 4, 2, 50, 64
    q = jnp.asarray(rng.standard_normal((1, n, hq, 32)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, cap, hkv, 32)), jnp.float32) for _ in range(2))
    mage = MAGE(k=8, exact_layers=0)
    kv_len = jnp.int32(prefix + n)
    fresh = mage.init_state(batch=1, num_heads=hq, num_kv_heads=hkv, q_len=n, kv_len=cap, head_dim=32)
    out, state = mage.attend(q, k, v, fresh, jnp.int32(Mode.ESTIMATE), kv_len=kv_len)
    np.testing.assert_allclose(out, masked_attention(q, k, v, np.arange(cap) < prefix + n), atol=1e-5)  # exact
    sparse, _ = mage.attend(q, k, v, state, jnp.int32(Mode.SPARSE), kv_len=kv_len)
    keep = np.zeros((1, hq, 1, cap), bool)
    for g in range(hkv):
        keep[0, g * 2:(g + 1) * 2, 0, np.asarray(state[0].indices)[0, g]] = True
    keep[..., prefix:prefix + n] = True
    np.testing.assert_allclose(sparse, masked_attention(q, k, v, keep), atol=1e-5)
    # the first step stored the list the later steps read: the selection, the block's rows, padded to key tiles
    listed = np.asarray(state[0].listed)
    assert listed.shape == (1, hkv, pk.split_kv_gather_width(8 + n))
    np.testing.assert_array_equal(listed[..., :8], state[0].indices)
    block_rows = np.minimum(prefix + np.arange(listed.shape[-1] - 8), prefix + n - 1)
    np.testing.assert_array_equal(listed[..., 8:], np.broadcast_to(block_rows, (1, hkv, block_rows.size)))
    np.testing.assert_array_equal(state[0].counts, 8 + n)
    # ...and a sparse step attends through the stored list as it is: here every row, so exactly
    every_row = state[0].replace(listed=jnp.minimum(jnp.arange(listed.shape[-1]), prefix + n - 1)[None, None]
                                 .repeat(hkv, 1), counts=jnp.full((1, hkv), prefix + n, jnp.int32))
    sparse, _ = mage.attend(q, k, v, (every_row, state[1]), jnp.int32(Mode.SPARSE), kv_len=kv_len)
    np.testing.assert_allclose(sparse, masked_attention(q, k, v, np.arange(cap) < prefix + n), atol=1e-5)


def mode_switches(jaxpr) -> int:
    """Conditionals of three or more branches (a policy's switch over its modes; the kernels' references hold
    two-way ones of their own) in a jaxpr and every jaxpr nested in it."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "cond" and len(eqn.params["branches"]) >= 3
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    count += mode_switches(sub)
    return count


def test_a_static_layer_and_mode_pick_the_branch_while_tracing(rng):
    """At a layer index known while tracing (the unrolled cached path) and a mode given as a Python int, MAGE
    attends through its one branch (no switch over its modes) and gives what the traced mode and per-layer flag give."""
    mage = MAGE(k=6, exact_layers=1)
    n, prefix, cap = 4, 40, 48
    q = jnp.asarray(rng.standard_normal((2, n, 4, 32)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, cap, 2, 32)), jnp.float32) for _ in range(2))
    kv_len = jnp.full((2,), prefix + n, jnp.int32)
    indices = jnp.asarray(np.sort([[rng.permutation(prefix)[:6] for _ in range(2)] for _ in range(2)]), jnp.int32)
    for layer in (0, 1):
        # what stack_layers gives that layer
        state = (selection_of(indices, kv_len, n), jnp.bool_(layer < mage.exact_layers))
        for mode in Mode:
            static = jax.make_jaxpr(lambda q: mage.at_layer(layer).attend(q, k, v, state, int(mode), kv_len=kv_len))(q)
            assert mode_switches(static.jaxpr) == 0, (layer, mode)
            got = mage.at_layer(layer).attend(q, k, v, state, int(mode), kv_len=kv_len)
            traced = jax.jit(lambda q, m: mage.attend(q, k, v, state, m, kv_len=kv_len))(q, jnp.int32(mode))
            jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6), got, traced)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(tiny_sdar_config(num_layers=3), seed=4)


def block_jaxpr(model, policy):
    """The jaxpr of one output block of SDAR's loop (`denoise_block`, a pending commit fused) under `policy`."""
    from dllm_jax.generate import block_loop
    from dllm_jax.generate import sdar as gen
    from dllm_jax.models import block_diffusion

    config, params = model.config, model.params()
    masks = jnp.full((1, config.block_size), config.mask_token_id, jnp.int32)
    cache, state = model.init_cache(1, 64), block_diffusion.init_policy_state(policy, config, 1, 64)
    pending = block_loop.Finished(ids=masks, pending=jnp.ones((1,), bool), mode=jnp.full((1,), int(Mode.SPARSE)))
    return jax.make_jaxpr(lambda c, s: block_loop.denoise_block(
        params, masks, c, s, jax.random.key(0), jnp.zeros((1,), jnp.int32), jnp.ones((1,), bool), pending,
        config=config, options=gen.SDAROptions(denoising_steps=4, top_k=1), policy=policy,
        sampler=gen.SDAR_SAMPLER)[0])(cache, state).jaxpr


def test_everything_kept_equals_dense_generation(model, rng):
    prompt = rng.integers(0, 170, (1, 10))
    dense = generate(model, prompt, **OPTIONS)
    np.testing.assert_array_equal(generate(model, prompt, method=MAGE(k=64, exact_layers=0), **OPTIONS), dense)
    np.testing.assert_array_equal(generate(model, prompt, method=MAGE(k=2, exact_layers=3), **OPTIONS), dense)


def test_no_step_of_a_block_has_a_conditional(model):
    """MAGE's forwards after a block's first all run SPARSE, and so do its commits, and its first forward estimates
    in every row: the whole block carries no per-layer switch over its modes (each cost the GPU ~0.1 ms idle per
    layer and step, issue 40); FlashBlock, whose later steps reuse or refresh per row, keeps one per layer in the
    body."""
    def while_bodies(policy):
        jaxpr = block_jaxpr(model, policy)
        return jaxpr, [eqn.params["body_jaxpr"].jaxpr for eqn in jaxpr.eqns if eqn.primitive.name == "while"]

    block, (body,) = while_bodies(MAGE(k=4, exact_layers=1))
    assert mode_switches(body) == 0
    assert mode_switches(block) == 0
    _, (body,) = while_bodies(FlashBlock(tau=2))
    assert mode_switches(body) == model.config.num_layers


def test_the_selection_after_the_forward_is_the_same_in_one_top_k(model, rng):
    """select_after_forward (the default): the same tokens as selecting in each layer (two rows; prompts shorter than
    k, about k, longer), and a block's program ranks once (one `top_k`) where it ranked per sparse layer."""
    for length, k in ((3, 8), (9, 4), (30, 4)):
        prompt = rng.integers(0, 170, (2, length))
        method = MAGE(k=k, exact_layers=1)
        assert method.select_after_forward
        np.testing.assert_array_equal(
            generate(model, prompt, method=method, **OPTIONS),
            generate(model, prompt, method=dataclasses.replace(method, select_after_forward=False), **OPTIONS),
            err_msg=f"prompt {length}, k={k}")

    def top_ks(policy):
        return sum(eqn.primitive.name == "top_k" for eqn in jaxpr_equations(block_jaxpr(model, policy)))

    # (the sampler ranks too: the same in both)
    sparse_layers = model.config.num_layers - 1
    assert top_ks(MAGE(k=4, exact_layers=1, select_after_forward=False)) - top_ks(MAGE(k=4, exact_layers=1)) \
        == sparse_layers - 1


@pytest.mark.gpu
@pytest.mark.parametrize("select_by", ["tiles", "sort"])
def test_the_selection_after_the_forward_on_the_gpu(model, rng, select_by):
    """The batched selection through the Pallas kernels gives the per-layer selection's tokens."""
    prompt = rng.integers(0, 170, (2, 30))
    method = MAGE(k=8, exact_layers=1, select_by=select_by)
    np.testing.assert_array_equal(
        generate(model, prompt, method=method, **OPTIONS),
        generate(model, prompt, method=dataclasses.replace(method, select_after_forward=False), **OPTIONS))


def test_small_k_runs_in_the_loop_and_interpret_matches_reference(model, rng):
    prompt = rng.integers(0, 170, (1, 14))
    method = MAGE(k=4, exact_layers=1)
    reference = generate(model, prompt, method=method, **OPTIONS)
    np.testing.assert_array_equal(
        generate(model, prompt, method=dataclasses.replace(method, backend="interpret"), **OPTIONS), reference)


def test_generate_command_with_mage(tmp_path, capsys):
    check_generate_command(tmp_path, capsys, ["--method", "mage", "--mage-k", "4", "--exact-layers", "1"],
                           MAGE(k=4, exact_layers=1))
