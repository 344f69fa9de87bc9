"""MAGE, FlashBlock and their combination on an SDAR-8B-shaped model (random bf16 weights and cache):
time per output block, measured on the real denoising loop, plus the time of one step in each mode.

Per cache length S, one block of `--block` tokens is decoded by `dllm_jax.generate.block_loop.denoise_block`
(the loop `generate` runs) with `--steps` denoising steps and low_confidence_static remasking, so
exactly block/steps tokens are unmasked per step, then one commit forward. The cache fill length is
reset to S before every timed block. Methods:
  cudnn      dense attention, cuDNN (what dense `generate` runs);
  splitkv    dense attention through the split-KV kernel (MAGE with every layer exact);
  mage       MAGE(k), first 2 layers exact;
  flashblock FlashBlock(tau);
  fb+mage    FlashBlock(tau, inner=MAGE(k)) (residual reuse, refreshed by the tau rule);
  fb0+mage   FlashBlock(None, inner=MAGE(k)) (residual from each block's first step only: paper Fig. 6).

    PYTHONPATH=. python -m benchmarks.sdar_methods --out benchmarks/results
    PYTHONPATH=. python -m benchmarks.sdar_methods --merge a.json b.json --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import tempfile
import traceback
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.merging import merge
from benchmarks.sdar_block_step import random_cache
from dllm_jax import MAGE, FlashBlock, shipped_config
from dllm_jax.attention.policy import Dense, Mode, unmasked_since_refresh
from dllm_jax.bench import markdown_table, time_carried, traced_kernels, write_results
from dllm_jax.generate.sampling import transfer_counts
from dllm_jax.generate.block_loop import Finished, cache_capacity, denoise_block
from dllm_jax.generate.sdar import SDAR_SAMPLER, SDAROptions
from dllm_jax.models.block_diffusion import init_policy_state
from dllm_jax.models.sdar import block_step
from dllm_jax.models.layers import prepare_params
from dllm_jax.testing import random_params

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the Pallas Triton backend warns on use

PAPER = "MAGE paper: 6.82x at 128k over exact attention (FlashInfer), SDAR-8B-Chat, k = 1024, 32 steps/block, H100"


def methods(k: int, tau: int, num_layers: int) -> dict:
    return {"cudnn": Dense(), "splitkv": MAGE(k=k, exact_layers=num_layers), "mage": MAGE(k=k),
            "flashblock": FlashBlock(tau=tau), "fb+mage": FlashBlock(tau=tau, inner=MAGE(k=k)),
            "fb0+mage": FlashBlock(tau=None, inner=MAGE(k=k))}


def phases(policy) -> dict[str, int]:
    """The modes whose single-step time is worth reporting for a policy."""
    if isinstance(policy, Dense):
        return {"step": int(Mode.DENSE)}
    if isinstance(policy, MAGE):
        return {"first": int(Mode.ESTIMATE), "sparse": int(Mode.SPARSE)}
    return {"first": int(Mode.ESTIMATE), "refresh": int(Mode.REFRESH), "reuse": int(Mode.SPARSE)}


def mode_counts(policy, block: int, steps: int) -> dict[str, int]:
    """Forwards per block in each mode, from the policy's own schedule under the static unmasking."""
    if isinstance(policy, Dense):
        return {"DENSE": steps + 1}
    schedule = np.asarray(transfer_counts(block, steps))
    counts: dict[str, int] = {}
    unmasked, left = 0, block
    for step in range(steps + 1):
        commit = left == 0 or step >= steps
        mode = Mode(int(policy.block_mode(jnp.int32(step), unmasked=jnp.int32(unmasked), commit=jnp.bool_(commit))))
        counts[mode.name] = counts.get(mode.name, 0) + 1
        if commit:
            break
        new = int(min(schedule[step], left))
        unmasked = int(unmasked_since_refresh(unmasked, mode, new))
        left -= new
    return counts


