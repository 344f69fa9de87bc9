"""One cached block step of an SDAR-8B-shaped model (random bf16 weights and cache) on the GPU.

For each (block tokens n, cache length S): `block_step` of n tokens against S cached positions
(no commit), jitted with the cache donated so its scratch write is in place. Next to the time:
the bytes the step must read at least (every weight once, except the embedding table of which only
n rows are gathered, plus the K and V of S + n positions in every layer), the bandwidth that
implies, and one layer's attention alone (cuDNN, `kv_len` = S + n) times the layer count.

    PYTHONPATH=. python -m benchmarks.sdar_block_step --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from dllm_jax.bench import (call_times, fmt, markdown_table, median_min_max, profiled_attention_share, time_calls,
                            write_results)
from dllm_jax import shipped_config
from dllm_jax.attention import backends
from dllm_jax.attention.dense import dense_attention
from dllm_jax.models.layers import prepare_params
from dllm_jax.testing import random_params
from dllm_jax.models.block_diffusion import KVCache
from dllm_jax.models.sdar import block_step


def random_cache(config, batch, max_length, length, key):
    shape = (batch, max_length, config.num_kv_heads, config.head_dim)
    make = jax.jit(lambda k: jax.random.normal(k, shape, jnp.bfloat16))
    keys = jax.random.split(key, 2 * config.num_layers)
    return KVCache(tuple(make(k) for k in keys[::2]), tuple(make(k) for k in keys[1::2]),
                   jnp.full((batch,), length, jnp.int32))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--cache-lengths", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--config", default="sdar-8b-chat")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()

    config = shipped_config(args.config)
    params = prepare_params(random_params(config, jax.random.key(0)), config)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    # an untied embedding table is only gathered (n rows); a tied one is read whole as the LM head
    embed_bytes = 0 if config.tie_word_embeddings else params["embed"].nbytes
    device = jax.devices()[0].device_kind
    print(f"{device}, jax {jax.__version__}, {args.config}: {param_bytes / 1e9:.2f} GB of bf16 weights", flush=True)
    rows = []
    for s in args.cache_lengths:
        for n in args.blocks:
            cache = random_cache(config, 1, s + n, s, jax.random.key(s))
            ids = jax.random.randint(jax.random.key(n), (1, n), 0, config.vocab_size)
            step = jax.jit(functools.partial(block_step, config=config), donate_argnames=("cache",))

            def run(ids, state=[cache]):  # thread the donated cache through the calls
                logits, state[0], _ = step(params, ids, state[0])
                return logits

            t = median_min_max(call_times(run, ids, repeats=args.repeats, warmup=2, burst_s=0))
            with tempfile.TemporaryDirectory() as trace_dir:
                share, gpu_ms = profiled_attention_share(run, ids, trace_dir=Path(trace_dir))
            kv_bytes = 2 * config.num_layers * (s + n) * config.num_kv_heads * config.head_dim * 2
            weight_bytes = param_bytes - embed_bytes + n * config.hidden_size * 2
            q = jax.random.normal(jax.random.key(1), (1, n, config.num_heads, config.head_dim), jnp.bfloat16)
            k = jax.random.normal(jax.random.key(2), (1, s + n, config.num_kv_heads, config.head_dim),
                                                jnp.bfloat16)
            v = k + 1
            attention = jax.jit(lambda q, k, v: dense_attention(q, k, v, kv_len=s + n))
            t_attn = time_calls(attention, q, k, v, repeats=args.repeats, warmup=2, burst_s=0)
            layer_kv_bytes = kv_bytes / config.num_layers
            row = dict(
                block_tokens=n, cache_length=s, step_ms=t[0] * 1e3, step_min_ms=t[1] * 1e3,
                weight_bytes=weight_bytes, kv_bytes=kv_bytes, bytes_read=weight_bytes + kv_bytes,
                achieved_tb_s=(weight_bytes + kv_bytes) / t[0] / 1e12,
                attention_share_by_profile=share, profiled_gpu_kernel_ms=gpu_ms,
                attention_layer_us=t_attn * 1e6, attention_all_layers_ms=t_attn * 1e3 * config.num_layers,
                attention_tb_s=layer_kv_bytes / t_attn / 1e12,
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
            del cache, run

    meta = dict(
        benchmark="sdar_block_step", device=device, jax=jax.__version__, date=datetime.date.today().isoformat(),
        model=f"{args.config} dimensions (d {config.hidden_size}, {config.num_layers} layers, "
              f"{config.num_heads}/{config.num_kv_heads} heads x {config.head_dim}, MLP {config.intermediate_size}, "
              f"vocab {config.vocab_size}), random bf16 weights and cache",
        batch=1, attention_implementation=backends.dense_default(jnp.bfloat16, config.head_dim),
        timing=f"median of {args.repeats} jitted calls after 2 warm-ups, cache donated",
    )
    write_results(args.out, meta, rows, markdown(meta, rows, config.num_layers))


def markdown(meta: dict, rows: list[dict], layers: int) -> list[str]:
    cells = [[r["block_tokens"], r["cache_length"], f"{r['step_ms']:.2f} ms",
              f"{r['weight_bytes'] / 1e9:.2f} + {r['kv_bytes'] / 1e9:.2f} GB", f"{r['achieved_tb_s']:.2f} TB/s",
              fmt(r["attention_share_by_profile"]), f"{r['attention_all_layers_ms']:.2f} ms",
              f"{r['attention_tb_s']:.2f} TB/s"] for r in rows]
    lines = [
        f"# SDAR block step against a KV cache, {meta['device']}, jax {meta['jax']}, {meta['date']}", "",
        f"{meta['model']}; batch 1; attention `{meta['attention_implementation']}`; {meta['timing']}.", "",
        *markdown_table(["block tokens", "cache", "step", "bytes read (weights + KV)", "achieved",
                         "attention share (profile)", f"{layers} x one layer's attention", "attention bandwidth"],
                        cells),
    ]
    return lines + ["", "Bytes read = the least a step must read: all weights but the embedding table (n rows gathered),",
              "and K and V of S + n positions in every layer. Achieved = those bytes / step time (H200 copy ceiling",
              "~4.3 TB/s, H100 ~3.0). Attention bandwidth = one layer's K+V bytes / one cuDNN call timed alone."]


if __name__ == "__main__":
    main()
