"""Section `weights`: the weight-reading part of an SDAR block step (batch 1, empty cache).

Timed two ways: one jitted call per step (wall: the host's dispatch and the first kernel's start included),
and LOOP_STEPS steps in one jitted `lax.fori_loop` (each step's ids the previous step's argmax, so the steps run
in order and none is dropped), per step, which is how the generation loop runs its forwards."""

from __future__ import annotations

import functools
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from dllm_jax.bench import time_calls, traced_kernels
from dllm_jax.models.sdar import block_step

from .measure import OUT_OF_TIME, error_row, random_ids, timed, weight_bytes, with_copy
from .plan import Plan
from .tables import cell, markdown_table

SECTION = "weights"


LOOP_STEPS = 8


def looped_steps(params, ids, cache, *, config, steps: int):
    """`steps` block steps of `ids` [B, n] against `cache` in one program, each step's ids the previous step's
    argmax (a dependency: the steps run in order, none is dropped); the last step's logits."""
    def body(_, ids):
        logits = block_step(params, ids, cache, config=config)[0]
        return jnp.argmax(logits, axis=-1).astype(ids.dtype)

    ids = jax.lax.fori_loop(0, steps - 1, body, ids)
    return block_step(params, ids, cache, config=config)[0]


def weights_rows(model, config, plan: Plan, copy: dict | None, *, deadline: float):
    w = weight_bytes(model.params(), config)
    for n in plan.weight_tokens:
        if time.monotonic() > deadline:
            yield dict(section="weights", tokens=n, batch=1, skipped=OUT_OF_TIME)
            continue
        try:
            cache = model.init_cache(1, n)  # empty: the step reads no KV, only weights
            ids = jnp.asarray(random_ids(config, 1, n, seed=n))
            # the jitted pure step (same signature before and after issue 17), parameters taken once:
            # `model.block_step` adds host checks that read the cache length back (a sync per call)
            params = model.params()
            jitted = jax.jit(functools.partial(block_step, config=config))
            step = lambda: jitted(params, ids, cache)[0]
            first_s, _ = timed(step)
            seconds = time_calls(step, repeats=10, warmup=1)
            looped = jax.jit(functools.partial(looped_steps, config=config, steps=LOOP_STEPS))
            loop_s = time_calls(lambda: looped(params, ids, cache), repeats=5, warmup=1) / LOOP_STEPS
            gpu_ms = None
            if jax.default_backend() == "gpu":
                with tempfile.TemporaryDirectory() as trace_dir:
                    _, gpu_ms = traced_kernels(lambda: jax.block_until_ready(step()), Path(trace_dir))
            tb_s = w / seconds / 1e12
            row = dict(section="weights", tokens=n, batch=1, weight_bytes=w, step_ms=seconds * 1e3,
                       first_call_s=first_s, tb_s=tb_s, loop_step_ms=loop_s * 1e3, loop_tb_s=w / loop_s / 1e12,
                       gpu_kernel_ms=gpu_ms,
                       gpu_kernel_tb_s=None if not gpu_ms else w / (gpu_ms / 1e3) / 1e12)
            row = with_copy(row, tb_s, copy)
            if copy is not None and gpu_ms:
                row["gpu_kernel_fraction_of_copy"] = row["gpu_kernel_tb_s"] / copy["copy_tb_s"]
            if copy is not None:
                row["loop_fraction_of_copy"] = row["loop_tb_s"] / copy["copy_tb_s"]
        except Exception as e:  # record it, go on with the other sizes
            row = error_row("weights", dict(tokens=n, batch=1), e)
        yield row


COMPARED = (("tokens",), "step_ms", "ms", False)  # the point's fields, the value, its unit, larger is better


def table(meta: dict, rows: list[dict]) -> list[str]:
    header = ["tokens", "weights read", "step (wall)", "TB/s", "of copy", f"in a loop of {LOOP_STEPS}", "TB/s",
              "of copy", "GPU kernels", "TB/s", "of copy"]
    cells = []
    for r in rows:
        if "skipped" in r or "error" in r:
            cells.append([r["tokens"], (r.get("skipped") or r["error"])[:140]])
            continue
        cells.append([r["tokens"], f"{r['weight_bytes'] / 1e9:.2f} GB", f"{r['step_ms']:.2f} ms", f"{r['tb_s']:.2f}",
                      cell(r.get("fraction_of_copy"), ".0%"), cell(r.get("loop_step_ms"), ".2f", " ms"),
                      cell(r.get("loop_tb_s")), cell(r.get("loop_fraction_of_copy"), ".0%"),
                      cell(r["gpu_kernel_ms"], ".2f", " ms"),
                      cell(r["gpu_kernel_tb_s"]), cell(r.get("gpu_kernel_fraction_of_copy"), ".0%")])
    return ["", "## Weight-reading part of an SDAR block step (batch 1, empty cache)", "",
            *markdown_table(header, cells)]


def headline(r: dict) -> str:
    looped = (f"; in a loop {r['loop_step_ms']:.2f} ms ({cell(r.get('loop_fraction_of_copy'), '.0%')})"
              if "loop_step_ms" in r else "")
    return (f"| weights, {r['tokens']} tokens | {r['step_ms']:.2f} ms, {r['tb_s']:.2f} TB/s "
            f"({cell(r.get('fraction_of_copy'), '.0%')} of copy){looped} |")