def measure(config, params, s: int, args) -> dict:
    n = config.block_size
    options = SDAROptions(max_new_tokens=n, denoising_steps=args.steps, remasking="low_confidence_static")
    capacity = cache_capacity(s, n)  # as generate allocates it
    cache = random_cache(config, 1, capacity, s, jax.random.key(s))
    ids = jax.random.randint(jax.random.key(s + 1), (1, n), 0, config.vocab_size)
    masks = jnp.full((1, n), config.mask_token_id, jnp.int32)
    key = jax.random.key(0)
    row = dict(cache=s, block=n, steps=args.steps, k=args.k, tau=args.tau)
    for name, policy in methods(args.k, args.tau, config.num_layers).items():
        try:
            state = init_policy_state(policy, config, 1, capacity)
            step = jax.jit(functools.partial(block_step, config=config, policy=policy),
                           donate_argnames=("cache", "policy_state"))
            for phase, mode in phases(policy).items():
                def one(st, mode=mode):
                    logits, c, p = step(params, ids, st[0], st[1], jnp.int32(mode))
                    return logits, (c, p)
                t, (cache, state) = time_carried(one, (cache, state), repeats=args.repeats, warmup=1)
                row[f"{name}_{phase}_ms"] = t * 1e3
                if args.profile:
                    print(f"{name} {phase}:", flush=True)
                    held = [(cache, state)]
                    traced_kernels(lambda: held.append(jax.block_until_ready(one(held.pop())[1])),
                                   Path(tempfile.mkdtemp()))
                    cache, state = held.pop()
            loop = jax.jit(functools.partial(denoise_block, config=config, options=options, policy=policy,
                                             sampler=SDAR_SAMPLER),
                           donate_argnames=("cache", "policy_state"))

            # one block as the loop runs it after the first: the previous block's commit (exact) in its first step
            finished = Finished(ids=masks, pending=jnp.ones((1,), bool), mode=jnp.full((1,), int(Mode.DENSE), jnp.int32))

            def block(st):
                cur, c, p, _, _ = loop(params, masks, st[0].replace(length=jnp.full((1,), s, jnp.int32)), st[1], key,
                                       jnp.zeros((1,), jnp.int32), jnp.ones((1,), bool), finished)
                return cur, (c, p)
            t, (cache, state) = time_carried(block, (cache, state), repeats=args.block_repeats, warmup=1)
            row[f"{name}_block_ms"] = t * 1e3
            row[f"{name}_modes"] = mode_counts(policy, n, args.steps)
            del state
        except Exception:
            traceback.print_exc()
            row[f"{name}_error"] = traceback.format_exc()[-400:]
            cache = random_cache(config, 1, capacity, s, jax.random.key(s))  # the failed call may have taken it
        print(json.dumps({key: value for key, value in row.items() if key.startswith(name)}), flush=True)
    return row


def table(meta: dict, rows: list[dict]) -> list[str]:
    names = list(methods(1, 1, 1))
    lines = [f"# SDAR block-diffusion methods on {meta['model']} — {meta['device']}, jax {meta['jax']}, {meta['date']}",
             "", f"Block of {meta['block']} tokens, {meta['steps']} denoising steps per block (one token unmasked per "
             f"step, low_confidence_static) + the commit forward, k = {meta['k']}, tau = {meta['tau']}; time per output "
             f"block = median of {meta['block_repeats']} whole blocks of the compiled loop (cache fill reset each time). "
             f"Speed-ups are against cuDNN dense in the same run. {PAPER}.", "",
             *markdown_table(["cache", *(f"{n} block" for n in names), "speed-up vs cuDNN: " + " / ".join(names[1:])],
                             [block_cells(r, names) for r in rows]),
             "", "One forward in each mode (ms) and forwards per block in each mode:", "",
             *markdown_table(["cache", "method", "step times", "forwards per block"],
                             [mode_cells(r, n) for r in rows for n in names])]
    return lines


def block_cells(r: dict, names: list[str]) -> list[str]:
    """Per method the time of a whole block, then the speed-ups against cuDNN dense in one cell."""
    cells = [f"{r[f'{n}_block_ms']:.0f} ms" if f"{n}_block_ms" in r else "failed" for n in names]
    base = r.get("cudnn_block_ms")
    ups = [f"{base / r[f'{n}_block_ms']:.2f}x" if base and f"{n}_block_ms" in r else "-" for n in names[1:]]
    return [r["cache"], *cells, " / ".join(ups)]


def mode_cells(r: dict, n: str) -> list[str]:
    """One forward's time in each mode of method `n`, and how many forwards of each mode a block runs."""
    times = ", ".join(f"{key[len(n) + 1:-3]} {value:.2f}" for key, value in r.items()
                      if key.startswith(n + "_") and key.endswith("_ms") and not key.endswith("block_ms"))
    modes = ", ".join(f"{m} {c}" for m, c in r.get(f"{n}_modes", {}).items())
    return [r["cache"], n, times, modes]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache-lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--block", type=int, default=32, help="block length (SDAR-8B-Chat's config says 4)")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--tau", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="single steps timed per mode")
    parser.add_argument("--block-repeats", type=int, default=3, help="whole blocks timed per method")
    parser.add_argument("--config", default="sdar-8b-chat")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count (smoke runs)")
    parser.add_argument("--profile", action="store_true", help="print each mode's top GPU kernels")
    parser.add_argument("--tag", default="", help="suffix of the result files (partial runs)")
    parser.add_argument("--merge", type=Path, nargs="*", default=None, help="combine result JSONs into one table")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()

    if args.merge:
        merge(args.merge, args.out, report=table, changes=lambda parts: dict(benchmark="sdar_methods"),
              order=lambda r: r["cache"])
        return

    config = dataclasses.replace(shipped_config(args.config), block_size=args.block)
    if args.layers is not None:
        config = dataclasses.replace(config, num_layers=args.layers)
    params = prepare_params(random_params(config, jax.random.key(0)), config)
    device = jax.devices()[0].device_kind
    print(f"{device}, jax {jax.__version__}", flush=True)
    rows = [measure(config, params, s, args) for s in args.cache_lengths]
    meta = dict(benchmark="sdar_methods" + args.tag, device=device, jax=jax.__version__,
                date=datetime.date.today().isoformat(),
                model=f"{args.config} dims ({config.num_layers} layers), random bf16 weights and cache, batch 1",
                block=args.block, steps=args.steps, k=args.k, tau=args.tau, repeats=args.repeats,
                block_repeats=args.block_repeats)
    write_results(args.out, meta, rows, table(meta, rows))


if __name__ == "__main__":
    main()
