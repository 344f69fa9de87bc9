"""Helpers shared by the benchmark scripts: random on-device weights, timing, profiler traces."""

from __future__ import annotations

import gzip
import json
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.models.layers import lm_param_shapes


def random_params(config, key):
    """bf16 params drawn on the device, leaf by leaf (projections N(0, 1/fan_in), norms 1)."""
    shapes = lm_param_shapes(config)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple))[0]]
    out = []
    for path, shape, k in zip(paths, leaves, keys):
        if "norm" in path:
            out.append(jnp.ones(shape, jnp.bfloat16))
        else:
            fan_in = shape[-1] if "embed" in path else shape[1] if "layers" in path else shape[0]
            out.append(jax.jit(lambda k, s=shape, f=fan_in: (jax.random.normal(k, s, jnp.float32) / np.sqrt(f)
                                                              ).astype(jnp.bfloat16))(k))
    return jax.tree.unflatten(treedef, out)


def time_fn(fn, *args, warmup=2, repeats=10):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)), float(np.min(times)), float(np.max(times))


def time_calls(fn, *args, repeats=5, burst_s=0.05):
    """Median seconds per call over `repeats` bursts of back-to-back calls, synchronising only after
    each burst, so that dispatch overlaps the previous call (fair to sub-ms kernels). A burst holds
    about `burst_s` of work (at least one call)."""
    jax.block_until_ready(fn(*args))  # compile
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    calls = int(min(50, max(1, burst_s / (time.perf_counter() - start))))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return float(np.median(times))


ATTENTION_KERNEL = re.compile(r"sdpa|fmha|flash|attention", re.IGNORECASE)


def profiled_attention_share(fn, *args, trace_dir: Path):
    """(share of GPU kernel time spent in attention kernels, total GPU kernel ms) for one call,
    from a profiler trace; (None, None) if the trace holds no GPU kernels."""
    jax.block_until_ready(fn(*args))
    return traced_kernels(lambda: jax.block_until_ready(fn(*args)), trace_dir)


def traced_kernels(run, trace_dir: Path):
    """Runs `run()` once under the profiler, prints the top GPU kernels and returns (attention share,
    total GPU kernel ms), or (None, None) if the trace holds no GPU kernels."""
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        run()
    files = sorted(trace_dir.rglob("*.trace.json.gz")) or sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        return None, None
    events = json.loads(gzip.decompress(files[-1].read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e]
    total = sum(e["dur"] for e in kernels)
    if not total:
        return None, None
    attention = sum(e["dur"] for e in kernels if ATTENTION_KERNEL.search(e["name"]))
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e["name"][:70]] = by_name.get(e["name"][:70], 0.0) + e["dur"]
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    print(f"GPU kernels {total / 1e3:.2f} ms; top: " + "; ".join(f"{name} {us / 1e3:.2f} ms" for name, us in top),
          flush=True)
    return attention / total, total / 1e3


def fmt(x):
    return "n/a" if x is None else f"{x:.2f}"


def write_results(out_dir: Path, meta: dict, rows: list[dict], lines: list[str]) -> None:
    """Writes <benchmark>_<device>_<date>.json (meta + rows) and .md (`lines`) and prints the table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{meta['benchmark']}_{meta['device'].replace(' ', '_')}_{meta['date']}"
    (out_dir / f"{stem}.json").write_text(json.dumps(dict(meta, rows=rows), indent=2) + "\n")
    table = "\n".join(lines) + "\n"
    (out_dir / f"{stem}.md").write_text(table)
    print(table)
