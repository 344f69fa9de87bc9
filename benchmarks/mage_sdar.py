"""MAGE on an SDAR-8B-shaped model (random bf16 weights and cache) on the GPU: time per output block.

For each cache length S (block of 4 tokens, --steps denoising steps per block): one block step
  - dense, cuDNN attention (`block_step`);
  - dense through the split-KV kernel (MAGE with every layer exact: the fair dense baseline);
  - MAGE's first step (exact attention + selection) and its later steps (k prefix keys + the block).
Per output block: dense = steps x step; MAGE = first step + (steps - 1) x sparse step.

    PYTHONPATH=. python -m benchmarks.mage_sdar --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import time
import traceback
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import random_params, write_results
from benchmarks.sdar_block_step import random_cache
from dllm_jax import MAGE, shipped_config
from dllm_jax.models.sdar import block_step, block_step_with_policy, init_policy_state

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the Pallas Triton backend warns on use


def timed(fn, state, repeats):
    """Median seconds of fn(state) -> (out, state), threading the (donated) state; 2 warm-ups."""
    samples = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        out, state = fn(state)
        jax.block_until_ready((out, state))
        samples.append(time.perf_counter() - start)
    return float(np.median(samples[2:])), state


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache-lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--config", default="sdar-8b-chat")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count (smoke runs)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()

    config = shipped_config(args.config)
    if args.layers is not None:
        config = dataclasses.replace(config, num_layers=args.layers)
    params = random_params(config, jax.random.key(0))
    device = jax.devices()[0].device_kind
    print(f"{device}, jax {jax.__version__}", flush=True)
    n = args.block
    rows = []
    for s in args.cache_lengths:
        ids = jax.random.randint(jax.random.key(s), (1, n), 0, config.vocab_size)
        cache = random_cache(config, 1, s + n, s, jax.random.key(s))
        row = dict(cache=s, block=n, steps=args.steps, k=args.k)
        try:
            cudnn = jax.jit(functools.partial(block_step, config=config), donate_argnames=("cache",))
            t_cudnn, cache = timed(lambda c: cudnn(params, ids, c), cache, args.repeats)
            row["cudnn_step_ms"] = t_cudnn * 1e3
            for name, method in (("splitkv", MAGE(k=args.k, exact_layers=config.num_layers)),
                                 ("mage", MAGE(k=args.k))):
                run = jax.jit(functools.partial(block_step_with_policy, config=config, policy=method),
                              donate_argnames=("cache", "policy_state"))
                state = (cache, init_policy_state(method, config, 1, s + n))
                for phase, step in (("first", 0), ("later", 1)):
                    def call(st, step=step):
                        logits, c, p = run(params, ids, st[0], st[1], jnp.int32(step))
                        return logits, (c, p)
                    t, state = timed(call, state, args.repeats)
                    row[f"{name}_{phase}_ms"] = t * 1e3
                cache = state[0]
                del state
            row["dense_block_ms"] = args.steps * row["cudnn_step_ms"]
            row["splitkv_block_ms"] = args.steps * row["splitkv_later_ms"]
            row["mage_block_ms"] = row["mage_first_ms"] + (args.steps - 1) * row["mage_later_ms"]
            row["speedup_vs_cudnn"] = row["dense_block_ms"] / row["mage_block_ms"]
            row["speedup_vs_splitkv"] = row["splitkv_block_ms"] / row["mage_block_ms"]
        except Exception:
            traceback.print_exc()
            row["error"] = traceback.format_exc()[-400:]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del cache

    meta = dict(benchmark="mage_sdar", device=device, jax=jax.__version__, date=datetime.date.today().isoformat(),
                model=f"{args.config} dims, random bf16 weights and cache, batch 1", block=n, steps=args.steps,
                k=args.k, repeats=args.repeats)
    lines = [f"# MAGE on {args.config} dims — {device}, jax {jax.__version__}, {meta['date']}", "",
             f"Block of {n} tokens, {args.steps} denoising steps per block, k = {args.k}, first 2 layers exact; "
             f"median of {args.repeats} steps, cache and policy state donated. Time per output block: dense = "
             f"{args.steps} x step; MAGE = first step + {args.steps - 1} x later step. Paper: 6.82x at 128k "
             "(H100, FlashInfer baseline, TPOB).", "",
             "| cache | cuDNN step | split-KV step | MAGE first step | MAGE later step | per block: cuDNN / split-KV / "
             "MAGE | MAGE speed-up vs cuDNN / vs split-KV |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['cache']} | failed: {r['error'].splitlines()[-1][:150]} | | | | | |")
            continue
        lines.append(f"| {r['cache']} | {r['cudnn_step_ms']:.2f} ms | {r['splitkv_later_ms']:.2f} ms | "
                     f"{r['mage_first_ms']:.2f} ms | {r['mage_later_ms']:.2f} ms | {r['dense_block_ms']:.0f} / "
                     f"{r['splitkv_block_ms']:.0f} / {r['mage_block_ms']:.0f} ms | {r['speedup_vs_cudnn']:.2f}x / "
                     f"{r['speedup_vs_splitkv']:.2f}x |")
    write_results(args.out, meta, rows, lines)


if __name__ == "__main__":
    main()
