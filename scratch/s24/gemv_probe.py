"""Issue 42 probe: weight-only 1-byte GEMMs at decode rows as XLA reductions vs XLA's dot (Triton GEMM fusion),
per SDAR-8B projection, 36 layers chained in one jit (7.7 GB int8 total: misses L2)."""
import sys
import jax, jax.numpy as jnp, numpy as np
from benchmarks.sections.bandwidth import copy_bandwidth
from dllm_jax.bench.timing import time_calls
from dllm_jax.quantize import quantize_weight, linear

import os
SMALL = bool(os.environ.get("PROBE_SMALL"))
D, I, QKV = (64, 192, 96) if SMALL else (4096, 12288, 6144)
SHAPES = {"qkv": (D, QKV), "o": (D, D), "gate_up": (D, 2 * I), "down": (I, D)}
LAYERS = 2 if SMALL else 36
ROWS = [int(r) for r in sys.argv[1:]] or [4]


def mm_bf16(x, w, s):
    return x @ w

def mm_xla(x, w, s):
    out = jax.lax.dot_general(x, w.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (out * s).astype(x.dtype)

def mm_reduce_nmk(x, w, s):
    out = jnp.sum(x[None, :, :].astype(jnp.float32) * w[:, None, :].astype(jnp.float32), axis=-1).T
    return (out * s).astype(x.dtype)

def mm_reduce_mnk(x, w, s):
    out = jnp.sum(x[:, None, :].astype(jnp.float32) * w[None, :, :].astype(jnp.float32), axis=-1)
    return (out * s).astype(x.dtype)

def mm_reduce_bf16(x, w, s):
    out = jnp.sum(x[None, :, :] * w[:, None, :].astype(x.dtype), axis=-1, dtype=jnp.float32).T
    return (out * s).astype(x.dtype)

def mm_pallas(x, w, s):
    return linear(x, {"w": w, "w_scale": s}, "w", gemm="pallas")

def mm_w8a8(x, w, s):
    return linear(x, {"w": w, "w_scale": s}, "w", gemm="w8a8")

def mm_xla_hi(x, w, s):  # bf16 dot of an explicitly converted weight, no preferred f32
    return (x @ w.astype(x.dtype).T * s.astype(x.dtype))

VARIANTS = {"bf16": (None, mm_bf16), "int8 xla": ("int8", mm_xla), "int8 reduce nmk": ("int8", mm_reduce_nmk),
            "int8 reduce mnk": ("int8", mm_reduce_mnk), "int8 reduce bf16": ("int8", mm_reduce_bf16),
            **({} if SMALL else {"int8 pallas": ("int8", mm_pallas)}), "int8 w8a8": ("int8", mm_w8a8), "fp8 xla": ("fp8", mm_xla), "fp8 w8a8": ("fp8", mm_w8a8), "fp8 reduce nmk": ("fp8", mm_reduce_nmk)}


KEEP = os.environ.get("PROBE_VARIANTS")
if KEEP:
    VARIANTS = {k: v for k, v in VARIANTS.items() if k in KEEP.split(",")}


def weights(name, mode):
    n_in, n_out = SHAPES[name]
    out = []
    for l in range(LAYERS):
        w = jax.random.normal(jax.random.key(l), (n_in, n_out), jnp.float32) * 0.02
        if mode is None:
            out.append((w.astype(jnp.bfloat16), jnp.ones((n_out,), jnp.float32)))
        else:
            v, s = quantize_weight(w, (0,), mode)
            out.append((v.T, s))
        del w
    return out


def chain(mm, name):
    n_in, n_out = SHAPES[name]
    def run(ws, x):
        for w, s in ws:
            xin = jnp.tile(x, (1, n_in // D))
            y = mm(xin, w, s)
            x = x + y[:, :D]
        return x
    return jax.jit(run)


def main():
    copy = copy_bandwidth(16 << 20 if SMALL else 2 << 30)["copy_tb_s"]
    print(f"device {jax.devices()[0].device_kind} jax {jax.__version__} copy {copy:.2f} TB/s", flush=True)
    table = []
    ref = {}
    for name in SHAPES:
        for label, (mode, mm) in VARIANTS.items():
            try:
                ws = weights(name, mode)
                nbytes = sum(w.nbytes for w, _ in ws)
                f = chain(mm, name)
                for r in ROWS:
                    x = (jax.random.normal(jax.random.key(99), (r, D), jnp.float32)).astype(jnp.bfloat16)
                    y = np.asarray(f(ws, x), np.float32)
                    if mode is None:
                        pass
                    key = (name, r, mode)
                    err = float(np.max(np.abs(y - ref[key])) / (np.max(np.abs(ref[key])) + 1e-9)) if key in ref else 0.0
                    ref.setdefault(key, y)
                    ms = time_calls(f, ws, x) * 1e3
                    frac = nbytes / ms / 1e9 / copy
                    table.append((name, r, label, ms, frac, err))
                    print(f"{name:8s} rows {r:3d} {label:18s} {ms:7.3f} ms {frac:6.1%} of copy  err-vs-first {err:.2e}", flush=True)
                del ws
            except Exception as e:  # noqa
                print(f"{name} {label} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    print("\nSUMMARY")
    for t in table:
        print(f"{t[0]:8s} {t[1]:3d} {t[2]:18s} {t[3]:7.3f} ms {t[4]:6.1%}  {t[5]:.1e}")


if __name__ == "__main__":
    main()
