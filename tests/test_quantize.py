"""Weight quantization (`dllm_jax.quantize`, issue 42): the quantized values' error bounds, the GEMM against
the matmul of the dequantized weight, the fused inference layout against fusing the dequantized weights,
conversion and loading of quantized trees, and the refusals."""

import copy
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dllm_jax
from dllm_jax import load_model
from dllm_jax.checkpoint import convert_hf_checkpoint
from dllm_jax.checkpoint.api import quantize_params
from dllm_jax.checkpoint.manifest import MANIFEST
from dllm_jax.cli import main
from dllm_jax.families import family_of
from dllm_jax.quantize import (W8A8_MIN_ROWS, LIMITS, MODES, dequantize, gemm_choice, linear, quantize_weight,
                               scale_name)
from dllm_jax.sharding import DECODER_AXES, param_sharding
from dllm_jax.testing import (random_params, tiny_diffusion_gemma_config, tiny_dream_config, tiny_llada2_config,
                              tiny_sdar_config,
                              write_hf_checkpoint)


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quantized_weight_lies_within_the_storage_rounding_of_the_weight(rng, mode):
    # per-channel magnitudes over three decades, an all-zero channel, an outlier that sets its channel's scale
    w = rng.normal(size=(3, 64, 5, 8)) * 10.0 ** rng.uniform(-2, 1, size=(3, 1, 5, 8))
    w[1, :, 2, 3] = 0
    w[2, 7, 4, 1] = 50.0
    values, scale = quantize_weight(jnp.asarray(w, jnp.float32), (1,), mode)
    assert values.dtype == MODES[mode] and values.shape == w.shape
    assert scale.dtype == jnp.float32 and scale.shape == (3, 5, 8)
    back = np.asarray(dequantize(values, scale, (1,)), np.float64)
    step = np.abs(w).max(axis=1, keepdims=True) / LIMITS[mode]
    if mode == "int8":  # round to nearest of 255 levels
        bound = step / 2
    else:  # e4m3: 3 mantissa bits (half an ulp is <= 2^-4 of the value), subnormals 2^-9 apart below 2^-6
        bound = np.maximum(np.abs(w) * 2.0 ** -4, step * 2.0 ** -10)
    assert np.all(np.abs(back - w) <= bound * (1 + 1e-5) + 1e-30)
    assert np.all(back[1, :, 2, 3] == 0)
    np.testing.assert_allclose(back[2, 7, 4, 1], 50.0, rtol=1e-6)  # a channel's largest magnitude is kept


@pytest.mark.parametrize("mode, rows, gemm", [("int8", 4, "auto"), ("int8", 32, "xla"), ("int8", W8A8_MIN_ROWS, "auto"),
                                              ("fp8", 4, "auto"), ("fp8", 16, "xla"), ("fp8", W8A8_MIN_ROWS, "auto"),
                                              ("fp8", 4, "w8a8")])
