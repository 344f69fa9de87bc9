"""SDAR generate: token-for-token against a PyTorch port of JetAstra/SDAR block_diffusion_generate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.generate import generate
from dllm_jax.generate import block_loop
from dllm_jax.generate import sdar as gen_sdar
from dllm_jax.testing import tiny_sdar_config
from torch_generate import sdar_generate
from torch_reference import qwen3_reference


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tiny_model):
    config = tiny_sdar_config(vocab_size=48, mask_token_id=40, eos_token_ids=(41, 42), pad_token_id=42)
    return config, tiny_model(config, seed=21), qwen3_reference(tiny_checkpoint(config, seed=21))


def uniforms_for(seed, n):
    key = jax.random.key(seed)
    return lambda t: np.asarray(jax.random.uniform(jax.random.fold_in(key, t), (1, n)))


CASES = {
    "sequential_greedy": dict(remasking="sequential", top_k=1, denoising_steps=4),
    "sequential_sampled_2_steps": dict(remasking="sequential", denoising_steps=2),
    "static_sampled": dict(remasking="low_confidence_static", denoising_steps=4),
    "dynamic_default": dict(denoising_steps=4),
    "dynamic_low_threshold": dict(confidence_threshold=0.2, denoising_steps=4, temperature=0.5),
    "dynamic_top_k_top_p": dict(denoising_steps=4, top_k=8, top_p=0.7, temperature=0.7),
    "greedy_dynamic_commits_all": dict(top_k=1, confidence_threshold=0.9, denoising_steps=4),
}


@pytest.mark.parametrize("prompt_length", [7, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_official_algorithm(setup, rng, case, prompt_length):
    config, model, reference = setup
    options = dict(CASES[case])
    prompt = rng.integers(0, 40, (1, prompt_length))
    seed = int(rng.integers(0, 2**31))
    out = generate(model, prompt, seed=seed, max_new_tokens=20, **options)
    steps = options.pop("denoising_steps")
    remasking = options.pop("remasking", "low_confidence_dynamic")
    expected = sdar_generate(reference, prompt, mask_id=config.mask_token_id, gen_length=20,
                             block_length=config.block_size, denoising_steps=steps, remasking_strategy=remasking,
                             stopping_criteria_idx=list(config.eos_token_ids),
                             uniforms=uniforms_for(seed, config.block_size), **options)
    [trimmed] = block_loop.trim(expected, [expected.shape[1]], [prompt_length], set(config.eos_token_ids))
    if not set(trimmed[prompt_length:].tolist()) & set(config.eos_token_ids):
        # no stop: the official output runs to the end of the last block, trailing masks included
        trimmed = expected[0]
    np.testing.assert_array_equal(np.asarray(out)[0], trimmed)
    np.testing.assert_array_equal(np.asarray(out)[0, :prompt_length], prompt[0])


def test_stops_after_the_block_with_a_stop_token(setup, rng):
    config, model, _ = setup
    stops = []
    for seed in range(12):
        out = np.asarray(generate(model, rng.integers(0, 40, (1, 5)), seed=seed, max_new_tokens=40))[0]
        gen = out[5:]
        hits = np.flatnonzero(np.isin(gen, config.eos_token_ids))
        if hits.size:
            assert hits[-1] == gen.size - 1  # cut right after the first stop token
            stops.append(seed)
        else:
            assert out.size == 48  # ceil(45 / 4) * 4 positions, all decoded
    assert stops, "no seed produced a stop token: the test model's vocabulary is too large to exercise stopping"


def test_one_compilation_for_new_prompts_and_seeds(setup, rng):
    """Prompts of any length within one PROMPT_BUCKET and any seed share one compiled loop (at most one new program:
    an earlier test may have compiled it)."""
    config, model, _ = setup
    before = gen_sdar.generate_sdar_jit._cache_size()
    for seed, length in enumerate((6, 1, 13, gen_sdar.PROMPT_BUCKET)):
        generate(model, rng.integers(0, 40, (1, length)), seed=seed, max_new_tokens=8)
    assert gen_sdar.generate_sdar_jit._cache_size() - before <= 1


def test_invalid_options_raise(setup):
    _, model, _ = setup
    prompt = np.ones((1, 4), np.int32)
    for options, message in [(dict(remasking="entropy_bounded"), "remasking"), (dict(temperature=0.0), "temperature"),
                             (dict(top_p=0.0), "top_p"), (dict(gen_length=8), "unknown SDAR generate options"),
                             (dict(denoising_steps=0), "positive")]:
        with pytest.raises(ValueError, match=message):
            generate(model, prompt, **options)


def test_progress_bar_counts_blocks(setup, rng, capsys):
    config, model, _ = setup
    prompt = rng.integers(0, 40, (1, 6))
    out = generate(model, prompt, seed=1, max_new_tokens=8, progress=True)
    np.testing.assert_array_equal(out, generate(model, prompt, seed=1, max_new_tokens=8))
    err = capsys.readouterr().err
    assert "SDAR blocks" in err and "/3" in err  # blocks 1..3 of ceil(14 / 4) = 4 (block 0 is prefilled)


def test_attention_policies_in_the_block_loop(setup, rng):
    """Dense policy == no policy; an oracle keeping every key block == dense; keeping one changes results."""
    from dllm_jax.attention.policy import Dense
    from oracle_policy import OracleTopK

    config, model, _ = setup
    options = dict(max_new_tokens=12, denoising_steps=4, remasking="low_confidence_static", seed=3)
    changed = []
    for _ in range(3):
        prompt = rng.integers(0, 40, (1, 9))
        dense = generate(model, prompt, **options)
        np.testing.assert_array_equal(generate(model, prompt, method=Dense(), **options), dense)
        np.testing.assert_array_equal(generate(model, prompt, method=OracleTopK(block=4, keep=6), **options), dense)  # 24 keys
        changed.append(not np.array_equal(generate(model, prompt, method=OracleTopK(block=4, keep=1), **options),
                                          dense))
    assert any(changed)


def test_per_row_sampling_is_each_rows_own_scalar_sampling(rng):
    """`sample_tokens_per_row` (a serving engine's slots, each with its request's temperature, top-k and top-p)
    gives every row exactly what `sample_tokens` gives it with that row's values, greedy rows (top-k 1) included,
    whatever the static bound on top-k (a row's k at the bound, below it, or 0)."""
    from dllm_jax.generate.sampling import sample_tokens, sample_tokens_per_row

    logits = jnp.asarray(rng.normal(size=(6, 3, 64)) * 3, jnp.float32)
    u = jnp.asarray(rng.uniform(size=(6, 3)), jnp.float32)
    rows = [(0.7, 1.0, 0, False), (1.0, 0.8, 5, False), (1.0, 1.0, 3, True), (1.3, 0.5, 2, False),
            (1.0, 1.0, 0, False), (0.9, 1.0, 5, False)]
    for max_top_k in (0, 5, 9):
        ks = [min(k, max_top_k) for _, _, k, _ in rows]
        t, p, greedy = (jnp.asarray(v) for v in ([r[0] for r in rows], [r[1] for r in rows], [r[3] for r in rows]))
        tokens, probs = sample_tokens_per_row(logits, u, temperature=t.astype(jnp.float32),
                                              top_k=jnp.asarray(ks, jnp.int32), max_top_k=max_top_k,
                                              top_p=p.astype(jnp.float32), keep_max=greedy)
        for b, ((temperature, top_p, _, keep_max), top_k) in enumerate(zip(rows, ks)):
            one, one_p = sample_tokens(logits[b:b + 1], u[b:b + 1], temperature=temperature,
                                       top_k=1 if keep_max else top_k, top_p=top_p)
            np.testing.assert_array_equal(np.asarray(tokens[b]), np.asarray(one[0]), err_msg=f"row {b}, {top_k=}")
            np.testing.assert_array_equal(np.asarray(probs[b]), np.asarray(one_p[0]), err_msg=f"row {b}, {top_k=}")
