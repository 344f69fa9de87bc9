"""Attention kernels against cuDNN on the GPU (batch 1, bf16, head_dim 128, bidirectional).

Sections (all timed in the same run, medians of bursts of back-to-back calls):
  dense   our flash kernel (a few tilings, best kept) vs `jax.nn.dot_product_attention(cudnn)`,
          32 heads, N in --lengths;
  block   block-sparse with random per-(head, query block) key-block lists at each density
          (blocks of --block), as time and as ratio to cuDNN dense; target <= 1.3 x density;
  column  column-sparse with random per-(head, group) column lists at each density;
  splitkv a 32-token block, 32 query / 8 KV heads, against a KV cache of each --cache-lengths:
          achieved read bandwidth (K and V bytes / time) of split-KV attention and of cuDNN, next to
          the device's copy bandwidth (read + write bytes / time of a negation); also the gathered
          form over 1024 / 4096 keys (MAGE's k);
  scores  the pattern-score kernels (block pooling, column mass, KV-head mass).

    PYTHONPATH=. python -m benchmarks.attention --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import functools
import traceback
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from dllm_jax.bench import time_calls, write_results
from dllm_jax.bench import random_lists

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the Pallas Triton backend warns on use

HEADS, HEAD_DIM, DTYPE = 32, 128, jnp.bfloat16
FLASH_TILINGS = [(128, 128, 8, 3), (128, 128, 8, 2)]
SPARSE_TUNINGS = [(8, 3, False), (8, 3, True), (4, 3, True)]  # (warps, stages, preload)
COLUMN_TUNINGS = [(64, 8, 2, False), (128, 8, 2, True), (128, 8, 3, True), (128, 4, 2, True), (256, 8, 2, True)]


def randn(key, shape):
    return jax.jit(lambda k: jax.random.normal(k, shape, DTYPE), static_argnums=())(key)


def qkv(n, heads=HEADS, kv_heads=HEADS, nq=None, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (randn(keys[0], (1, nq or n, heads, HEAD_DIM)), randn(keys[1], (1, n, kv_heads, HEAD_DIM)),
            randn(keys[2], (1, n, kv_heads, HEAD_DIM)))




def best(candidates, rows, label):
    """Times each (name, fn, args) candidate; returns (best seconds, best name); errors are reported."""
    results = []
    for name, fn, args in candidates:
        try:
            t = time_calls(fn, *args)
            results.append((t, name))
            print(f"  {label} {name}: {t * 1e3:.3f} ms", flush=True)
        except Exception as e:  # a tiling that fails to compile is reported, not fatal
            print(f"  {label} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            rows.append(dict(section="error", label=label, tiling=name, error=str(e)[:500]))
    return min(results) if results else (None, None)


def cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")


def dense_section(lengths, rows, cudnn_times):
    for n in lengths:
        q, k, v = qkv(n)
        cudnn_times[n] = time_calls(jax.jit(cudnn), q, k, v)
        flops = 4 * n * n * HEADS * HEAD_DIM
        print(f"dense N={n}: cudnn {cudnn_times[n] * 1e3:.3f} ms", flush=True)
        err = float(jnp.abs(pk.flash_attention(q, k, v).astype(jnp.float32) - cudnn(q, k, v).astype(jnp.float32)).max())
        cands = [(f"{bq}x{bk} w{w} s{s}", jax.jit(functools.partial(pk.flash_attention, block_q=bq, block_kv=bk,
                                                                     num_warps=w, num_stages=s)), (q, k, v))
                 for bq, bk, w, s in FLASH_TILINGS]
        t, name = best(cands, rows, f"flash N={n}")
        rows.append(dict(section="dense", n=n, cudnn_ms=cudnn_times[n] * 1e3, flash_ms=t * 1e3, tiling=name,
                         ratio_to_cudnn=t / cudnn_times[n], flash_tflops=flops / t / 1e12,
                         cudnn_tflops=flops / cudnn_times[n] / 1e12, max_abs_diff_vs_cudnn=err))


def block_section(lengths, densities, block, rows, cudnn_times):
    for n in lengths:
        q, k, v = qkv(n)
        n_b = -(-n // block)
        for d in densities:
            width = max(1, round(d * n_b))
            idx, cnt = random_lists(jax.random.key(n + width), rows=n_b, items=n_b, width=width, heads=HEADS)
            cands = [(f"w{w} s{s}{' preload' if p else ''}", jax.jit(functools.partial(
                pk.block_sparse_attention, block_q=block, block_kv=block, num_warps=w, num_stages=s,
                preload_indices=p)), (q, k, v, idx, cnt)) for w, s, p in SPARSE_TUNINGS]
            t, name = best(cands, rows, f"block N={n} d={d}")
            if t is None:
                continue
            real_d = width / n_b
            rows.append(dict(section="block", n=n, density=real_d, block=block, ms=t * 1e3, tuning=name,
                             cudnn_ms=cudnn_times[n] * 1e3, ratio_to_cudnn=t / cudnn_times[n],
                             target_ratio=1.3 * real_d, meets_target=t / cudnn_times[n] <= 1.3 * real_d))


def column_section(lengths, densities, group, rows, cudnn_times):
    for n in lengths:
        q, k, v = qkv(n)
        n_g = -(-n // group)
        for d in densities:
            width = max(128, round(d * n / 128) * 128)
            idx, cnt = random_lists(jax.random.key(n + width + 1), rows=n_g, items=n, width=min(width, n),
                                    heads=HEADS)
            cands = [(f"cols{bc} w{w} s{s}{' prefetch' if p else ''}", jax.jit(functools.partial(
                pk.column_sparse_attention, group_size=group, block_cols=bc, num_warps=w, num_stages=s,
                prefetch_indices=p)), (q, k, v, idx, cnt)) for bc, w, s, p in COLUMN_TUNINGS]
            t, name = best(cands, rows, f"column N={n} d={d}")
            if t is None:
                continue
            rows.append(dict(section="column", n=n, density=min(width, n) / n, group=group, ms=t * 1e3,
                             tuning=name, cudnn_ms=cudnn_times[n] * 1e3, ratio_to_cudnn=t / cudnn_times[n],
                             speedup_vs_cudnn=cudnn_times[n] / t))
            del idx, cnt


def splitkv_section(cache_lengths, rows, block_tokens=32, kv_heads=8):
    for s in cache_lengths:
        q, k, v = qkv(s, kv_heads=kv_heads, nq=block_tokens, seed=s)
        kv_bytes = k.nbytes + v.nbytes
        big = jnp.zeros((1 << 29,), DTYPE)  # 1 GiB: copy bandwidth without launch effects
        copy_bw = 2 * big.nbytes / time_calls(jax.jit(lambda x: -x), big)
        del big
        t_cudnn = time_calls(jax.jit(cudnn), q, k, v)
        err = float(jnp.abs(pk.split_kv_attention(q, k, v).astype(jnp.float32)
                            - cudnn(q, k, v).astype(jnp.float32)).max())
        cands = [(f"bk{bk} splits{sp}", jax.jit(functools.partial(pk.split_kv_attention, block_kv=bk,
                                                                   num_splits=sp)), (q, k, v))
                 for bk in (64, 128) for sp in (None, 16, 64)] + [
            (f"bk128 splits{sp} w{w} s{st}", jax.jit(functools.partial(
                pk.split_kv_attention, block_kv=128, num_splits=sp, num_warps=w, num_stages=st)), (q, k, v))
            for sp in (None, 32) for w, st in ((8, 2), (4, 3))]
        t, name = best(cands, rows, f"split-KV S={s}")
        t_default = time_calls(jax.jit(pk.split_kv_attention), q, k, v)
        row = dict(section="splitkv", cache=s, block_tokens=block_tokens, heads=HEADS, kv_heads=kv_heads,
                   kv_mb=kv_bytes / 1e6, ms=t * 1e3, tuning=name, default_ms=t_default * 1e3,
                   tb_s=kv_bytes / t / 1e12, default_tb_s=kv_bytes / t_default / 1e12,
                   copy_tb_s=copy_bw / 1e12, fraction_of_copy=kv_bytes / t / copy_bw,
                   cudnn_ms=t_cudnn * 1e3, cudnn_tb_s=kv_bytes / t_cudnn / 1e12, max_abs_diff_vs_cudnn=err)
        for top in (1024, 4096):
            idx, cnt = random_lists(jax.random.key(top), rows=1, items=s, width=top, heads=kv_heads)
            t_g = time_calls(jax.jit(pk.split_kv_gather_attention), q, k, v, idx[:, :, 0], cnt[:, :, 0])
            row[f"gather{top}_ms"] = t_g * 1e3
        rows.append(row)
        print(f"split-KV S={s}: {row}", flush=True)


def scores_section(rows):
    for n, block in ((16384, 128), (16384, 32), (65536, 128)):
        q, k, _ = qkv(n)
        _, lse = pk.flash_attention(q, k, k, return_lse=True)
        t = time_calls(jax.jit(functools.partial(pk.block_scores, block_q=block, block_kv=block)), q, k, lse)
        rows.append(dict(section="scores", kernel="block_scores", n=n, block=block, ms=t * 1e3))
    for n, group in ((16384, 64), (16384, 128)):
        q, k, _ = qkv(n)
        _, lse = pk.flash_attention(q, k, k, return_lse=True)
        t = time_calls(jax.jit(functools.partial(pk.column_scores, group_size=group)), q, k, lse)
        rows.append(dict(section="scores", kernel="column_scores", n=n, block=group, ms=t * 1e3))
    for s in (65536, 131072):
        q, k, _ = qkv(s, kv_heads=8, nq=32, seed=s)
        _, lse = pk.split_kv_attention(q, k, k, return_lse=True)
        t = time_calls(jax.jit(pk.kv_scores), q, k, lse)
        rows.append(dict(section="scores", kernel="kv_scores", n=s, block=32, ms=t * 1e3))
    for r in rows:
        if r["section"] == "scores":
            print(f"scores {r}", flush=True)


def table(meta, rows):
    lines = [f"# Attention kernels vs cuDNN — {meta['device']}, jax {meta['jax']}, {meta['date']}", "",
             "Batch 1, bf16, head_dim 128, bidirectional. Times are medians of bursts of back-to-back jitted "
             "calls; ratios use the cuDNN time from the same run. Sparse patterns are random per (head, row).", ""]
    dense = [r for r in rows if r["section"] == "dense"]
    if dense:
        lines += ["## Dense (32 heads)", "", "| N | cuDNN ms | flash ms (best tiling) | flash / cuDNN | cuDNN TFLOP/s |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['n']} | {r['cudnn_ms']:.3f} | {r['flash_ms']:.3f} ({r['tiling']}) | {r['ratio_to_cudnn']:.2f} "
                  f"| {r['cudnn_tflops']:.0f} |" for r in dense]
        lines.append("")
    block = [r for r in rows if r["section"] == "block"]
    if block:
        lines += [f"## Block-sparse (blocks of {block[0]['block']}, 32 heads)", "",
                  "| N | density | ms | / cuDNN dense | target (1.3 x density) | met |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['n']} | {r['density']:.2f} | {r['ms']:.3f} | {r['ratio_to_cudnn']:.3f} | {r['target_ratio']:.3f} "
                  f"| {'yes' if r['meets_target'] else 'no'} |" for r in block]
        lines.append("")
    column = [r for r in rows if r["section"] == "column"]
    if column:
        lines += [f"## Column-sparse (groups of {column[0]['group']} queries, 32 heads)", "",
                  "| N | density | ms | / cuDNN dense | speed-up vs cuDNN |", "|---|---|---|---|---|"]
        lines += [f"| {r['n']} | {r['density']:.2f} | {r['ms']:.3f} | {r['ratio_to_cudnn']:.3f} | "
                  f"{r['speedup_vs_cudnn']:.2f}x |" for r in column]
        lines.append("")
    split = [r for r in rows if r["section"] == "splitkv"]
    if split:
        lines += ["## Split-KV block attention (32 query tokens, 32 query / 8 KV heads)", "",
                  "| cache | KV MB | split-KV ms (best) | TB/s | default ms | copy TB/s | best / copy | cuDNN ms | cuDNN TB/s "
                  "| gathered 1024 ms | gathered 4096 ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['cache']} | {r['kv_mb']:.0f} | {r['ms']:.3f} ({r['tuning']}) | {r['tb_s']:.2f} | "
                  f"{r['default_ms']:.3f} | {r['copy_tb_s']:.2f} | {r['fraction_of_copy']:.2f} | {r['cudnn_ms']:.3f} | "
                  f"{r['cudnn_tb_s']:.2f} | {r['gather1024_ms']:.3f} | {r['gather4096_ms']:.3f} |" for r in split]
        lines.append("")
    scores = [r for r in rows if r["section"] == "scores"]
    if scores:
        lines += ["## Pattern scores", "", "| kernel | N | block / group | ms |", "|---|---|---|---|"]
        lines += [f"| {r['kernel']} | {r['n']} | {r['block']} | {r['ms']:.3f} |" for r in scores]
        lines.append("")
    errors = [r for r in rows if r["section"] == "error"]
    if errors:
        lines += ["## Tilings that failed", ""] + [f"- {r['label']} {r['tiling']}: {r['error'][:200]}" for r in errors]
    return lines


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", nargs="+", default=["dense", "block", "column", "splitkv", "scores"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--densities", type=float, nargs="+", default=[1.0, 0.5, 0.3, 0.1])
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--cache-lengths", type=int, nargs="+", default=[16384, 65536, 131072])
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    meta = dict(benchmark="attention" + (f"_{args.tag}" if args.tag else ""), device=jax.devices()[0].device_kind,
                jax=jax.__version__, date=datetime.date.today().isoformat(), batch=1, heads=HEADS,
                head_dim=HEAD_DIM, dtype="bfloat16", sections=args.sections)
    print(meta, flush=True)
    rows, cudnn_times = [], {}
    sections = dict(
        dense=lambda: dense_section(args.lengths, rows, cudnn_times),
        block=lambda: block_section(args.lengths, args.densities, args.block, rows, cudnn_times),
        column=lambda: column_section(args.lengths, args.densities, args.group, rows, cudnn_times),
        splitkv=lambda: splitkv_section(args.cache_lengths, rows),
        scores=lambda: scores_section(rows),
    )
    if ("block" in args.sections or "column" in args.sections) and "dense" not in args.sections:
        for n in args.lengths:
            cudnn_times[n] = time_calls(jax.jit(cudnn), *qkv(n))
    for name in args.sections:
        try:
            sections[name]()
        except Exception:  # keep the other sections' numbers
            traceback.print_exc()
            rows.append(dict(section="error", label=name, tiling="section", error=traceback.format_exc()[-500:]))
    write_results(args.out, meta, rows, table(meta, rows))


if __name__ == "__main__":
    main()