def test_linear_equals_the_matmul_of_the_dequantized_weight(rng, mode, rows, gemm):
    """Every GEMM `linear` has on batch-shaped activations."""
    x = jnp.asarray(rng.normal(size=(2, rows // 2, 96)), jnp.bfloat16)
    w = rng.normal(size=(96, 48)) * rng.uniform(0.1, 2, size=(1, 48))
    values, scale = quantize_weight(jnp.asarray(w, jnp.float32), (0,), mode)
    out = linear(x, {"w": values.T, scale_name("w"): scale}, "w", gemm=gemm)  # stored [out, in]
    assert out.dtype == jnp.bfloat16 and out.shape == (2, rows // 2, 48)
    expected = np.asarray(x, np.float32) @ np.asarray(dequantize(values, scale, (0,)))
    out = np.asarray(out, np.float32)
    if gemm == "w8a8" or (gemm == "auto" and rows >= W8A8_MIN_ROWS):
        # W8A8 rounds the activations onto the storage dtype per row as well (e4m3: each within 2^-4 of its value;
        # int8: within half a step of 1/127 of the row's absmax): an error of a few percent of the output at most,
        # where a misplaced scale or transposed weight would be of the order of the output itself
        assert np.linalg.norm(out - expected) / np.linalg.norm(expected) < (0.05 if mode == "fp8" else 0.02)
    else:  # weight-only: the dequantized weight's matmul up to the bf16 rounding of the inputs and the output
        np.testing.assert_allclose(out, expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())


def test_linear_resolves_its_gemm_by_rows_and_refuses_an_unknown_one():
    x4 = jnp.zeros((4, 64), jnp.bfloat16)
    w = jnp.zeros((48, 64), jnp.int8)
    assert gemm_choice("auto", x4) == "xla"
    assert gemm_choice("auto", jnp.zeros((W8A8_MIN_ROWS - 1, 64), jnp.bfloat16)) == "xla"
    assert gemm_choice("auto", jnp.zeros((W8A8_MIN_ROWS, 64), jnp.bfloat16)) == "w8a8"
    assert gemm_choice("xla", jnp.zeros((W8A8_MIN_ROWS, 64), jnp.bfloat16)) == "xla"
    for removed in ("pallas", "interpret"):  # the Pallas kernel is a benchmark's comparison, not a product path
        with pytest.raises(ValueError, match=f"gemm='{removed}' is not one of"):
            gemm_choice(removed, x4)
    with pytest.raises(ValueError, match="gemm='fast'"):
        linear(x4, {"w": w, scale_name("w"): jnp.ones(48)}, "w", gemm="fast")


def dequantized_tree(tree: dict, table: dict) -> dict:
    """A quantized checkpoint-layout tree with each quantized tensor replaced by values * scale (float32)."""
    out = {}
    for name, value in tree.items():
        entry = table.get(name)
        if isinstance(value, dict):
            out[name] = dequantized_tree(value, entry if isinstance(entry, dict) else {})
        elif entry is not None:
            out[name] = dequantize(value, tree[scale_name(name)], entry)
        elif not name.endswith("_scale") or name.removesuffix("_scale") not in table:
            out[name] = value.astype(jnp.float32)
    return out


@pytest.mark.parametrize("make_config, execution", [(tiny_sdar_config, "unrolled"), (tiny_sdar_config, "scan"),
                                                    (tiny_dream_config, "unrolled"), (tiny_llada2_config, "unrolled"),
                                                    (tiny_diffusion_gemma_config, "unrolled")])
@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_fused_quantized_layers_are_the_fused_dequantized_weights(make_config, execution, mode):
    """Quantizing per output channel in the checkpoint layout, then fusing (q/k/v grouped per KV head, gate/up
    interleaved) and storing [out, in], gives exactly the fused weights of the dequantized checkpoint."""
    config = make_config()
    family = family_of(config)
    params, quantized_config = quantize_params(random_params(config, jax.random.key(2), jnp.float32), config, mode)
    reference = family.prepare_params(dequantized_tree(copy.copy(params), family.quantized), config,
                                      execution=execution)
    fused = family.prepare_params(params, quantized_config, execution=execution)
    layers = fused["layers"] if isinstance(fused["layers"], tuple) else (fused["layers"],)
    references = reference["layers"] if isinstance(reference["layers"], tuple) else (reference["layers"],)
    if "self_conditioning" in fused:  # DiffusionGemma's MLP of the previous step's logits
        layers, references = (*layers, fused["self_conditioning"]), (*references, reference["self_conditioning"])
    checked = 0
    for layer, ref in zip(layers, references):
        assert set(layer) == set(ref) | {name + "_scale" for name in ref if scale_name(name) in layer}
        for name, value in layer.items():
            if scale_name(name) in layer:
                assert value.dtype == MODES[mode]
                restored = jnp.swapaxes(dequantize(value, layer[scale_name(name)], (value.ndim - 1,)), -1, -2)
                np.testing.assert_array_equal(np.asarray(restored), np.asarray(ref[name]), err_msg=name)
                checked += 1
            elif not name.endswith("_scale"):
                np.testing.assert_array_equal(np.asarray(value, np.float32), np.asarray(ref[name]), err_msg=name)
    assert checked >= 2 * len(layers)  # gate_up and down at least
    if not config.tie_word_embeddings:  # the LM head, stored [vocab, hidden]
        assert fused["lm_head"].dtype == MODES[mode] and fused["lm_head"].shape == reference["lm_head"].shape[::-1]
        head = dequantize(fused["lm_head"], fused[scale_name("lm_head")], (1,)).T
        np.testing.assert_array_equal(np.asarray(head), np.asarray(reference["lm_head"]))


@pytest.fixture
def sdar_hf(tmp_path):
    return write_hf_checkpoint(tmp_path / "hf", tiny_sdar_config(), seed=4)


def test_int8_conversion_loads_as_quantizing_at_load(sdar_hf, tmp_path, rng):
    out = tmp_path / "int8"
    convert_hf_checkpoint(sdar_hf, out, quantize="int8", progress=False)
    manifest = json.loads((out / MANIFEST).read_text())
    entry = json.loads((out / "config.json").read_text())["dllm_jax"]
    assert (manifest["format_version"], manifest["quantize"], manifest["param_dtype"]) == (3, "int8", "bfloat16")
    assert (entry["format_version"], entry["quantize"]) == (3, "int8")
    assert "layers/q_proj_scale" in manifest["checksums"]
    converted, direct = load_model(out), load_model(sdar_hf, quantize="int8", progress=False)
    assert converted.config == direct.config and converted.config.quantize == "int8"
    leaves, same = jax.tree.leaves_with_path(converted.params()), jax.tree.leaves(direct.params())
    for (path, a), b in zip(leaves, same):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), path
    layer = converted.params()["layers"][0]
    assert layer["qkv_proj"].dtype == jnp.int8 and layer["qkv_proj_scale"].dtype == jnp.float32
    assert layer["attn_norm"].dtype == jnp.bfloat16 and converted.params()["embed"].dtype == jnp.bfloat16
    ids = rng.integers(3, converted.config.vocab_size, (2, 24))
    np.testing.assert_array_equal(np.asarray(converted(ids)), np.asarray(direct(ids)))
    bf16 = load_model(sdar_hf, progress=False)
    assert sum(x.nbytes for x in jax.tree.leaves(converted.params()["layers"])) < 0.6 * sum(
        x.nbytes for x in jax.tree.leaves(bf16.params()["layers"]))


def test_quantized_conversion_refusals(sdar_hf, tmp_path):
    out = tmp_path / "int8"
    assert main(["convert", str(sdar_hf), str(out), "--quantize", "int8", "--quiet"]) == 0
    with pytest.raises(ValueError, match="converted with quantize='int8'.*cannot be loaded as quantize='fp8'"):
        load_model(out, quantize="fp8")
    with pytest.raises(ValueError, match="computes in bfloat16; dtype='float32'"):
        load_model(out, dtype="float32")
    with pytest.raises(ValueError, match="would hold int8 weights"):
        load_model(sdar_hf, dtype="float32", quantize="int8")
    with pytest.raises(ValueError, match="quantize='int4' is not one of"):
        load_model(sdar_hf, quantize="int4")
    with pytest.raises(ValueError, match="dtype='float32' cannot go with it"):
        convert_hf_checkpoint(sdar_hf, tmp_path / "f32", quantize="int8", dtype="float32")
    assert not (tmp_path / "f32").exists()
    manifest = json.loads((out / MANIFEST).read_text())
    damaged = dict(manifest, checksums=dict(manifest["checksums"], **{"layers/down_proj": [0]}))
    (out / MANIFEST).write_text(json.dumps(damaged))
    with pytest.raises(ValueError, match="damaged.*layers/down_proj"):
        load_model(out)
    (out / MANIFEST).write_text(json.dumps(dict(manifest, format_version=2)))
    with pytest.raises(ValueError, match="format_version 2 with quantize 'int8'"):
        load_model(out)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="a GPU may have FP8 tensor cores")
def test_fp8_is_refused_by_name_where_there_are_no_fp8_tensor_cores(sdar_hf):
    with pytest.raises(ValueError, match="quantize='fp8' needs a GPU with FP8 tensor cores.*cpu.*quantize='int8'"):
        load_model(sdar_hf, quantize="fp8")


def test_quantized_weights_and_scales_shard_like_the_weights_they_stand_for():
    mesh = jax.make_mesh((1,), ("tp",))
    spec = lambda name, ndim, quantized=False: tuple(param_sharding(mesh, name, ndim, DECODER_AXES,  # noqa: E731
                                                                    quantized=quantized).spec)
    assert spec("qkv_proj", 2) == (None, "tp") and spec("qkv_proj", 2, True) == ("tp", None)
    assert spec("o_proj", 2) == ("tp", None) and spec("o_proj", 2, True) == (None, "tp")
    assert spec("qkv_proj_scale", 1) == ("tp",) and spec("down_proj_scale", 1) == (None,)
    assert spec("gate_up_proj_scale", 2) == (None, "tp")  # the scan layout's leading layer axis


def test_fp8_generation_compiles_with_cublas_gemms_only_where_every_gemm_is_fp8_by_fp8():
    from dllm_jax.generate.sdar import generate_sdar_cublas_jit, generate_sdar_jit, program

    config = tiny_sdar_config()
    rows = W8A8_MIN_ROWS // config.block_size  # the batch from which a denoising step's GEMMs are FP8 x FP8
    fp8, int8 = (dataclasses.replace(config, quantize=mode) for mode in ("fp8", "int8"))
    assert program(fp8, rows) is generate_sdar_cublas_jit
    assert program(fp8, 2 * rows) is generate_sdar_cublas_jit
    assert program(fp8, rows - 1) is generate_sdar_jit  # weight-only GEMMs: Triton's fused cast pays there
    assert program(int8, 4 * rows) is generate_sdar_jit and program(config, 4 * rows) is generate_sdar_jit


def test_diffusion_gemma_fp8_generation_compiles_with_cublas_gemms_where_every_pass_is_wide():
    from dllm_jax.generate.diffusion_gemma import generate_canvases_cublas_jit, generate_canvases_jit, program

    config = tiny_diffusion_gemma_config(canvas_length=W8A8_MIN_ROWS // 2)
    fp8, int8 = (dataclasses.replace(config, quantize=mode) for mode in ("fp8", "int8"))
    assert program(fp8, 2, 1000) is generate_canvases_cublas_jit  # canvases of 64 rows per prompt, 2 prompts
    assert program(fp8, 1, 1000) is generate_canvases_jit  # a canvas of 64 rows: weight-only GEMMs
    assert program(fp8, 4, 16) is generate_canvases_jit  # the prompt's pass: 64 rows
    assert program(int8, 8, 1000) is generate_canvases_jit and program(config, 8, 1000) is generate_canvases_jit


@pytest.mark.gpu
def test_wide_fp8_generation_runs_on_cublas_gemms(sdar_hf):
    """FP8 generation at a batch whose GEMMs are all FP8 x FP8 compiles with cuBLAS's GEMMs and generates: the
    prompt kept, every new position a token of the vocabulary."""
    model = load_model(sdar_hf, quantize="fp8", progress=False)
    rows = W8A8_MIN_ROWS // model.config.block_size
    ids = np.random.default_rng(0).integers(3, model.config.mask_token_id, (rows, 40))
    out = np.asarray(dllm_jax.generate(model, ids, max_new_tokens=8, seed=0))
    assert out.shape == (rows, 48) and (out[:, :40] == ids).all()
    assert ((out[:, 40:] >= 0) & (out[:, 40:] < model.config.vocab_size)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quantized_gemms_on_a_gpu_read_the_stored_weight(mode):
    """On the GPU, XLA fuses the weight's cast into the GEMM (no bf16 copy of the [out, in] weight is written),
    and from W8A8_MIN_ROWS rows the GEMM multiplies the stored weight as it is (no cast of it anywhere)."""
    n_out, n_in = 1536, 1024
    values, scale = quantize_weight(jax.random.normal(jax.random.key(0), (n_in, n_out)), (0,), mode)
    p = {"w": values.T, scale_name("w"): scale}
    for rows in (4, 32, W8A8_MIN_ROWS, 512):
        x = jax.random.normal(jax.random.key(1), (rows, n_in), jnp.bfloat16)
        text = jax.jit(lambda x, p: linear(x, p, "w")).lower(x, p).compile().as_text()
        entry = text[text.index("ENTRY"):].split("\n}\n")[0]  # the top level: what is written to memory
        assert f"bf16[{n_out},{n_in}]" not in entry and f"bf16[{n_in},{n_out}]" not in entry, (rows, entry)
        if rows >= W8A8_MIN_ROWS:
            assert f"bf16[{n_out},{n_in}]" not in text and f"f32[{n_out},{n_in}]" not in text, text
        expected = np.asarray(x, np.float32) @ np.asarray(dequantize(values, scale, (0,)))
        out = np.asarray(jax.jit(lambda x, p: linear(x, p, "w"))(x, p), np.float32)
        assert np.linalg.norm(out - expected) / np.linalg.norm(expected) < (0.05 if mode == "fp8" else 0.02)


@pytest.mark.gpu
def test_fp8_loads_on_a_gpu_with_fp8_tensor_cores(sdar_hf, rng):
    model = load_model(sdar_hf, quantize="fp8", progress=False)
    assert model.params()["layers"][0]["gate_up_proj"].dtype == jnp.float8_e4m3fn
    ids = rng.integers(3, model.config.vocab_size, (2, 80))
    reference = np.asarray(load_model(sdar_hf, dtype="float32", progress=False)(ids))
    logits = np.asarray(model(ids))
    assert np.linalg.norm(logits - reference) / np.linalg.norm(reference) < 0.1
