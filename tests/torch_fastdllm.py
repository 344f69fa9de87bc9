"""PyTorch port of Fast-dLLM's LLaDA sampling (NVlabs/Fast-dLLM: llada/generate.py `generate`,
`generate_with_prefix_cache`, `generate_with_dual_cache`, `get_transfer_index`, and the KV-cache path of
llada/model/modeling_llada.py), written independently of dllm_jax as a test reference.

The model is a transformers `LlamaForCausalLM` holding LLaDA's weights (`torch_reference.llama_reference`);
its modules are used for the per-token maps (norms, projections, MLP) and attention is written out here,
bidirectional, so the three cache modes of the official model can be reproduced:

- The official cache stores per layer (keys, values) taken *before* RoPE, shape [B, kv_heads, n, head_dim].
  On every call RoPE is applied to the whole key sequence at positions 0..n_keys-1, and the queries get
  positions n_keys - n_queries .. n_keys - 1 (prefix cache), or end - n_queries .. end - 1 with
  end = last replaced index + 1 (dual cache).
- Every query attends to every key (no mask at all: the model builds a causal bias for cached calls but
  never passes it to attention).
- Prefix cache: keys/values of the call = cached prefix ++ the window's own; nothing is stored back.
- Dual cache: the block's fresh keys/values overwrite the cache at the block's positions (in place in the
  official code), and attention runs over the whole cache (prefix, fresh block, stale suffix).

Decoding is greedy (temperature 0) with "low_confidence" remasking, as in the official defaults.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

LayerKV = tuple[torch.Tensor, torch.Tensor]  # (pre-RoPE keys, values), each [B, kv_heads, n, head_dim]
CACHE_MODES = (None, "prefix", "dual")


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None)  # transformers >= 5 keeps it here
    return float(params["rope_theta"] if params else config.rope_theta)


def rope(t: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotates t [B, heads, n, head_dim] to `positions` [n]: half-split pairs (LLaDA's and Llama's layout)."""
    dim = t.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    first, second = t[..., : dim // 2], t[..., dim // 2:]
    return t * angles.cos() + torch.cat([-second, first], dim=-1) * angles.sin()


def _attention(q, keys, values, q_positions, theta):
    """Bidirectional attention of q [B, H, n, d] over pre-RoPE keys/values [B, KVH, m, d]."""
    q = rope(q, q_positions, theta)
    k = rope(keys, torch.arange(keys.shape[2]), theta)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) / (q.shape[-1] ** 0.5)
    return torch.softmax(scores, dim=-1) @ v


@torch.no_grad()
def _forward(model, ids: torch.Tensor, start: int, past: list[LayerKV] | None, replace: bool):
    """Logits [B, n, V] of tokens ids [B, n] sitting at positions start..start+n-1, and the per-layer
    (keys, values) the official model returns as its cache for this call.
    past None: plain forward (start must be 0). replace False: keys = past ++ own (prefix cache).
    replace True: own keys/values overwrite past[:, :, start:start+n] (dual cache)."""
    cfg = model.config
    heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    theta = _rope_theta(cfg)
    b, n = ids.shape
    q_positions = torch.arange(start, start + n)
    h = model.model.embed_tokens(ids)
    stored = []
    for layer_index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        xn = layer.input_layernorm(h)
        q = attn.q_proj(xn).view(b, n, heads, head_dim).transpose(1, 2)
        k = attn.k_proj(xn).view(b, n, kv_heads, head_dim).transpose(1, 2)
        v = attn.v_proj(xn).view(b, n, kv_heads, head_dim).transpose(1, 2)
        if past is None:
            keys, values = k, v
        elif not replace:
            keys, values = torch.cat([past[layer_index][0], k], dim=2), torch.cat([past[layer_index][1], v], dim=2)
        else:
            keys, values = past[layer_index][0].clone(), past[layer_index][1].clone()
            keys[:, :, start:start + n], values[:, :, start:start + n] = k, v
        stored.append((keys, values))
        out = _attention(q, keys, values, q_positions, theta)
        h = h + attn.o_proj(out.transpose(1, 2).reshape(b, n, heads * head_dim))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.model.norm(h)), stored


def full_forward(model, ids) -> tuple[torch.Tensor, list[LayerKV]]:
    """Whole-sequence forward (official `model(x, use_cache=True)`): fp32 logits [B, L, V] and the cache
    of every position, pre-RoPE keys and values per layer."""
    return _forward(model, torch.as_tensor(np.asarray(ids), dtype=torch.long), 0, None, False)


def truncate_cache(cache: list[LayerKV], length: int) -> list[LayerKV]:
    """The prefix cache: keys/values of positions 0..length-1 only (official `[:, :, :current_block_start]`)."""
    return [(k[:, :, :length], v[:, :, :length]) for k, v in cache]


