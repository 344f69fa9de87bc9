"""Section `llada`: `dllm_jax.generate` on LLaDA at the plan's (batch, gen_length, steps) points, with every
Fast-dLLM cache and method of the plan; tokens/s of the warm call."""

from __future__ import annotations

import gc
import json
import time

from dllm_jax.attention.methods import describe
from dllm_jax.bench import family_methods

from .measure import OUT_OF_TIME, activation_bytes, error_row, kv_bytes_per_position, memory_verdict, random_ids, timed
from .plan import Plan
from .tables import cell, markdown_table

SECTION = "llada"


def llada_rows(model, config, plan: Plan, *, deadline: float):
    from dllm_jax import generate

    methods = family_methods("LLaDA", small=plan.small_methods)
    for (batch, gen, steps), cache, name in ((run, cache, name) for run in plan.llada_runs
                                              for cache in plan.llada_caches for name in plan.llada_methods):
        point = dict(prompt=plan.llada_prompt, batch=batch, gen_length=gen, steps=steps, block=plan.llada_block,
                     cache=cache)
        if name != "dense":  # rows of the baseline package and of dense runs keep their old fields
            point["method"] = name
        tokens = batch * (plan.llada_prompt + gen)
        need = activation_bytes(config, tokens) + batch * gen * config.vocab_size * 4 * 2
        if cache is not None:  # the KV cache of every layer over the whole sequence
            need += kv_bytes_per_position(config) * tokens
        reason = OUT_OF_TIME if time.monotonic() > deadline else memory_verdict(need)
        if reason:
            yield dict(section="llada", **point, skipped=reason)
            continue
        ids = random_ids(config, batch, plan.llada_prompt, seed=batch + gen)
        fast = {} if cache is None else dict(cache=cache)  # the baseline package has no cache option
        if name != "dense":
            fast["method"] = methods[name]
        try:
            run = lambda: generate(model, ids, seed=0, gen_length=gen, steps=steps, block_length=plan.llada_block,
                                   **fast)
            first_s, _ = timed(run)
            warm_s, out = timed(run)
            generated = batch * (out.shape[1] - plan.llada_prompt)
            row = dict(section="llada", **point, generated=generated, first_call_s=first_s, warm_s=warm_s,
                       compile_s=first_s - warm_s, tokens_per_s=generated / warm_s,
                       per_step_ms=warm_s / steps * 1e3)
            if name != "dense":
                row["config"] = describe(methods[name])
        except Exception as e:
            row = error_row("llada", point, e)
            gc.collect()
        print(json.dumps(row), flush=True)
        yield row


COMPARED = (("prompt", "batch", "gen_length", "steps", "cache", "method"), "tokens_per_s", "tok/s", True)


def table(meta: dict, rows: list[dict]) -> list[str]:
    header = ["prompt", "batch", "gen", "steps", "block", "cache", "method", "tok/s", "vs exact", "per step",
              "first call"]
    # the exact sampler: no cache, dense, one token per step, at the same prompt, batch and gen length
    exact = {(r["prompt"], r["batch"], r["gen_length"]): r["tokens_per_s"] for r in rows
             if "tokens_per_s" in r and not r.get("cache") and not r.get("method") and r["steps"] == r["gen_length"]}
    cells = []
    for r in rows:
        head = [r["prompt"], r["batch"], r["gen_length"], r["steps"], r["block"], r.get("cache") or "none",
                r.get("method", "dense")]
        if "skipped" in r or "error" in r:
            cells.append(head + [(r.get("skipped") or r["error"])[:140]])
            continue
        base = exact.get((r["prompt"], r["batch"], r["gen_length"]))
        cells.append(head + [f"{r['tokens_per_s']:.1f}", cell(r["tokens_per_s"] / base if base else None, ".1f", "x"),
                             f"{r['per_step_ms']:.1f} ms", f"{r['first_call_s']:.1f} s"])
    return ["", "## LLaDA generation", "",
            "vs exact: against the exact sampler (no cache, dense, one token per step) at the same prompt, "
            "batch and gen length, measured in the same run.", "", *markdown_table(header, cells)]


def headline(r: dict) -> str:
    return (f"| LLaDA P={r['prompt']} B={r['batch']} gen {r['gen_length']} steps {r['steps']} cache "
            f"{r.get('cache')} {r.get('method', 'dense')} | {r['tokens_per_s']:.1f} tok/s |")
