"""Bad generate arguments and bad configs are refused on the host, naming the argument and the value.

Every refused input is checked to raise before anything is traced or compiled (a JAX compilation
event listener counts them); valid boundary values still run.
"""

import json
import math
import re

import jax
import jax.monitoring
import numpy as np
import pytest

from dllm_jax import generate
from dllm_jax.config import LLaDAConfig, SDARConfig, config_from_hf, read_hf_config, shipped_config
from dllm_jax.generate import LLaDAOptions, SDAROptions
from dllm_jax.testing import no_compilation, tiny_llada_config, tiny_sdar_config

NAN, INF = float("nan"), float("inf")
LLADA = dict(gen_length=8, steps=8, block_length=8)  # small valid options the bad one is merged into


@pytest.fixture(scope="module")
def models(tiny_model):
    return tiny_model(tiny_llada_config()), tiny_model(tiny_sdar_config())




def test_the_compilation_check_sees_a_compilation():
    with pytest.raises(AssertionError, match="refused input still compiled"):
        with no_compilation():
            jax.jit(lambda x: x * 3 + 1)(np.float32(2.0))


def refused(match: str):
    """pytest.raises(ValueError) whose message must contain `match` literally."""
    return pytest.raises(ValueError, match=re.escape(match))


# (options, text the message must contain): the argument's name and its bad value
LLADA_BAD_OPTIONS = {
    "temperature_nan": (dict(temperature=NAN), "temperature must be a finite number in [0, inf), got nan"),
    "temperature_inf": (dict(temperature=INF), "temperature must be a finite number in [0, inf), got inf"),
    "temperature_negative": (dict(temperature=-0.5), "temperature must lie in [0, inf), got -0.5"),
    "temperature_string": (dict(temperature="1"), "temperature must be a real number, got '1'"),
    "cfg_scale_nan": (dict(cfg_scale=NAN), "cfg_scale must be a finite number in [0, inf), got nan"),
    "cfg_scale_inf": (dict(cfg_scale=INF), "cfg_scale must be a finite number in [0, inf), got inf"),
    "cfg_scale_negative": (dict(cfg_scale=-1.0), "cfg_scale must lie in [0, inf), got -1"),
    "gen_length_fraction": (dict(gen_length=2.5), "gen_length must be an integer, got 2.5"),
    "gen_length_bool": (dict(gen_length=True), "gen_length must be an integer, got True (bool)"),
    "gen_length_zero": (dict(gen_length=0), "gen_length must be a positive integer, got 0"),
    "gen_length_string": (dict(gen_length="8"), "gen_length must be an integer, got '8' (str)"),
    "steps_negative": (dict(steps=-8), "steps must be a positive integer, got -8"),
    "steps_float": (dict(steps=8.0), "steps must be an integer, got 8.0 (float)"),
    "block_length_none": (dict(block_length=None), "block_length must be an integer, got None"),
    "remasking_unknown": (dict(remasking="entropy"), "remasking must be one of ('low_confidence', 'random'), "
                                                     "got 'entropy'"),
    "padding_unknown": (dict(padding="left"), "padding must be one of"),
    "logits_eos_inf_int": (dict(logits_eos_inf=1), "logits_eos_inf must be True or False, got 1 (int)"),
    "seed_beyond_int32": (dict(seed=2**40), f"seed must be an integer in [{-2**31}, {2**31 - 1}], got {2**40}"),
    "seed_below_int32": (dict(seed=-2**31 - 1), f"got {-2**31 - 1}"),
    "seed_fraction": (dict(seed=1.5), "seed must be an integer, got 1.5 (float)"),
    "seed_bool": (dict(seed=True), "seed must be an integer, got True (bool)"),
    "unknown_option": (dict(top_k=3), "unknown LLaDA generate options ['top_k']"),
}


