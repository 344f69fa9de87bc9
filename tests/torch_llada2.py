"""PyTorch port of the official LLaDA2.0 modeling file (`modeling_llada2_moe.py` of the Hub repos
inclusionAI/LLaDA2.0-mini etc.) and of its `generate()` sampler, written independently of dllm_jax from
the facts in dllm_jax/configs/llada2.0-mini/README.md. Module and parameter names are the official ones,
so `state_dict()` is an official-format checkpoint. Eager attention with an additive 0 / -inf mask;
the MoE runs the official inference path (tokens sorted by expert, one expert at a time).

The sampler draws with `torch.multinomial` in the original; here the draw is by inverse CDF from
uniforms passed in (one [n] array per forward), so that a seeded JAX run can be replayed.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class Cfg:
    """The config.json keys the official code reads."""

    vocab_size: int = 160
    hidden_size: int = 64
    intermediate_size: int = 96
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    use_qkv_bias: bool = False
    use_bias: bool = False
    use_qk_norm: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 600000.0
    partial_rotary_factor: float = 0.5
    max_position_embeddings: int = 512
    num_experts: int = 8
    num_shared_experts: int = 1
    num_experts_per_tok: int = 2
    n_group: int = 2
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    moe_intermediate_size: int = 24
    first_k_dense_replace: int = 1
    tie_word_embeddings: bool = False
    norm_topk_prob: bool = True

    def hf_dict(self, **extra) -> dict:
        return {"architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "hidden_act": "silu",
                "score_function": "sigmoid", **dataclasses.asdict(self), **extra}


class RMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(cfg: Cfg, positions: torch.Tensor, dtype):
    """[1, L, rot] tables: inv_freq over rot = head_dim * partial_rotary_factor dims (transformers'
    default rope init with a partial rotary factor), half-rotation layout, cast to the activation dtype."""
    rot = int(cfg.head_dim * cfg.partial_rotary_factor)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))
    freqs = positions.float()[:, :, None] * inv_freq[None, None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_partial_rope(x, cos, sin):
    """x [B, H, L, D]; the first cos.shape[-1] dims rotated, the rest passed through."""
    cos, sin = cos[:, None], sin[:, None]
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg: Cfg, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    def __init__(self, cfg: Cfg):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))

    def forward(self, x):
        cfg = self.cfg
        x = x.view(-1, x.shape[-1])
        logits = F.linear(x.float(), self.weight.float())
        scores = torch.sigmoid(logits.float()).type_as(logits)
        biased = scores + self.expert_bias
        t = biased.shape[0]
        group_scores = biased.view(t, cfg.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(t, cfg.n_group, cfg.num_experts // cfg.n_group).reshape(t, -1)
        masked = biased.masked_fill(~score_mask.bool(), float("-inf"))
        _, idx = torch.topk(masked, k=cfg.num_experts_per_tok, dim=-1)
        weights = torch.gather(scores, 1, idx).type_as(logits)
        if cfg.num_experts_per_tok > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * cfg.routed_scaling_factor


class SparseMoe(nn.Module):
    def __init__(self, cfg: Cfg):
        super().__init__()
        self.cfg = cfg
        self.experts = nn.ModuleList([MLP(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts)])
        self.gate = Gate(cfg)
        if cfg.num_shared_experts:
            self.shared_experts = MLP(cfg, cfg.moe_intermediate_size * cfg.num_shared_experts)

    def forward(self, x):
        b, n, d = x.shape
        idx, weights = self.gate(x)
        flat_x = x.view(-1, d)
        counts = torch.zeros(idx.shape[0], self.cfg.num_experts, dtype=torch.long).scatter_(1, idx, 1).sum(0)
        order = idx.view(-1).argsort()
        sorted_x = flat_x[order // idx.shape[1]]
        outs, start = [], 0
        for e, count in enumerate(counts.tolist()):
            if count:
                outs.append(self.experts[e](sorted_x[start:start + count]))
                start += count
        out = torch.cat(outs)
        unsorted = torch.empty_like(out)
        unsorted[order] = out
        y = unsorted.view(*idx.shape, -1).type(weights.dtype).mul_(weights.unsqueeze(-1)).sum(dim=1).type(out.dtype)
        y = y.view(b, n, d)
        if self.cfg.num_shared_experts:
            y = y + self.shared_experts(x)
        return y


class Attention(nn.Module):
    def __init__(self, cfg: Cfg):
        super().__init__()
        self.cfg = cfg
        h, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.query_key_value = nn.Linear(cfg.hidden_size, (h + 2 * kv) * hd, bias=cfg.use_qkv_bias)
        if cfg.use_qk_norm:
            self.query_layernorm = RMSNorm(hd, cfg.rms_norm_eps)
            self.key_layernorm = RMSNorm(hd, cfg.rms_norm_eps)
        self.dense = nn.Linear(h * hd, cfg.hidden_size, bias=cfg.use_bias)

    def forward(self, x, mask, cos, sin, past=None):
        """past: (k, v) [B, Hkv, S, D] prepended to this call's keys (the cache); returns (out, (k, v))."""
        cfg = self.cfg
        b, n, _ = x.shape
        h, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv = self.query_key_value(x).view(b, n, h + 2 * kv, hd)
        q, k, v = (t.transpose(1, 2) for t in qkv.split([h, kv, kv], dim=-2))
        if cfg.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        kk, vv = (t.repeat_interleave(h // kv, dim=1) for t in (k, v))
        scores = q @ kk.transpose(2, 3) * hd ** -0.5
        if mask is not None:
            scores = scores + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = (probs @ vv).transpose(1, 2).reshape(b, n, h * hd)
        return self.dense(out), (k, v)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Cfg, index: int):
        super().__init__()
        self.attention = Attention(cfg)
        self.mlp = SparseMoe(cfg) if index >= cfg.first_k_dense_replace else MLP(cfg, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, mask, cos, sin, past=None):
        out, kv = self.attention(self.input_layernorm(x), mask, cos, sin, past)
        x = x + out
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class Backbone(nn.Module):
    def __init__(self, cfg: Cfg):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LLaDA2MoeModelLM(nn.Module):
    def __init__(self, cfg: Cfg):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, ids, mask=None, position_ids=None, past=None):
        """ids [B, L] long; mask additive [1|B, 1, L, S]; past: per layer (k, v) or None. Returns
        (float logits [B, L, V], per-layer (k, v) of past + this call)."""
        if position_ids is None:
            position_ids = torch.arange(ids.shape[1])[None]
        x = self.model.word_embeddings(ids)
        cos, sin = rope_cos_sin(self.cfg, position_ids, x.dtype)
        kvs = []
        for i, layer in enumerate(self.model.layers):
            x, kv = layer(x, mask, cos, sin, None if past is None else past[i])
            kvs.append(kv)
        return self.lm_head(self.model.norm(x)).float(), kvs


