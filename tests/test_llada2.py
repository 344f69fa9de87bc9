"""LLaDA2 (MoE block diffusion): the forward against a PyTorch port of the official modeling file, the
cached path against the full forward, the converter's checks, and generation against a port of the
official sampler, on tiny random models whose checkpoints the port writes with the official names."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

import torch_llada2 as ref
from dllm_jax import generate, load_model
from dllm_jax.config import LLaDA2Config, config_from_hf, shipped_config
from dllm_jax.models import llada2 as m
from dllm_jax.models.moe import routed_experts

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# 3 layers (the first dense), 8 experts in 2 groups (1 kept), top-2, a shared expert, partial rotary
TINY = ref.Cfg()
VARIANTS = {
    "mini-like": TINY,
    "biases, no qk-norm, full rotary, top-1, 2 shared": dataclasses.replace(
        TINY, use_qkv_bias=True, use_bias=True, use_qk_norm=False, partial_rotary_factor=1.0,
        num_experts_per_tok=1, num_shared_experts=2, n_group=4, topk_group=2, first_k_dense_replace=0,
        num_hidden_layers=2),
    "no shared expert, one group, top-3, 2 dense layers": dataclasses.replace(
        TINY, num_shared_experts=0, n_group=1, topk_group=1, num_experts_per_tok=3, first_k_dense_replace=2),
}
MASK, EOS = 150, 141


def write_checkpoint(path, cfg: ref.Cfg, seed: int = 0, *, drop=(), extra=None, reshape=None):
    """The port's random model as an official-format HF checkpoint (config.json + model.safetensors)."""
    model = ref.random_model(cfg, seed)
    tensors = {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if k not in drop}
    tensors |= extra or {}
    for name, shape in (reshape or {}).items():
        tensors[name] = np.zeros(shape, np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg.hf_dict(mask_token_id=MASK, eos_token_id=EOS,
                                                             pad_token_id=EOS)))
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(torch port, fp32 JAX model) of TINY, loaded through the converter."""
    path = tmp_path_factory.mktemp("llada2")
    torch_model = write_checkpoint(path, TINY)
    return torch_model, load_model(path, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(torch port, fp32 JAX model) of a 2-layer TINY (one dense, one MoE layer): generation tests compile
    the whole loop per option set, and fewer layers compile faster."""
    path = tmp_path_factory.mktemp("llada2_small")
    torch_model = write_checkpoint(path, dataclasses.replace(TINY, num_hidden_layers=2), seed=1)
    return torch_model, load_model(path, dtype="float32", progress=False)


def torch_logits(model, ids, block_length):
    ids = torch.as_tensor(np.asarray(ids), dtype=torch.long)
    with torch.no_grad():
        return model(ids, ref.block_diffusion_mask(ids.shape[1], block_length))[0].numpy()


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("name", VARIANTS)
def test_forward_matches_the_official_modeling_file(tmp_path, rng, name):
    cfg = VARIANTS[name]
    torch_model = write_checkpoint(tmp_path, cfg, seed=3)
    model = load_model(tmp_path, dtype="float32", progress=False)
    ids = rng.integers(0, 140, (2, 13))
    for block_length in (4, 32):
        got = np.asarray(model(ids, block_length=block_length))
        np.testing.assert_array_less(rel_err(got, torch_logits(torch_model, ids, block_length)), 1e-4)


def test_routing_selects_what_the_official_gate_selects(tiny, rng):
    """Group-limited top-k on the biased scores, weights from the unbiased ones (the fp32 gate)."""
    torch_model, model = tiny
    gate = torch_model.model.layers[1].mlp.gate
    x = rng.standard_normal((50, TINY.hidden_size)).astype(np.float32)
    idx_t, w_t = gate(torch.as_tensor(x))
    p = model.params()["layers"][1]
    config = model.config
    idx, w = m.route(jnp.asarray(x), p["router"], p["expert_bias"], config)
    order_t, order = np.argsort(idx_t.numpy(), -1), np.argsort(np.asarray(idx), -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), order, -1),
                                  np.take_along_axis(idx_t.numpy(), order_t, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, -1),
                               np.take_along_axis(w_t.detach().numpy(), order_t, -1), rtol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
