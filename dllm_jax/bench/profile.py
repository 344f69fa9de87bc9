"""GPU kernel time from a profiler trace: the top kernels of one call and the share spent in attention."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import jax


ATTENTION_KERNEL = re.compile(r"sdpa|fmha|flash|attention", re.IGNORECASE)


def profiled_attention_share(fn, *args, trace_dir: Path):
    """(share of GPU kernel time spent in attention kernels, total GPU kernel ms) for one call,
    from a profiler trace; (None, None) if the trace holds no GPU kernels."""
    jax.block_until_ready(fn(*args))
    return traced_kernels(lambda: jax.block_until_ready(fn(*args)), trace_dir)


def traced_kernels(run, trace_dir: Path):
    """Runs `run()` once under the profiler, prints the top GPU kernels and returns (attention share,
    total GPU kernel ms), or (None, None) if the trace holds no GPU kernels."""
    profile = kernel_profile(run, trace_dir)
    if profile is None:
        return None, None
    print(f"GPU kernels {profile['gpu_ms']:.2f} ms; top: "
          + "; ".join(f"{k['name']} {k['ms']:.2f} ms" for k in profile["kernels"][:8]), flush=True)
    return profile["attention_share"], profile["gpu_ms"]


def kernel_profile(run, trace_dir: Path, *, top: int = 12) -> dict | None:
    """Runs `run()` once under the profiler: {gpu_ms (all GPU kernels), launches, attention_share, kernels: the
    `top` kernel names (70 characters) by time, each {name, ms, launches}}, or None if the trace holds no GPU
    kernels (a CPU run)."""
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        run()
    files = sorted(trace_dir.rglob("*.trace.json.gz")) or sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        return None
    events = json.loads(gzip.decompress(files[-1].read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e]
    total = sum(e["dur"] for e in kernels)
    if not total:
        return None
    attention = sum(e["dur"] for e in kernels if ATTENTION_KERNEL.search(e["name"]))
    by_name: dict[str, list] = {}
    for e in kernels:
        entry = by_name.setdefault(e["name"][:70], [0.0, 0])
        entry[0] += e["dur"]
        entry[1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(gpu_ms=total / 1e3, launches=len(kernels), attention_share=attention / total,
                kernels=[dict(name=name, ms=us / 1e3, launches=n) for name, (us, n) in ranked])
