"""GPU kernel time from a profiler trace: the top kernels of one call and the share spent in attention."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import jax


ATTENTION_KERNEL = re.compile(r"sdpa|fmha|flash|attention", re.IGNORECASE)
KINDS = 20  # kernel kinds a profile keeps


def kernel_kind(name: str) -> str:
    """A kernel's kind: its name without XLA's numbering (`loop_add_fusion_70` -> `loop_add_fusion`, `sort_358_1`
    -> `sort`), 70 characters at most: what a long tail of small fusions adds up to."""
    return re.sub(r"(_\d+)+$", "", name[:70])


def tally(entries) -> dict[str, list]:
    """{name: [microseconds, launches]} summed over (name, microseconds, launches) entries."""
    totals: dict[str, list] = {}
    for name, us, n in entries:
        entry = totals.setdefault(name, [0.0, 0])
        entry[0] += us
        entry[1] += n
    return totals


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
    """Runs `run()` once under the profiler: {gpu_ms (all GPU kernels), launches, attention_share, span_ms (first
    kernel's start to the last one's end), kernels: the `top` kernel names (70 characters) by time, each {name, ms,
    launches}, kinds: the KINDS `kernel_kind`s by time, alike}, or None if the trace holds no GPU kernels (a CPU
    run)."""
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        run()
    files = sorted(trace_dir.rglob("*.trace.json.gz")) or sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        return None
    events = json.loads(gzip.decompress(files[-1].read_bytes()))
    return summarize_trace(events["traceEvents"] if isinstance(events, dict) else events, top=top)


def summarize_trace(events: list[dict], *, top: int = 12) -> dict | None:
    """`kernel_profile`'s summary of a trace's events (Chrome trace format: the GPU kernels are the complete
    events, ph "X", of the processes whose name has "gpu" in it), or None if they hold no GPU kernel time."""
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e]
    total = sum(e["dur"] for e in kernels)
    if not total:
        return None
    attention = sum(e["dur"] for e in kernels if ATTENTION_KERNEL.search(e["name"]))
    by_name = tally((e["name"][:70], e["dur"], 1) for e in kernels)
    by_kind = tally((kernel_kind(name), us, n) for name, (us, n) in by_name.items())

    def ranked(groups: dict, count: int) -> list[dict]:
        return [dict(name=name, ms=us / 1e3, launches=n)
                for name, (us, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:count]]

    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    return dict(gpu_ms=total / 1e3, launches=len(kernels), attention_share=attention / total, span_ms=span / 1e3,
                kernels=ranked(by_name, top), kinds=ranked(by_kind, KINDS))