def random_model(cfg: Cfg, seed: int = 0) -> LLaDA2MoeModelLM:
    """Random weights giving logits of order one: projections N(0, 1/fan_in), embeddings N(0, 1), norm
    weights 1 + N(0, 0.1^2), expert biases N(0, 0.1^2) (so that they change the selection)."""
    torch.manual_seed(seed)
    model = LLaDA2MoeModelLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "word_embeddings" in name:
                p.copy_(torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.copy_(0.1 * torch.randn_like(buf))
    return model.eval()


def block_diffusion_mask(n: int, block_length: int, dtype=torch.float32):
    """The official additive mask: 0 where key block <= query block, -inf elsewhere; [1, 1, n, n]."""
    blocks = -(-n // block_length)
    tril = torch.tril(torch.ones(blocks, blocks))
    full = tril.repeat_interleave(block_length, 0).repeat_interleave(block_length, 1)[:n, :n]
    return torch.where(full.bool(), 0.0, float("-inf")).to(dtype)[None, None]


# --- the official sampler (`LLaDA2MoeModelLM.generate`) ------------------------------------------------

def top_k_logits(logits, k):
    if not k:
        return logits
    kth = torch.topk(logits, k)[0][..., -1, None]
    return torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)


def top_p_logits(logits, p):
    if p is None or p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, descending=True)
    remove = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1) > p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    mask = torch.scatter(torch.zeros_like(logits, dtype=torch.bool), -1, sorted_idx, remove)
    return logits.masked_fill(mask, float("-inf"))


