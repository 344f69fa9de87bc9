"""HF safetensors -> Orbax conversion and loading: round trips and every error path."""

import json
import tracemalloc

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from dllm_jax import convert_hf_checkpoint, load_model
from dllm_jax.checkpoint import orbax as orbax_io
from dllm_jax.checkpoint.hf import read_hf_params
from dllm_jax.testing import random_hf_tensors, tiny_llada_config, write_hf_checkpoint

Q0 = "model.transformer.blocks.0.q_proj.weight"


def ids_for(config, rng):
    return rng.integers(0, config.tokenizer_vocab_size, (2, 17))


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_convert_then_load_equals_loading_hf_directly(tmp_path, config, rng, shards, dtype):
    hf = write_hf_checkpoint(tmp_path / "hf", config, shards=shards, seed=3)
    (hf / "tokenizer.json").write_text("{}")
    convert_hf_checkpoint(hf, tmp_path / "out", dtype=dtype, progress=False)
    stored = orbax_io.stored_shapes(tmp_path / "out")
    assert {d.name for _, d in stored.values()} == {dtype}
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dllm_jax"]["param_dtype"] == dtype
    ids = ids_for(config, rng)
    direct = load_model(hf, dtype=dtype)(ids)
    converted = load_model(tmp_path / "out", dtype=dtype)(ids)
    np.testing.assert_array_equal(np.asarray(converted), np.asarray(direct))


def test_bf16_source_loads_in_fp32(tmp_path, config, rng):
    hf = write_hf_checkpoint(tmp_path / "hf", config, dtype="bfloat16")
    convert_hf_checkpoint(hf, tmp_path / "out", dtype="float32", progress=False)
    ids = ids_for(config, rng)
    np.testing.assert_array_equal(np.asarray(load_model(tmp_path / "out", dtype="float32")(ids)),
                                  np.asarray(load_model(hf, dtype="float32")(ids)))


def test_converted_params_are_the_hf_tensors_in_flax_layout(tmp_path, config):
    tensors = random_hf_tensors(config, seed=5)
    write_hf_checkpoint(tmp_path / "hf", config, tensors=tensors)
    convert_hf_checkpoint(tmp_path / "hf", tmp_path / "out", dtype="float32", progress=False)
    params = load_model(tmp_path / "out", dtype="float32").params()
    h, d, i = config.num_heads, config.head_dim, config.intermediate_size
    layers = params["layers"]  # the inference layout: per layer, q/k/v and gate/up fused column-wise
    kv, g = config.num_kv_heads, config.num_heads // config.num_kv_heads
    qkv = np.asarray(layers[1]["qkv_proj"]).reshape(-1, kv, g + 2, d)  # per KV head: its query heads, key, value
    blocks = {name: tensors[f"model.transformer.blocks.1.{name}.weight"].T.reshape(-1, count, d)
              for name, count in (("q_proj", h), ("k_proj", kv), ("v_proj", kv))}
    for head in range(kv):
        np.testing.assert_array_equal(qkv[:, head, :g], blocks["q_proj"][:, head * g:(head + 1) * g])
        np.testing.assert_array_equal(qkv[:, head, g], blocks["k_proj"][:, head])
        np.testing.assert_array_equal(qkv[:, head, g + 1], blocks["v_proj"][:, head])
    np.testing.assert_array_equal(layers[0]["o_proj"], tensors["model.transformer.blocks.0.attn_out.weight"].T)
    np.testing.assert_array_equal(layers[1]["gate_up_proj"][:, 0::2], tensors["model.transformer.blocks.1.ff_proj.weight"].T)
    np.testing.assert_array_equal(layers[1]["gate_up_proj"][:, 1::2], tensors["model.transformer.blocks.1.up_proj.weight"].T)
    np.testing.assert_array_equal(layers[0]["down_proj"], tensors["model.transformer.blocks.0.ff_out.weight"].T)
    np.testing.assert_array_equal(params["lm_head"], tensors["model.transformer.ff_out.weight"].T)
    np.testing.assert_array_equal(params["embed"], tensors["model.transformer.wte.weight"])


def assert_convert_fails(tmp_path, hf, *patterns):
    out = tmp_path / "out"
    with pytest.raises(ValueError) as info:
        convert_hf_checkpoint(hf, out, progress=False)
    for pattern in patterns:
        assert pattern in str(info.value), f"{pattern!r} not in: {info.value}"
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"], "temporary files left behind"
    with pytest.raises(ValueError):
        load_model(hf)
    return str(info.value)


def test_missing_tensor(tmp_path, config):
    tensors = random_hf_tensors(config)
    del tensors[Q0], tensors["model.transformer.ln_f.weight"]
    hf = write_hf_checkpoint(tmp_path / "hf", config, tensors=tensors)
    assert_convert_fails(tmp_path, hf, f"{Q0}: missing", "model.transformer.ln_f.weight: missing", "2 problems")


def test_unexpected_tensor(tmp_path, config):
    tensors = random_hf_tensors(config) | {"model.transformer.blocks.0.q_proj.bias": np.zeros(64, np.float32)}
    hf = write_hf_checkpoint(tmp_path / "hf", config, tensors=tensors)
    assert_convert_fails(tmp_path, hf, "model.transformer.blocks.0.q_proj.bias: unexpected")


