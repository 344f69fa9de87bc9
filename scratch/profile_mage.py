"""Issue 40 probe: top-k micro timings, then a kernel profile of one output block (dense, MAGE by sort, MAGE by
threshold) against a long cache. python scratch/profile_mage.py MODEL S TRACE_DIR"""
import dataclasses, functools, gzip, json, os, sys, time
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from benchmarks.sections.long_cache import block_loop
from benchmarks.sections.plan import Plan
from benchmarks.sections.sdar import sdar_options
from dllm_jax.attention.mage import MAGE
from dllm_jax.attention.policy import Dense
from dllm_jax.attention.select import top_k_positions
from dllm_jax.bench import model_for
from dllm_jax.bench.timing import time_calls
from dllm_jax.generate import sdar as gen

name, s, trace_root = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
k = 512 if s > 4096 else 16
for batch in (() if os.environ.get("SKIP_TOPK") else (1, 4)):
    scores = jax.random.uniform(jax.random.key(batch), (batch, 8, s), jnp.float32)
    want = None
    for method, bits in (("sort", 4), ("threshold", 1), ("threshold", 2), ("threshold", 4)):
        fn = jax.jit(functools.partial(top_k_positions, k=k, method=method, bits=bits))
        got = np.asarray(fn(scores)); want = got if want is None else want
        print(f"topk b{batch} S{s} k{k} {method}/{bits}: {time_calls(fn, scores) * 1e3:.3f} ms equal={np.array_equal(got, want)}", flush=True)

model, config = model_for(name, layers=None, context=s + 64, dtype=jnp.bfloat16)
params = model.params()
n = config.block_size
options = gen.SDAROptions(**sdar_options(Plan()))
capacity = gen.cache_capacity(s + 5 * n, n)
mage = MAGE() if s > 4096 else MAGE(k=16, exact_layers=1)
wanted = os.environ.get("POLICIES", "dense,mage/sort,mage/threshold").split(",")
policies = {"dense": Dense(), "mage/sort": dataclasses.replace(mage, select_by="sort"), "mage/threshold": mage}
for label, policy in ((label, policies[label]) for label in wanted):
    cache = model.init_cache(1, capacity)
    state = gen.sdar_model.init_policy_state(policy, config, 1, capacity)
    loop = block_loop(gen, params, jnp.full((1, n), config.mask_token_id, jnp.int32), policy, options, config, 1, False)
    at = lambda c: c.replace(length=jnp.full(c.length.shape, s, jnp.int32))
    t = time.perf_counter()
    _, cache, state = loop(at(cache), state); jax.block_until_ready(cache)
    print(f"{label}: compiled+first {time.perf_counter() - t:.1f} s", flush=True)
    for _ in range(2):
        _, cache, state = loop(at(cache), state)
    jax.block_until_ready(cache)
    t = time.perf_counter()
    _, cache, state = loop(at(cache), state); jax.block_until_ready(cache)
    wall = (time.perf_counter() - t) * 1e3
    d = trace_root / label.replace("/", "_")
    with jax.profiler.trace(str(d)):
        _, cache, state = loop(at(cache), state); jax.block_until_ready(cache)
    files = sorted(d.rglob("*.trace.json.gz"))
    events = json.loads(gzip.decompress(files[-1].read_bytes())) if files else []
    events = events["traceEvents"] if isinstance(events, dict) else events
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e]
    by, count = {}, {}
    for e in kernels:
        key = e["name"][:60]
        by[key] = by.get(key, 0.0) + e["dur"]; count[key] = count.get(key, 0) + 1
    total = sum(by.values())
    print(f"== {label}: wall {wall:.1f} ms, GPU kernels {total / 1e3:.1f} ms in {len(kernels)} launches", flush=True)
    for key, us in sorted(by.items(), key=lambda kv: -kv[1])[:14]:
        print(f"   {us / 1e3:7.2f} ms  x{count[key]:4d}  {key}", flush=True)
    del cache, state, loop
