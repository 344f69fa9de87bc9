"""Every entry of the family registry (dllm_jax.families) end to end at tiny sizes: its HF checkpoint is
converted, loaded, generated from with dense attention and with every method that applies to it, and
generated from on the command line. The tables below hold each family's tiny test data: a family added
to the registry without them fails here, and so does one whose entry misses a part."""

import dataclasses

import numpy as np
import pytest

from dllm_jax import convert_hf_checkpoint, generate, load_model
from dllm_jax.attention.methods import BIDIRECTIONAL, BLOCK, KINDS, make_method, method_names
from dllm_jax.config import CONFIG_CLASSES, config_from_hf
from dllm_jax.families import FAMILIES, family_named, family_of, register
from dllm_jax.testing import (tiny_diffusion_gemma_config, tiny_dream_config, tiny_llada2_config, tiny_llada_config,
                              tiny_sdar_config, write_hf_checkpoint, write_tiny_tokenizer)

VOCAB, MASK, EOS = 160, 150, 141  # the tiny tokenizer's (write_tiny_tokenizer)

# one layer (compilation time grows with the unrolled layers); LLaDA2's a MoE layer (its dense layers are
# the shared MLP, tests/test_llada2.py runs both)
CONFIGS = {
    "llada": tiny_llada_config(num_layers=1, mask_token_id=MASK, eos_token_id=EOS, pad_token_id=EOS),
    "sdar": tiny_sdar_config(num_layers=1, vocab_size=VOCAB, mask_token_id=MASK, eos_token_ids=(EOS,),
                             pad_token_id=EOS),
    "dream": tiny_dream_config(num_layers=1, vocab_size=VOCAB, mask_token_id=MASK, eos_token_id=EOS,
                               pad_token_id=EOS, bos_token_id=EOS),
    "llada2": tiny_llada2_config(num_layers=1, first_k_dense_replace=0, mask_token_id=MASK, eos_token_id=EOS,
                                 pad_token_id=EOS),
    # a sliding and a global layer (their shapes differ); no mask token: it denoises canvases of random tokens
    "diffusiongemma": tiny_diffusion_gemma_config(eos_token_ids=(EOS,)),
}
# generate's options: prompt (16) + answer a multiple of the methods' 16-position blocks
OPTIONS = {"llada": dict(gen_length=16, steps=4, block_length=16), "sdar": dict(max_new_tokens=8),
           "dream": dict(max_new_tokens=16, steps=4), "llada2": dict(gen_length=8, block_length=4, steps=2),
           "diffusiongemma": dict(max_new_tokens=8, max_denoising_steps=2)}
CLI_FLAGS = {"llada": ["--steps", "2"], "sdar": ["--steps", "4"], "dream": ["--steps", "2"],
             "llada2": ["--block-length", "4", "--steps", "2"], "diffusiongemma": ["--steps", "2"]}
METHOD_PARAMS = {  # tiny-size parameters, as the methods' own tests use them
    "sparsed": dict(block_size=16), "pulsecol": dict(group_size=16, refreshes=2), "sparge": dict(block_q=16, block_kv=16),
    "mage": dict(k=16, exact_layers=1), "flashblock": {}, "flashblock+mage": dict(k=16, exact_layers=1),
}


def test_the_test_tables_cover_the_registry_and_every_config_class_has_an_entry():
    for table in (CONFIGS, OPTIONS, CLI_FLAGS):
        assert set(table) == set(FAMILIES)
    assert set(METHOD_PARAMS) == set(method_names())
    assert {f.config_class for f in FAMILIES.values()} == set(CONFIG_CLASSES)  # config_from_hf's classes
    assert {f.method_kind for f in FAMILIES.values()} == set(KINDS)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_lookups_agree(name):
    family, config = FAMILIES[name], CONFIGS[name]
    assert family.name == name == config.family
    assert family_named(name) is family_named(family.label) is family_named(family.label.upper()) is family
    assert family_of(config) is family_of(family.config_class) is family_of(family.model_class) is family
    assert isinstance(config, family.config_class)
    assert config_from_hf(config.to_hf_config()) == config  # the HF name rules find the family back
    assert family.model_types[0] in config.to_hf_config()["model_type"].lower()
    # DiffusionGemma's weights are not sharded (param_axes None: a mesh is refused, tests/test_diffusion_gemma.py)
    assert family.param_axes is None or set(family.param_axes) >= {"qkv_proj", "o_proj", "embed", "lm_head"}
    assert all(isinstance(getattr(config, size), int) for size in family.tp_split)
    assert config.stop_ids == (EOS,)
    assert family.methods == method_names(family.method_kind)
    stops = family.without_stops(config).stop_ids
    assert stops == (() if family.stops_field else (EOS,))


