"""Attention kernels against cuDNN on the GPU (batch 1, bf16, head_dim 128, bidirectional).

Sections (all timed in the same run, medians of bursts of back-to-back calls; cuDNN is timed once
per N and shared by the sections):
  dense   cuDNN (`jax.nn.dot_product_attention(cudnn)`), our Triton flash (FLASH_TILINGS, best kept)
          and our Mosaic GPU flash over the MOSAIC_SWEEP tilings that fit shared memory (each
          reported, the best kept and written into its row: autotuned block sizes and pipeline
          depth per N), and the fused SparseD estimation kernel (`flash_block_mass`, 128-key
          tiles); 32 heads, N in --lengths; target Mosaic <= 1.00 x cuDNN;
  block   block-sparse with random per-(head, query block) key-block lists at each density
          (blocks of --block), Triton (SPARSE_TUNINGS) and Mosaic (MOSAIC_SPARSE_STAGES), each
          as time / (density x cuDNN), target <= 1.10;
  column  column-sparse (Triton) with random per-(head, group) column lists at each density, N in
          --column-lengths, as time / (density x cuDNN), target <= 1.20;
  splitkv a 32-token block, 32 query / 8 KV heads, against a KV cache of each --cache-lengths:
          achieved read bandwidth (K and V bytes / time) of split-KV attention and of cuDNN, next to
          the device's copy bandwidth (read + write bytes / time of a negation); also the gathered
          form over 1024 / 4096 keys (MAGE's k);
  scores  the pattern-score kernels (block pooling, column mass, KV-head mass).
The results files are rewritten after each section, so a run cut short keeps what it measured.

    PYTHONPATH=. python -m benchmarks.attention --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import traceback
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from pallas_kernels import mosaic
from dllm_jax.bench import markdown_table, time_calls, write_results
from dllm_jax.bench import random_lists

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the Pallas Triton backend warns on use

HEADS, HEAD_DIM, DTYPE = 32, 128, jnp.bfloat16
FLASH_TILINGS = [(128, 128, 8, 3), (128, 128, 8, 2)]
SPARSE_TUNINGS = [(8, 3, False), (8, 3, True), (4, 3, True)]  # (warps, stages, preload)
# (block_cols, warps, stages, prefetch); 256 columns need 296 KB of shared memory at head_dim 128 (sm90: 227)
COLUMN_TUNINGS = [(64, 8, 2, False), (128, 8, 2, True), (128, 8, 3, True), (128, 4, 2, True)]
MOSAIC_SWEEP = [mosaic.Tiling(block_kv=bk, stages=s) for bk in (64, 128) for s in (2, 3, 4)]
MOSAIC_SPARSE_STAGES = (2, 3)
# issue 18's targets: dense time / cuDNN; sparse time / (density x cuDNN)
TARGETS = dict(dense=1.00, block=1.10, column=1.20)


def randn(key, shape):
    return jax.jit(lambda k: jax.random.normal(k, shape, DTYPE), static_argnums=())(key)


def qkv(n, heads=HEADS, kv_heads=HEADS, nq=None, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (randn(keys[0], (1, nq or n, heads, HEAD_DIM)), randn(keys[1], (1, n, kv_heads, HEAD_DIM)),
            randn(keys[2], (1, n, kv_heads, HEAD_DIM)))




def best(candidates, rows, label):
    """Times each (name, fn, args) candidate; returns (best seconds, best name, {name: ms}), or
    (None, None, {}) when none ran; errors (e.g. a tiling that does not compile) are reported."""
    results = {}
    for name, fn, args in candidates:
        try:
            results[name] = time_calls(fn, *args)
            print(f"  {label} {name}: {results[name] * 1e3:.3f} ms", flush=True)
        except Exception as e:  # a tiling that fails to compile is reported, not fatal
            print(f"  {label} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            rows.append(dict(section="error", label=label, tiling=name, error=str(e)[:500]))
    if not results:
        return None, None, {}
    name = min(results, key=results.get)
    return results[name], name, {n: t * 1e3 for n, t in results.items()}


def fitting(tilings, rows, label):
    """{name: tiling} of the Mosaic tilings whose shared memory fits (`Tiling.check`); the others
    are reported and skipped."""
    kept = {}
    for t in tilings:
        name = f"{t.block_q}x{t.block_kv} s{t.stages}"
        try:
            t.check(HEAD_DIM, jnp.dtype(DTYPE).itemsize)
            kept[name] = t
        except ValueError as e:
            print(f"  {label} {name}: skipped ({e})", flush=True)
            rows.append(dict(section="error", label=label, tiling=name, error=f"skipped: {e}"))
    return kept


def ms(t):
    return None if t is None else t * 1e3


def over(t, base):
    return None if t is None else t / base


def met(ratio, target):
    return None if ratio is None else ratio <= target


@jax.jit
def max_abs_diff(a, b):
    return jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()


def cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")


def cudnn_time(cudnn_times, q, k, v):
    """Seconds of cuDNN dense attention at these inputs' N, timed once per run and shared."""
    n = q.shape[1]
    if n not in cudnn_times:
        cudnn_times[n] = time_calls(jax.jit(cudnn), q, k, v)
        print(f"cuDNN N={n}: {cudnn_times[n] * 1e3:.3f} ms", flush=True)
    return cudnn_times[n]


