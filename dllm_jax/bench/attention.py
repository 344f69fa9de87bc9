"""`dllm-jax bench`'s attention section: the platform's dense attention against our flash, block-sparse and
column-sparse kernels at several densities of random per-row patterns (batch 1, bf16, bidirectional)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dllm_jax.bench.tables import markdown_table
from dllm_jax.bench.timing import time_calls


@functools.partial(jax.jit, static_argnames=("rows", "items", "width", "heads"))
def random_lists(key, *, rows, items, width, heads):
    """[1, heads, rows, width] distinct sorted random picks from range(items) (all of them at width =
    items), with counts [1, heads, rows] = width."""
    if width == items:
        idx = jnp.broadcast_to(jnp.arange(items, dtype=jnp.int32), (1, heads, rows, items))
    else:
        _, idx = jax.lax.top_k(jax.random.uniform(key, (1, heads, rows, items)), width)
        idx = jnp.sort(idx.astype(jnp.int32), axis=-1)
    return idx, jnp.full((1, heads, rows), width, jnp.int32)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def attention_rows(lengths, densities, *, heads: int, head_dim: int, block: int = 128, group: int = 128,
                   repeats: int = 5):
    import pallas_kernels as pk

    gpu = on_gpu()
    ours = "pallas" if gpu else "reference (jnp; Pallas needs a GPU)"
    flash = pk.flash_attention if gpu else pk.flash_attention_reference
    block_sparse = pk.block_sparse_attention if gpu else pk.block_sparse_attention_reference
    column_sparse = pk.column_sparse_attention if gpu else pk.column_sparse_attention_reference
    baseline = "cudnn" if gpu else "xla"
    rows = []
    for n in lengths:
        keys = jax.random.split(jax.random.key(n), 4)
        q, k, v = (jax.random.normal(kk, (1, n, heads, head_dim), jnp.bfloat16) for kk in keys[:3])
        dense = jax.jit(functools.partial(jax.nn.dot_product_attention, implementation=baseline))
        t_dense = time_calls(dense, q, k, v, repeats=repeats)
        t_flash = time_calls(jax.jit(flash), q, k, v, repeats=repeats)
        row = dict(section="attention", n=n, heads=heads, head_dim=head_dim, baseline=baseline, kernels=ours, dense_ms=t_dense * 1e3,
                   flash_ms=t_flash * 1e3, block_sparse_ms={}, column_sparse_ms={})
        nb, ng = -(-n // block), -(-n // group)
        for d in densities:
            idx, cnt = random_lists(keys[3], rows=nb, items=nb, width=max(1, round(d * nb)), heads=heads)
            fn = jax.jit(functools.partial(block_sparse, block_q=block, block_kv=block))
            row["block_sparse_ms"][str(d)] = time_calls(fn, q, k, v, idx, cnt, repeats=repeats) * 1e3
            idx, cnt = random_lists(keys[3], rows=ng, items=n, width=max(1, round(d * n)), heads=heads)
            fn = jax.jit(functools.partial(column_sparse, group_size=group))
            row["column_sparse_ms"][str(d)] = time_calls(fn, q, k, v, idx, cnt, repeats=repeats) * 1e3
        print(f"attention N={n}: {baseline} {t_dense * 1e3:.3f} ms, flash {t_flash * 1e3:.3f} ms", flush=True)
        rows.append(row)
    return rows



def attention_markdown(attention: list[dict]) -> list[str]:
    """The section's table: per length, dense time and each kernel's time with its ratio to dense."""
    first = attention[0]
    densities = list(first["block_sparse_ms"])
    header = ["N", f"{first['baseline']} dense", "flash", *(f"block-sparse d={d}" for d in densities),
              *(f"column-sparse d={d}" for d in densities)]
    rows = []
    for r in attention:
        cell = lambda ms: f"{ms:.3f} ms ({r['dense_ms'] / ms:.2f}×)"
        rows.append([r["n"], f"{r['dense_ms']:.3f} ms", cell(r["flash_ms"]),
                     *(cell(r["block_sparse_ms"][d]) for d in densities),
                     *(cell(r["column_sparse_ms"][d]) for d in densities)])
    return [f"## Attention (batch 1, {first['heads']} heads, head_dim {first['head_dim']}, bf16, "
            f"bidirectional; ours: {first['kernels']})", "",
            f"Ratio = {first['baseline']} dense time / time (> 1 is faster). Sparse patterns are random "
            "per (head, row): blocks of 128 / groups of 128 queries, at density d.", "",
            *markdown_table(header, rows), ""]
