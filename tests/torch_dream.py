"""PyTorch references for Dream: transformers' `Qwen2ForCausalLM` with an all-visible attention mask (the
forward), and a port of the official sampler (`DreamGenerationMixin._sample` of the Dream model
repository's generation_utils.py, batched version: per-row top-k over a [B, L] confidence, the count from
the batch's masks / batch size).

Written from the official code's facts, not copied. Random draws: by default the official torch calls
(Categorical sampling, torch.rand, torch.multinomial); with `draws` (a function of the step returning
float32 uniforms [B, L]) the same draws as dllm_jax's sampler instead, so that sampled paths can be
compared token for token: inverse-CDF token draws, `u < p` transfers, Gumbel top-k for the alg_temp
selection (the distribution of multinomial without replacement).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM


def dream_checkpoint(directory, *, seed: int = 0, mask_token_id: int, eos_token_id: int, **config) -> Qwen2ForCausalLM:
    """A random fp32 Qwen2ForCausalLM saved with save_pretrained (safetensors) into `directory`, its
    config.json rewritten as Dream's (architectures DreamModel, model_type Dream, mask_token_id).
    Every weight, biases included, is drawn at a scale where all of them matter. Returns the model."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(attn_implementation="eager", bos_token_id=eos_token_id, eos_token_id=eos_token_id,
                      pad_token_id=eos_token_id, **config)
    model = Qwen2ForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.5 * torch.randn_like(param))
            elif "embed_tokens" in name:
                param.copy_(torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
    directory = Path(directory)
    model.save_pretrained(directory, safe_serialization=True)
    hf = json.loads((directory / "config.json").read_text())
    hf |= {"architectures": ["DreamModel"], "model_type": "Dream", "mask_token_id": mask_token_id}
    (directory / "config.json").write_text(json.dumps(hf, indent=2))
    return model


def official_inputs(attention_mask: torch.Tensor | None, length: int):
    """The official sampler's model inputs for a mask padded to `length`: (4D bool mask or None, tok_idx
    or None); None, None without padding ("full" attention)."""
    if attention_mask is None or not torch.any(attention_mask == 0):
        return None, None
    mask = F.pad(attention_mask, (0, length - attention_mask.shape[1]), value=1)
    tok_idx = mask.long().cumsum(-1) - 1
    tok_idx.masked_fill_(mask == 0, 1)
    pairwise = torch.logical_and(mask[:, None, None, :].bool(), mask[:, None, :, None].bool())
    return pairwise, tok_idx


def qwen2_logits(model: Qwen2ForCausalLM, x: torch.Tensor, pairwise=None, tok_idx=None) -> torch.Tensor:
    """Bidirectional fp32 logits [B, L, V]: an explicit all-visible (or pairwise padding) additive 4D
    mask, so nothing depends on transformers' causal default."""
    b, n = x.shape
    bias = torch.zeros(b, 1, n, n)
    if pairwise is not None:
        bias = bias.masked_fill(~pairwise, torch.finfo(torch.float32).min)
    positions = torch.arange(n)[None].expand(b, n) if tok_idx is None else tok_idx
    with torch.no_grad():
        return model(input_ids=x, attention_mask=bias, position_ids=positions).logits


def filter_logits(logits, temperature, top_p, top_k):
    """The official sample_tokens' logits: / temperature (if > 0), top-p, then top-k, removed entries at
    the dtype's lowest value."""
    lowest = torch.finfo(logits.dtype).min
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        remove = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1) > top_p
        remove = torch.cat([torch.zeros_like(remove[..., :1]), remove[..., :-1]], dim=-1)
        logits = logits.masked_fill(torch.zeros_like(remove).scatter(-1, order, remove), lowest)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]))[0][..., -1:]
        logits = logits.masked_fill(logits < kth, lowest)
    return logits


def sample(logits, temperature, top_p, top_k, alg, u=None):
    """(confidence, tokens) of logits [n, V] as the official sample_tokens; u [n]: injected draws."""
    probs = torch.softmax(filter_logits(logits, temperature, top_p, top_k), dim=-1)
    if temperature > 0:
        if u is None:
            tokens = torch.distributions.Categorical(probs=probs).sample()
        else:
            cdf = probs.cumsum(-1)
            tokens = (cdf >= u[:, None] * cdf[:, -1:]).int().argmax(-1)
        confidence = probs.gather(-1, tokens[:, None])[:, 0]
    else:
        confidence, tokens = probs.max(dim=-1)
    if alg == "topk_margin":
        top = torch.sort(probs, dim=-1, descending=True)[0]
        confidence = top[:, 0] - top[:, 1]
    elif alg == "entropy":
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return confidence, tokens


def diffusion_generate(logits_fn, input_ids, attention_mask=None, *, mask_token_id: int, max_new_tokens: int,
                       steps: int, eps: float = 1e-3, alg: str = "origin", alg_temp=None, temperature: float = 0.0,
                       top_p=None, top_k=None, draws=None) -> np.ndarray:
    """The official `_sample` loop; logits_fn(x, pairwise, tok_idx) -> logits [B, L, V]. Returns int64
    [B, P + max_new_tokens] (numpy)."""
    input_ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)
    attention_mask = None if attention_mask is None else torch.as_tensor(np.asarray(attention_mask))
    length = input_ids.shape[1] + max_new_tokens
    x = F.pad(input_ids, (0, max_new_tokens), value=mask_token_id)
    pairwise, tok_idx = official_inputs(attention_mask, length)
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        mask_index = x == mask_token_id
        logits = logits_fn(x, pairwise, tok_idx)
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        mask_logits = logits[mask_index]
        t, s = timesteps[i], timesteps[i + 1]
        u = None if draws is None else {k: torch.as_tensor(np.array(v))[mask_index] for k, v in draws(i).items()}
        if alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1
            x0 = torch.full_like(x[mask_index], mask_token_id)
            rand = torch.rand(x0.shape) if u is None else u["transfer"]
            transfer = rand < p_transfer
            _, x0[transfer] = sample(mask_logits[transfer], temperature, top_p, top_k, alg,
                                     None if u is None else u["token"][transfer])
            x[mask_index] = x0
            continue
        confidence, x0 = sample(mask_logits, temperature, top_p, top_k, alg, None if u is None else u["token"])
        num_mask_token = mask_index.sum() / mask_index.shape[0]
        count = int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token)
        full_confidence = torch.full(x.shape, -torch.inf, dtype=logits.dtype)
        full_confidence[mask_index] = confidence
        if count > 0:
            if not alg_temp:
                _, transfer_index = torch.topk(full_confidence, count)
            elif draws is None:
                transfer_index = torch.multinomial(F.softmax(full_confidence / alg_temp, dim=-1), num_samples=count)
            else:
                uniforms = torch.as_tensor(np.array(draws(i)["select"]))
                scores = torch.log_softmax(full_confidence / alg_temp, dim=-1)
                scores = torch.where(torch.isfinite(scores), scores - torch.log(-torch.log(uniforms)), -torch.inf)
                _, transfer_index = torch.topk(scores, count)
            x_ = torch.full_like(x, mask_token_id)
            x_[mask_index] = x0
            rows = torch.arange(x.shape[0])[:, None].expand_as(transfer_index)
            x[rows, transfer_index] = x_[rows, transfer_index]
    return x.numpy()