def dense_section(lengths, rows, cudnn_times):
    tilings = fitting(MOSAIC_SWEEP, rows, "mosaic flash")
    for n in lengths:
        q, k, v = qkv(n)
        t_cudnn = cudnn_time(cudnn_times, q, k, v)
        flops = 4 * n * n * HEADS * HEAD_DIM
        triton = {f"{bq}x{bk} w{w} s{s}": jax.jit(functools.partial(
            pk.flash_attention, backend="triton", block_q=bq, block_kv=bk, num_warps=w, num_stages=s))
            for bq, bk, w, s in FLASH_TILINGS}
        t_triton, triton_name, triton_sweep = best([(name, fn, (q, k, v)) for name, fn in triton.items()], rows,
                                                   f"triton flash N={n}")
        mosaic_fns = {name: jax.jit(functools.partial(pk.flash_attention, backend="mosaic", tiling=t))
                      for name, t in tilings.items()}
        t_mosaic, mosaic_name, mosaic_sweep = best([(name, fn, (q, k, v)) for name, fn in mosaic_fns.items()], rows,
                                                   f"mosaic flash N={n}")
        mass = jax.jit(functools.partial(pk.flash_block_mass, block_kv=128))
        t_mass, _, _ = best([("block_kv 128", mass, (q, k, v))], rows, f"fused mass N={n}")
        ref = jax.jit(cudnn)(q, k, v)

        def diff(fn):
            return float(max_abs_diff(fn(q, k, v), ref))

        mosaic_ratio = over(t_mosaic, t_cudnn)
        rows.append(dict(
            section="dense", n=n, cudnn_ms=t_cudnn * 1e3, cudnn_tflops=flops / t_cudnn / 1e12,
            triton_ms=ms(t_triton), triton_tiling=triton_name, triton_ratio=over(t_triton, t_cudnn),
            triton_sweep_ms=triton_sweep,
            triton_max_abs_diff_vs_cudnn=None if t_triton is None else diff(triton[triton_name]),
            mosaic_ms=ms(t_mosaic), mosaic_ratio=mosaic_ratio, target_ratio=TARGETS["dense"],
            mosaic_met=met(mosaic_ratio, TARGETS["dense"]),
            mosaic_tiling=None if t_mosaic is None else dataclasses.asdict(tilings[mosaic_name]),
            mosaic_sweep_ms=mosaic_sweep, mosaic_tflops=None if t_mosaic is None else flops / t_mosaic / 1e12,
            mosaic_max_abs_diff_vs_cudnn=None if t_mosaic is None else diff(mosaic_fns[mosaic_name]),
            fused_mass_ms=ms(t_mass), fused_mass_ratio=over(t_mass, t_cudnn),
            fused_mass_max_abs_diff_vs_cudnn=None if t_mass is None else diff(lambda *a: mass(*a)[0])))


