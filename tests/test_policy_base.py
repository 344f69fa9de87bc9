"""One attention channel: the policy base class (a default for every optional hook, an isinstance
check), and every model call attending through its `policy` argument."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax import MAGE, FlashBlock, PulseCol, SpargeAttn, SparseD
from dllm_jax.attention.policy import AttentionPolicy, Dense, Mode, check_policy
from dllm_jax.generate.sampling import transfer_counts
from dllm_jax.testing import tiny_llada_config, tiny_sdar_config


@dataclasses.dataclass(frozen=True)
class OnlyRequired(AttentionPolicy):
    def mode(self, step):
        return Mode.SPARSE

    def attend(self, q, k, v, state, mode, **masks):
        return q, state


@dataclasses.dataclass(frozen=True)
class ZeroAttention(Dense):
    """Attention output 0: each position's logits then depend on its own token only."""

    def attend(self, q, k, v, state, mode, **masks):
        return jnp.zeros_like(q), state


def test_optional_hooks_have_defaults():
    policy = OnlyRequired()
    assert policy.init_state(batch=1, num_heads=2, num_kv_heads=1, q_len=4, kv_len=4, head_dim=8) == ()
    assert policy.bind(total_steps=8, prompt_length=3, gen_length=5) is policy
    assert policy.stack_layers({"a": 1}) == {"a": 1}
    assert policy.block_mode(3, unmasked=2, commit=True) == Mode.SPARSE  # falls back to mode(step)
    assert policy.pattern_mask((), num_queries=4, num_keys=4, num_heads=2) is None
    assert policy.selection(()) is None


def test_every_method_is_a_policy():
    for method in (Dense(), SparseD(), PulseCol(), SpargeAttn(), MAGE(), FlashBlock(), FlashBlock(inner=MAGE())):
        assert isinstance(method, AttentionPolicy)
        check_policy(method)


def test_required_hooks_and_the_type_check():
    @dataclasses.dataclass(frozen=True)
    class NoAttend(AttentionPolicy):
        def mode(self, step):
            return Mode.DENSE

    with pytest.raises(TypeError, match="abstract"):
        NoAttend()

    class DuckTyped:  # the three methods, but not an AttentionPolicy
        def init_state(self, **shapes):
            return ()

        def mode(self, step):
            return Mode.DENSE

        def attend(self, q, k, v, state, mode, **masks):
            return q, state

    with pytest.raises(ValueError, match="DuckTyped.*is not an attention policy"):
        check_policy(DuckTyped())

    @dataclasses.dataclass(frozen=True)
    class Unhashable(OnlyRequired):
        values: list = dataclasses.field(default_factory=list)

    with pytest.raises(ValueError, match="must be hashable"):
        check_policy(Unhashable())


def test_model_calls_attend_through_the_policy(tiny_model):
    """Four tokens equal, at different positions: dense attention gives them different logits; with
    attention output 0 their logits are equal. So each call really routes attention through `policy`."""
    ids = np.array([[5, 7, 5, 9, 5, 11, 5, 3]], np.int32)
    same = [0, 2, 4, 6]
    llada, sdar = tiny_model(tiny_llada_config()), tiny_model(tiny_sdar_config())
    for model in (llada, sdar):
        assert np.abs(np.diff(np.asarray(model(ids))[0, same], axis=0)).max() > 1e-3
        zero = np.asarray(model(ids, policy=ZeroAttention()))
        np.testing.assert_allclose(np.diff(zero[0, same], axis=0), 0, atol=1e-5)
    cache = sdar.prefill(ids[:, :4], sdar.init_cache(1, 16))
    zero_cache = sdar.prefill(ids[:, :4], sdar.init_cache(1, 16), policy=ZeroAttention())
    # layer 0's keys come from the embeddings alone; layer 1's from layer 0's attention output
    np.testing.assert_allclose(np.asarray(zero_cache.k[0]), np.asarray(cache.k[0]), atol=1e-5)  # layer 0
    assert np.abs(np.asarray(zero_cache.k[1]) - np.asarray(cache.k[1])).max() > 1e-3
    block = ids[:, 4:]  # tokens 5, 11, 5, 3
    logits, _ = sdar.block_step(block, cache)
    zero, _ = sdar.block_step(block, cache, policy=ZeroAttention())
    assert np.abs(np.asarray(logits)[0, 0] - np.asarray(logits)[0, 2]).max() > 1e-3
    np.testing.assert_allclose(np.asarray(zero)[0, 0], np.asarray(zero)[0, 2], atol=1e-5)


def test_transfer_counts_spread_the_remainder_over_the_first_steps():
    np.testing.assert_array_equal(np.asarray(transfer_counts(4, 3)), [2, 1, 1])  # SDAR: one block
    np.testing.assert_array_equal(np.asarray(transfer_counts(jnp.array([5, 2, 0]), 2)), [[3, 2], [1, 1], [0, 0]])