@pytest.mark.parametrize("t", [23, 200])  # 16- and 64-row tiles
def test_routed_experts_equal_a_dense_loop_over_experts(rng, backend, t):
    """The grouped GEMMs (ragged_dot, and the Pallas kernel in interpret mode) against each token's selected
    experts applied one by one (float64 numpy)."""
    d, e, im, k = 16, 6, 8, 3
    x = rng.standard_normal((t, d)).astype(np.float32)
    gate_up = rng.standard_normal((e, d, 2 * im)).astype(np.float32) / 4
    down = rng.standard_normal((e, im, d)).astype(np.float32) / 3
    idx = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    w = rng.random((t, k)).astype(np.float32)
    got = np.asarray(routed_experts(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w), jnp.asarray(gate_up),
                                    jnp.asarray(down), backend=backend))
    want = np.zeros((t, d))
    for i in range(t):
        for j in range(k):
            h = x[i].astype(np.float64) @ gate_up[idx[i, j]]
            act = h[0::2] / (1 + np.exp(-h[0::2])) * h[1::2]
            want[i] += w[i, j] * (act @ down[idx[i, j]])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_cached_path_equals_the_full_forward(small, rng):
    """prefill + block steps (with and without commit) give the full block-causal forward's logits."""
    _, model = small
    bl = 4
    model_cfg = dataclasses.replace(model.config, block_size=bl)
    jit = lambda f, *static: jax.jit(f, static_argnames=("config", *static))  # noqa: E731
    forward, prefill, block_step, commit_and_step = (jit(m.forward), jit(m.prefill, "chunk_tokens"),
                                                     jit(m.block_step, "commit"),
                                                     jit(m.commit_and_step))
    params = model.params()
    ids = jnp.asarray(rng.integers(0, 140, (2, 16)))
    full = np.asarray(forward(params, ids, config=model_cfg)[0])
    cache = m.init_cache(model_cfg, 2, 32, jnp.float32)
    cache = prefill(params, ids[:, :8], cache, config=model_cfg)
    logits, cache, _ = block_step(params, ids[:, 8:12], cache, config=model_cfg)
    np.testing.assert_allclose(np.asarray(logits), full[:, 8:12], rtol=1e-4, atol=1e-4)
    assert np.asarray(cache.length).tolist() == [8, 8]
    _, cache, _ = block_step(params, ids[:, 8:12], cache, config=model_cfg, commit=True)
    logits, cache, _ = block_step(params, ids[:, 12:16], cache, config=model_cfg)
    np.testing.assert_allclose(np.asarray(logits), full[:, 12:16], rtol=1e-4, atol=1e-4)
    # the commit of one block fused with the next block's first step, after a prefill in one-block chunks
    cache = prefill(params, ids[:, :8], m.init_cache(model_cfg, 2, 32, jnp.float32), config=model_cfg, chunk_tokens=8)
    zeros = jnp.zeros((2,), jnp.int32)
    logits, cache, _ = commit_and_step(params, ids[:, 8:12], jnp.ones((2,), bool), ids[:, 12:16], cache,
                                         m.init_policy_state(m.Dense(), model_cfg, 2, 32), zeros, zeros,
                                         config=model_cfg)
    np.testing.assert_allclose(np.asarray(logits), full[:, 12:16], rtol=1e-4, atol=1e-4)


def test_shipped_config_is_llada2_mini():
    c = shipped_config("llada2.0-mini")
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim) == (
        2048, 20, 16, 4, 128, 64)
    assert (c.num_experts, c.num_experts_per_tok, c.n_group, c.topk_group, c.moe_intermediate_size,
            c.num_shared_experts, c.first_k_dense_replace, c.routed_scaling_factor) == (256, 8, 8, 4, 512, 1, 1, 2.5)
    assert (c.vocab_size, c.mask_token_id, c.eos_token_id, c.rope_theta, c.block_size) == (
        157184, 156895, 156892, 600000.0, 32)
    sizes = jax.tree.leaves(jax.tree.map(lambda s: int(np.prod(s)), m.param_shapes(c),
                                         is_leaf=lambda x: isinstance(x, tuple)))
    assert 16.0e9 < sum(sizes) < 16.5e9  # "16B total"


def test_config_refuses_what_it_does_not_implement():
    hf = TINY.hf_dict(mask_token_id=MASK, eos_token_id=EOS, pad_token_id=EOS)
    assert isinstance(config_from_hf(hf), LLaDA2Config)
    for bad, words in [({"score_function": "softmax"}, "score_function"), ({"rope_scaling": {"type": "yarn"}}, "yarn"),
                       ({"num_experts": 7}, "n_group"), ({"hidden_act": "gelu"}, "hidden_act")]:
        with pytest.raises(ValueError, match=words):
            config_from_hf(hf | bad)
    with pytest.raises(ValueError, match="rope_theta"):
        config_from_hf({k: v for k, v in hf.items() if k != "rope_theta"})


