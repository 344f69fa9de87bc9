import json
import math

import pytest

from dllm_jax.config import LLaDAConfig, SHIPPED_CONFIG_DIR, config_from_hf, shipped_config
from dllm_jax.models.llada import param_shapes
from dllm_jax.testing import tiny_llada_config


@pytest.mark.parametrize("name", ["llada-8b-instruct", "llada-1.5"])
def test_shipped_llada_configs_have_the_published_values(name):
    c = shipped_config(name)
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (4096, 32, 32, 32, 128)
    assert (c.intermediate_size, c.vocab_size, c.tokenizer_vocab_size) == (12288, 126464, 126464)
    assert (c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings) == (500000.0, 1e-5, False)
    assert (c.mask_token_id, c.eos_token_id, c.pad_token_id) == (126336, 126081, 126081)
    sizes = [math.prod(s) for s in _leaves(param_shapes(c))]
    embedding = 2 * 126464 * 4096  # wte + untied head
    assert round(sum(sizes) / 1e9, 2) == 8.02  # "8.02B params, 6.98B non-embedding"
    assert round((sum(sizes) - embedding) / 1e9, 2) == 6.98


def _leaves(tree):
    for v in tree.values():
        yield from (_leaves(v) if isinstance(v, dict) else [v])


def test_hf_round_trip():
    c = tiny_llada_config(tie_word_embeddings=True)
    assert LLaDAConfig.from_hf_config(c.to_hf_config()) == c
    assert config_from_hf(c.to_hf_config()) == c


def test_optional_keys_take_llada_defaults():
    # rope_theta is required, and LLaDA's default token ids (126336, ...) lie beyond a 100-token vocabulary
    hf = {"model_type": "llada", "d_model": 64, "n_heads": 4, "n_layers": 2, "vocab_size": 100, "rope_theta": 5e5,
          "mask_token_id": 90, "eos_token_id": 91, "pad_token_id": 91, "eot_token_id": 92,
          "n_kv_heads": None, "mlp_ratio": 3}
    c = LLaDAConfig.from_hf_config(hf)
    assert (c.num_kv_heads, c.intermediate_size, c.vocab_size) == (4, 192, 100)
    mqa = LLaDAConfig.from_hf_config(hf | {"multi_query_attention": True})
    assert mqa.num_kv_heads == 1


@pytest.mark.parametrize("key,value", [("alibi", True), ("include_bias", True), ("block_type", "sequential"),
                                       ("layer_norm_type", "default"), ("activation_type", "gelu"),
                                       ("attention_layer_norm", True), ("clip_qkv", 8.0), ("rope", False)])
def test_unsupported_features_are_rejected(key, value):
    hf = tiny_llada_config().to_hf_config() | {key: value}
    with pytest.raises(ValueError, match=key):
        LLaDAConfig.from_hf_config(hf)


@pytest.mark.parametrize("change,message", [
    (dict(n_kv_heads=3), "multiple of"), (dict(d_model=66), "multiple of"), (dict(n_layers=0), "positive"),
    (dict(embedding_size=100), "exceeds"),
])
def test_inconsistent_configs_are_rejected(change, message):
    with pytest.raises(ValueError, match=message):
        LLaDAConfig.from_hf_config(tiny_llada_config().to_hf_config() | change)


def test_missing_required_keys_and_unknown_models():
    hf = tiny_llada_config().to_hf_config()
    del hf["d_model"]
    with pytest.raises(ValueError, match="d_model"):
        LLaDAConfig.from_hf_config(hf)
    with pytest.raises(ValueError, match="unsupported model"):
        config_from_hf({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="available"):
        shipped_config("llada-70b")


def test_config_is_frozen_and_hashable():
    c = tiny_llada_config()
    with pytest.raises(Exception):
        c.hidden_size = 8
    assert hash(c) == hash(tiny_llada_config())
    assert json.loads((SHIPPED_CONFIG_DIR / "llada-1.5" / "config.json").read_text())["model_type"] == "llada"


def test_absent_optional_ids_derive_from_the_files_own():
    """A small custom model's config.json without eot_token_id / pad_token_id takes them from its own eos,
    not from LLaDA-8B's tokenizer (126348 would lie beyond its vocabulary); the published configs, which lack
    eot_token_id too, keep LLaDA's <|eot_id|>."""
    hf = tiny_llada_config().to_hf_config()
    del hf["eot_token_id"], hf["pad_token_id"]
    c = config_from_hf(hf)
    assert (c.eos_token_id, c.eot_token_id, c.pad_token_id, c.stop_ids) == (141, 141, 141, (141,))
    assert shipped_config("llada-8b-instruct").eot_token_id == 126348
    from dllm_jax.testing import tiny_dream_config, tiny_llada2_config, tiny_sdar_config
    for config, absent in ((tiny_sdar_config(eos_token_ids=(181,)), ("pad_token_id",)),
                           (tiny_dream_config(), ("pad_token_id", "bos_token_id")),
                           (tiny_llada2_config(), ("pad_token_id",))):
        hf = config.to_hf_config()
        for key in absent:
            del hf[key]
        parsed = config_from_hf(hf)
        assert all(getattr(parsed, key) == parsed.stop_ids[-1] for key in absent), (type(config).__name__, parsed)


def test_every_config_shares_the_base_and_its_names():
    from dllm_jax.config import CONFIG_CLASSES, DecoderConfig, DiffusionGemmaConfig
    from dllm_jax.hf_config import ModelConfig
    from dllm_jax.testing import tiny_dream_config, tiny_llada2_config, tiny_sdar_config

    configs = (tiny_llada_config(), tiny_sdar_config(), tiny_dream_config(), tiny_llada2_config())
    # the masked-diffusion decoders share DecoderConfig; DiffusionGemma (no mask token) only the ModelConfig base
    assert [type(c) for c in configs] == [c for c in CONFIG_CLASSES if issubclass(c, DecoderConfig)]
    assert set(CONFIG_CLASSES) == {type(c) for c in configs} | {DiffusionGemmaConfig}
    assert all(issubclass(c, ModelConfig) for c in CONFIG_CLASSES)
    for c in configs:
        assert isinstance(c, DecoderConfig)
        assert isinstance(c.stop_ids, tuple) and c.stop_ids
        assert c.rotary_dim <= c.head_dim and isinstance(c.qk_norm, bool) and isinstance(c.qkv_bias, bool)
    assert [c.qk_norm for c in configs] == [False, True, False, True]
    assert [c.qkv_bias for c in configs] == [False, False, True, False]
    assert tiny_sdar_config().stop_ids == (181, 182)
    hf = tiny_llada2_config(qk_norm=False, qkv_bias=True, o_bias=True).to_hf_config()
    assert (hf["use_qk_norm"], hf["use_qkv_bias"], hf["use_bias"], hf["norm_topk_prob"]) == (False, True, True, True)
    with pytest.raises(ValueError, match=r"LLaDA2Config.qk_norm \(config.json key 'use_qk_norm'\) must be"):
        tiny_llada2_config(qk_norm=1)