def test_wrong_shape(tmp_path, config):
    tensors = random_hf_tensors(config)
    tensors[Q0] = tensors[Q0][:, :-1].copy()
    hf = write_hf_checkpoint(tmp_path / "hf", config, tensors=tensors)
    assert_convert_fails(tmp_path, hf, f"{Q0}: shape [64, 63], config expects [64, 64]")


def test_wrong_dtype(tmp_path, config):
    tensors = random_hf_tensors(config)
    tensors[Q0] = tensors[Q0].astype(np.int32)
    hf = write_hf_checkpoint(tmp_path / "hf", config, tensors=tensors)
    assert_convert_fails(tmp_path, hf, f"{Q0}: dtype I32")


def test_truncated_file(tmp_path, config):
    hf = write_hf_checkpoint(tmp_path / "hf", config, shards=2)
    shard = hf / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    assert_convert_fails(tmp_path, hf, "model-00002-of-00002.safetensors: corrupt or truncated")


def test_config_that_does_not_match_the_weights(tmp_path, config):
    hf = write_hf_checkpoint(tmp_path / "hf", config)
    wrong = config.to_hf_config() | {"d_model": 128, "n_layers": 3}
    (hf / "config.json").write_text(json.dumps(wrong))
    message = assert_convert_fails(tmp_path, hf, "model.transformer.wte.weight: shape [160, 64], config expects [160, 128]",
                                   "model.transformer.blocks.2.q_proj.weight: missing")
    assert "problems" in message


def test_index_naming_an_absent_shard(tmp_path, config):
    hf = write_hf_checkpoint(tmp_path / "hf", config, shards=2)
    (hf / "model-00001-of-00002.safetensors").unlink()
    assert_convert_fails(tmp_path, hf, "shard files that do not exist", "model-00001-of-00002.safetensors")


def test_index_listing_a_tensor_its_shard_lacks(tmp_path, config):
    hf = write_hf_checkpoint(tmp_path / "hf", config, shards=2)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.transformer.blocks.9.q_proj.weight"] = "model-00001-of-00002.safetensors"
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_convert_fails(tmp_path, hf, "model.transformer.blocks.9.q_proj.weight: listed in the index")


def test_no_weights_or_no_config(tmp_path, config):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(config.to_hf_config()))
    assert_convert_fails(tmp_path, hf, "no *.safetensors")
    (hf / "config.json").unlink()
    save_file(random_hf_tensors(config), hf / "model.safetensors")
    assert_convert_fails(tmp_path, hf, "config.json not found")


def test_existing_output_is_kept_unless_overwrite(tmp_path, config):
    hf = write_hf_checkpoint(tmp_path / "hf", config)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="already exists"):
        convert_hf_checkpoint(hf, out, progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="refusing to overwrite .*not a committed dllm_jax conversion"):
        convert_hf_checkpoint(hf, out, overwrite=True, progress=False)  # it never deletes what it did not write
    assert (out / "keep.txt").read_text() == "mine"
    convert_hf_checkpoint(hf, tmp_path / "converted", progress=False)
    convert_hf_checkpoint(hf, tmp_path / "converted", overwrite=True, progress=False)
    assert (tmp_path / "converted" / "params").is_dir()


def test_failure_while_writing_leaves_nothing(tmp_path, config, monkeypatch):
    hf = write_hf_checkpoint(tmp_path / "hf", config)

    def broken_save(directory, params):
        (directory / "params").mkdir()
        raise OSError("disk full")

    monkeypatch.setattr(orbax_io, "save_params", broken_save)
    with pytest.raises(OSError, match="disk full"):
        convert_hf_checkpoint(hf, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_bad_dtype_argument(tmp_path, config):
    hf = write_hf_checkpoint(tmp_path / "hf", config)
    with pytest.raises(ValueError, match="dtype must be one of"):
        convert_hf_checkpoint(hf, tmp_path / "out", dtype="int8")
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(hf, dtype="float16")


def test_converted_dir_whose_config_no_longer_matches(tmp_path, config):
    hf = write_hf_checkpoint(tmp_path / "hf", config)
    convert_hf_checkpoint(hf, tmp_path / "out", progress=False)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    (tmp_path / "out" / "config.json").write_text(json.dumps(cfg | {"mlp_hidden_size": 32}))
    with pytest.raises(ValueError, match=r"layers/gate_proj: stored shape \[2, 64, 96\], config expects \[2, 64, 32\]"):
        load_model(tmp_path / "out")


def test_load_model_rejects_non_checkpoints(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nothing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        load_model(tmp_path / "file")


def test_conversion_streams_without_a_second_copy(tmp_path):
    """Peak host memory while reading is the converted model plus about one tensor, not two models."""
    config = tiny_llada_config(hidden_size=256, num_layers=8, num_heads=4, num_kv_heads=4, intermediate_size=1024,
                               vocab_size=4096, tokenizer_vocab_size=4000)
    tensors = random_hf_tensors(config)
    largest = max(t.nbytes for t in tensors.values())
    write_hf_checkpoint(tmp_path / "hf", config, tensors=tensors, shards=3)
    del tensors
    tracemalloc.start()
    try:
        params = read_hf_params(tmp_path / "hf", config, dtype="float32", progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = sum(x.nbytes for x in jax.tree.leaves(params))
    assert peak < size + 3 * largest < 1.5 * size
