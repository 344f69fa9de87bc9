"""Session 12 sweep: the Pallas quantized GEMV's tiles at SDAR-8B decode shapes against XLA's weight-only and bf16."""
import itertools, json, math, os, sys, time
import jax, jax.numpy as jnp
from dllm_jax.bench.timing import time_calls
from benchmarks.sections.bandwidth import copy_bandwidth
from dllm_jax.quantize import quantize_weight
from pallas_kernels.quantized_matmul import quantized_matmul, quantized_matmul_reference, fits

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
ROWS = int(os.environ.get("ROWS", 4))
BUDGET = float(os.environ.get("BUDGET", 70))
copy = copy_bandwidth(2 << 30)["copy_tb_s"]
print(f"copy {copy:.2f} TB/s", flush=True)
results = []

def weights(n, k, mode, copies):
    out = []
    for i in range(copies):
        w = jax.random.normal(jax.random.key(i), (n, k), jnp.float32) * 0.02
        if mode is None:
            out.append((w.T.astype(jnp.bfloat16), None))
        else:
            v, s = quantize_weight(w, (1,), mode)
            out.append((v, s))
        del w
    return out

def bench(fn, ws, x):
    f = jax.jit(lambda ws, x: [fn(x, w, s) for w, s in ws])
    return time_calls(f, ws, x, repeats=7) * 1e3

for name, (n, k) in SHAPES.items():
    copies = max(1, math.ceil(400e6 / (n * k)))
    x = jax.random.normal(jax.random.key(7), (ROWS, k), jnp.bfloat16)
    wb = weights(n, k, None, copies)
    ms = bench(lambda x, w, s: x @ w, wb, x); del wb
    base = dict(shape=name, n=n, k=k, rows=ROWS)
    results.append(dict(base, variant="bf16", ms=ms, frac=2 * n * k * copies / ms / 1e9 / copy))
    print(results[-1], flush=True)
    for mode in ("int8", "fp8"):
        wq = weights(n, k, mode, copies)
        nbytes = n * k * copies
        ms = bench(lambda x, w, s: quantized_matmul_reference(x, w, s), wq, x)
        results.append(dict(base, variant=f"{mode} xla", ms=ms, frac=nbytes / ms / 1e9 / copy)); print(results[-1], flush=True)
        grid = [(bn, bk, sk, 4 if bk < 1024 else 3, 4) for bk in (512, 256, 1024) for bn in (16, 32, 64) for sk in (1, 2, 4)]
        if mode == "fp8":  # only the best int8 tiles and neighbours
            best = sorted([r for r in results if r["shape"] == name and r["variant"].startswith("int8 pallas")], key=lambda r: r["ms"])[:4]
            grid = [tuple(r["tiles"]) for r in best]
        t0 = time.monotonic()
        for bn, bk, sk, st, nw in grid:
            if time.monotonic() - t0 > BUDGET:
                print("out of budget", name, mode, flush=True); break
            if not fits(x.shape, (n, k), block_n=bn, block_k=bk, split_k=sk) or bk * sk > k:
                continue
            try:
                fn = lambda x, w, s, bn=bn, bk=bk, sk=sk, st=st, nw=nw: quantized_matmul(x, w, s, block_n=bn, block_k=bk, split_k=sk, num_stages=st, num_warps=nw)
                got = fn(x, *wq[0]); ref = quantized_matmul_reference(x, *wq[0])
                err = float(jnp.linalg.norm((got - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
                ms = bench(fn, wq, x)
                results.append(dict(base, variant=f"{mode} pallas", tiles=[bn, bk, sk, st, nw], ms=ms, err=err, frac=nbytes / ms / 1e9 / copy))
            except Exception as e:
                results.append(dict(base, variant=f"{mode} pallas", tiles=[bn, bk, sk, st, nw], error=str(e)[:200]))
            print(results[-1], flush=True)
        del wq
out = os.environ.get("OUTFILE", "/tmp/r/gemv_sweep.json")
json.dump(dict(copy_tb_s=copy, device=jax.devices()[0].device_kind, results=results), open(out, "w"), indent=1)
print("\n| shape | variant | tiles | ms | of copy |")
for name in SHAPES:
    rs = [r for r in results if r["shape"] == name and "ms" in r]
    for v in ("bf16", "int8 xla", "fp8 xla"):
        for r in rs:
            if r["variant"] == v: print(f"| {name} | {v} | | {r['ms']:.3f} | {r['frac']:.0%} |")
    for v in ("int8 pallas", "fp8 pallas"):
        for r in sorted([r for r in rs if r["variant"] == v], key=lambda r: r["ms"])[:3]:
            print(f"| {name} | {v} | {r['tiles']} | {r['ms']:.3f} | {r['frac']:.0%} | err {r['err']:.1e}")