@pytest.mark.parametrize("case", list(LLADA_BAD_OPTIONS))
def test_llada_bad_options_are_refused_before_compiling(models, case):
    llada, _ = models
    options, message = LLADA_BAD_OPTIONS[case]
    with no_compilation(), refused(message):
        generate(llada, np.arange(1, 9)[None], **(LLADA | options))


SDAR_BAD_OPTIONS = {
    "temperature_zero": (dict(temperature=0.0), "temperature must lie in (0, inf), got 0"),
    "temperature_negative": (dict(temperature=-1.0), "temperature must lie in (0, inf), got -1"),
    "temperature_nan": (dict(temperature=NAN), "temperature must be a finite number in (0, inf), got nan"),
    "temperature_inf": (dict(temperature=INF), "temperature must be a finite number in (0, inf), got inf"),
    "top_p_zero": (dict(top_p=0.0), "top_p must lie in (0, 1], got 0"),
    "top_p_above_one": (dict(top_p=1.5), "top_p must lie in (0, 1], got 1.5"),
    "top_p_nan": (dict(top_p=NAN), "top_p must be a finite number in (0, 1], got nan"),
    "top_k_negative": (dict(top_k=-1), "top_k must be an integer >= 0, got -1"),
    "top_k_fraction": (dict(top_k=2.5), "top_k must be an integer, got 2.5"),
    "top_k_beyond_vocabulary": (dict(top_k=193), "top_k=193 exceeds the vocabulary (vocab_size=192)"),
    "threshold_negative": (dict(confidence_threshold=-0.1), "confidence_threshold must lie in [0, 1], got -0.1"),
    "threshold_above_one": (dict(confidence_threshold=1.1), "confidence_threshold must lie in [0, 1], got 1.1"),
    "threshold_nan": (dict(confidence_threshold=NAN), "confidence_threshold must be a finite number in [0, 1], "
                                                      "got nan"),
    "max_new_tokens_fraction": (dict(max_new_tokens=2.5), "max_new_tokens must be an integer, got 2.5"),
    "max_new_tokens_bool": (dict(max_new_tokens=True), "max_new_tokens must be an integer, got True (bool)"),
    "denoising_steps_zero": (dict(denoising_steps=0), "denoising_steps must be a positive integer, got 0"),
    "denoising_steps_beyond_block": (dict(denoising_steps=5), "denoising_steps=5 exceeds the model's block_size=4"),
    "remasking_unknown": (dict(remasking="entropy_bounded"), "remasking must be one of"),
    "seed_beyond_int32": (dict(seed=2**40), "seed must be an integer in"),
}


@pytest.mark.parametrize("case", list(SDAR_BAD_OPTIONS))
def test_sdar_bad_options_are_refused_before_compiling(models, case):
    _, sdar = models
    options, message = SDAR_BAD_OPTIONS[case]
    with no_compilation(), refused(message):
        generate(sdar, np.arange(1, 9)[None], **(dict(max_new_tokens=8) | options))


BAD_PROMPTS = {
    "id_at_vocabulary": (np.array([[1, 2, 160]]), "token ids must lie in [0, 160) (vocab_size), got [160] at "
                                                  "[batch, position] [(0, 2)]"),
    "negative_id": (np.array([[-1, 2, 3]]), "got [-1] at [batch, position] [(0, 0)]"),
    "float_ids": (np.array([[1.0, 2.0]]), "prompt_ids must be integer token ids, got dtype float64"),
    "bool_ids": (np.array([[True, False]]), "prompt_ids must be integer token ids, got dtype bool"),
    "empty_prompt": (np.zeros((1, 0), np.int32), "prompt_ids must be [batch>0, length>0], got shape (1, 0)"),
    "empty_batch": (np.zeros((0, 4), np.int32), "got shape (0, 4)"),
    "one_dimensional": (np.arange(1, 5), "got shape (4,)"),
    "ragged": ([[1, 2, 3], [4]], "prompt_ids must be a rectangular [batch, length] array"),
}


