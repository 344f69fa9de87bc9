"""SparseD and PulseCol on a LLaDA-8B-shaped model (random bf16 weights) on the GPU: time of one
denoising step in each phase, and the end-to-end ratio over dense that the schedules imply.

For each context length N (prompt N - G, G generated tokens, logits from the prompt end as in
generation): the dense step (`forward` with Dense(), cuDNN attention) and `forward` with the method at
a step of each phase of each method (SparseD: dense / estimation / sparse; PulseCol: refresh / sparse). The sparse
steps reuse the pattern the estimation step produced on the same inputs. Projection for T steps:
  SparseD: end = int(T * skip) + 1 dense steps, one estimation step, T - end - 1 sparse steps;
  PulseCol: len(refresh_steps(T)) refresh steps, the rest sparse.

    PYTHONPATH=. python -m benchmarks.sparse_llada --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import traceback
import warnings
from pathlib import Path

import jax

from dllm_jax.bench import time_calls, time_carried, write_results
from dllm_jax import PulseCol, SparseD, shipped_config
from dllm_jax.attention.policy import Mode
from dllm_jax.models.llada import forward, init_policy_state
from dllm_jax.models.layers import prepare_params
from dllm_jax.testing import random_params

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the Pallas Triton backend warns on use

PAPERS = {("sparsed", 128): 1.25, ("sparsed", 1024): 1.50, ("pulsecol", 128): 1.58, ("pulsecol", 1024): 1.95}


def phase_times(method, phases, params, ids, config, logits_from, repeats):
    """{phase: seconds} for `forward` with the method at one step of each phase. The policy state is donated
    and threaded from call to call, as the generate loop's carry is (one copy of the patterns), so
    the sparse phase runs on the pattern that the estimation phase produced."""
    run = jax.jit(functools.partial(forward, config=config, policy=method, logits_from=logits_from),
                  donate_argnames=("policy_state",))
    state = init_policy_state(method, config, 1, ids.shape[1])
    times = {}
    for phase, step in phases:
        assert int(method.mode(step)) == phase, (phase, step)
        times[phase], state = time_carried(lambda st, step=step: run(params, ids, None, st, step), state,
                                           repeats=repeats, warmup=2)  # two warm-up calls (compilation)
        print(f"  {type(method).__name__} {Mode(phase).name}: {times[phase] * 1e3:.1f} ms", flush=True)
    del state
    return times


def project(kind, method_cfg, times, t_dense, total_steps):
    if kind == "sparsed":
        bound = method_cfg.bind(total_steps=total_steps, prompt_length=0)
        end = bound.end_step
        sparse_total = end * t_dense + times[Mode.ESTIMATE] + (total_steps - end - 1) * times[Mode.SPARSE]
    else:
        refreshes = len(method_cfg.bind(total_steps=total_steps).schedule)
        sparse_total = refreshes * times[Mode.ESTIMATE] + (total_steps - refreshes) * times[Mode.SPARSE]
    return total_steps * t_dense / sparse_total


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--gen-length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=None, help="override the layer count (smoke runs)")
    parser.add_argument("--select", type=float, default=0.3)
    parser.add_argument("--sparse-block", type=int, default=128)
    parser.add_argument("--sparsity", type=float, default=0.8)
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--methods", nargs="+", default=["sparsed", "pulsecol"], choices=["sparsed", "pulsecol"])
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()

    config = shipped_config("llada-8b-instruct")
    if args.layers is not None:
        config = dataclasses.replace(config, num_layers=args.layers)
    params = prepare_params(random_params(config, jax.random.key(0)), config)
    device = jax.devices()[0].device_kind
    print(f"{device}, jax {jax.__version__}", flush=True)
    sparsed = SparseD(select=args.select, block_size=args.sparse_block)
    methods = ([("sparsed", sparsed)] if "sparsed" in args.methods else []) + (
        [("pulsecol", PulseCol(sparsity=args.sparsity, group_size=g)) for g in args.group_sizes]
        if "pulsecol" in args.methods else [])
    rows = []
    for n in args.lengths:
        prompt = n - args.gen_length
        ids = jax.random.randint(jax.random.key(n), (1, n), 0, config.tokenizer_vocab_size)
        dense = jax.jit(functools.partial(forward, config=config, logits_from=prompt))
        t_dense = time_calls(dense, params, ids, repeats=args.repeats, warmup=2, burst_s=0)
        print(f"N={n}: dense step {t_dense * 1e3:.1f} ms", flush=True)
        for kind, cfg in methods:
            try:
                if kind == "sparsed":
                    bound = cfg.bind(total_steps=128, prompt_length=prompt)
                    end = bound.end_step
                    phases = [(Mode.DENSE, 0), (Mode.ESTIMATE, end), (Mode.SPARSE, end + 1)]
                else:
                    bound = cfg.bind(total_steps=128)
                    phases = [(Mode.ESTIMATE, 0), (Mode.SPARSE, 1)]
                times = phase_times(bound, [(p, jax.numpy.int32(s)) for p, s in phases], params, ids, config,
                                    prompt, args.repeats)
            except Exception:  # e.g. out of memory at 64k: record it and go on
                traceback.print_exc()
                rows.append(dict(n=n, method=kind, config=repr(cfg), error=traceback.format_exc()[-400:]))
                continue
            row = dict(n=n, method=kind, config=repr(cfg), dense_ms=t_dense * 1e3,
                       estimate_ms=times[Mode.ESTIMATE] * 1e3, sparse_ms=times[Mode.SPARSE] * 1e3,
                       estimate_over_dense=times[Mode.ESTIMATE] / t_dense, sparse_over_dense=times[Mode.SPARSE] / t_dense,
                       policy_dense_ms=times.get(Mode.DENSE, 0.0) * 1e3 or None)
            for total in (128, 1024):
                row[f"projected_speedup_{total}"] = project(kind, cfg, times, t_dense, total)
                row[f"paper_{total}"] = PAPERS[(kind, total)]
            rows.append(row)
            print(json.dumps(row), flush=True)

    meta = dict(benchmark="sparse_llada" + (f"_{args.tag}" if args.tag else ""), device=device, jax=jax.__version__, date=datetime.date.today().isoformat(),
                model=f"LLaDA-8B dimensions, {config.num_layers} layers, random bf16 weights, batch 1",
                gen_length=args.gen_length, methods=[repr(m) for _, m in methods], repeats=args.repeats)
    lines = [f"# SparseD and PulseCol on LLaDA-8B dims — {device}, jax {jax.__version__}, {meta['date']}", "",
             f"Batch 1, random bf16 weights, {args.gen_length} generated tokens (logits from the prompt end), "
             f"median of {args.repeats}. SparseD(select={args.select}, block_size={args.sparse_block}, skip=0.2); "
             f"PulseCol(sparsity={args.sparsity}, group_size in {args.group_sizes}, eta=0.3, refreshes=16). "
             "Projected speed-up = T dense steps / the schedule's steps; papers measured on A800 / RTX PRO 6000 "
             "against FlashAttention at 64k.", "",
             "| N | method | dense step | estimation step (x dense) | sparse step (x dense) | projected 128 steps "
             "| projected 1024 steps | paper 128 / 1024 (64k) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['n']} | {r['method']} {r.get('config', '')} | failed: {r['error'].splitlines()[-1][:120]} "
                         "| | | | | |")
            continue
        name = r["method"] + (f" g{r['config'].split('group_size=')[1].split(',')[0]}" if r["method"] == "pulsecol" else "")
        lines.append(f"| {r['n']} | {name} | {r['dense_ms']:.1f} ms | {r['estimate_ms']:.1f} ms "
                     f"({r['estimate_over_dense']:.2f}) | {r['sparse_ms']:.1f} ms ({r['sparse_over_dense']:.2f}) | "
                     f"{r['projected_speedup_128']:.2f}x | {r['projected_speedup_1024']:.2f}x | "
                     f"{r['paper_128']:.2f}x / {r['paper_1024']:.2f}x |")
    write_results(args.out, meta, rows, lines)


if __name__ == "__main__":
    main()
