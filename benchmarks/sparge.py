"""SpargeAttn on the GPU: sparsity under an L1 bound, and time against cuDNN dense attention and against
the plain block-sparse kernel running the same predicted map.

Inputs (no real weights here): smooth synthetic q, k, v [1, N, 32, 128] bf16 built like an LM's
attention inputs, so that the maps have real structure:
  latent[t] = topic[t // segment] + drift[t] + 0.5 * noise[t] over 128 latent dims, with topics N(0, I)
  per segment of `--segment` tokens and drift a two-pass moving average (width 64) of white noise,
  rescaled to unit variance; per head h, q_h = s_h * latent @ A_h and k_h = latent @ (A_h + 0.5 * E_h)
  (A_h, E_h Gaussian, /sqrt(128)), then RoPE (theta 500000, LLaDA's); the per-head sharpness s_h runs
  linearly over --sharpness (0.1 to 1.0) so that heads range from near-uniform to peaked; v is N(0, 1).
Calibration (`dllm_jax.analysis.calibration.calibrate`, l1 = 0.04 for the map, pv_l1 = 0.05 with the PV
filter, a simthreshd1 grid of step 1/sim_steps) runs on --samples draws; every number in the table is
measured on one further, held-out draw. Timings: medians of bursts of back-to-back jitted calls.

    PYTHONPATH=. python -m benchmarks.sparge --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import functools
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from dllm_jax.bench import markdown_table, time_calls, write_results
from dllm_jax.analysis.calibration import calibrate
from dllm_jax.models.layers import apply_rope, rope_tables
from pallas_kernels.sparge import map_to_lists

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the Pallas Triton backend warns on use

HEADS, HEAD_DIM, DTYPE = 32, 128, jnp.bfloat16
BLOCK_Q, BLOCK_KV = 64, 128
TUNINGS = [(8, 3), (4, 3), (8, 2), (4, 2)]  # (num_warps, num_stages) of the sparse kernels


@functools.partial(jax.jit, static_argnames=("n", "segment", "sharpness"))
def smooth_inputs(key, *, n, segment, sharpness=(0.1, 1.0)):
    """(q, k, v) as the module docstring describes."""
    keys = jax.random.split(key, 7)
    latent_dim = HEAD_DIM
    topics = jax.random.normal(keys[0], (-(-n // segment), latent_dim))[jnp.arange(n) // segment]
    drift = jax.random.normal(keys[1], (n, latent_dim))
    for _ in range(2):  # moving average of width 64, twice: a smooth random walk around the topic
        c = jnp.cumsum(jnp.pad(drift, ((64, 0), (0, 0))), axis=0)
        drift = (c[64:] - c[:-64]) / 64.0
    drift = drift / jnp.std(drift)
    latent = topics + drift + 0.5 * jax.random.normal(keys[2], (n, latent_dim))
    a = jax.random.normal(keys[3], (HEADS, latent_dim, HEAD_DIM)) / np.sqrt(latent_dim)
    e = jax.random.normal(keys[4], (HEADS, latent_dim, HEAD_DIM)) / np.sqrt(latent_dim)
    sharpness = jnp.linspace(*sharpness, HEADS)[None, :, None]
    q = jnp.einsum("tl,hld->thd", latent, a) * sharpness
    k = jnp.einsum("tl,hld->thd", latent, a + 0.5 * e)
    cos, sin = rope_tables(jnp.arange(n), HEAD_DIM, 500000.0)
    q, k = apply_rope(q[None], cos, sin, in_fp32=True), apply_rope(k[None], cos, sin, in_fp32=True)
    v = jax.random.normal(keys[5], (1, n, HEADS, HEAD_DIM))
    return q.astype(DTYPE), k.astype(DTYPE), v.astype(DTYPE)


def relative_l1(out, ref):
    out, ref = jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32)
    return float(jnp.sum(jnp.abs(out - ref)) / jnp.sum(jnp.abs(ref)))


def cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")


def measure(n, args):
    print(f"--- N = {n}", flush=True)
    draw = lambda seed: smooth_inputs(jax.random.key(seed), n=n, segment=args.segment,
                                      sharpness=tuple(args.sharpness))
    samples = [draw(1000 * n + i) for i in range(args.samples)]
    start = time.perf_counter()
    cal = calibrate(samples, l1=0.04, pv_l1=0.05, block_q=BLOCK_Q, block_kv=BLOCK_KV, sim_steps=args.sim_steps,
                    progress=args.progress)
    calibration_s = time.perf_counter() - start
    print(f"calibrated in {calibration_s:.0f} s; per-head sparsity {np.round(cal.sparsity, 2).tolist()}", flush=True)
    del samples
    q, k, v = draw(7)  # held out
    dense = jax.jit(cudnn)
    ref = dense(q, k, v)
    t_cudnn = time_calls(dense, q, k, v)
    t_flash = time_calls(jax.jit(pk.flash_attention), q, k, v)
    configs = {
        "calibrated (map + PV filter)": dict(simthreshd1=cal.simthreshd1, cdfthreshd=cal.cdfthreshd,
                                             pvthreshd=cal.pvthreshd),
        "calibrated map, no PV filter": dict(simthreshd1=cal.simthreshd1, cdfthreshd=cal.cdfthreshd, pvthreshd=None),
        "official defaults (-0.1, topk 0.5, 50)": dict(simthreshd1=-0.1, topk=0.5, pvthreshd=50.0),
    }
    rows = []
    for name, cfg in configs.items():
        prediction = {key: cfg[key] for key in ("simthreshd1", "cdfthreshd", "topk") if key in cfg}
        predict = jax.jit(lambda q, k: map_to_lists(pk.predict_block_map(q, k, block_q=BLOCK_Q, block_kv=BLOCK_KV,
                                                                           **prediction)))
        indices, counts = predict(q, k)
        best = {}
        for kernel in ("sparge", "block_sparse"):
            for warps, stages in TUNINGS:
                if kernel == "sparge":
                    fn = jax.jit(lambda q, k, v, i, c, w=warps, s=stages: pk.pv_skip_attention(
                        q, k, v, i, c, pvthreshd=cfg["pvthreshd"], block_q=BLOCK_Q, block_kv=BLOCK_KV,
                        num_warps=w, num_stages=s))
                else:
                    fn = jax.jit(lambda q, k, v, i, c, w=warps, s=stages: pk.block_sparse_attention(
                        q, k, v, i, c, block_q=BLOCK_Q, block_kv=BLOCK_KV, num_warps=w, num_stages=s))
                t = time_calls(fn, q, k, v, indices, counts)
                if kernel not in best or t < best[kernel][0]:
                    best[kernel] = (t, warps, stages)
        warps, stages = best["sparge"][1:]
        full = jax.jit(lambda q, k, v: pk.sparge_attention(q, k, v, **cfg, block_q=BLOCK_Q, block_kv=BLOCK_KV,
                                                           return_sparsity=True, num_warps=warps, num_stages=stages))
        out, sparsity = full(q, k, v)
        row = dict(
            n=n, config=name, l1=relative_l1(out, ref), map_sparsity=float(sparsity.map_sparsity()),
            total_sparsity=float(sparsity.pv_sparsity()), cudnn_ms=t_cudnn * 1e3, flash_ms=t_flash * 1e3,
            sparge_ms=time_calls(full, q, k, v) * 1e3, predict_ms=time_calls(predict, q, k) * 1e3,
            pv_kernel_ms=best["sparge"][0] * 1e3, pv_kernel_tuning=best["sparge"][1:],
            block_sparse_ms=best["block_sparse"][0] * 1e3, block_sparse_tuning=best["block_sparse"][1:],
            calibration_s=calibration_s if name.startswith("calibrated") else None,
            per_head_sparsity=np.asarray(sparsity.per_head()).round(3).tolist())
        print({key: value for key, value in row.items() if key != "per_head_sparsity"}, flush=True)
        rows.append(row)
    return rows


def table(meta, rows):
    lines = [f"# SpargeAttn vs cuDNN — {meta['device']}, jax {meta['jax']}, {meta['date']}", "",
             f"q/k/v [1, N, {HEADS}, {HEAD_DIM}] bf16, bidirectional; smooth synthetic inputs (see "
             f"benchmarks/sparge.py) with per-head sharpness {meta['sharpness'][0]} to {meta['sharpness'][1]}; "
             "tiles 64 x 128; calibrated on "
             f"{meta['samples']} draws (L1 bound 0.04 for the map, 0.05 with the PV filter), measured on a held-out "
             "draw. Sparsity = fraction of the 64 x 128 tiles whose QK^T (map) / exp(S)V (total) was skipped. "
             "Ratios are cuDNN time / time (> 1 is faster than cuDNN).", "",
             *markdown_table(["N", "config", "L1 vs cuDNN", "map sparsity", "total sparsity", "cuDNN ms",
                              "SpargeAttn ms (prediction + kernel)", "ratio", "prediction ms", "PV-filter kernel ms",
                              "ratio", "block-sparse kernel, same map, ms", "ratio"], [cells(r) for r in rows])]
    lines += ["", "Our dense Pallas flash kernel in the same run: " + ", ".join(
        f"N={r['n']}: {r['flash_ms']:.2f} ms" for r in rows if r["config"].startswith("calibrated (")) + "."]
    return lines


def cells(r: dict) -> list[str]:
    c = r["cudnn_ms"]
    return [r["n"], r["config"], f"{r['l1']:.4f}", f"{r['map_sparsity']:.3f}", f"{r['total_sparsity']:.3f}", f"{c:.2f}",
            f"{r['sparge_ms']:.2f}", f"{c / r['sparge_ms']:.2f}", f"{r['predict_ms']:.2f}", f"{r['pv_kernel_ms']:.2f}",
            f"{c / r['pv_kernel_ms']:.2f}", f"{r['block_sparse_ms']:.2f}", f"{c / r['block_sparse_ms']:.2f}"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--samples", type=int, default=2, help="calibration draws")
    parser.add_argument("--sim-steps", type=int, default=8, help="simthreshd1 grid step 1/sim_steps")
    parser.add_argument("--segment", type=int, default=1024, help="tokens per topic segment")
    parser.add_argument("--sharpness", type=float, nargs=2, default=[0.1, 1.0], help="per-head query scale range")
    parser.add_argument("--progress", action="store_true", help="a progress bar over the calibration sweep")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    meta = dict(benchmark="sparge" + (f"_{args.tag}" if args.tag else ""), device=jax.devices()[0].device_kind,
                jax=jax.__version__, date=datetime.date.today().isoformat(), heads=HEADS, head_dim=HEAD_DIM,
                dtype="bfloat16", block_q=BLOCK_Q, block_kv=BLOCK_KV, samples=args.samples,
                sim_steps=args.sim_steps, segment=args.segment, sharpness=args.sharpness, inputs="smooth synthetic (benchmarks/sparge.py)")
    print(meta, flush=True)
    rows = [row for n in args.lengths for row in measure(n, args)]
    write_results(args.out, meta, rows, table(meta, rows))


if __name__ == "__main__":
    main()