def test_converter_names_every_bad_tensor_in_one_error(tmp_path):
    expert = "model.layers.1.mlp.experts.3.up_proj.weight"
    write_checkpoint(tmp_path, TINY, drop=("model.layers.2.mlp.gate.expert_bias", expert),
                     extra={"model.layers.1.mlp.experts.8.up_proj.weight": np.zeros((24, 64), np.float32)},
                     reshape={"model.layers.0.attention.query_key_value.weight": (120, 64)})
    with pytest.raises(ValueError) as err:
        load_model(tmp_path, dtype="float32", progress=False)
    text = str(err.value)
    assert "4 problems" in text
    for words in ("model.layers.2.mlp.gate.expert_bias: missing", f"{expert}: missing",
                  "experts.8.up_proj.weight: unexpected", "query_key_value.weight: shape [120, 64], config expects [128, 64]"):
        assert words in text


def test_convert_then_load_gives_the_same_logits(tmp_path, rng):
    from dllm_jax import convert_hf_checkpoint
    hf = tmp_path / "hf"
    torch_model = write_checkpoint(hf, TINY)
    convert_hf_checkpoint(hf, tmp_path / "out", progress=False)
    model = load_model(tmp_path / "out", dtype="float32")
    ids = rng.integers(0, 140, (1, 9))
    np.testing.assert_array_less(rel_err(np.asarray(model(ids)), torch_logits(torch_model, ids, 32)), 1e-4)


@pytest.mark.parametrize("overrides", [{}, dict(qkv_bias=True, o_bias=True, qk_norm=False,
                                                 num_shared_experts=0, tie_word_embeddings=True)],
                         ids=["tiny", "biases, no qk-norm, no shared expert, tied head"])
def test_random_checkpoint_of_testing_loads_into_the_official_module(tmp_path, rng, overrides):
    """write_hf_checkpoint's random LLaDA2 checkpoint (notebooks/families.ipynb's,
    tests/sharded_generation.py's) has exactly the
    official module's tensor names and shapes, and loads to the port's logits."""
    from safetensors.numpy import load_file

    from dllm_jax.testing import tiny_llada2_config, write_hf_checkpoint
    hf = write_hf_checkpoint(tmp_path, tiny_llada2_config(**overrides), seed=2)
    hf_config = json.loads((hf / "config.json").read_text())
    torch_model = ref.LLaDA2MoeModelLM(ref.Cfg(**{f.name: hf_config[f.name] for f in dataclasses.fields(ref.Cfg)}))
    tensors = load_file(str(hf / "model.safetensors"))
    if hf_config["tie_word_embeddings"]:  # the port always has a head: the tied one is the embedding
        assert "lm_head.weight" not in tensors
        tensors["lm_head.weight"] = tensors["model.word_embeddings.weight"]
    torch_model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=True)
    model = load_model(hf, dtype="float32", progress=False)
    ids = rng.integers(0, 140, (2, 11))
    got = np.asarray(model(ids, block_length=4))
    np.testing.assert_array_less(rel_err(got, torch_logits(torch_model.eval(), ids, 4)), 1e-4)


def replay(seed, n):
    """The JAX loop's uniforms of a one-row generation's t-th forward (generate.llada2 module docstring)."""
    key = jax.random.key(seed)
    return lambda t: np.asarray(jax.random.uniform(jax.random.fold_in(key, t), (1, n), jnp.float32)[0])


SAMPLERS = {
    "greedy, low threshold": dict(temperature=0.0, threshold=0.02),
    "T=0.7, top-k 20, top-p 0.9": dict(temperature=0.7, top_k=20, top_p=0.9, threshold=0.05),
}


@pytest.mark.parametrize("name", SAMPLERS)
def test_generation_matches_the_official_sampler(small, rng, name):
    torch_model, model = small
    opts = dict(gen_length=21, block_length=8, steps=3) | SAMPLERS[name]
    prompt = rng.integers(0, 140, (1, 11))
    got = generate(model, prompt, seed=5, **opts)
    want = ref.generate(torch_model, prompt, eos_id=EOS, mask_id=MASK, uniforms=replay(5, 8), **opts).numpy()
    np.testing.assert_array_equal(got, want)