def sample(logits, u, temperature, top_k, top_p):
    """(tokens, probabilities) of logits [n, V]; the multinomial draw replaced by an inverse-CDF draw
    from u [n] (the first token whose cumulative probability reaches u * total)."""
    if temperature == 0.0 and not top_k and (top_p is None or top_p >= 1.0):  # greedy
        probs = F.softmax(logits, dim=-1)
        token = logits.argmax(dim=-1, keepdim=True)
        return token[:, 0], probs.gather(-1, token)[:, 0]
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logits = top_p_logits(top_k_logits(logits, top_k), top_p)
    probs = F.softmax(logits, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.as_tensor(np.array(u), dtype=cdf.dtype)
    token = torch.argmax((cdf >= u[:, None] * cdf[:, -1:]).int(), dim=-1, keepdim=True)
    return token[:, 0], probs.gather(-1, token)[:, 0]


def transfer_schedule(block_length, steps):
    base, rem = block_length // steps, block_length % steps
    out = torch.full((steps,), base, dtype=torch.int64)
    out[:rem] += 1
    return out


@torch.no_grad()
def generate(model, prompt, *, temperature=0.0, block_length=32, steps=32, gen_length=64, top_p=None, top_k=None,
             minimal_topk=1, threshold=0.95, eos_id, mask_id, uniforms=None):
    """The official generate() for one prompt [1, P] (full forward over every block so far under the
    block-diffusion mask, no cache). `uniforms(t)` -> [block_length] U(0,1) for the t-th forward.
    Returns prompt + generated tokens up to and including the first eos (or gen_length of them)."""
    steps = min(steps, gen_length // minimal_topk)
    prompt = torch.as_tensor(np.asarray(prompt), dtype=torch.long)
    p = prompt.shape[1]
    num_blocks = (p + gen_length + block_length - 1) // block_length
    total = num_blocks * block_length
    mask = block_diffusion_mask(total, block_length)
    positions = torch.arange(total)[None]
    x = torch.full((1, total), mask_id, dtype=torch.long)
    x[:, :p] = prompt
    schedule = transfer_schedule(block_length, steps)
    t = 0
    for block in range(p // block_length, num_blocks):
        end = (block + 1) * block_length
        cur = x[:, :end]
        for step in range(steps):
            active = cur[:, -block_length:] == mask_id
            if active.sum() == 0:
                break
            logits, _ = model(cur, mask[:, :, :end, :end], positions[:, :end])
            x0, x0_p = sample(logits[0, -block_length:], None if uniforms is None else uniforms(t), temperature,
                              top_k, top_p)
            t += 1
            x0, x0_p = x0[None], x0_p[None]
            count = int(schedule[step])
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            confidence = torch.where(active, x0_p, -torch.inf)
            high = confidence[0] > threshold
            if int(high.sum()) >= count:
                transfer[0] = high
            else:
                _, idx = torch.topk(confidence[0], k=min(count, int(active.sum())))
                transfer[0, idx] = True
            if transfer.any():
                cur[:, -block_length:][transfer] = x0[transfer]
        if (x[0, p:end] == eos_id).any():
            break
    answer = x[:, :p + gen_length]
    eos = (answer[0, p:] == eos_id).nonzero(as_tuple=True)[0]
    first = int(eos[0]) if len(eos) else gen_length
    return answer[:, :p + first + 1]