def prefix_forward(model, window, prefix_cache: list[LayerKV]) -> torch.Tensor:
    """Logits [B, n, V] of window = x[:, s:], s = the cache's length: the window's queries (RoPE positions
    s..s+n-1) attend to the cached prefix and to the window itself. The cache is not extended (the official
    loop drops the returned `past_key_values`)."""
    s = prefix_cache[0][0].shape[2]
    logits, _ = _forward(model, torch.as_tensor(np.asarray(window), dtype=torch.long), s, prefix_cache, False)
    return logits


def dual_forward(model, block, cache: list[LayerKV], start: int) -> tuple[torch.Tensor, list[LayerKV]]:
    """Logits [B, e-s, V] of block = x[:, s:e], s = start, against a full-length cache: the block's fresh
    keys/values replace the cache at s:e, the block's queries (RoPE positions s..e-1) attend to all of it.
    Returns the updated cache (the official code updates it in place)."""
    return _forward(model, torch.as_tensor(np.asarray(block), dtype=torch.long), start, cache, True)


def num_transfer_tokens(block_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """[B, steps] int64: the block's mask count spread evenly, the remainder going to the first steps."""
    count = block_mask.sum(dim=1, keepdim=True)
    schedule = torch.zeros(count.shape[0], steps, dtype=torch.int64) + count // steps
    for row in range(count.shape[0]):
        schedule[row, : int(count[row, 0] % steps)] += 1
    return schedule


@dataclasses.dataclass(frozen=True)
class Factor:
    """The official factor rule (`get_transfer_index_dynamic`), passed where a threshold goes."""

    factor: float


def factor_count(ranked_confidence: torch.Tensor, factor: float) -> int:
    """How many of a row's n eligible positions (confidences sorted descending) the official factor loop
    commits: it walks thresholds 1 - factor / (i + 1) for i = 1..n, the first replaced by -1, stops at the
    first position below its threshold (top_i), and adds one when top_i is the first or the last index."""
    n = len(ranked_confidence)
    if n == 0:
        return 0
    thresholds = [1 - factor / (i + 1) for i in range(1, n + 1)]
    thresholds[0] = -1
    top_i = 0
    for top_i in range(n):
        if ranked_confidence[top_i] < thresholds[top_i]:
            break
    if top_i == 0 or top_i == n - 1:
        top_i += 1
    return top_i


def transfer_index(logits, mask_index, x, k, threshold=None):
    """Official `get_transfer_index` at temperature 0, low_confidence: x0 = argmax; confidence = float64
    softmax probability of x0 on eligible (mask_index) positions, -inf elsewhere. Per row, the top-k[row]
    positions by confidence (torch.topk order); with a threshold, k = every eligible position and, of the
    ranked list, the first is always kept and each later one dropped if its confidence < threshold.
    Returns (x0 with x outside mask_index, bool transfer [B, n])."""
    x0 = torch.argmax(logits, dim=-1)
    p = F.softmax(logits.to(torch.float64), dim=-1)
    x0_p = torch.gather(p, -1, x0[..., None])[..., 0]
    x0 = torch.where(mask_index, x0, x)
    confidence = torch.where(mask_index, x0_p, torch.tensor(-np.inf, dtype=torch.float64))
    if isinstance(threshold, Factor):
        k = [factor_count(torch.sort(confidence[row][mask_index[row]], descending=True)[0], threshold.factor)
             for row in range(confidence.shape[0])]
    elif threshold is not None:
        k = mask_index.sum(dim=1)
    transfer = torch.zeros_like(x0, dtype=torch.bool)
    for row in range(confidence.shape[0]):
        _, ranked = torch.topk(confidence[row], k=int(k[row]))
        transfer[row, ranked] = True
        if threshold is not None and not isinstance(threshold, Factor):
            low = ranked[1:][confidence[row, ranked[1:]] < threshold]
            transfer[row, low] = False
    return x0, transfer


def _step(x_view, logits, mask_index, k, threshold):
    """One official update: x_view[transfer] = x0[transfer] (x_view is a view into x)."""
    x0, transfer = transfer_index(logits, mask_index, x_view, k, threshold)
    x_view[transfer] = x0[transfer]


def _count(schedule, i, threshold):
    """The official `num_transfer_tokens[:, i] if threshold is None else None`; where the official code
    indexes past the schedule (IndexError) this raises RuntimeError."""
    if threshold is not None:
        return None
    if i >= schedule.shape[1]:
        raise RuntimeError(f"schedule of {schedule.shape[1]} steps exhausted with masks left in the block "
                           "(the official code raises IndexError here)")
    return schedule[:, i]


def _check_progress(before, x, threshold):
    """With a threshold, a loop step that changes nothing is repeated on the same inputs for ever by the
    official code; raise instead. (Without one, `_count` ends such a loop.)"""
    if threshold is not None and torch.equal(before, x):
        raise RuntimeError("a decoding step changed nothing (the official loop would never end)")


def _block_without_cache(model, x, s, e, mask_id, schedule, threshold) -> int:
    """Official `generate`'s loop for block x[:, s:e]: full forwards until no row has a mask in the block;
    eligible positions are the masks before e. Updates x in place; returns the forwards made."""
    nfe = 0
    while True:
        before = x.clone()
        mask_index = x == mask_id
        mask_index[:, e:] = False
        logits, _ = full_forward(model, x)
        _step(x, logits, mask_index, _count(schedule, nfe, threshold), threshold)
        nfe += 1
        if not (x[:, s:e] == mask_id).any():
            return nfe
        _check_progress(before, x, threshold)


def _block_with_cache(model, x, s, e, mask_id, schedule, threshold, cache) -> int:
    """Official `generate_with_prefix_cache` / `generate_with_dual_cache` for block x[:, s:e]: one full
    forward (fresh cache, first step), then cached forwards until no row has a mask in the block. The
    loop is entered even if the first step finished the block. Updates x in place; returns the forwards."""
    mask_index = x == mask_id
    mask_index[:, e:] = False
    logits, kv = full_forward(model, x)
    _step(x, logits, mask_index, _count(schedule, 0, threshold), threshold)
    if cache == "prefix":
        kv = truncate_cache(kv, s)
    nfe = 1
    while True:
        before = x.clone()
        if cache == "prefix":  # window = x[:, s:], eligible = the block's masks only
            mask_index = x[:, s:] == mask_id
            mask_index[:, e - s:] = False
            logits = prefix_forward(model, x[:, s:], kv)
            _step(x[:, s:], logits, mask_index, _count(schedule, nfe, threshold), threshold)
        else:
            mask_index = x[:, s:e] == mask_id
            logits, kv = dual_forward(model, x[:, s:e], kv, s)
            _step(x[:, s:e], logits, mask_index, _count(schedule, nfe, threshold), threshold)
        nfe += 1
        if not (x[:, s:e] == mask_id).any():
            return nfe
        _check_progress(before, x, threshold)


def fast_generate(model, prompt, *, steps, gen_length, block_length, mask_id, threshold=None, cache=None,
                  factor=None):
    """Fast-dLLM LLaDA generation, greedy, low_confidence remasking, step for step as the official
    `generate` (cache None), `generate_with_prefix_cache` ("prefix") and `generate_with_dual_cache`
    ("dual"), with the official `threshold` rule or, given `factor`, the official factor rule
    (`get_transfer_index_dynamic`). prompt: int [B, P], no padding.
    Returns (x as np.int64 [B, P + gen_length], nfe).

    A block ends when no row has a mask left in it (the official checks `.sum() == 0` over the batch; the
    official functions themselves only take B = 1). Where the official code would fail or never stop, this
    raises RuntimeError: threshold None and the schedule runs out with masks left (official IndexError,
    e.g. steps per block == 1 with a cache, or a predicted mask_id), or, with a threshold, a loop step that
    changes nothing (official: same inputs forever)."""
    if cache not in CACHE_MODES:
        raise ValueError(f"cache must be one of {CACHE_MODES}, got {cache!r}")
    if factor is not None:
        threshold = Factor(factor)
    if gen_length % block_length:
        raise ValueError(f"gen_length ({gen_length}) must be a multiple of block_length ({block_length})")
    num_blocks = gen_length // block_length
    if steps % num_blocks:
        raise ValueError(f"steps ({steps}) must be a multiple of the number of blocks ({num_blocks})")
    prompt = torch.as_tensor(np.asarray(prompt), dtype=torch.long)
    if prompt.ndim != 2:
        raise ValueError(f"prompt must be [B, P], got shape {tuple(prompt.shape)}")
    b, p = prompt.shape
    x = torch.full((b, p + gen_length), mask_id, dtype=torch.long)
    x[:, :p] = prompt
    nfe = 0
    for block in range(num_blocks):
        s, e = p + block * block_length, p + (block + 1) * block_length
        schedule = num_transfer_tokens(x[:, s:e] == mask_id, steps // num_blocks)
        if cache is None:
            nfe += _block_without_cache(model, x, s, e, mask_id, schedule, threshold)
        else:
            nfe += _block_with_cache(model, x, s, e, mask_id, schedule, threshold, cache)
    return x.numpy().astype(np.int64), nfe