def block_section(lengths, densities, block, rows, cudnn_times):
    tilings = fitting([mosaic.Tiling(block_kv=block, stages=s) for s in MOSAIC_SPARSE_STAGES], rows,
                      "mosaic block-sparse")
    stages = {name: t.stages for name, t in tilings.items()}
    target = TARGETS["block"]
    for n in lengths:
        q, k, v = qkv(n)
        t_cudnn = cudnn_time(cudnn_times, q, k, v)
        n_b = -(-n // block)
        sparse = functools.partial(pk.block_sparse_attention, block_q=block, block_kv=block)
        for d in densities:
            width = max(1, round(d * n_b))
            idx, cnt = random_lists(jax.random.key(n + width), rows=n_b, items=n_b, width=width, heads=HEADS)
            args = (q, k, v, idx, cnt)
            triton = {f"w{w} s{s}{' preload' if p else ''}": jax.jit(functools.partial(
                sparse, backend="triton", num_warps=w, num_stages=s, preload_indices=p)) for w, s, p in SPARSE_TUNINGS}
            t_triton, triton_name, triton_sweep = best([(name, fn, args) for name, fn in triton.items()], rows,
                                                       f"triton block N={n} d={d}")
            mosaic_fns = {name: jax.jit(functools.partial(sparse, backend="mosaic", stages=s))
                          for name, s in stages.items()}
            t_mosaic, mosaic_name, mosaic_sweep = best([(name, fn, args) for name, fn in mosaic_fns.items()], rows,
                                                       f"mosaic block N={n} d={d}")
            real_d = width / n_b
            ideal = real_d * t_cudnn
            triton_ratio, mosaic_ratio = over(t_triton, ideal), over(t_mosaic, ideal)
            agree = (None if t_triton is None or t_mosaic is None
                     else float(max_abs_diff(mosaic_fns[mosaic_name](*args), triton[triton_name](*args))))
            rows.append(dict(
                section="block", n=n, density=real_d, block=block, cudnn_ms=t_cudnn * 1e3, ideal_ms=ideal * 1e3,
                target_ratio=target, triton_ms=ms(t_triton), triton_tuning=triton_name, triton_sweep_ms=triton_sweep,
                triton_ratio=triton_ratio, triton_met=met(triton_ratio, target), mosaic_ms=ms(t_mosaic),
                mosaic_stages=None if t_mosaic is None else stages[mosaic_name], mosaic_sweep_ms=mosaic_sweep,
                mosaic_ratio=mosaic_ratio, mosaic_met=met(mosaic_ratio, target), mosaic_vs_triton_max_abs_diff=agree))
            del idx, cnt


def column_section(lengths, densities, group, rows, cudnn_times):
    target = TARGETS["column"]
    for n in lengths:
        q, k, v = qkv(n)
        t_cudnn = cudnn_time(cudnn_times, q, k, v)
        n_g = -(-n // group)
        for d in densities:
            width = max(128, round(d * n / 128) * 128)
            idx, cnt = random_lists(jax.random.key(n + width + 1), rows=n_g, items=n, width=min(width, n),
                                    heads=HEADS)
            cands = [(f"cols{bc} w{w} s{s}{' prefetch' if p else ''}", jax.jit(functools.partial(
                pk.column_sparse_attention, group_size=group, block_cols=bc, num_warps=w, num_stages=s,
                prefetch_indices=p)), (q, k, v, idx, cnt)) for bc, w, s, p in COLUMN_TUNINGS]
            t, name, sweep = best(cands, rows, f"column N={n} d={d}")
            del idx, cnt
            if t is None:
                continue
            real_d = min(width, n) / n
            ratio = t / (real_d * t_cudnn)
            rows.append(dict(section="column", n=n, density=real_d, group=group, ms=t * 1e3, tuning=name,
                             sweep_ms=sweep, cudnn_ms=t_cudnn * 1e3, ideal_ms=real_d * t_cudnn * 1e3, ratio=ratio,
                             target_ratio=target, met=ratio <= target, speedup_vs_cudnn=t_cudnn / t))


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
        t, name, _ = best(cands, rows, f"split-KV S={s}")
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


def num(x, digits=3, missing="failed"):
    return missing if x is None else f"{x:.{digits}f}"


def paren(x, prefix=""):
    return "" if x is None else f" ({prefix}{x})"


def yes(x):
    return "n/a" if x is None else ("yes" if x else "no")


def table(meta, rows):
    lines = [f"# Attention kernels vs cuDNN — {meta['device']}, jax {meta['jax']}, {meta['date']}", "",
             f"Batch 1, {HEADS} heads, head_dim {HEAD_DIM}, bf16, bidirectional, Nq = Nk = N. Times are medians of "
             "bursts of back-to-back jitted calls; ratios use the cuDNN time from the same run. Sparse patterns are "
             "random per (head, query block / group); sparse ratios are time / (density x cuDNN).", ""]
    dense = [r for r in rows if r["section"] == "dense"]
    if dense:
        lines += [f"## Dense (target: Mosaic <= {TARGETS['dense']:.2f} x cuDNN)", "",
                  *markdown_table(["N", "cuDNN ms", "Triton ms (tiling)", "Triton / cuDNN", "Mosaic ms",
                                   "Mosaic / cuDNN", "met", "Mosaic tiling (block_q x block_kv, stages)",
                                   "Mosaic max abs diff vs cuDNN", "fused mass ms", "mass / cuDNN", "cuDNN TFLOP/s"],
                                  [dense_cells(r) for r in dense]),
                  "", "Mosaic tiling sweep (the autotuning behind the chosen tiling):", "",
                  *markdown_table(["N", "tiling", "ms", "/ cuDNN"],
                                  [[r["n"], name, f"{t:.3f}", f"{t / r['cudnn_ms']:.3f}"]
                                   for r in dense for name, t in r["mosaic_sweep_ms"].items()]), ""]
    block = [r for r in rows if r["section"] == "block"]
    if block:
        lines += [f"## Block-sparse (blocks of {block[0]['block']}; target time / (density x cuDNN) <= "
                  f"{TARGETS['block']:.2f})", "",
                  *markdown_table(["N", "density", "cuDNN x density ms", "Triton ms (tuning)", "Triton ratio",
                                   "Triton met", "Mosaic ms (stages)", "Mosaic ratio", "Mosaic met",
                                   "Mosaic vs Triton max abs diff"], [block_cells(r) for r in block]), ""]
    column = [r for r in rows if r["section"] == "column"]
    if column:
        lines += [f"## Column-sparse, Triton (groups of {column[0]['group']} queries; target time / (density x cuDNN) "
                  f"<= {TARGETS['column']:.2f})", "",
                  *markdown_table(["N", "density", "cuDNN x density ms", "ms (tuning)", "ratio", "met",
                                   "speed-up vs cuDNN"],
                                  [[r["n"], f"{r['density']:.3f}", f"{r['ideal_ms']:.3f}", f"{r['ms']:.3f} ({r['tuning']})",
                                    f"{r['ratio']:.3f}", yes(r["met"]), f"{r['speedup_vs_cudnn']:.2f}x"]
                                   for r in column]), ""]
    split = [r for r in rows if r["section"] == "splitkv"]
    if split:
        lines += ["## Split-KV block attention (32 query tokens, 32 query / 8 KV heads)", "",
                  *markdown_table(["cache", "KV MB", "split-KV ms (best)", "TB/s", "default ms", "copy TB/s",
                                   "best / copy", "cuDNN ms", "cuDNN TB/s", "gathered 1024 ms", "gathered 4096 ms"],
                                  [splitkv_cells(r) for r in split]), ""]
    scores = [r for r in rows if r["section"] == "scores"]
    if scores:
        lines += ["## Pattern scores", "",
                  *markdown_table(["kernel", "N", "block / group", "ms"],
                                  [[r["kernel"], r["n"], r["block"], f"{r['ms']:.3f}"] for r in scores]), ""]
    errors = [r for r in rows if r["section"] == "error"]
    if errors:
        lines += ["## Tilings skipped or failed", ""] + [f"- {r['label']} {r['tiling']}: {r['error'][:200]}" for r in errors]
    return lines


def dense_cells(r: dict) -> list[str]:
    tiling = r["mosaic_tiling"]
    tiling = "" if tiling is None else f"{tiling['block_q']} x {tiling['block_kv']}, {tiling['stages']}"
    return [r["n"], f"{r['cudnn_ms']:.3f}", f"{num(r['triton_ms'])}{paren(r['triton_tiling'])}", num(r["triton_ratio"]),
            num(r["mosaic_ms"]), num(r["mosaic_ratio"]), yes(r["mosaic_met"]), tiling,
            num(r["mosaic_max_abs_diff_vs_cudnn"], 4), num(r["fused_mass_ms"]), num(r["fused_mass_ratio"]),
            f"{r['cudnn_tflops']:.0f}"]


def block_cells(r: dict) -> list[str]:
    return [r["n"], f"{r['density']:.3f}", f"{r['ideal_ms']:.3f}", f"{num(r['triton_ms'])}{paren(r['triton_tuning'])}",
            num(r["triton_ratio"]), yes(r["triton_met"]), f"{num(r['mosaic_ms'])}{paren(r['mosaic_stages'], 's')}",
            num(r["mosaic_ratio"]), yes(r["mosaic_met"]), num(r["mosaic_vs_triton_max_abs_diff"], 4, "n/a")]


def splitkv_cells(r: dict) -> list[str]:
    return [r["cache"], f"{r['kv_mb']:.0f}", f"{r['ms']:.3f} ({r['tuning']})", f"{r['tb_s']:.2f}", f"{r['default_ms']:.3f}",
            f"{r['copy_tb_s']:.2f}", f"{r['fraction_of_copy']:.2f}", f"{r['cudnn_ms']:.3f}", f"{r['cudnn_tb_s']:.2f}",
            f"{r['gather1024_ms']:.3f}", f"{r['gather4096_ms']:.3f}"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", nargs="+", default=["dense", "block", "column"],
                        choices=["dense", "block", "column", "splitkv", "scores"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536], help="N of dense and block")
    parser.add_argument("--column-lengths", type=int, nargs="+", default=[65536])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.3, 0.1])
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--cache-lengths", type=int, nargs="+", default=[16384, 65536, 131072])
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    meta = dict(benchmark="attention" + (f"_{args.tag}" if args.tag else ""), device=jax.devices()[0].device_kind,
                jax=jax.__version__, date=datetime.date.today().isoformat(), batch=1, heads=HEADS,
                head_dim=HEAD_DIM, dtype="bfloat16", sections=args.sections, lengths=args.lengths,
                column_lengths=args.column_lengths, densities=args.densities, block=args.block, group=args.group,
                targets=TARGETS, mosaic_sweep=[dataclasses.asdict(t) for t in MOSAIC_SWEEP])
    print(meta, flush=True)
    rows, cudnn_times = [], {}
    sections = dict(
        dense=lambda: dense_section(args.lengths, rows, cudnn_times),
        block=lambda: block_section(args.lengths, args.densities, args.block, rows, cudnn_times),
        column=lambda: column_section(args.column_lengths, args.densities, args.group, rows, cudnn_times),
        splitkv=lambda: splitkv_section(args.cache_lengths, rows),
        scores=lambda: scores_section(rows),
    )
    for name in args.sections:
        try:
            sections[name]()
        except Exception:  # keep the other sections' numbers
            traceback.print_exc()
            rows.append(dict(section="error", label=name, tiling="section", error=traceback.format_exc()[-500:]))
        write_results(args.out, meta, rows, table(meta, rows))  # after each section: a cut-short run keeps it


if __name__ == "__main__":
    main()
