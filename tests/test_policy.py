"""The policy hook: per-layer policy state rides in the generate loop's carry (oracle top-k policy)."""

import jax
import numpy as np
import pytest
import torch

from dllm_jax.attention.policy import Dense
from dllm_jax.generate import generate
from dllm_jax.models import llada
from dllm_jax.testing import tiny_llada_config
from oracle_policy import OracleTopK
from torch_generate import llada_generate

OPTIONS = dict(gen_length=16, steps=8, block_length=8)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(tiny_llada_config(vocab_size=48, tokenizer_vocab_size=48, mask_token_id=40, eos_token_id=41,
                                        pad_token_id=41, eot_token_id=42), seed=5)


def prompts(rng, n=4):
    return [rng.integers(0, 40, (2, 12)) for _ in range(n)]


def test_dense_policy_and_all_blocks_kept_equal_dense(model, rng):
    for prompt in prompts(rng, 2):
        dense = generate(model, prompt, **OPTIONS)
        np.testing.assert_array_equal(generate(model, prompt, method=Dense(), **OPTIONS), dense)
        np.testing.assert_array_equal(generate(model, prompt, method=OracleTopK(block=4, keep=7), **OPTIONS), dense)


def test_sparse_policy_changes_results(model, rng):
    changed = [not np.array_equal(generate(model, p, method=OracleTopK(block=4, keep=1), **OPTIONS),
                                  generate(model, p, **OPTIONS)) for p in prompts(rng)]
    assert any(changed)


def test_state_threads_through_the_compiled_loop_like_a_python_loop(model, rng):
    """generate(method=policy) equals the official algorithm driven step by step from Python, with the
    per-layer policy state carried by hand between the steps."""
    policy = OracleTopK(block=4, keep=2)
    config, params = model.config, model.params()
    # one compilation for every step (step traced); called eagerly, each step's lax.cond compiled anew
    forward = jax.jit(llada.forward, static_argnames=("config", "policy"))
    differs_from_dense = []
    for prompt in prompts(rng, 3):
        state = llada.init_policy_state(policy, config, prompt.shape[0], prompt.shape[1] + OPTIONS["gen_length"])
        step = [0]

        def logits_fn(x, mask, state_box=[state]):
            logits, state_box[0] = forward(params, x.numpy(), None, state_box[0], step[0], config=config,
                                           policy=policy)
            step[0] += 1
            return torch.tensor(np.asarray(logits))

        expected = llada_generate(logits_fn, prompt, mask_id=config.mask_token_id, eos_id=config.eos_token_id,
                                  eot_id=config.eot_token_id, **OPTIONS)
        np.testing.assert_array_equal(generate(model, prompt, method=policy, **OPTIONS), expected)
        differs_from_dense.append(not np.array_equal(expected, generate(model, prompt, **OPTIONS)))
    assert any(differs_from_dense), "the policy never changed a result: the comparison would prove nothing"


def test_policy_objects_are_validated(model):
    prompt = np.ones((1, 4), np.int32)
    with pytest.raises(ValueError, match="not an attention policy"):
        generate(model, prompt, method=object(), **OPTIONS)
