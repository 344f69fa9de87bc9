"""Session 16 probe (issue 40): one output block of the SDAR-8B loop at a 128k cache, dense and MAGE, under the
profiler: every kernel name by time (top 45), and the idle gaps between consecutive kernels (which kernel ended
before each gap > 10 us, summed). python scratch/s16/profile_mage.py S OUT_DIR"""
import gzip, json, os, sys, time
from pathlib import Path
import jax, jax.numpy as jnp
from benchmarks.sections.long_cache import block_loop
from benchmarks.sections.plan import Plan
from benchmarks.sections.sdar import sdar_options
from dllm_jax.attention.mage import MAGE
from dllm_jax.attention.policy import Dense
from dllm_jax.bench import model_for
from dllm_jax.generate import sdar as gen

s, out = int(sys.argv[1]), Path(sys.argv[2])
model, config = model_for(os.environ.get("MODEL", "sdar-8b-chat"), layers=None, context=s + 64, dtype=jnp.bfloat16)
params = model.params()
n = config.block_size
options = gen.SDAROptions(**sdar_options(Plan()))
capacity = gen.cache_capacity(s + 5 * n, n)
mage = MAGE() if s > 4096 else MAGE(k=16, exact_layers=1)
summary = {}
for label, policy in (("dense", Dense()), ("mage", mage)):
    cache = model.init_cache(1, capacity)
    state = gen.sdar_model.init_policy_state(policy, config, 1, capacity)
    loop = block_loop(gen, params, jnp.full((1, n), config.mask_token_id, jnp.int32), policy, options, config, 1, False)
    at = lambda c: c.replace(length=jnp.full(c.length.shape, s, jnp.int32))
    for _ in range(3):
        _, cache, state = loop(at(cache), state)
    jax.block_until_ready(cache)
    t = time.perf_counter()
    for _ in range(3):
        _, cache, state = loop(at(cache), state)
    jax.block_until_ready(cache)
    wall = (time.perf_counter() - t) / 3 * 1e3
    d = out / f"trace_{label}"
    with jax.profiler.trace(str(d)):
        _, cache, state = loop(at(cache), state); jax.block_until_ready(cache)
    files = sorted(d.rglob("*.trace.json.gz"))
    events = json.loads(gzip.decompress(files[-1].read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e),
                     key=lambda e: e["ts"])
    by, count = {}, {}
    for e in kernels:
        key = e["name"][:70]
        by[key] = by.get(key, 0.0) + e["dur"]; count[key] = count.get(key, 0) + 1
    gaps, gap_count, idle = {}, {}, 0.0
    for a, b in zip(kernels, kernels[1:]):
        g = b["ts"] - (a["ts"] + a["dur"])
        if g > 10:
            key = a["name"][:50] + "  ->  " + b["name"][:40]
            gaps[key] = gaps.get(key, 0.0) + g; gap_count[key] = gap_count.get(key, 0) + 1
        if g > 0:
            idle += g
    if not kernels:
        print(label, "no GPU kernels (CPU)", wall); continue
    total = sum(by.values())
    span = (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) / 1e3
    print(f"== {label}: wall {wall:.1f} ms/block, GPU kernels {total / 1e3:.1f} ms in {len(kernels)} launches, "
          f"span {span:.1f} ms, idle between kernels {idle / 1e3:.1f} ms", flush=True)
    for key, us in sorted(by.items(), key=lambda kv: -kv[1])[:45]:
        print(f"   {us / 1e3:7.3f} ms  x{count[key]:5d}  {key}", flush=True)
    print(f"-- {label}: gaps > 10 us by the kernel before -> after (top 25)")
    for key, us in sorted(gaps.items(), key=lambda kv: -kv[1])[:25]:
        print(f"   {us / 1e3:7.3f} ms  x{gap_count[key]:5d}  {key}", flush=True)
    summary[label] = dict(wall_ms=wall, gpu_ms=total / 1e3, launches=len(kernels), idle_ms=idle / 1e3,
                          kernels={k: [v / 1e3, count[k]] for k, v in by.items()},
                          gaps={k: [v / 1e3, gap_count[k]] for k, v in gaps.items()})
    del cache, state, loop
(out / "profile_mage_s16.json").write_text(json.dumps(summary))
