"""Sampling values are inputs of the compiled loop, not part of its program: after one warm-up call, `generate`
with other temperatures, top-p, top-k (up to the loop's bound), confidence thresholds and remasking rules (SDAR,
LLaDA), or DiffusionGemma's entropy bounds, schedules and step counts, traces and compiles nothing (JAX's compile
events, counted), and each result equals the loop compiled with those values as static options (`rows=None`;
DiffusionGemma: `sampling=None`). For SDAR and LLaDA2 that is the sampler that takes the options' values as Python numbers
(the program before the values were traced); LLaDA's and Dream's loops have one sampler, fed the options' values
as constants there, and their tests against the official samplers' ports pin the values' meaning."""

import jax
import numpy as np
import pytest

import dllm_jax
from dllm_jax.generate.diffusion_gemma import DiffusionGemmaOptions, generate_canvases_jit
from dllm_jax.generate.dream import DreamOptions, generate_dream_jit
from dllm_jax.generate.llada import LLaDAOptions, generate_llada_fast_jit, generate_llada_jit
from dllm_jax.generate.llada2 import LLaDA2Options, answers, generate_llada2_jit
from dllm_jax.generate.sampling import top_k_bound
from dllm_jax.generate.block_loop import trim
from dllm_jax.generate.sdar import SDAROptions, generate_sdar_jit, left_padded
from dllm_jax.testing import (compile_events, tiny_diffusion_gemma_config, tiny_dream_config, tiny_llada2_config,
                              tiny_llada_config, tiny_sdar_config)

SDAR_SWEEP = [dict(temperature=0.7), dict(temperature=0.5, top_p=0.9), dict(top_p=0.8), dict(top_k=3),
              dict(top_k=5, temperature=0.9), dict(top_k=1), dict(confidence_threshold=0.5),
              dict(confidence_threshold=0.95, temperature=1.3), dict(remasking="low_confidence_static"),
              dict(remasking="sequential", temperature=0.8)]
LLADA2_SWEEP = [dict(threshold=0.5), dict(threshold=0.99), dict(temperature=0.7), dict(temperature=0.6, top_p=0.9),
                dict(top_k=4, temperature=1.0), dict(top_k=2), dict(top_p=0.5)]


def sweep(model, prompt, base: dict, values: list[dict]) -> tuple[list, list]:
    """(outputs of `generate` with base | each values, the compile events of all but the first call)."""
    first = dllm_jax.generate(model, prompt, seed=3, **base | values[0])
    with compile_events() as events:
        rest = [dllm_jax.generate(model, prompt, seed=3, **base | v) for v in values[1:]]
    return [first, *rest], events


@pytest.fixture(scope="module")
def sdar(tiny_model):
    return tiny_model(tiny_sdar_config(), 0)


def test_sdar_sampling_values_compile_once_and_equal_the_static_loop(sdar, rng):
    prompt = rng.integers(0, 170, (2, 9)).astype(np.int32)
    base = dict(max_new_tokens=8, denoising_steps=2)
    outputs, events = sweep(sdar, prompt, base, SDAR_SWEEP)
    assert events == [], events
    assert len({o.tobytes() for o in outputs}) > 3  # the values change the tokens: they reach the loop
    for values in (SDAR_SWEEP[1], SDAR_SWEEP[4], SDAR_SWEEP[6], SDAR_SWEEP[8], SDAR_SWEEP[9]):  # static, compiled anew
        opts = SDAROptions(**base | values)
        x, end = generate_sdar_jit(sdar.params(), prompt, None, 3, config=sdar.config, options=opts)
        rows = trim(np.asarray(x), np.asarray(end), [9, 9], set(sdar.config.stop_ids))
        expected = left_padded(rows, prompt, np.ones_like(prompt), 9 + 8, sdar.config.pad_token_id)
        np.testing.assert_array_equal(dllm_jax.generate(sdar, prompt, seed=3, **base | values), expected)


def test_a_top_k_past_the_bound_compiles_a_loop_with_a_larger_bound(sdar, rng):
    """top_k up to 64 shares the loop; a larger one selects more candidates: one more program, then none."""
    prompt = rng.integers(0, 170, (1, 6)).astype(np.int32)
    dllm_jax.generate(sdar, prompt, max_new_tokens=4, top_k=100)
    with compile_events() as events:
        dllm_jax.generate(sdar, prompt, max_new_tokens=4, top_k=90)
    assert events == [] and top_k_bound(90, 192) == top_k_bound(100, 192) == 128


def test_llada2_sampling_values_compile_once_and_equal_the_static_loop(tiny_model, rng):
    model = tiny_model(tiny_llada2_config(), 1)
    prompt = rng.integers(0, 140, (2, 5)).astype(np.int32)
    base = dict(gen_length=8, block_length=4, steps=2)
    outputs, events = sweep(model, prompt, base, LLADA2_SWEEP)
    assert events == [], events
    assert len({o.tobytes() for o in outputs}) > 2
    for values in (LLADA2_SWEEP[0], LLADA2_SWEEP[3], LLADA2_SWEEP[4]):
        opts = LLaDA2Options(**base | values)
        x, _ = generate_llada2_jit(model.params(), prompt, 3, config=model.config, options=opts)
        expected = np.full((2, 5 + 8), model.config.pad_token_id, np.int32)  # as generate returns a batch
        for row, answer in zip(expected, answers(np.asarray(x), 5, opts, model.config.eos_token_id)):
            row[:len(answer)] = answer
        np.testing.assert_array_equal(dllm_jax.generate(model, prompt, seed=3, **base | values), expected)


