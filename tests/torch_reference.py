"""PyTorch reference for LLaDA: transformers' `LlamaForCausalLM` loaded with LLaDA's weights.

Written independently of dllm_jax's converter: its own name map (models.md §4), its own reading of
the safetensors files (safetensors.torch). Attention is made bidirectional by an explicit 4D
additive mask (0 = attend, finfo.min = hidden) with the eager kernel, so nothing depends on
transformers' default causal masking.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

LLADA_TO_LLAMA = (
    (r"model\.transformer\.wte\.weight", "model.embed_tokens.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.([qkv])_proj\.weight", r"model.layers.\1.self_attn.\2_proj.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.attn_out\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.ff_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.ff_proj\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.up_proj\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.ff_out\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    (r"model\.transformer\.ln_f\.weight", "model.norm.weight"),
    (r"model\.transformer\.ff_out\.weight", "lm_head.weight"),
)


def llama_reference(hf_dir: str | Path) -> LlamaForCausalLM:
    """An fp32 `LlamaForCausalLM` equal to the LLaDA checkpoint in `hf_dir`."""
    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    d, heads = cfg["d_model"], cfg["n_heads"]
    config = LlamaConfig(
        vocab_size=cfg.get("embedding_size") or cfg["vocab_size"], hidden_size=d,
        intermediate_size=cfg["mlp_hidden_size"], num_hidden_layers=cfg["n_layers"],
        num_attention_heads=heads, num_key_value_heads=cfg.get("n_kv_heads") or heads,
        head_dim=d // heads, rms_norm_eps=cfg["rms_norm_eps"], rope_theta=cfg["rope_theta"],
        max_position_embeddings=max(cfg["max_sequence_length"], 4096),
        tie_word_embeddings=bool(cfg.get("weight_tying")), attention_bias=False, mlp_bias=False,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    state = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            new = next(re.sub(p, r, name) for p, r in LLADA_TO_LLAMA if re.fullmatch(p, name))
            state[new] = tensor.to(torch.float32)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model


def reference_logits(model: LlamaForCausalLM, input_ids: np.ndarray, key_mask: np.ndarray | None = None):
    """fp32 logits [B, L, V]; bidirectional, keys with key_mask == 0 hidden from every query."""
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)
    b, n = ids.shape
    bias = torch.zeros(b, 1, n, n, dtype=torch.float32)
    if key_mask is not None:
        hidden = torch.as_tensor(np.asarray(key_mask) == 0)[:, None, None, :].expand(b, 1, n, n)
        bias = bias.masked_fill(hidden, torch.finfo(torch.float32).min)
    positions = torch.arange(n)[None].expand(b, n)  # LLaDA never shifts positions for padding
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=bias, position_ids=positions).logits.numpy()


def qwen3_reference(hf_dir: str | Path):
    """An fp32 `Qwen3ForCausalLM` with the SDAR checkpoint in `hf_dir` (SDAR uses Qwen3's names 1:1)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    config = Qwen3Config(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"], rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg["rope_theta"], max_position_embeddings=cfg["max_position_embeddings"],
        tie_word_embeddings=cfg["tie_word_embeddings"], attention_bias=False, attn_implementation="eager",
    )
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    state = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        state |= {name: t.to(torch.float32) for name, t in load_file(file).items()}
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model


def block_causal_logits(model, input_ids: np.ndarray, block_length: int):
    """fp32 logits [B, L, V] under SDAR's mask: bidirectional inside blocks, causal across them."""
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)
    b, n = ids.shape
    blocks = torch.arange(n) // block_length
    allowed = blocks[None, :] <= blocks[:, None]
    bias = torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=bias[None, None].expand(b, 1, n, n),
                     position_ids=torch.arange(n)[None].expand(b, n)).logits.numpy()
