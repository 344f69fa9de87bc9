"""Section `sdar`: `dllm_jax.generate` on SDAR, dense at every (prompt, batch) point and the methods at
the plan's method points; tokens/s, decode time per forward and its bandwidth."""

from __future__ import annotations

import gc
import json
import time

import numpy as np
from dllm_jax.attention.methods import describe
from dllm_jax.bench import family_methods

from .measure import (OUT_OF_TIME, activation_bytes, error_row, kv_bytes_per_position, memory_verdict, random_ids,
                      timed, weight_bytes, with_copy)
from .plan import Plan
from .tables import cell, markdown_table

SECTION = "sdar"


def sdar_options(plan: Plan) -> dict:
    return dict(max_new_tokens=plan.sdar_new_tokens, denoising_steps=plan.sdar_steps,
                remasking="low_confidence_static")


def sdar_memory(config, batch: int, prompt: int, new: int) -> int:
    positions = prompt + new + 2 * config.block_size + 128  # the loop's cache, rounded up to its tile
    logits = batch * config.block_size * config.vocab_size * 4 * 2
    return batch * positions * kv_bytes_per_position(config) + activation_bytes(config, batch * prompt) + logits


def average_kv_length(prompt: int, new: int, block: int) -> float:
    """Mean keys a block step attends to over the generation: block j of new/block reads prompt + (j+1)*block."""
    blocks = -(-new // block)
    return prompt + block * (blocks + 1) / 2


def sdar_rows(model, config, plan: Plan, *, baseline: bool, copy: dict | None, prefills: dict, deadline: float):
    """Dense generation at every (prompt, batch) point, the methods at plan.method_points."""
    from dllm_jax import generate

    w = weight_bytes(model.params(), config)
    bs, steps, new = config.block_size, plan.sdar_steps, plan.sdar_new_tokens
    blocks = -(-new // bs)
    # the pre-issue-17 loop ran a forward per commit; the current one commits a block in the next
    # block's first forward (one weight read for both), and the last block's commit not at all
    forwards = blocks * (steps + 1) if baseline else blocks * steps
    methods = family_methods("SDAR", small=plan.small_methods)
    methods = {name: methods[name] for name in ("dense", *plan.methods)}
    method_batches = dict(plan.method_points)
    for prompt in plan.sdar_prompts:
        for batch in plan.sdar_batches:
            names = ["dense"] + [n for n in methods if n != "dense" and batch in method_batches.get(prompt, ())]
            point = dict(prompt=prompt, batch=batch, new_tokens=new)
            reason = memory_verdict(sdar_memory(config, batch, prompt, new))
            if reason:
                print(f"sdar {point}: {reason}", flush=True)
                yield dict(section="sdar", **point, methods=names, skipped=reason)
                continue
            ids = random_ids(config, batch, prompt, seed=prompt + batch)
            mask = {} if baseline else dict(attention_mask=np.ones_like(ids))
            dense_s = None
            for name in names:
                method = methods[name]
                what = dict(point, method=name)
                if time.monotonic() > deadline:
                    yield dict(section="sdar", **what, skipped=OUT_OF_TIME)
                    continue
                try:
                    run = lambda: generate(model, ids, method=method, seed=0, **mask, **sdar_options(plan))
                    first_s, _ = timed(run)
                    warm_s, out = timed(run)
                    generated = batch * (out.shape[1] - prompt)  # stop tokens disabled: no row ends early
                    if (prompt, batch) not in prefills:
                        # the empty cache built outside the clock: 73 eager allocations cost more host time
                        # than the prefill's own GPU time (H100, SDAR-8B, 1k tokens); generate builds it in its jit
                        empty = model.init_cache(batch, prompt)
                        prefill = lambda: model.prefill(ids, empty)  # not donated: the same cache each call
                        timed(prefill)
                        prefills[(prompt, batch)] = timed(prefill)[0]
                    # timing noise can exceed a tiny decode: no decode figures then
                    decode_s = warm_s - prefills[(prompt, batch)]
                    decode_s = decode_s if decode_s > 0 else None
                    per_forward = None if decode_s is None else decode_s / forwards
                    kv = batch * average_kv_length(prompt, new, bs) * kv_bytes_per_position(config)
                    row = dict(section="sdar", **what, config=describe(method),
                               steps=steps, block=bs, generated=generated, forwards=forwards,
                               first_call_s=first_s, warm_s=warm_s, compile_s=first_s - warm_s,
                               tokens_per_s=generated / warm_s, prefill_s=prefills[(prompt, batch)],
                               decode_s=decode_s, decode_tokens_per_s=decode_s and generated / decode_s,
                               per_forward_ms=per_forward and per_forward * 1e3, weight_bytes=w,
                               kv_bytes_per_forward=kv)
                    if name == "dense":
                        dense_s = warm_s
                    if name == "dense" and per_forward is not None:
                        tb_s = (w + kv) / per_forward / 1e12
                        row = with_copy(row | dict(tb_s=tb_s), tb_s, copy)
                    elif name != "dense" and dense_s is not None:
                        row["speedup_vs_dense"] = dense_s / warm_s
                except Exception as e:  # e.g. out of memory: record it, go on with the others
                    row = error_row("sdar", what, e)
                    gc.collect()
                print(json.dumps(row), flush=True)
                yield row


COMPARED = (("prompt", "batch", "method", "new_tokens"), "tokens_per_s", "tok/s", True)


def table(meta: dict, rows: list[dict]) -> list[str]:
    r0 = next((r for r in rows if "steps" in r), dict(block="?", steps=meta["plan"]["sdar_steps"]))
    header = ["prompt", "batch", "method", "new", "tok/s", "decode tok/s", "per forward", "GB per forward", "TB/s",
              "of copy", "vs dense", "first call"]
    cells = []
    for r in rows:
        head = [r["prompt"], r["batch"], r.get("method", ", ".join(r.get("methods", []))), r["new_tokens"]]
        if "skipped" in r or "error" in r:
            cells.append(head + [(r.get("skipped") or r["error"])[:140]])
            continue
        cells.append(head + [f"{r['tokens_per_s']:.1f}", cell(r["decode_tokens_per_s"], ".1f"),
                             cell(r["per_forward_ms"], ".2f", " ms"),
                             f"{(r['weight_bytes'] + r['kv_bytes_per_forward']) / 1e9:.1f}", cell(r.get("tb_s")),
                             cell(r.get("fraction_of_copy"), ".0%"), cell(r.get("speedup_vs_dense"), ".2f", "x"),
                             f"{r['first_call_s']:.1f} s"])
    points = "; ".join(f"prompt {p}, batch {', '.join(map(str, bs))}" for p, bs in meta["plan"]["method_points"])
    return ["", "## SDAR generation", "",
            f"Block {r0['block']}, {r0['steps']} denoising steps + the commit per block, low_confidence_static, "
            "stop tokens disabled, every row the same prompt length (no padding). Dense at every point; "
            f"the methods ({', '.join(meta['plan']['methods'])}; default parameters) only at "
            + (points or "no point (dense only)")
            + ". tok/s = generated tokens / warm call (prefill included); decode = warm call - prefill "
            "(`model.prefill` timed alone); bytes per forward = weights + the batch's KV rows (mean over the "
            "blocks), for dense attention.", "", *markdown_table(header, cells)]


def headline(r: dict) -> str:
    extra = f", {r['speedup_vs_dense']:.2f}x dense" if "speedup_vs_dense" in r else ""
    return f"| SDAR P={r['prompt']} B={r['batch']} {r['method']} | {r['tokens_per_s']:.1f} tok/s{extra} |"
