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


def top_k_logits(logits, k):
    if k <= 0:
        return logits
    values, _ = torch.topk(logits, k)
    return torch.where(logits < values[..., -1, None], torch.full_like(logits, float("-inf")), logits)


def top_p_logits(logits, p):
    sorted_logits, sorted_indices = torch.sort(logits, descending=True)
    cumulative = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    sorted_mask = cumulative > p
    sorted_mask[..., 1:] = sorted_mask[..., :-1].clone()
    sorted_mask[..., 0] = False
    mask = torch.scatter(torch.full_like(logits, False, dtype=torch.bool), -1, sorted_indices, sorted_mask)
    return logits.masked_fill(mask, float("-inf"))


def sample_tokens(logits, u, temperature, top_k, top_p):
    """generate.py's sampler with torch.multinomial replaced by an inverse-CDF draw from given uniforms."""
    if temperature != 1.0:
        logits = logits / temperature
    if top_k > 0:
        logits = top_k_logits(logits, top_k)
    if top_p < 1.0:
        logits = top_p_logits(logits, top_p)
    probs = F.softmax(logits, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.tensor(np.asarray(u), dtype=probs.dtype)
    token = torch.argmax((cdf >= u[..., None] * cdf[..., -1:]).to(torch.int8), dim=-1)
    return token, torch.gather(probs, -1, token[..., None])[..., 0]


def sdar_generate(qwen3, prompt, *, mask_id, gen_length, block_length, denoising_steps, temperature=1.0, top_k=0,
                  top_p=1.0, remasking_strategy="low_confidence_dynamic", confidence_threshold=0.85,
                  stopping_criteria_idx=None, uniforms=None):
    """JetAstra/SDAR block_diffusion_generate on a transformers Qwen3 model with a DynamicCache:
    store_kv=False is emulated by cropping the block back off the cache after each denoising forward."""
    from transformers import DynamicCache

    prompt = torch.as_tensor(np.asarray(prompt), dtype=torch.long)
    p = prompt.shape[1]
    num_blocks = (p + gen_length + block_length - 1) // block_length
    total = num_blocks * block_length
    x = torch.full((1, total), mask_id, dtype=torch.long)
    x[:, :p] = prompt
    cache = DynamicCache()
    prefill = (p // block_length) * block_length

    def forward(ids, start, store):
        n = ids.shape[1]
        blocks = torch.arange(start + n) // block_length
        allowed = blocks[None, start:].T >= blocks[None, :]  # [n, start + n]
        bias = torch.zeros(n, start + n).masked_fill(~allowed, torch.finfo(torch.float32).min)
        with torch.no_grad():
            out = qwen3(input_ids=ids, attention_mask=bias[None, None], position_ids=torch.arange(start, start + n)[None],
                        past_key_values=cache, use_cache=True)
        if not store:
            cache.crop(-n)  # store_kv=False: drop this call's keys again
        return out.logits

    if prefill:
        forward(x[:, :prefill], 0, True)
    base, rem = block_length // denoising_steps, block_length % denoising_steps
    schedule = [base + (i < rem) for i in range(denoising_steps)]
    draws = 0
    for num_block in range(p // block_length, num_blocks):
        start = num_block * block_length
        cur_x = x[:, start:start + block_length].clone()
        for step in range(denoising_steps + 1):
            mask_index = cur_x == mask_id
            if mask_index.sum() == 0:
                forward(cur_x, start, True)
                break
            logits = forward(cur_x, start, False)
            x0, x0_p = sample_tokens(logits, uniforms(draws), temperature, top_k, top_p)
            draws += 1
            k = schedule[step]
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            if remasking_strategy == "sequential":
                first = mask_index[0].nonzero(as_tuple=True)[0].min().item()
                transfer[0, first:first + k] = True
            else:
                confidence = torch.where(mask_index, x0_p, -torch.inf)
                high = confidence[0] > confidence_threshold
                if remasking_strategy == "low_confidence_dynamic" and high.sum() >= k:
                    transfer[0] = high
                else:
                    _, idx = torch.topk(confidence[0], k)
                    transfer[0, idx] = True
            cur_x[transfer] = x0[transfer]
        x[:, start:start + block_length] = cur_x
        if stopping_criteria_idx is not None and any(s in x[:, p:] for s in stopping_criteria_idx):
            break
    return x.numpy()