LLADA_SWEEP = [dict(temperature=0.0), dict(temperature=0.5), dict(temperature=0.9), dict(temperature=1.3),
               dict(temperature=0.0, remasking="random"), dict(temperature=0.2), dict(temperature=2.0),
               dict(temperature=0.6, remasking="random")]
FAST_SWEEP = {"threshold": [0.9, 0.5, 0.7, 0.95, 0.3, 0.8], "factor": [1.0, 0.5, 2.0, 3.0, 0.2, 1.5]}


def test_llada_temperatures_compile_once_and_equal_the_static_loop(tiny_model, rng):
    model = tiny_model(tiny_llada_config(), 0)
    prompt = rng.integers(0, 120, (2, 5)).astype(np.int32)
    base = dict(gen_length=8, steps=8, block_length=4)
    outputs, events = sweep(model, prompt, base, LLADA_SWEEP)
    assert events == [], events
    assert len({o.tobytes() for o in outputs}) > 3
    for values in (LLADA_SWEEP[0], LLADA_SWEEP[2], LLADA_SWEEP[4], LLADA_SWEEP[7]):
        static = generate_llada_jit(model.params(), prompt, None, 3, config=model.config,
                                    options=LLaDAOptions(**base | values))
        np.testing.assert_array_equal(dllm_jax.generate(model, prompt, seed=3, **base | values), np.asarray(static))


@pytest.mark.parametrize("rule", ["threshold", "factor"])
def test_fast_dllm_thresholds_and_factors_compile_once_per_rule(tiny_model, rng, rule):
    """Fast-dLLM's dual cache: six thresholds (or six factors), two temperatures and both remasking rules share one
    program; whether the rule is a threshold or a factor is the program's structure."""
    model = tiny_model(tiny_llada_config(), 0)
    prompt = rng.integers(0, 120, (2, 6)).astype(np.int32)
    base = dict(gen_length=8, steps=8, block_length=4, cache="dual")
    values = [{rule: v, "temperature": 0.0 if i % 3 else 0.8, "remasking": "random" if i % 2 else "low_confidence"}
              for i, v in enumerate(FAST_SWEEP[rule])]
    outputs, events = sweep(model, prompt, base, values)
    assert events == [], events
    for chosen in (values[1], values[3]):
        static, _ = generate_llada_fast_jit(model.params(), prompt, None, 3, config=model.config,
                                            options=LLaDAOptions(**base | chosen))
        np.testing.assert_array_equal(dllm_jax.generate(model, prompt, seed=3, **base | chosen), np.asarray(static))


DREAM_SWEEP = [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=0.5, top_p=0.9), dict(top_k=3),
               dict(top_k=5, temperature=1.1, top_p=0.8), dict(top_p=0.6, temperature=0.9)]


def test_dream_sampling_values_compile_once_and_equal_the_static_loop(tiny_model, rng):
    model = tiny_model(tiny_dream_config(), 0)
    prompt = rng.integers(0, 160, (2, 5)).astype(np.int32)
    base = dict(max_new_tokens=6, steps=6, alg="maskgit_plus")
    outputs, events = sweep(model, prompt, base, DREAM_SWEEP)
    assert events == [], events
    assert len({o.tobytes() for o in outputs}) > 3
    for values in (DREAM_SWEEP[2], DREAM_SWEEP[4]):
        static = generate_dream_jit(model.params(), prompt, None, 3, config=model.config,
                                    options=DreamOptions(**base | values))
        np.testing.assert_array_equal(dllm_jax.generate(model, prompt, seed=3, **base | values), np.asarray(static))


DIFFUSION_GEMMA_SWEEP = [dict(entropy_bound=0.1), dict(entropy_bound=0.5), dict(t_min=0.2, t_max=1.2),
                         dict(max_denoising_steps=3), dict(confidence_threshold=None), dict(confidence_threshold=4.5),
                         dict(entropy_bound=2.0, t_max=1.5, max_denoising_steps=2)]


def test_diffusion_gemma_sampling_values_compile_once_and_equal_the_static_loop(tiny_model, rng):
    """DiffusionGemma's entropy bound, temperature schedule, step count and confidence threshold (adaptive stopping
    on and off) share one program; max_new_tokens and stability_threshold set its shapes."""
    model = tiny_model(tiny_diffusion_gemma_config(), 0)
    prompt = rng.integers(0, 160, (2, 5)).astype(np.int32)
    base = dict(max_new_tokens=16, max_denoising_steps=4)
    outputs, events = sweep(model, prompt, base, DIFFUSION_GEMMA_SWEEP)
    assert events == [], events
    assert len({o.tobytes() for o in outputs}) > 3
    for values in (DIFFUSION_GEMMA_SWEEP[2], DIFFUSION_GEMMA_SWEEP[4], DIFFUSION_GEMMA_SWEEP[6]):
        opts = DiffusionGemmaOptions(**base | values)
        out, ran, _ = generate_canvases_jit(model.params(), prompt, np.array([5, 5], np.int32), jax.random.key(3),
                                            config=model.config, options=opts, stop_ids=model.config.stop_ids,
                                            pad_id=model.config.pad_token_id)
        new = np.asarray(out)[:, :int(ran) * model.config.canvas_length][:, :16]
        expected = np.full((2, 5 + 16), model.config.pad_token_id, np.int32)
        expected[:, :5], expected[:, 5:5 + new.shape[1]] = prompt, new
        np.testing.assert_array_equal(dllm_jax.generate(model, prompt, seed=3, **base | values), expected)
