"""The SpargeAttn policy in LLaDA's jitted loop and its per-head calibration."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax import SpargeAttn, generate, load_model
from dllm_jax.attention.policy import Mode
from dllm_jax.analysis.calibration import calibrate, calibrate_llada, layer_inputs, relative_l1, save_calibration
from dllm_jax.attention import kernels
from dllm_jax.models.llada import forward, init_policy_state
import pallas_kernels as pk
from dllm_jax.testing import tiny_llada_config, tiny_sdar_config, write_hf_checkpoint
from test_sparge import structured_qkv

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

OPTIONS = dict(gen_length=32, steps=8, block_length=16)
TILES = dict(block_q=16, block_kv=16)


@pytest.fixture(scope="module")
def model(tiny_model):
    """test_sparse_methods' model (same config and seed: one copy per session)."""
    return tiny_model(tiny_llada_config(vocab_size=48, tokenizer_vocab_size=48, mask_token_id=40, eos_token_id=41,
                                        pad_token_id=41, eot_token_id=42), seed=3)


def test_keeping_everything_equals_dense_generation(model, rng):
    prompt = rng.integers(0, 40, (2, 20))
    keep_all = SpargeAttn(simthreshd1=0.0, topk=1.0, pvthreshd=None, **TILES)
    np.testing.assert_array_equal(generate(model, prompt, method=keep_all, **OPTIONS),
                                  generate(model, prompt, **OPTIONS))


def test_calibrated_policy_runs_in_the_jitted_loop_with_the_kernel(model, rng, tmp_path):
    """Per-layer, per-head values from `calibrate_llada` (saved and loaded back) drive the loop. A
    forward through the policy gives the same logits with the Pallas kernel (interpret mode) as with
    the jnp references, and differs from dense (the filter and the map are active). Tokens are not
    compared across backends: the tiny random model's masked positions have near-equal confidences,
    so rounding-level differences reorder the commits."""
    prompt = rng.integers(0, 40, (1, 20))
    sample = np.concatenate([prompt, np.full((1, 32), 40)], axis=1)
    calibration = calibrate_llada(model, [sample], sim_steps=2, progress=False, **TILES)
    layers, heads = model.config.num_layers, model.config.num_heads
    assert calibration.simthreshd1.shape == calibration.pvthreshd.shape == (layers, heads)
    assert (calibration.sparsity > 0).any()
    path = tmp_path / "sparge.json"
    save_calibration(path, calibration)
    method = SpargeAttn.from_calibration(path)
    assert method.block_q == method.block_kv == 16
    np.testing.assert_allclose(np.asarray(method.cdfthreshd), calibration.cdfthreshd, rtol=1e-6)

    def logits(policy):
        state = init_policy_state(policy, model.config, 1, sample.shape[1])
        run = jax.jit(lambda p, x, s: forward(p, x, None, s, 0, config=model.config, policy=policy)[0])
        return np.asarray(run(model.params(), jnp.asarray(sample), state))

    reference, interpreted = logits(method), logits(dataclasses.replace(method, backend="interpret"))
    np.testing.assert_allclose(interpreted, reference, atol=1e-5)
    assert np.abs(reference - np.asarray(model(sample))).max() > 1e-4
    out = generate(model, prompt, method=dataclasses.replace(method, backend="interpret"), **OPTIONS)
    assert out.shape == (1, 52) and not (out == 40).any()
    np.testing.assert_array_equal(out[:, :20], prompt)


def test_calibration_meets_the_bound_on_its_samples(rng):
    samples = [structured_qkv(rng, 1, 256, 4, 2, 64, jnp.float32, block=32) for _ in range(2)]
    cal = calibrate(samples, l1=0.04, pv_l1=0.06, sim_steps=4, block_q=32, block_kv=32)
    assert cal.simthreshd1.shape == cal.cdfthreshd.shape == cal.pvthreshd.shape == (4,)
    print("per-head sparsity", cal.sparsity, "L1", cal.l1)
    assert (cal.l1 < 0.06).all() and (cal.sparsity > 0.1).all()
    # re-measure independently with the chosen values
    num = den = 0.0
    for q, k, v in samples:
        out = pk.sparge_attention_reference(q, k, v, simthreshd1=cal.simthreshd1, cdfthreshd=cal.cdfthreshd,
                                            pvthreshd=cal.pvthreshd, block_q=32, block_kv=32)
        ref = kernels.dense(q, k, v, "reference")
        num += np.abs(np.asarray(out) - np.asarray(ref)).sum(axis=(0, 1, 3))
        den += np.abs(np.asarray(ref)).sum(axis=(0, 1, 3))
    np.testing.assert_allclose(num / den, cal.l1, rtol=1e-4)
    np.testing.assert_allclose(relative_l1(ref, ref), 0.0)


def test_layer_inputs_are_what_attention_sees(model, rng):
    ids = rng.integers(0, 48, (1, 24))
    q, k, v = layer_inputs(model, ids)
    config = model.config
    assert q.shape == (config.num_layers, 1, 24, config.num_heads, config.head_dim)
    assert k.shape == v.shape == (config.num_layers, 1, 24, config.num_kv_heads, config.head_dim)
    assert not np.allclose(np.asarray(q[0]), np.asarray(q[1]))


def test_schedule_and_errors(tmp_path):
    method = SpargeAttn(skip=0.25).bind(total_steps=8)
    assert [int(method.mode(jnp.int32(t))) for t in range(8)] == [Mode.DENSE] * 2 + [Mode.SPARSE] * 6
    assert SpargeAttn().topk == 0.5 and SpargeAttn(cdfthreshd=0.9).topk is None
    for make, message in ((lambda: SpargeAttn(cdfthreshd=0.9, topk=0.5), "not both"),
                          (lambda: SpargeAttn(cdfthreshd=1.5), "cdfthreshd must be finite"),
                          (lambda: SpargeAttn(block_q=48), "block_q=48"),
                          (lambda: SpargeAttn(skip=1.0), "skip=1.0"),
                          (lambda: SpargeAttn(skip=0.5).mode(0), "step count"),
                          (lambda: SpargeAttn.from_calibration(tmp_path / "missing.json"), "no SpargeAttn calibration"),
                          (lambda: SpargeAttn(simthreshd1=(0.1, 0.2, 0.3)).init_state(
                              batch=1, num_heads=4, num_kv_heads=2, q_len=64, kv_len=64, head_dim=16),
                           "3 values, the model has 4 query heads")):
        with pytest.raises(ValueError, match=message):
            make()
    per_layer = SpargeAttn(simthreshd1=[[0.1] * 4] * 3)
    from dllm_jax.attention.policy import stacked_state
    with pytest.raises(ValueError, match="3 layers of values, the model has 2"):
        stacked_state(per_layer, 2, batch=1, num_heads=4, num_kv_heads=2, q_len=64, kv_len=64, head_dim=16)


def test_sdar_is_rejected_with_a_clear_error(tmp_path):
    sdar = load_model(write_hf_checkpoint(tmp_path, tiny_sdar_config()), dtype="float32", progress=False)
    with pytest.raises(ValueError, match="SpargeAttn is a method for LLaDA models"):
        generate(sdar, np.arange(8)[None], method=SpargeAttn(**TILES), max_new_tokens=4)
