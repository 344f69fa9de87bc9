"""Tiny random checkpoints in a model's own HF format, for tests, the demo and benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from dllm_jax.checkpoint.hf import TARGET_DTYPES, hf_name, hf_shape, param_shapes_for, rules_for, tree_get
from dllm_jax.config import LLaDAConfig, SDARConfig


def tiny_llada_config(**overrides) -> LLaDAConfig:
    """A small LLaDA config (2 layers, d=64, GQA 4:2) that runs in milliseconds on a CPU."""
    values = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
                  vocab_size=160, tokenizer_vocab_size=150, rope_theta=500000.0, rms_norm_eps=1e-5,
                  max_position_embeddings=256, mask_token_id=140, eos_token_id=141, pad_token_id=141,
                  eot_token_id=142)
    return LLaDAConfig(**(values | overrides))


def tiny_sdar_config(**overrides) -> SDARConfig:
    """A small SDAR config (2 layers, d=64, 4 query / 2 kv heads of 32: head_dim * heads != d as in
    SDAR-4B, block size 4) that runs in milliseconds on a CPU."""
    values = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=96,
                  vocab_size=192, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=512,
                  block_size=4, mask_token_id=180, eos_token_ids=(181, 182), pad_token_id=182)
    return SDARConfig(**(values | overrides))


def random_hf_tensors(config, *, seed: int = 0, dtype: str = "float32") -> dict[str, np.ndarray]:
    """{HF name: random tensor} for every weight of `config`, in the HF (torch) layout.

    Projections are N(0, 1/fan_in), embeddings N(0, 1), norm weights 1 + N(0, 0.1²): logits of
    order one, so numerical differences are visible.
    """
    rng = np.random.default_rng(seed)
    shapes = param_shapes_for(config)
    tensors = {}
    for rule in rules_for(config):
        target = tree_get(shapes, rule.path)
        target = target[1:] if rule.per_layer else target
        shape = hf_shape(rule.transform, target)
        for layer in (range(config.num_layers) if rule.per_layer else [None]):
            if rule.path[-1].endswith("norm"):
                value = 1.0 + 0.1 * rng.standard_normal(shape)
            elif rule.path == ("embed",):
                value = rng.standard_normal(shape)
            else:
                value = rng.standard_normal(shape) / np.sqrt(shape[-1])
            tensors[hf_name(rule, layer)] = value.astype(TARGET_DTYPES[dtype])
    return tensors


def write_hf_checkpoint(directory, config, *, seed: int = 0, dtype: str = "float32", shards: int = 1,
                        tensors: dict[str, np.ndarray] | None = None) -> Path:
    """Writes config.json + safetensors (sharded with model.safetensors.index.json if shards > 1)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = random_hf_tensors(config, seed=seed, dtype=dtype) if tensors is None else tensors
    hf_config = config.to_hf_config() | {"torch_dtype": dtype}
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    names = list(tensors)
    if shards == 1:
        save_file(tensors, directory / "model.safetensors")
        return directory
    weight_map = {}
    for i, chunk in enumerate(np.array_split(np.array(names, dtype=object), shards)):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in chunk}, directory / file)
        weight_map |= {n: file for n in chunk}
    index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return directory


QWEN_STYLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_tokenizer(directory, vocab_size: int, *, mask_token_id: int, eos_token_id: int,
                         chat_template: str = QWEN_STYLE_TEMPLATE) -> Path:
    """A word-level tokenizer.json whose ids cover 0..vocab_size-1 ("w<i>" words, "user" and
    "assistant"; id 0 is the unknown token; mask, EOS and the chat markers are special tokens), plus
    tokenizer_config.json with `chat_template`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = Path(directory)
    specials = {mask_token_id: "<|mask|>", eos_token_id: "<|im_end|>", eos_token_id - 1: "<|im_start|>"}
    words = {0: "[UNK]", eos_token_id - 2: "user", eos_token_id - 3: "assistant"}
    vocab = {specials.get(i, words.get(i, f"w{i}")): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(specials.values()))
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"chat_template": chat_template, "eos_token": "<|im_end|>", "bos_token": None}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory
