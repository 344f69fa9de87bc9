"""Issue 42 probe: what XLA:GPU makes of weight-quantized GEMMs at SDAR-8B decode shapes.

A stack of L layers' four GEMMs (qkv, o, gate_up, down) run in one jit, per variant; prints ms per stack,
the GB of weights read and the GB/s, and the GEMM custom calls / fusions XLA chose."""
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.bench.timing import time_calls

L = int(os.environ.get("LAYERS", 36))
MS = [int(m) for m in os.environ.get("MS", "4 64 256").split()]
D, QKV, I = 4096, 6144, 12288
SHAPES = [(D, QKV), (D, D), (D, 2 * I), (I, D)]
FP8 = jnp.float8_e4m3fn


def make_weights(kind, key):
    ws = []
    for li in range(L):
        layer = []
        for k_in, n_out in SHAPES:
            key, sub = jax.random.split(key)
            w = (jax.random.normal(sub, (k_in, n_out), jnp.float32) * 0.02)
            if kind == "bf16":
                layer.append(w.astype(jnp.bfloat16))
            elif kind in ("int8", "int8t", "int8dyn"):
                s = jnp.max(jnp.abs(w), axis=0) / 127
                q = jnp.clip(jnp.round(w / s), -127, 127).astype(jnp.int8)
                layer.append((q.T if kind in ("int8t", "int8dyn") else q, s.astype(jnp.bfloat16)))
            else:  # fp8 variants: per-output-channel scale, stored [N, K] (contracting dim minor) or [K, N]
                s = jnp.max(jnp.abs(w), axis=0) / 448
                q = (w / s).astype(FP8)
                layer.append((q.T if kind.endswith("t") else q, s.astype(jnp.float32)))
            del w
        ws.append(layer)
    return ws


def gemm(kind, x, w):
    if kind == "bf16":
        return x @ w
    q, s = w
    if kind == "int8":
        return (x @ q.astype(x.dtype)) * s
    if kind == "int8t":
        return jax.lax.dot_general(x, q.astype(x.dtype), (((1,), (1,)), ((), ()))) * s
    if kind == "int8dyn":  # W8A8: activations onto int8 per row, an int8 x int8 -> int32 GEMM
        xf = x.astype(jnp.float32)
        xs = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / 127 + 1e-12
        xq = jnp.round(xf / xs).astype(jnp.int8)
        out = jax.lax.dot_general(xq, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
        return (out.astype(jnp.float32) * xs * s.astype(jnp.float32)).astype(x.dtype)
    if kind == "fp8w":  # bf16 activations, fp8 weight upcast in the GEMM's operand
        return (x @ q.astype(x.dtype)) * s.astype(x.dtype)
    # fp8 x fp8: activations quantized per tensor on the fly
    xs = jnp.max(jnp.abs(x)).astype(jnp.float32) / 448 + 1e-12
    xq = (x.astype(jnp.float32) / xs).astype(FP8)
    if kind == "fp8t":  # direct fp8 dot_general, w [N, K]
        out = jax.lax.dot_general(xq, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return (out * (xs * s)).astype(x.dtype)
    if kind == "fp8st":  # the scaled-dot pattern XLA's gemm rewriter matches (scalar scales), w [N, K]
        a = xq.astype(jnp.bfloat16) * xs.astype(jnp.bfloat16)
        b = q.astype(jnp.bfloat16)
        out = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())))
        return out * s.astype(x.dtype)
    raise ValueError(kind)


def stack(kind, ws, x):
    for layer in ws:
        a = gemm(kind, x, layer[0])[:, :D]
        x = x + gemm(kind, a, layer[1])
        both = gemm(kind, x, layer[2])
        x = x + gemm(kind, jax.nn.silu(both[:, 0::2]) * both[:, 1::2], layer[3])
    return x


def main():
    kinds = os.environ.get("KINDS", "bf16 int8 int8t fp8w fp8t fp8st").split()
    dev = jax.devices()[0]
    print(dev.device_kind, jax.__version__, "layers", L, flush=True)
    # copy bandwidth of this run
    big = jnp.ones((2 * 1024 ** 3 // 2,), jnp.bfloat16)
    t = time_calls(jax.jit(lambda a: a + 1), big)
    copy_bw = 2 * big.nbytes / t / 1e9
    del big
    print(f"copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    rows = []
    for kind in kinds:
        t0 = time.time()
        ws = make_weights(kind, jax.random.key(0))
        nbytes = sum(a.nbytes for layer in ws for w in layer for a in (w if isinstance(w, tuple) else (w,)))
        fn = jax.jit(lambda ws, x, kind=kind: stack(kind, ws, x))
        for m in MS:
            x = (jax.random.normal(jax.random.key(1), (m, D), jnp.float32) * 0.5).astype(jnp.bfloat16)
            try:
                compiled = fn.lower(ws, x).compile()
                text = compiled.as_text()
                calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
                fusions = len(re.findall(r"__triton_gemm", text))
                sec = time_calls(fn, ws, x, repeats=5)
                ref = stack("bf16", None, x) if False else None
                rows.append((kind, m, sec * 1e3, nbytes / 1e9, nbytes / sec / 1e9, calls, fusions))
                print(f"{kind:6s} M={m:4d} {sec*1e3:8.2f} ms {nbytes/1e9:6.2f} GB {nbytes/sec/1e9:7.0f} GB/s "
                      f"calls={calls} triton_gemm={fusions} ({time.time()-t0:.0f}s)", flush=True)
                if kind != "bf16" and m == MS[0] and os.environ.get("DUMP"):
                    with open(f"{os.environ['DUMP']}/{kind}.hlo", "w") as f:
                        f.write(text)
            except Exception as e:  # noqa: BLE001
                print(f"{kind} M={m} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        del ws
    print("\n| variant | M | ms / stack | GB | GB/s | % copy |")
    print("|---|---|---|---|---|---|")
    for kind, m, ms, gb, bw, calls, fus in rows:
        print(f"| {kind} | {m} | {ms:.2f} | {gb:.2f} | {bw:.0f} | {100*bw/copy_bw:.0f}% |")


if __name__ == "__main__":
    main()