@pytest.mark.parametrize("family", ["llada", "sdar"])
@pytest.mark.parametrize("case", list(BAD_PROMPTS))
def test_bad_prompts_are_refused_before_compiling(models, case, family):
    llada, sdar = models
    prompt, message = BAD_PROMPTS[case]
    if family == "sdar" and case == "id_at_vocabulary":
        prompt, message = np.array([[1, 2, 192]]), "token ids must lie in [0, 192) (vocab_size), got [192]"
    options = LLADA if family == "llada" else dict(max_new_tokens=8)
    with no_compilation(), refused(message):
        generate(llada if family == "llada" else sdar, prompt, **options)


BAD_MASKS = {
    "value_two": (np.array([[2, 1, 1, 1]]), "attention_mask must hold only 0 (padding) and 1 (token), got values [2]"),
    "value_minus_one": (np.array([[-1, 1, 1, 1]]), "got values [-1]"),
    "float_dtype": (np.array([[0.0, 1.0, 1.0, 1.0]]), "attention_mask must hold integers or booleans (1 = token, "
                                                      "0 = padding), got dtype float64"),
    "wrong_shape": (np.ones((1, 5), np.int32), "attention_mask shape (1, 5) != prompt_ids shape (1, 4)"),
}


@pytest.mark.parametrize("padding", ["ignore", "mask"])
@pytest.mark.parametrize("case", list(BAD_MASKS))
def test_bad_attention_masks_are_refused_before_compiling(models, case, padding):
    llada, _ = models
    mask, message = BAD_MASKS[case]
    with no_compilation(), refused(message):
        generate(llada, np.arange(1, 5)[None], attention_mask=mask, padding=padding, **LLADA)


@pytest.mark.parametrize("prompt_length,positions", [(8, [1, 6]), (9, [3])])
def test_sdar_refuses_mask_ids_in_the_prefilled_blocks(models, prompt_length, positions):
    _, sdar = models
    prompt = np.arange(1, prompt_length + 1)[None]
    prompt[0, positions] = sdar.config.mask_token_id
    with no_compilation(), refused(f"prompt_ids hold the mask token id 180 at positions {positions}, inside the "
                                   f"complete prompt blocks"):
        generate(sdar, prompt, max_new_tokens=8)


def test_valid_boundaries_still_generate(models):
    """temperature 0, bool masks and the int32 seed limits for LLaDA; top_p 1, thresholds 0 and 1,
    top_k = vocab_size, denoising_steps = block_size and an infilled trailing block for SDAR."""
    llada, sdar = models
    prompt = np.arange(1, 9)[None]
    mask = np.ones((1, 8), bool)
    mask[0, :2] = False
    low = generate(llada, prompt, attention_mask=mask, padding="mask", temperature=0.0, seed=-2**31, **LLADA)
    high = generate(llada, prompt, attention_mask=mask, padding="mask", temperature=0.0, seed=2**31 - 1, **LLADA)
    np.testing.assert_array_equal(low, high)  # greedy: the seed draws nothing
    assert low.shape == (1, 16) and not (low == llada.config.mask_token_id).any()

    infill = np.arange(1, 7)[None]  # blocks of 4: positions 4, 5 form the trailing partial block
    infill[0, 5] = sdar.config.mask_token_id
    for threshold in (0.0, 1.0):
        out = generate(sdar, infill, max_new_tokens=6, top_p=1.0, top_k=sdar.config.vocab_size,
                       confidence_threshold=threshold, denoising_steps=sdar.config.block_size, seed=2**31 - 1)
        np.testing.assert_array_equal(out[0, :5], infill[0, :5])
        assert out[0, 5] != sdar.config.mask_token_id  # the infilled position was decoded


