"""MAGE's selection at SDAR-8B shapes (issue 40): the top k positions of every (row, KV head) against a long
cache, found by `lax.top_k` (sort), by a tournament over tile maxima (tiles) and by the radix threshold
(`dllm_jax.attention.select`), alone and as the whole selection step (`select_prefix` with the LSE given: the
Eq. 3 scores over the cache, then the top k); on a GPU also the Eq. 3 scores kernel alone at several key tiles per
program, and the first step's split-KV pass with its scores computed from the logits it writes against
`kv_scores` reading the keys again. Every tiles and threshold result is checked equal to the sort's in the same run.

    PYTHONPATH=. python -m benchmarks.mage_select --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from dllm_jax.attention.mage import select_prefix
from dllm_jax.attention.select import top_k_positions
from dllm_jax.bench.results import write_results
from dllm_jax.bench.tables import markdown_table
from dllm_jax.bench.timing import time_calls
from dllm_jax.generate.block_loop import cache_capacity

SHAPE = dict(queries=4, heads=32, kv_heads=8, head_dim=128)  # one SDAR-8B block
CHUNKS = (2048, 4096, 8192, 16384)  # the sort's chunk lengths timed (4096 chosen by session 18's H200 run)
TILES = (4, 8, 16)  # the tournament's tile lengths timed
SCORE_TILES = (1, 2, 8)  # kv_scores' key tiles per program timed (8 was the default before session 18)
BITS = (2, 4)  # 1 bit per pass measured slower at batches 1 and 4 (H100 probe, issue 40); 8: 255 compares per entry


def top_k_rows(batch: int, length: int, k: int) -> list[dict]:
    """The top k alone over [batch, kv_heads, length] f32 scores: sort with the whole row sorted, sort by each of
    CHUNKS (`select.SORT_CHUNK` is the default), the tournament over tile maxima at each TILES, the threshold at
    each BITS, then the Pallas kernel."""
    scores = jax.random.uniform(jax.random.key(length + batch), (batch, SHAPE["kv_heads"], length), jnp.float32)
    point = dict(part="top-k", batch=batch, length=length, k=k)
    sort = jax.jit(functools.partial(top_k_positions, k=k, method="sort", chunk=length))  # one sort per row
    want = np.asarray(sort(scores))
    rows = [dict(point, method="sort (whole rows)", ms=time_calls(sort, scores) * 1e3, equal=True)]
    for chunk in (c for c in CHUNKS if k <= c < length):
        fn = jax.jit(functools.partial(top_k_positions, k=k, method="sort", chunk=chunk))
        rows.append(dict(point, method=f"sort/chunks of {chunk}", ms=time_calls(fn, scores) * 1e3,
                         equal=bool(np.array_equal(np.asarray(fn(scores)), want))))
    for tile in TILES:
        fn = jax.jit(functools.partial(top_k_positions, k=k, method="tiles", tile=tile))
        rows.append(dict(point, method=f"tiles of {tile}", ms=time_calls(fn, scores) * 1e3,
                         equal=bool(np.array_equal(np.asarray(fn(scores)), want))))
    for bits in BITS:
        fn = jax.jit(functools.partial(top_k_positions, k=k, method="threshold", bits=bits))
        rows.append(dict(point, method=f"threshold/{bits}", ms=time_calls(fn, scores) * 1e3,
                         equal=bool(np.array_equal(np.asarray(fn(scores)), want))))
    kernel = pk.top_k_positions if jax.default_backend() == "gpu" else pk.top_k_positions_reference  # Triton: GPUs
    fn = jax.jit(functools.partial(kernel, k=k))  # the Pallas kernel MAGE does not use
    rows.append(dict(point, method="kernel", ms=time_calls(fn, scores) * 1e3,
                     equal=bool(np.array_equal(np.asarray(fn(scores)), want))))
    return rows


def score_rows(batch: int, length: int) -> list[dict]:
    """The Eq. 3 scores alone (`pallas_kernels.kv_scores`, a GPU kernel) at each SCORE_TILES key tiles per program of
    64 keys, against a bf16 cache of `generate`'s capacity; each checked against the default's output."""
    from pallas_kernels.kv_scores import TILES_PER_PROGRAM, kv_scores

    q, cache, prefix, lse, capacity = selection_inputs(batch, length)
    point = dict(part="scores", batch=batch, length=length, k=0, capacity=capacity)
    want = np.asarray(kv_scores(q, cache, lse, kv_len=prefix))
    rows = []
    for tiles in sorted({TILES_PER_PROGRAM, *SCORE_TILES}):
        fn = jax.jit(lambda q, c, p, l, t=tiles: kv_scores(q, c, l, kv_len=p, tiles_per_program=t))
        ms = time_calls(fn, q, cache, prefix, lse) * 1e3
        rows.append(dict(point, method="default" if tiles == TILES_PER_PROGRAM else f"{tiles} tiles per program",
                         ms=ms, tb_s=batch * length * SHAPE["kv_heads"] * SHAPE["head_dim"] * 2 / ms / 1e9,
                         equal=bool(np.allclose(np.asarray(fn(q, cache, prefix, lse)), want, rtol=1e-5, atol=0))))
    return rows


def pass_rows(batch: int, length: int) -> list[dict]:
    """MAGE's first step over the prefix and its Eq. 3 scores: the split-KV pass, then `kv_scores` reading the keys
    again; against the pass writing its logits (`return_logits`) and `kv_scores_from_logits` (GPU kernels)."""
    from pallas_kernels import kv_scores, kv_scores_from_logits, split_kv_attention

    q, cache, prefix, _, capacity = selection_inputs(batch, length)
    point = dict(part="pass + scores", batch=batch, length=length, k=0, capacity=capacity)

    def twice(q, c, p):
        o, lse = split_kv_attention(q, c, c, kv_len=p, return_lse=True)
        return o, kv_scores(q, c, lse, kv_len=p)

    def once(q, c, p):
        o, lse, logits = split_kv_attention(q, c, c, kv_len=p, return_lse=True, return_logits=True)
        return o, kv_scores_from_logits(logits, lse, kv_len=p)

    rows, want = [], None
    for name, fn in (("default", jax.jit(twice)), ("from the pass's logits", jax.jit(once))):
        got = np.asarray(fn(q, cache, prefix)[1])
        want = got if want is None else want
        rows.append(dict(point, method=name, ms=time_calls(fn, q, cache, prefix) * 1e3,
                         equal=bool(np.allclose(got, want, rtol=1e-4, atol=1e-12))))
    return rows


def selection_inputs(batch: int, length: int):
    """(q, cache, prefix lengths, LSE, capacity): one SDAR-8B block against a random bf16 cache of `generate`'s
    capacity, the prefix `length` keys long."""
    capacity = cache_capacity(length + SHAPE["queries"], SHAPE["queries"])
    keys = jax.random.split(jax.random.key(length), 3)
    q = jax.random.normal(keys[0], (batch, SHAPE["queries"], SHAPE["heads"], SHAPE["head_dim"]), jnp.bfloat16)
    cache = jax.random.normal(keys[1], (batch, capacity, SHAPE["kv_heads"], SHAPE["head_dim"]), jnp.bfloat16)
    lse = 10 + jax.random.uniform(keys[2], (batch, SHAPE["heads"], SHAPE["queries"]), jnp.float32)
    return q, cache, jnp.full((batch,), length, jnp.int32), lse, capacity


def selection_rows(batch: int, length: int, k: int) -> list[dict]:
    """MAGE's selection step (scores over the prefix, then the top k) against a bf16 cache of `generate`'s
    capacity, the prefix `length` keys long."""
    q, cache, prefix, lse, capacity = selection_inputs(batch, length)
    point = dict(part="selection", batch=batch, length=length, k=k, capacity=capacity)
    rows, want = [], None
    for select_by in ("sort", "tiles", "threshold"):
        fn = jax.jit(lambda q, c, p, l, s=select_by: select_prefix(q, c, prefix_len=p, k=k, lse=l, select_by=s))
        got = np.asarray(fn(q, cache, prefix, lse))
        want = got if want is None else want
        rows.append(dict(point, method=select_by, ms=time_calls(fn, q, cache, prefix, lse) * 1e3,
                         equal=bool(np.array_equal(got, want))))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--ks", type=int, nargs="+", default=[512])
    args = parser.parse_args()
    rows = []
    for length in args.lengths:
        for batch in args.batches:
            for k in args.ks:
                rows += top_k_rows(batch, length, k)
                print(rows[-1], flush=True)
            rows += selection_rows(batch, length, 512)
            print(rows[-1], flush=True)
            if jax.default_backend() == "gpu":  # a Pallas GPU kernel
                rows += score_rows(batch, length) + pass_rows(batch, length)
                print(rows[-1], flush=True)
    meta = dict(benchmark="mage_select", device=jax.devices()[0].device_kind, jax=jax.__version__,
                date=datetime.date.today().isoformat(), shape=SHAPE, timing="time_calls (median of jitted calls)")
    base = {(r["part"], r["batch"], r["length"], r["k"]): r["ms"] for r in rows
            if r["method"] in ("sort", "sort (whole rows)", "default")}
    cells = [[r["part"], r["batch"], r["length"], r["k"], r["method"], f"{r['ms']:.3f}",
              f"{base[(r['part'], r['batch'], r['length'], r['k'])] / r['ms']:.2f}x", "yes" if r["equal"] else "NO"]
             for r in rows]
    lines = [f"# MAGE's top-k selection, {meta['device']}, jax {meta['jax']}, {meta['date']}", "",
             f"{SHAPE}. top-k: the k largest of f32 scores [batch, kv_heads, length], ascending positions; "
             "selection: `select_prefix` with the LSE given (the Eq. 3 scores over a bf16 cache of `generate`'s "
             "capacity, then the top k). sort (whole rows): one sort per row; sort/chunks of c: the top k of each "
             "c-long chunk, then of the candidates (`sort` on a GPU above SORT_CHUNK). tiles of t: the top k "
             "of t-long tiles' maxima (recursively), then of the k best tiles' entries. threshold/b: the "
             "radix threshold fixing b bits per counting pass. scores (GPU only): the Eq. 3 scores alone, by key tiles "
             "per program (speed-up against the default; equal: within 1e-5 of its output). pass + scores (GPU "
             "only): the split-KV pass over the prefix and the scores, by kv_scores (the keys read again) or from the "
             "logits the pass writes (equal: scores within 1e-4). "
             "Speed-up against sort in the same run; equal: the same positions as sort.", "",
             *markdown_table(["part", "batch", "length", "k", "method", "ms", "vs sort (scores: vs default)", "equal"],
                             cells)]
    write_results(args.out, meta, rows, lines)


if __name__ == "__main__":
    main()
