"""LLaDA generate: token-for-token against a PyTorch port of the official algorithm (tests/torch_generate.py)."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
import torch

from dllm_jax.attention.policy import Dense
from dllm_jax.generate import generate
from dllm_jax.generate import llada as gen_llada
from dllm_jax.testing import tiny_llada_config
from torch_generate import llada_generate
from torch_reference import llama_reference, reference_logits


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tiny_model):
    # a small vocabulary makes EOS/EoT predictions (and so the eos/eot options) actually matter
    config = tiny_llada_config(vocab_size=48, tokenizer_vocab_size=48, mask_token_id=40, eos_token_id=41,
                               pad_token_id=41, eot_token_id=42)
    return config, tiny_model(config, seed=11), llama_reference(tiny_checkpoint(config, seed=11))


def torch_logits_fn(reference, padding):
    def fn(x, mask):
        key_mask = None if (mask is None or padding == "ignore") else mask.numpy()
        return torch.as_tensor(reference_logits(reference, x.numpy(), key_mask))
    return fn


def uniforms(seed, steps, b, total, vocab, cfg=False):
    key = jax.random.key(seed)
    gumbel = [np.asarray(jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, 0), t), (b, total, vocab)))
              for t in range(steps)]
    rand = [np.asarray(jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, 1), t), (b, total)))
            for t in range(steps)]
    return gumbel, rand


CASES = {
    "greedy_3_blocks": dict(gen_length=12, steps=6, block_length=4),
    "greedy_one_block_uneven_schedule": dict(gen_length=10, steps=4, block_length=10),
    "random_remasking": dict(gen_length=8, steps=8, block_length=4, remasking="random"),
    "temperature": dict(gen_length=8, steps=4, block_length=4, temperature=0.8),
    "cfg": dict(gen_length=8, steps=4, block_length=4, cfg_scale=1.5),
    "logits_eos_inf": dict(gen_length=8, steps=8, block_length=8, logits_eos_inf=True),
    "confidence_eos_eot_inf_greedy": dict(gen_length=12, steps=12, block_length=6, confidence_eos_eot_inf=True),
    "confidence_eos_eot_inf_sampled": dict(gen_length=8, steps=8, block_length=4, temperature=1.0,
                                           confidence_eos_eot_inf=True),
}


@pytest.mark.parametrize("padding", ["none", "ignore", "mask"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_official_algorithm(setup, rng, case, padding):
    config, model, reference = setup
    options = CASES[case]
    prompt = rng.integers(0, 40, (2, 7))  # 7: not a multiple of any block length above
    mask = None
    if padding != "none":
        mask = np.ones_like(prompt)
        mask[1, :3] = 0
        prompt[1, :3] = config.pad_token_id
    seed = int(rng.integers(0, 2**31))
    out = generate(model, prompt, attention_mask=mask, seed=seed,
                   **options, **({} if padding == "none" else {"padding": padding}))
    total = prompt.shape[1] + options["gen_length"]
    gumbel, rand = uniforms(seed, options["steps"], 2, total, config.vocab_size)
    expected = llada_generate(
        torch_logits_fn(reference, padding), prompt, attention_mask=mask, mask_id=config.mask_token_id,
        eos_id=config.eos_token_id, eot_id=config.eot_token_id, gumbel_uniforms=gumbel, random_uniforms=rand,
        **options)
    assert out.shape == (2, total)
    np.testing.assert_array_equal(np.asarray(out), expected)
    np.testing.assert_array_equal(np.asarray(out)[:, :prompt.shape[1]], prompt)


def test_one_compilation_and_one_trace_of_the_step(setup, rng):
    """The loop is compiled once; the model is traced once per compilation, not once per step."""
    config, model, _ = setup
    traces = []

    @dataclasses.dataclass(frozen=True)
    class CountingDense(Dense):
        def attend(self, q, k, v, state, mode, **masks):
            traces.append(1)
            return super().attend(q, k, v, state, mode, **masks)

    opts = gen_llada.LLaDAOptions(gen_length=16, steps=16, block_length=4)
    run = functools.partial(gen_llada.generate_llada_jit, config=config, options=opts, policy=CountingDense())
    before = gen_llada.generate_llada_jit._cache_size()
    for seed in range(3):
        prompt = rng.integers(0, 40, (1, 5)).astype(np.int32)
        np.asarray(run(model.params(), prompt, None, np.int32(seed)))
    assert gen_llada.generate_llada_jit._cache_size() == before + 1
    assert len(traces) == config.num_layers  # 16 steps, one trace of the step (its layers unrolled)


def test_invalid_options_raise(setup):
    _, model, _ = setup
    prompt = np.ones((1, 4), np.int32)
    for options, message in [(dict(gen_length=10, block_length=4), "multiple of block_length"),
                             (dict(gen_length=8, block_length=4, steps=3), "multiple of the number of blocks"),
                             (dict(remasking="entropy"), "remasking"), (dict(padding="left"), "padding"),
                             (dict(temperature=-1.0), "temperature"), (dict(top_k=3), "unknown LLaDA generate options")]:
        with pytest.raises(ValueError, match=message):
            generate(model, prompt, **options)
    with pytest.raises(ValueError, match="attention_mask shape"):
        generate(model, prompt, attention_mask=np.ones((1, 5)), gen_length=4, steps=4, block_length=4)
    with pytest.raises(ValueError, match="unknown method 'sparse'"):
        generate(model, prompt, method="sparse")
    with pytest.raises(ValueError, match="method=42 is not an attention policy"):
        generate(model, prompt, method=42)


def test_mask_tokens_inside_the_prompt_are_predicted_as_officially(setup, rng):
    """A prompt holding mask tokens (infilling) takes the full-logits path and matches the reference."""
    config, model, reference = setup
    prompt = rng.integers(0, 40, (2, 9))
    prompt[:, 2] = config.mask_token_id
    options = dict(gen_length=8, steps=8, block_length=4)
    out = generate(model, prompt, **options)
    expected = llada_generate(torch_logits_fn(reference, "ignore"), prompt, mask_id=config.mask_token_id,
                              eos_id=config.eos_token_id, eot_id=config.eot_token_id, **options)
    np.testing.assert_array_equal(np.asarray(out), expected)


def test_progress_bar_advances_once_per_step_from_the_compiled_loop(setup, rng, capsys):
    config, model, _ = setup
    prompt = rng.integers(0, 40, (1, 5))
    plain = generate(model, prompt, gen_length=8, steps=8, block_length=4)
    with_bar = generate(model, prompt, gen_length=8, steps=8, block_length=4, progress=True)
    np.testing.assert_array_equal(with_bar, plain)
    err = capsys.readouterr().err
    assert "LLaDA denoising" in err and "8/8" in err