def test_options_store_canonical_python_numbers():
    """numpy scalars give options equal (and hashing equal) to Python numbers: one compiled loop."""
    a = LLaDAOptions(gen_length=np.int64(8), steps=np.int32(8), block_length=8, temperature=np.float32(0.5))
    b = LLaDAOptions(gen_length=8, steps=8, block_length=8, temperature=0.5)
    assert a == b and hash(a) == hash(b) and type(a.gen_length) is int and type(a.temperature) is float
    s = SDAROptions(top_k=np.int64(3), top_p=np.float64(0.5))
    assert s == SDAROptions(top_k=3, top_p=0.5) and type(s.top_k) is int


# ---- configs ----------------------------------------------------------------------------------

LLADA_BAD_FIELDS = {
    "mask_beyond_vocabulary": (dict(mask_token_id=160), "LLaDAConfig.mask_token_id=160 lies beyond the vocabulary "
                                                        "(vocab_size=160"),
    "eos_beyond_vocabulary": (dict(eos_token_id=1000), "LLaDAConfig.eos_token_id=1000 lies beyond the vocabulary"),
    "pad_negative": (dict(pad_token_id=-1), "LLaDAConfig.pad_token_id must be an integer >= 0, got -1"),
    "eot_beyond_vocabulary": (dict(eot_token_id=126348), "LLaDAConfig.eot_token_id=126348 lies beyond"),
    "mask_is_eos": (dict(mask_token_id=141), "mask_token_id=141 is also a stop or padding token id"),
    "rope_theta_zero": (dict(rope_theta=0.0), "LLaDAConfig.rope_theta must lie in (0, inf), got 0"),
    "rope_theta_negative": (dict(rope_theta=-1e4), "LLaDAConfig.rope_theta must lie in (0, inf), got -10000"),
    "rope_theta_nan": (dict(rope_theta=NAN), "LLaDAConfig.rope_theta must be a finite number in (0, inf), got nan"),
    "rope_theta_inf": (dict(rope_theta=INF), "got inf"),
    "rms_norm_eps_zero": (dict(rms_norm_eps=0.0), "LLaDAConfig.rms_norm_eps must lie in (0, inf), got 0"),
    "max_positions_zero": (dict(max_position_embeddings=0), "LLaDAConfig.max_position_embeddings (config.json key "
                                                            "'max_sequence_length') must be a positive integer, got 0"),
    "hidden_size_string": (dict(hidden_size="64"), "LLaDAConfig.hidden_size (config.json key 'd_model') must be an "
                                                   "integer, got '64' (str)"),
    "tie_word_embeddings_string": (dict(tie_word_embeddings="false"), "must be True or False, got 'false'"),
}


@pytest.mark.parametrize("case", list(LLADA_BAD_FIELDS))
def test_llada_config_fields_are_checked(case):
    change, message = LLADA_BAD_FIELDS[case]
    with refused(message):
        tiny_llada_config(**change)


SDAR_BAD_FIELDS = {
    "mask_beyond_vocabulary": (dict(mask_token_id=192), "SDARConfig.mask_token_id=192 lies beyond the vocabulary"),
    "eos_beyond_vocabulary": (dict(eos_token_ids=(181, 151645)), "SDARConfig.eos_token_ids[1] (config.json key "
                                                                 "'eos_token_id')=151645 lies beyond"),
    "mask_is_pad": (dict(mask_token_id=182), "mask_token_id=182 is also a stop or padding token id"),
    "rope_theta_negative": (dict(rope_theta=-1.0), "SDARConfig.rope_theta must lie in (0, inf), got -1"),
    "rms_norm_eps_negative": (dict(rms_norm_eps=-1e-6), "SDARConfig.rms_norm_eps must lie in (0, inf)"),
    "max_positions_negative": (dict(max_position_embeddings=-1), "SDARConfig.max_position_embeddings must be a "
                                                                 "positive integer, got -1"),
    "block_size_fraction": (dict(block_size=2.5), "SDARConfig.block_size must be an integer, got 2.5"),
    "eos_not_a_sequence": (dict(eos_token_ids=181), "SDARConfig.eos_token_ids must be a tuple of token ids"),
    "eos_negative_sentinel": (dict(eos_token_ids=(-1,)), "must be an integer >= 0, got -1; eos_token_ids=() never "
                                                         "stops early"),
}


