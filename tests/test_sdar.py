"""SDAR port: block-causal logits vs transformers' Qwen3ForCausalLM, cached path vs full path."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax import SDAR, SDARConfig, convert_hf_checkpoint, load_model, shipped_config
from dllm_jax.attention.policy import Dense
from dllm_jax.config import config_from_hf
from dllm_jax.models import block_diffusion, sdar
from dllm_jax.models.block_diffusion import block_causal_mask
from dllm_jax.models.sdar import forward, param_shapes
from dllm_jax.testing import jaxpr_equations, random_hf_tensors, tiny_sdar_config, write_hf_checkpoint
from test_llada_numerics import BF16_BOUND, FP32_BOUND, relative_error
from torch_reference import block_causal_logits, qwen3_reference

CONFIGS = {
    "untied_gqa_block4": dict(),
    "tied_block8": dict(tie_word_embeddings=True, block_size=8),
    "mha_block2": dict(num_heads=4, num_kv_heads=4, head_dim=16, block_size=2),
    "mqa_3_layers_block16": dict(num_layers=3, num_heads=4, num_kv_heads=1, head_dim=16, block_size=16),
}


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def checkpoint(request, tiny_checkpoint):
    config = tiny_sdar_config(**CONFIGS[request.param])
    directory = tiny_checkpoint(config, seed=len(request.param))
    return config, directory, qwen3_reference(directory)


@pytest.mark.parametrize("length", [24, 23])  # 23: the last block is partial
def test_fp32_block_causal_logits_match_torch(checkpoint, rng, length):
    config, directory, reference = checkpoint
    model = load_model(directory, dtype="float32", progress=False)
    assert isinstance(model, SDAR)
    ids = rng.integers(0, config.vocab_size, (2, length))
    logits = model(ids)
    assert logits.shape == (2, length, config.vocab_size) and logits.dtype == jnp.float32
    assert relative_error(logits, block_causal_logits(reference, ids, config.block_size)) <= FP32_BOUND


@pytest.mark.parametrize("block_length", [1, 3, 32])
def test_block_length_override_matches_torch(checkpoint, rng, block_length):
    config, directory, reference = checkpoint
    ids = rng.integers(0, config.vocab_size, (1, 20))
    logits = load_model(directory, dtype="float32", progress=False)(ids, block_length=block_length)
    assert relative_error(logits, block_causal_logits(reference, ids, block_length)) <= FP32_BOUND


def test_bf16_close_to_fp32(checkpoint, rng):
    config, directory, _ = checkpoint
    ids = rng.integers(0, config.vocab_size, (2, 21))
    fp32 = load_model(directory, dtype="float32", progress=False)(ids)
    bf16 = load_model(directory, progress=False)(ids)
    assert relative_error(bf16, np.asarray(fp32, np.float64)) <= BF16_BOUND


def tiny_prefill(tiny_checkpoint, rng, *, blocks: int, capacity_blocks: int):
    """(the tiny SDAR of `tiny_sdar_config` in float32, a random prompt of `blocks` blocks over 2 rows, the jitted
    `sdar.prefill`, an empty 2-row cache of `capacity_blocks` blocks)."""
    config = tiny_sdar_config()
    model = load_model(tiny_checkpoint(config), dtype="float32", progress=False)
    bs = config.block_size
    ids = jnp.asarray(rng.integers(0, config.vocab_size, (2, blocks * bs)))
    prefill = jax.jit(sdar.prefill, static_argnames=("config", "chunk_tokens"))
    return model, ids, prefill, block_diffusion.init_cache(config, 2, capacity_blocks * bs, jnp.float32)


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])  # 2: the last chunk overlaps the one before
def test_prefill_in_chunks_writes_the_one_pass_cache(tiny_checkpoint, rng, blocks_per_chunk):
    """A prompt of 3 blocks over 2 rows prefilled in chunks of `blocks_per_chunk` blocks writes the
    K/V and lengths of one pass over the whole prompt (which the test below checks against the full
    forward)."""
    model, ids, prefill, empty = tiny_prefill(tiny_checkpoint, rng, blocks=3, capacity_blocks=5)
    config, bs = model.config, model.config.block_size
    assert block_diffusion.prefill_chunk_length(2, 3 * bs, bs) == 3 * bs
    assert block_diffusion.prefill_chunk_length(2, 3 * bs, bs, 2 * blocks_per_chunk * bs) == blocks_per_chunk * bs
    one_pass = prefill(model.params(), ids, empty, config=config)
    chunked = prefill(model.params(), ids, empty, config=config, chunk_tokens=2 * blocks_per_chunk * bs)
    np.testing.assert_array_equal(np.asarray(chunked.length), np.asarray(one_pass.length))
    for want, got in zip(one_pass.k + one_pass.v, chunked.k + chunked.v):
        assert relative_error(got[:, :3 * bs], np.asarray(want[:, :3 * bs], np.float64)) <= 1e-5


def test_prefill_runs_only_the_chunks_that_cover_the_fill_lengths(tiny_checkpoint, rng):
    """A prompt padded to 6 blocks whose rows fill 3 and 2 blocks, prefilled in chunks of 2 blocks: the filled
    positions hold the K/V of the whole prompt's prefill, and nothing past the longest fill length is written
    (the chunks past it never ran: the cache there keeps its poison, finite because masked keys are still read)."""
    model, ids, prefill, empty = tiny_prefill(tiny_checkpoint, rng, blocks=6, capacity_blocks=7)
    config, bs = model.config, model.config.block_size
    poison = 123.0
    poisoned = empty.replace(k=tuple(jnp.full_like(k, poison) for k in empty.k),
                             v=tuple(jnp.full_like(v, poison) for v in empty.v))
    lengths = jnp.asarray([3 * bs, 2 * bs], jnp.int32)
    whole = prefill(model.params(), ids, empty, config=config)
    short = prefill(model.params(), ids, poisoned, lengths, config=config, chunk_tokens=2 * 2 * bs)
    np.testing.assert_array_equal(np.asarray(short.length), np.asarray(lengths))
    for want, got in zip(whole.k + whole.v, short.k + short.v):
        assert relative_error(got[:, :3 * bs], np.asarray(want[:, :3 * bs], np.float64)) <= 1e-5
        assert (np.asarray(got[:, 3 * bs:]) == poison).all()


@pytest.mark.parametrize("dtype,bound", [("float32", 1e-5), ("bfloat16", BF16_BOUND)])
def test_cached_path_equals_full_forward_at_every_block(checkpoint, rng, dtype, bound):
    """Prefill of the complete prompt blocks, then per block: two denoising steps (no commit) and a
    commit. Each step's logits equal the full block-causal forward over everything so far."""
    config, directory, _ = checkpoint
    model = load_model(directory, dtype=dtype, progress=False)
    bs = config.block_size
    prompt = rng.integers(0, config.vocab_size, (2, 2 * bs + (bs // 2 or 1)))  # ends in a partial block
    full_prompt = (prompt.shape[1] // bs) * bs
    cache = model.prefill(prompt[:, :full_prompt], model.init_cache(2, 6 * bs))
    np.testing.assert_array_equal(np.asarray(cache.length), [full_prompt] * 2)
    tokens = prompt[:, :full_prompt]
    block = np.full((2, bs), config.mask_token_id)
    block[:, : prompt.shape[1] - full_prompt] = prompt[:, full_prompt:]
    for _ in range(3):
        for step in range(3):
            commit = step == 2
            logits, new_cache = model.block_step(block, cache, commit=commit)
            reference = model(np.concatenate([tokens, block], axis=1))[:, -bs:]
            assert relative_error(logits, np.asarray(reference, np.float64)) <= bound
            if commit:
                np.testing.assert_array_equal(np.asarray(new_cache.length), np.asarray(cache.length) + bs)
            else:  # the filled prefix and its length are untouched
                np.testing.assert_array_equal(np.asarray(new_cache.length), np.asarray(cache.length))
                n = int(cache.length[0])
                for new, old in zip(new_cache.k + new_cache.v, cache.k + cache.v):
                    np.testing.assert_array_equal(np.asarray(new[:, :n]), np.asarray(old[:, :n]))
            cache = new_cache
            if not commit:  # "denoise": unmask some positions
                block = np.where(rng.random(block.shape) < 0.5, rng.integers(0, config.vocab_size, block.shape), block)
        tokens = np.concatenate([tokens, block], axis=1)
        block = np.full((2, bs), config.mask_token_id)


def test_block_step_works_inside_jit_loops(rng):
    """The cached path is a pure function of (params, ids, cache): it scans with the cache as carry."""
    config = tiny_sdar_config()
    model = SDAR(config, dtype=jnp.float32, rngs=__import__("flax").nnx.Rngs(0))
    from dllm_jax.models.sdar import block_step

    blocks = jnp.asarray(rng.integers(0, config.vocab_size, (3, 1, config.block_size)))

    @jax.jit
    def run(params, cache):
        def body(cache, ids):
            logits, cache, _ = block_step(params, ids, cache, config=config, commit=True)
            return cache, logits
        return jax.lax.scan(body, cache, blocks)

    cache, logits = run(model.params(), model.init_cache(1, 16))
    full = model(blocks.transpose(1, 0, 2).reshape(1, -1))
    assert cache.length.tolist() == [12]
    assert relative_error(logits.transpose(1, 0, 2, 3).reshape(full.shape), np.asarray(full, np.float64)) <= 1e-5


def test_commit_and_step_reads_the_cache_once_per_layer_where_split_kv_runs(rng):
    """Dense under the split-KV kernel attends a commit and the next block's first step in one call per layer (a
    fill length per query), with the logits and cache of one call per segment: rows with and without a pending
    block, at different fill lengths; both equal the full block-causal forward."""
    config = tiny_sdar_config()
    model = SDAR(config, dtype=jnp.float32, rngs=__import__("flax").nnx.Rngs(0))
    params, n = model.params(), config.block_size
    ids = jnp.asarray(rng.integers(0, 180, (2, 5 * n)))
    cache = model.prefill(ids[:, :3 * n], model.init_cache(2, 8 * n))
    cache = cache.replace(length=jnp.asarray([3 * n, 2 * n], jnp.int32))  # row 1: one block less filled
    pending = jnp.asarray([True, False])
    finished, block = ids[:, 3 * n:4 * n], ids[:, 4 * n:]
    zeros = jnp.zeros((2,), jnp.int32)

    def step(policy):
        states = block_diffusion.init_policy_state(policy, config, 2, 8 * n)
        return sdar.commit_and_step(params, finished, pending, block, cache, states, zeros, zeros, config=config,
                                    policy=policy)

    joined, apart = Dense(backend="interpret"), Dense(backend="reference")
    q = jnp.zeros((2, 2 * n, config.num_heads, config.head_dim))
    assert joined.joins_segments(q, cache.k[0]) and not apart.joins_segments(q, cache.k[0])
    equations = list(jaxpr_equations(jax.make_jaxpr(lambda: step(joined))().jaxpr))
    passes = [e for e in equations if e.primitive.name == "pallas_call" and e.params["name"] == "split_kv_attention"]
    assert len(passes) == config.num_layers
    (got, got_cache, _), (want, want_cache, _) = step(joined), step(apart)
    assert relative_error(got, np.asarray(want, np.float64)) <= 1e-5
    np.testing.assert_array_equal(np.asarray(got_cache.length), [4 * n, 2 * n])
    for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v):
        assert relative_error(a, np.asarray(b, np.float64)) <= 1e-5
    # row 0 commits its block and steps the next; row 1 (nothing pending) steps `block` at its own fill length
    full0 = model(ids[:1])[:, 4 * n:]
    full1 = model(jnp.concatenate([ids[1:, :2 * n], block[1:]], axis=1))[:, 2 * n:]
    assert relative_error(got, np.asarray(jnp.concatenate([full0, full1]), np.float64)) <= 1e-5


def test_block_causal_mask():
    mask = np.asarray(block_causal_mask(5, 2))
    expected = np.array([[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], bool)
    np.testing.assert_array_equal(mask, expected)


def test_cache_misuse_raises_clear_errors():
    config = tiny_sdar_config()
    model = SDAR(config, dtype=jnp.float32, rngs=__import__("flax").nnx.Rngs(0))
    ids = np.ones((1, 6), np.int32)
    with pytest.raises(ValueError, match="not a multiple of block_size=4"):
        model.prefill(ids, model.init_cache(1, 16))
    cache = model.prefill(ids[:, :4], model.init_cache(1, 8))
    with pytest.raises(ValueError, match="needs an empty cache"):
        model.prefill(ids[:, :4], cache)
    _, cache = model.block_step(ids[:, :4], cache, commit=True)
    with pytest.raises(ValueError, match="cache full"):
        model.block_step(ids[:, :4], cache)
    with pytest.raises(ValueError, match="does not fit"):
        model.block_step(np.ones((2, 4), np.int32), cache)
    with pytest.raises(ValueError, match="token ids"):
        model(np.full((1, 4), config.vocab_size))
    with pytest.raises(ValueError, match="max_length"):
        model.init_cache(1, 0)


@pytest.mark.parametrize("name,dims", [
    ("sdar-4b-chat", (2560, 36, 32, 8, 128, 9728, False, 8.82)),
    ("sdar-8b-chat", (4096, 36, 32, 8, 128, 12288, False, 16.38)),
    ("trado-8b-instruct", (4096, 36, 32, 8, 128, 12288, False, 16.38)),
    ("sdar-1.7b-chat", (2048, 28, 16, 8, 128, 6144, True, 3.44)),
])
def test_shipped_sdar_configs(name, dims):
    c = shipped_config(name)
    shapes = jax.tree.leaves(param_shapes(c), is_leaf=lambda x: isinstance(x, tuple))
    gigabytes = round(sum(int(np.prod(s)) for s in shapes) * 2 / 1e9, 2)  # bf16; models.md: 8.82 / 16.38 GB
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
            c.tie_word_embeddings, gigabytes) == dims
    assert (c.vocab_size, c.block_size, c.mask_token_id, c.eos_token_ids) == (151936, 4, 151669, (151645, 151643))
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16), param_shapes(c),
                          is_leaf=lambda x: isinstance(x, tuple))
    out = jax.eval_shape(lambda p, i: forward(p, i, config=c)[0], params, jax.ShapeDtypeStruct((1, 64), jnp.int32))
    assert out.shape == (1, 64, 151936)


def test_sdar_config_parsing():
    c = tiny_sdar_config(tie_word_embeddings=True)
    assert SDARConfig.from_hf_config(c.to_hf_config()) == c
    hf = c.to_hf_config()
    assert isinstance(config_from_hf(hf | {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}), SDARConfig)
    transformers5 = {k: v for k, v in hf.items() if k != "rope_theta"} | {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert SDARConfig.from_hf_config(transformers5).rope_theta == 5e5
    for change, message in [({"num_experts": 128}, "mixture-of-experts"), ({"attention_bias": True}, "attention_bias"),
                            ({"rope_scaling": {"rope_type": "yarn", "factor": 4}}, "yarn"),
                            ({"num_key_value_heads": 3}, "multiple of"), ({"hidden_act": "gelu"}, "gelu")]:
        with pytest.raises(ValueError, match=message):
            SDARConfig.from_hf_config(hf | change)


def test_sdar_round_trip_through_orbax(tmp_path, rng):
    config = tiny_sdar_config()
    hf = write_hf_checkpoint(tmp_path / "hf", config, shards=2, dtype="bfloat16")
    convert_hf_checkpoint(hf, tmp_path / "out", dtype="float32", progress=False)
    ids = rng.integers(0, config.vocab_size, (1, 12))
    np.testing.assert_array_equal(np.asarray(load_model(tmp_path / "out", dtype="float32")(ids)),
                                  np.asarray(load_model(hf, dtype="float32", progress=False)(ids)))


def sdar_convert_error(tmp_path, tensors, config=None, hf_config=None):
    config = config or tiny_sdar_config()
    hf = write_hf_checkpoint(tmp_path / "hf", config, tensors=tensors)
    if hf_config is not None:
        (hf / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(ValueError) as info:
        convert_hf_checkpoint(hf, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    return str(info.value)


def test_sdar_converter_errors(tmp_path):
    config = tiny_sdar_config()
    tensors = random_hf_tensors(config)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"]
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(128, np.float32)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int64)
    message = sdar_convert_error(tmp_path, tensors)
    for expected in ["model.layers.1.self_attn.k_norm.weight: missing",
                     "model.layers.0.self_attn.k_proj.weight: shape [128, 64], config expects [64, 64]",
                     "model.layers.0.self_attn.q_proj.bias: unexpected", "model.norm.weight: dtype I64",
                     "4 problems"]:
        assert expected in message


def test_sdar_tied_config_with_untied_weights_is_reported(tmp_path):
    config = tiny_sdar_config()
    message = sdar_convert_error(tmp_path, random_hf_tensors(config), hf_config=config.to_hf_config() | {"tie_word_embeddings": True})
    assert "lm_head.weight: unexpected" in message
