"""One full-sequence forward of a LLaDA-8B-shaped model (random bf16 weights) on the GPU.

For each sequence length: the forward as `model(ids)` computes it (cuDNN attention), the same
forward with attention replaced by an elementwise q + k + v (the rest of the step, projections kept), and 32 x one layer's attention
alone. The attention share is reported both ways. Writes JSON + Markdown to --out.

    PYTHONPATH=. python -m benchmarks.llada_forward --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from dllm_jax.bench import (call_times, fmt, markdown_table, median_min_max, profiled_attention_share,
                            write_results)
from dllm_jax import shipped_config
from dllm_jax.attention import backends
from dllm_jax.attention.dense import dense_attention
from dllm_jax.attention.policy import Dense
from dllm_jax.models.llada import forward
from dllm_jax.models.layers import prepare_params
from dllm_jax.testing import random_params


@dataclasses.dataclass(frozen=True)
class NoAttention(Dense):
    """Skips attention but keeps q, k and v live, so XLA cannot drop their projections and RoPE."""

    def attend(self, q, k, v, state, mode, **_):
        return q + jnp.repeat(k + v, q.shape[2] // k.shape[2], axis=2), state


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--layers", type=int, default=None, help="override the layer count (smoke runs)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()

    config = shipped_config("llada-8b-instruct")
    if args.layers is not None:
        config = dataclasses.replace(config, num_layers=args.layers)
    params = prepare_params(random_params(config, jax.random.key(0)), config)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    device = jax.devices()[0].device_kind
    print(f"{device}, jax {jax.__version__}, {n_params / 1e9:.2f}B params (bf16)", flush=True)
    full = jax.jit(lambda p, ids: forward(p, ids, config=config)[0])
    rest = jax.jit(lambda p, ids: forward(p, ids, config=config, policy=NoAttention())[0])
    attention = jax.jit(dense_attention)
    rows = []
    for n in args.lengths:
        ids = jax.random.randint(jax.random.key(n), (1, n), 0, config.tokenizer_vocab_size)
        logits = full(params, ids)
        finite = bool(jnp.isfinite(logits).all())
        del logits
        t_full = median_min_max(call_times(full, params, ids, repeats=args.repeats, warmup=2, burst_s=0))
        t_rest = median_min_max(call_times(rest, params, ids, repeats=args.repeats, warmup=2, burst_s=0))
        kq, kk, kv = jax.random.split(jax.random.key(1), 3)
        shape = (1, n, config.num_heads, config.head_dim)
        q, k, v = (jax.random.normal(x, shape, jnp.bfloat16) for x in (kq, kk, kv))
        t_attn = median_min_max(call_times(attention, q, k, v, repeats=args.repeats, warmup=2, burst_s=0))
        with tempfile.TemporaryDirectory() as trace_dir:
            share, gpu_ms = profiled_attention_share(full, params, ids, trace_dir=Path(trace_dir))
        flops = 4 * n * n * config.num_heads * config.head_dim
        row = dict(
            seq_len=n, forward_ms=t_full[0] * 1e3, forward_min_ms=t_full[1] * 1e3, forward_max_ms=t_full[2] * 1e3,
            without_attention_ms=t_rest[0] * 1e3, attention_layer_ms=t_attn[0] * 1e3,
            attention_all_layers_ms=t_attn[0] * 1e3 * config.num_layers,
            attention_share_by_removal=1 - t_rest[0] / t_full[0],
            attention_share_by_kernel_time=t_attn[0] * config.num_layers / t_full[0],
            attention_share_by_profile=share, profiled_gpu_kernel_ms=gpu_ms,
            attention_tflops=flops / t_attn[0] / 1e12, logits_finite=finite,
        )
        rows.append(row)
        print(json.dumps(row), flush=True)

    meta = dict(
        benchmark="llada_forward", device=device, jax=jax.__version__, date=datetime.date.today().isoformat(),
        model=f"LLaDA-8B-Instruct dimensions (d 4096, {config.num_layers} layers, 32 heads x 128, MLP 12288, "
              "vocab 126464), random bf16",
        batch=1, attention_implementation=backends.dense_default(jnp.bfloat16, config.head_dim),
        output="full float32 logits [1, N, 126464]", timing=f"median of {args.repeats} jitted calls after 2 warm-ups",
    )
    write_results(args.out, meta, rows, markdown(meta, rows, config.num_layers))


def markdown(meta: dict, rows: list[dict], layers: int) -> list[str]:
    cells = [[r["seq_len"], f"{r['forward_ms']:.1f} ms", f"{r['without_attention_ms']:.1f} ms",
              f"{r['attention_share_by_removal']:.2f}", f"{r['attention_all_layers_ms']:.1f} ms",
              f"{r['attention_share_by_kernel_time']:.2f}", fmt(r["attention_share_by_profile"]),
              f"{r['attention_tflops']:.0f}"] for r in rows]
    lines = [
        f"# LLaDA-8B forward, {meta['device']}, jax {meta['jax']}, {meta['date']}", "",
        f"{meta['model']}; batch 1; attention `{meta['attention_implementation']}`; {meta['output']}; "
        f"{meta['timing']}.", "",
        *markdown_table(["N", "forward", "without attention", "attention share (removal)",
                         f"{layers} x one layer's attention", "share (kernel time)", "share (profile)",
                         "attention TFLOP/s"], cells),
    ]
    return lines + [
        "", "Attention share, three ways: *removal* = 1 - (forward with attention replaced by an elementwise",
        "q + k + v) / forward (XLA re-fuses the graph without the attention call, so this one is only indicative);",
        "*kernel time* = layers x one layer's cuDNN attention timed alone / forward; *profile* = time of attention",
        "kernels / all GPU kernel time in a profiler trace of one forward (the direct measurement).",
    ]


if __name__ == "__main__":
    main()
