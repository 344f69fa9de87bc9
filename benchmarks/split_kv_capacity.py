"""Split-KV attention against a 128k-key cache whose capacity is, or is not, a multiple of the key tile
(issue 40): time per call, the K/V read rate against the copy rate of the same run, and the error against
the jnp reference. Before issue 40 a capacity off the 128-key tile was padded (a copy of the whole cache
per call); the kernel now reads any capacity in place.

    PYTHONPATH=. python -m benchmarks.split_kv_capacity --out benchmarks/results
"""

import argparse
import datetime
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from dllm_jax.bench.results import write_results
from dllm_jax.bench.tables import markdown_table
from dllm_jax.bench.timing import time_calls

SHAPE = dict(queries=4, heads=32, kv_heads=8, head_dim=128)  # one SDAR-8B block
CAPACITIES = (131096, 131200)  # 128k + 24 (what the mage128k section allocated); 1025 whole tiles of 128


def measure(batch: int, capacity: int) -> dict:
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((batch, SHAPE["queries"], SHAPE["heads"], SHAPE["head_dim"])), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((batch, capacity, SHAPE["kv_heads"], SHAPE["head_dim"])), jnp.bfloat16)
            for _ in range(2))
    length = jnp.full((batch,), capacity - 20, jnp.int32)
    attend = jax.jit(lambda q, k, v, n: pk.split_kv_attention(q, k, v, kv_len=n))
    expected = pk.split_kv_attention_reference(q, k, v, kv_len=length).astype(jnp.float32)
    err = float(jnp.max(jnp.abs(attend(q, k, v, length).astype(jnp.float32) - expected)))
    seconds = time_calls(attend, q, k, v, length)
    tile = -(-capacity // 128) * 128  # the copy the kernel made before issue 40: pad to whole tiles, then attend
    pad = lambda x: jnp.pad(x, [(0, 0), (0, tile - capacity), (0, 0), (0, 0)])
    attend_padded = jax.jit(lambda q, k, v, n: pk.split_kv_attention(q, pad(k), pad(v), kv_len=n))
    padded = time_calls(attend_padded, q, k, v, length)
    copy = time_calls(jax.jit(lambda x: x * 1), k)  # reads and writes one cache array: K + V bytes moved
    kv_bytes = 2 * k.size * k.dtype.itemsize
    return dict(batch=batch, capacity=capacity, split_kv_ms=seconds * 1e3, padded_before_ms=padded * 1e3,
                read_tb_s=kv_bytes / seconds / 1e12, copy_tb_s=kv_bytes / copy / 1e12, read_vs_copy=copy / seconds,
                max_abs_err=err)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    rows = [measure(batch, capacity) for batch in (1, 4) for capacity in CAPACITIES]
    meta = dict(benchmark="split_kv_capacity", device=jax.devices()[0].device_kind, jax=jax.__version__,
                date=datetime.date.today().isoformat(), shape=SHAPE, dtype="bfloat16", kv_len="capacity - 20",
                timing="time_calls (median of jitted calls)")
    cells = [[r["batch"], r["capacity"], f"{r['split_kv_ms']:.3f}", f"{r['padded_before_ms']:.3f}",
              f"{r['read_tb_s']:.2f}", f"{r['copy_tb_s']:.2f}", f"{r['read_vs_copy']:.2f}", f"{r['max_abs_err']:.1e}"]
             for r in rows]
    lines = [f"# Split-KV at 128k keys: capacity on and off the key tile, {meta['device']}, jax {meta['jax']}, "
             f"{meta['date']}", "",
             f"{SHAPE}, bf16, kv_len = capacity - 20. Read: K + V bytes / time; copy: `x * 1` of one cache "
             "array (its read + write, the same bytes) in the same run. Padded: the program before issue 40 "
             "(the cache padded to whole 128-key tiles, then attended), same run.", "",
             *markdown_table(["batch", "capacity", "split-KV ms", "padded, as before (ms)", "read TB/s", "copy TB/s",
                              "read / copy", "max abs err"], cells)]
    write_results(args.out, meta, rows, lines)


if __name__ == "__main__":
    main()