def test_generation_stops_after_the_block_with_the_first_eos(small, rng):
    """An eos (here a token the model does produce) ends generation after its block; the answer is cut
    after it, as the official sampler returns it. Sampled with T = 0 and a top-k filter: the official
    code then samples at T = 1 (it divides by T only when T > 0)."""
    torch_model, model = small
    opts = dict(gen_length=24, block_length=4, steps=2, temperature=0.0, top_k=5)
    prompt = rng.integers(0, 140, (1, 6))
    free = ref.generate(torch_model, prompt, eos_id=EOS, mask_id=MASK, uniforms=replay(0, 4), **opts).numpy()
    j = next(j for j in range(3, 24) if free[0, 6 + j] != MASK)
    eos = int(free[0, 6 + j])
    want = ref.generate(torch_model, prompt, eos_id=eos, mask_id=MASK, uniforms=replay(0, 4), **opts).numpy()
    assert want.shape[1] <= 6 + j + 1 and want[0, -1] == eos
    model.config = dataclasses.replace(model.config, eos_token_id=eos, pad_token_id=eos)
    try:
        got = generate(model, prompt, **opts)
        batch = generate(model, np.concatenate([prompt, rng.integers(0, 140, (1, 6))]), **opts)
    finally:
        model.config = dataclasses.replace(model.config, eos_token_id=EOS, pad_token_id=EOS)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(batch[0, :want.shape[1]], want[0])  # a row of a batch as alone
    assert (batch[0, want.shape[1]:] == eos).all() and batch.shape == (2, 6 + 24)


def test_mage_and_flashblock_run_and_keeping_every_key_is_dense(small, rng):
    from dllm_jax import FlashBlock, MAGE
    torch_model, model = small
    opts = dict(gen_length=16, block_length=4, steps=4)
    prompt = rng.integers(0, 140, (1, 9))
    dense = ref.generate(torch_model, prompt, eos_id=EOS, mask_id=MASK, **opts).numpy()  # = the dense loop (tested)
    # MAGE keeping every prefix key; FlashBlock refreshing at every step around a 3-key MAGE selection
    for method in (MAGE(k=64, exact_layers=0), FlashBlock(tau=0, inner=MAGE(k=3, exact_layers=0))):
        np.testing.assert_array_equal(generate(model, prompt, method=method, **opts), dense)
    with pytest.raises(ValueError, match=r"SparseD is a method for LLaDA models .*for LLaDA2 use one of \['mage'"):
        generate(model, prompt, method="sparsed", **opts)


def test_cli_generates_with_llada2_flags(tmp_path, capsys):
    from dllm_jax.cli import main
    from dllm_jax.testing import write_tiny_tokenizer

    cfg = dataclasses.replace(TINY, num_hidden_layers=2)
    write_checkpoint(tmp_path, cfg, seed=2)
    model = str(write_tiny_tokenizer(tmp_path, cfg.vocab_size, mask_token_id=MASK, eos_token_id=EOS))
    flags = ["--gen-length", "8", "--block-length", "4", "--steps", "4", "--threshold", "0.5", "--top-k", "1"]
    assert main(["generate", "--model", model, "--prompt", "w5 w6 w7", *flags]) == 0
    assert "[LLaDA2: " in capsys.readouterr().err
    for flags, message in ((["--cfg-scale", "1"], "--cfg-scale applies to LLaDA models; this checkpoint is LLaDA2"),
                           (["--method", "sparsed"], "SparseD is a method for LLaDA models")):
        assert main(["generate", "--model", model, "--prompt", "w5", *flags]) == 2
        assert message in capsys.readouterr().err
    assert main(["analyze", "--model", model, "--prompt", "w5", "--method", "sparsed"]) == 2
    assert "SparseD is a method for LLaDA models" in capsys.readouterr().err  # analyze: tests/test_analysis_families.py


@pytest.mark.gpu
def test_gpu_bf16_and_the_block_methods_kernels(tmp_path, rng):
    """On the GPU: the bf16 forward (cuDNN attention at head_dim 128, the grouped-matmul kernel) against the fp32
    port; in fp32, the cached generation against the port's sampler, and MAGE's / FlashBlock's Pallas
    kernels keeping every key equal dense."""
    cfg = dataclasses.replace(TINY, hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                              num_hidden_layers=2)
    torch_model = write_checkpoint(tmp_path, cfg, seed=11)
    ids = rng.integers(0, 140, (2, 96))
    model = load_model(tmp_path, dtype="bfloat16", progress=False)
    assert rel_err(np.asarray(model(ids)), torch_logits(torch_model, ids, 32)) <= 3e-2
    model = load_model(tmp_path, dtype="float32", progress=False)
    opts = dict(gen_length=64, block_length=32, steps=8)
    prompt = rng.integers(0, 140, (1, 40))
    dense = ref.generate(torch_model, prompt, eos_id=EOS, mask_id=MASK, **opts).numpy()
    np.testing.assert_array_equal(generate(model, prompt, **opts), dense)
    from dllm_jax import FlashBlock, MAGE
    for method in (MAGE(k=128, exact_layers=0), FlashBlock(tau=0, inner=MAGE(k=128, exact_layers=0))):
        np.testing.assert_array_equal(generate(model, prompt, method=method, **opts), dense)