def test_unknown_families_are_named():
    with pytest.raises(ValueError, match=r"unknown model family 'gpt'; known: \['LLaDA', 'SDAR', 'Dream', 'LLaDA2', "
                                         r"'DiffusionGemma'\]"):
        family_named("gpt")
    with pytest.raises(ValueError, match="str is not a model or config of a known family"):
        family_of("llada")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (converted directory, float32 model), converted and loaded once per family."""
    cache = {}

    def get(name):
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            hf = write_hf_checkpoint(root / "hf", CONFIGS[name], seed=1)
            mask = next(iter(CONFIGS[name].placeholder_ids), None)  # DiffusionGemma has no mask token
            write_tiny_tokenizer(hf, VOCAB, mask_token_id=mask, eos_token_id=EOS)  # travels with the conversion
            convert_hf_checkpoint(hf, root / "out", progress=False)
            cache[name] = root / "out", load_model(root / "out", dtype="float32", progress=False)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(FAMILIES))
def test_convert_load_and_generate_with_every_method_that_applies(converted, name):
    family = FAMILIES[name]
    _, model = converted(name)
    assert type(model) is family.model_class and model.config == CONFIGS[name] and family_of(model) is family
    prompt = np.random.default_rng(0).integers(3, 100, (1, 16)).astype(np.int32)
    answer = family.options_class(**OPTIONS[name])
    length = getattr(answer, family.answer_option)
    for method in [None, *family.methods]:
        policy = None if method is None else make_method(method, **METHOD_PARAMS[method])
        out = np.asarray(generate(model, prompt, method=policy, **OPTIONS[name]))
        assert out.dtype == np.int32 and out.shape[0] == 1, method
        np.testing.assert_array_equal(out[0, :16], prompt[0])  # the prompt, then at most `length` new tokens
        assert 16 < out.shape[1] <= 16 + length, (method, out.shape)
    other = BLOCK if family.method_kind == BIDIRECTIONAL else BIDIRECTIONAL
    wrong = method_names(other)[0]
    with pytest.raises(ValueError, match=f"is a method for {other} models .*for {family.label} (use one of|no sparse)"):
        generate(model, prompt, method=make_method(wrong, **METHOD_PARAMS[wrong]), **OPTIONS[name])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_command_line_generates_from_the_converted_directory(converted, name, capsys):
    from dllm_jax.cli import main

    directory, _ = converted(name)
    label = FAMILIES[name].label
    assert main(["generate", "--model", str(directory), "--prompt", "w5 w6 w7", "--gen-length", "8",
                 "--dtype", "float32", *CLI_FLAGS[name]]) == 0
    assert f"[{label}: " in capsys.readouterr().err


def test_a_family_entry_is_checked():
    sdar = FAMILIES["sdar"]
    with pytest.raises(ValueError, match="method_kind='sdar' is not one of"):
        dataclasses.replace(sdar, method_kind="sdar")
    with pytest.raises(ValueError, match="SDARConfig.family='sdar' is not 'sdar2'"):
        dataclasses.replace(sdar, name="sdar2")
    # a registered entry may not take another's name, classes or HF model types (tests/test_fifth_family.py adds one)
    with pytest.raises(ValueError, match="'sdar': its name and config class and model class and HF model types "
                                         "already belong to SDAR"):
        register(dataclasses.replace(sdar))
    assert set(FAMILIES) == {"llada", "sdar", "dream", "llada2", "diffusiongemma"}
    assert [f.sampler for f in FAMILIES.values()] == [f.label for f in FAMILIES.values()]  # each runs its own
