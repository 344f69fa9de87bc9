"""PyTorch port of the official LLaDA `generate()` (ML-GSAI/LLaDA generate.py, as models.md §1 states it),
written independently of dllm_jax. Random numbers are passed in, so a seeded JAX run can be replayed."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def num_transfer_tokens(mask_index: torch.Tensor, steps: int) -> torch.Tensor:
    mask_num = mask_index.sum(dim=1, keepdim=True)
    base = mask_num // steps
    remainder = mask_num % steps
    out = torch.zeros(mask_num.size(0), steps, dtype=torch.int64) + base
    for i in range(mask_num.size(0)):
        out[i, : remainder[i]] += 1
    return out


def llada_generate(logits_fn, prompt, *, steps, gen_length, block_length, temperature=0.0, cfg_scale=0.0,
                   remasking="low_confidence", mask_id, eos_id, eot_id, logits_eos_inf=False,
                   confidence_eos_eot_inf=False, attention_mask=None, gumbel_uniforms=None, random_uniforms=None):
    """logits_fn(x [B', L] long, attention_mask or None) -> float logits tensor [B', L, V].
    gumbel_uniforms / random_uniforms: per global step, arrays [B, L, V] / [B, L] of U(0,1)."""
    prompt = torch.as_tensor(np.asarray(prompt), dtype=torch.long)
    b, p = prompt.shape
    x = torch.full((b, p + gen_length), mask_id, dtype=torch.long)
    x[:, :p] = prompt
    if attention_mask is not None:
        attention_mask = torch.cat([torch.as_tensor(np.asarray(attention_mask)).long(),
                                    torch.ones(b, gen_length, dtype=torch.long)], dim=1)
    prompt_index = x != mask_id
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    t = 0
    for num_block in range(num_blocks):
        start, end = p + num_block * block_length, p + (num_block + 1) * block_length
        transfer_counts = num_transfer_tokens(x[:, start:end] == mask_id, steps_per_block)
        for i in range(steps_per_block):
            mask_index = x == mask_id
            if cfg_scale > 0.0:
                un_x = x.clone()
                un_x[prompt_index] = mask_id
                mask = None if attention_mask is None else torch.cat([attention_mask, attention_mask])
                both = logits_fn(torch.cat([x, un_x]), mask)
                logits, un_logits = torch.chunk(both, 2, dim=0)
                logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
            else:
                logits = logits_fn(x, attention_mask)
            if logits_eos_inf:
                logits[:, :, eos_id] = -torch.inf
            if temperature == 0:
                logits_with_noise = logits  # add_gumbel_noise returns its input at T=0 (an alias)
            else:
                noise = torch.tensor(np.asarray(gumbel_uniforms[t]), dtype=torch.float64)
                logits_with_noise = logits.to(torch.float64).exp() / (-torch.log(noise)) ** temperature
            x0 = torch.argmax(logits_with_noise, dim=-1)
            if confidence_eos_eot_inf:
                logits_with_noise[:, :, eos_id] = logits[:, :, eot_id] = -torch.inf
            if remasking == "low_confidence":
                p_ = F.softmax(logits, dim=-1)
                x0_p = torch.squeeze(torch.gather(p_, dim=-1, index=torch.unsqueeze(x0, -1)), -1)
            else:
                x0_p = torch.tensor(np.asarray(random_uniforms[t]), dtype=torch.float32)
            x0_p[:, end:] = -np.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -np.inf)
            transfer_index = torch.zeros_like(x0, dtype=torch.bool)
            for j in range(confidence.shape[0]):
                _, select_index = torch.topk(confidence[j], k=int(transfer_counts[j, i]))
                transfer_index[j, select_index] = True
            x[transfer_index] = x0[transfer_index]
            t += 1
    return x.numpy()
