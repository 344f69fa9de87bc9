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