@pytest.mark.parametrize("case", list(SDAR_BAD_FIELDS))
def test_sdar_config_fields_are_checked(case):
    change, message = SDAR_BAD_FIELDS[case]
    with refused(message):
        tiny_sdar_config(**change)


DELETE = object()  # llada_hf / sdar_hf: drop the key


def llada_hf(**change):
    hf = tiny_llada_config().to_hf_config() | change
    return {k: v for k, v in hf.items() if v is not DELETE}


def sdar_hf(**change):
    hf = tiny_sdar_config().to_hf_config() | change
    return {k: v for k, v in hf.items() if v is not DELETE}


BAD_HF = {
    "llada_d_model_string": (llada_hf(d_model="64"), "config.json key 'd_model' must be an integer, got '64' (str)"),
    "llada_n_layers_fraction": (llada_hf(n_layers=2.5), "config.json key 'n_layers' must be an integer, got 2.5"),
    "llada_n_heads_bool": (llada_hf(n_heads=True), "config.json key 'n_heads' must be an integer, got True (bool)"),
    "llada_rope_theta_string": (llada_hf(rope_theta="500000"), "config.json key 'rope_theta' must be a real number, "
                                                               "got '500000'"),
    "llada_weight_tying_string": (llada_hf(weight_tying="false"), "config.json key 'weight_tying' must be True or "
                                                                  "False, got 'false'"),
    "llada_missing_rope_theta": (llada_hf(rope_theta=DELETE), "LLaDA config.json lacks required keys ['rope_theta']"),
    "llada_null_rope_theta": (llada_hf(rope_theta=None), "lacks required keys ['rope_theta']"),
    "llada_rope_theta_nan": (llada_hf(rope_theta=NAN), "key 'rope_theta' must be a finite number, got nan"),
    "llada_rope_theta_zero": (llada_hf(rope_theta=0), "rope_theta must lie in (0, inf), got 0"),
    "llada_mask_beyond_vocabulary": (llada_hf(mask_token_id=5000), "mask_token_id=5000 lies beyond the vocabulary"),
    "llada_default_mask_beyond_vocabulary": (llada_hf(mask_token_id=DELETE), "mask_token_id=126336 lies beyond"),
    "llada_eps_zero": (llada_hf(rms_norm_eps=0), "rms_norm_eps must lie in (0, inf), got 0"),
    "llada_positions_zero": (llada_hf(max_sequence_length=0), "'max_sequence_length') must be a positive integer"),
    "llada_gpt2_architecture": (llada_hf(architectures=["GPT2LMHeadModel"]),
                                "config.json architectures=['GPT2LMHeadModel']: ['GPT2LMHeadModel'] is not a LLaDA "
                                "architecture (accepted: ['LLaDAModelLM'])"),
    "llada_moe_architecture": (llada_hf(architectures=["LLaDA2MoeModelLM"]), "is not a LLaDA architecture"),
    "llada_architectures_string": (llada_hf(architectures="LLaDAModelLM"), "'architectures' must be a list"),
    "llada_architecture_other_model_type": (llada_hf(model_type="gpt2"), "unsupported model: model_type='gpt2'"),
    "sdar_hidden_size_string": (sdar_hf(hidden_size="64"), "key 'hidden_size' must be an integer, got '64'"),
    "sdar_block_size_fraction": (sdar_hf(block_size=3.5), "config.json key 'block_size' must be an integer, got 3.5"),
    "sdar_eos_string": (sdar_hf(eos_token_id=["181"]), "config.json key 'eos_token_id' must be an integer, got '181'"),
    "sdar_missing_rope_theta": (sdar_hf(rope_theta=DELETE), "SDAR config.json lacks required keys ['rope_theta']"),
    "sdar_rope_theta_inf": (sdar_hf(rope_theta=INF), "key 'rope_theta' must be a finite number, got inf"),
    "sdar_mask_beyond_vocabulary": (sdar_hf(mask_token_id=151669), "mask_token_id=151669 lies beyond the vocabulary"),
    "sdar_eps_negative": (sdar_hf(rms_norm_eps=-1e-6), "rms_norm_eps must lie in (0, inf)"),
    "sdar_positions_zero": (sdar_hf(max_position_embeddings=0), "max_position_embeddings must be a positive integer"),
    "sdar_gpt2_architecture": (sdar_hf(architectures=["GPT2LMHeadModel"]), "is not a SDAR architecture"),
    "sdar_model_type_llada": (sdar_hf(model_type="llada"), "is not a LLaDA architecture"),
    "sdar_rope_scaling_list": (sdar_hf(rope_scaling=[]), "config.json key 'rope_scaling' must be an object or null"),
    "json_list": ([tiny_llada_config().to_hf_config()], "a config.json must hold a JSON object of keys, got an array"),
    "json_number": (3, "a config.json must hold a JSON object of keys, got a number: 3"),
}


