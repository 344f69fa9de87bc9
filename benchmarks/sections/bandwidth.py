"""Section `copy`: the copy bandwidth of the device, which every bandwidth row is a fraction of."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from dllm_jax.bench import time_calls

from .tables import markdown_table

SECTION = "copy"


def copy_bandwidth(nbytes: int, *, repeats: int = 10) -> dict:
    """Copy bandwidth of the default device: a bf16 array of `nbytes` copied under jit (XLA emits a
    copy: the output cannot alias an undonated input), (read + written bytes) / median time; the same
    for an elementwise negation (a streaming kernel rather than a memcpy)."""
    x = jnp.ones((nbytes // 2 // 1024, 1024), jnp.bfloat16)  # 2-D: no single axis near 2**31
    copy_s = time_calls(jax.jit(jnp.copy), x, repeats=repeats, warmup=1)
    negate_s = time_calls(jax.jit(jnp.negative), x, repeats=repeats, warmup=1)
    del x
    return dict(bytes=nbytes, copy_ms=copy_s * 1e3, copy_tb_s=2 * nbytes / copy_s / 1e12,
                elementwise_ms=negate_s * 1e3, elementwise_tb_s=2 * nbytes / negate_s / 1e12)


def table(meta: dict, rows: list[dict]) -> list[str]:
    lines = ["## Copy bandwidth", ""]
    lines += markdown_table(["array", "copy", "elementwise (negate)"],
                            [[f"{r['bytes'] / 2**30:.2f} GiB", f"{r['copy_tb_s']:.2f} TB/s ({r['copy_ms']:.2f} ms)",
                              f"{r['elementwise_tb_s']:.2f} TB/s"] for r in rows])
    return lines + ["", "(read + written bytes) / time."]


def headline(r: dict) -> str:
    return f"| copy bandwidth | {r['copy_tb_s']:.2f} TB/s |"