@pytest.mark.parametrize("case", list(BAD_HF))
def test_bad_hf_configs_are_refused_naming_the_key(case):
    hf, message = BAD_HF[case]
    with refused(message):
        config_from_hf(hf)


def test_each_family_refuses_the_other_families_config():
    with refused("is not a LLaDA architecture"):
        LLaDAConfig.from_hf_config(llada_hf(architectures=["SDARForCausalLM"]))
    with refused("config.json model_type='llada' is not a SDAR model"):
        SDARConfig.from_hf_config(llada_hf())
    with refused("got an array"):
        LLaDAConfig.from_hf_config([])


def test_integral_floats_transformers5_rope_and_no_stop_ids_are_accepted():
    assert tiny_sdar_config(eos_token_ids=[181]).eos_token_ids == (181,)  # a tuple: the config stays hashable
    assert tiny_sdar_config(eos_token_ids=()).eos_token_ids == ()
    assert config_from_hf(llada_hf(d_model=64.0, n_layers=2.0)) == tiny_llada_config()
    assert config_from_hf(sdar_hf(rope_theta=DELETE, rope_parameters={"rope_theta": 1e6})) == tiny_sdar_config()
    assert config_from_hf(llada_hf(architectures=DELETE)) == tiny_llada_config()  # model_type alone decides


def test_read_hf_config_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with refused(f"{tmp_path / 'config.json'}: a config.json must hold a JSON object of keys, got an array: [1, 2]"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00")
    with refused("is not valid JSON"):
        read_hf_config(tmp_path)


@pytest.mark.parametrize("name", ["llada-8b-instruct", "llada-1.5", "sdar-1.7b-chat", "sdar-4b-chat", "sdar-8b-chat",
                                  "trado-4b-instruct", "trado-8b-instruct"])
def test_every_shipped_config_passes_the_checks(name):
    config = shipped_config(name)
    assert math.isfinite(config.rope_theta) and config.rope_theta >= 5e5
    assert 0 <= config.mask_token_id < config.vocab_size


def test_sdar_block_size_three_is_a_valid_config_but_needs_steps_within_the_block(tiny_model):
    sdar = tiny_model(tiny_sdar_config(block_size=3))  # no divisibility rule: the schedule spreads the remainder
    with no_compilation(), refused("denoising_steps=4 exceeds the model's block_size=3"):
        generate(sdar, np.arange(1, 8)[None], max_new_tokens=6)  # the default denoising_steps=4


def test_until_stop_keeps_the_first_stop_and_nothing_after():
    from dllm_jax.generate.requests import until_stop

    assert until_stop([5, 7, 2, 9, 2], (2, 3)).tolist() == [5, 7, 2]
    assert until_stop([5, 3, 2], {2, 3}).tolist() == [5, 3]
    assert until_stop([5, 7], (2,)).tolist() == [5, 7]
    assert until_stop([], (2,)).tolist() == []
