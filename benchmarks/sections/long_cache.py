"""Section `mage128k`: one output block of the SDAR generate loop against a long cache, dense, MAGE (its top k
found by its default tile tournament, by lax.top_k and by the radix threshold), FlashBlock and FlashBlock + MAGE,
each with its byte ideal: the bytes its block must read (`block_bytes`) at the copy bandwidth of the same run."""

from __future__ import annotations

import dataclasses
import gc
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from dllm_jax.attention.methods import describe
from dllm_jax.attention.policy import Dense, Mode
from dllm_jax.bench import family_methods, kernel_profile, time_carried

from .measure import OUT_OF_TIME, activation_bytes, error_row, kv_bytes_per_position, memory_verdict, weight_bytes, with_copy
from .plan import Plan
from .sdar import sdar_options
from .tables import cell, markdown_table

SECTION = "mage128k"


@dataclasses.dataclass(frozen=True)
class DenseApart(Dense):
    """Dense with one call per segment of a forward: the commit riding on the next block's first step reads the
    cache twice (method "dense/apart": the baseline of the one-pass forward)."""

    def joins_segments(self, q, k) -> bool:
        return False


def long_rows(model, config, plan: Plan, *, baseline: bool, copy: dict | None, deadline: float):
    """Dense and MAGE: the time of one output block of the generate loop (`denoise_block`: the block's
    denoising forwards and its commit) against a long cache, in the loop's own code."""
    from dllm_jax.generate import block_loop as loops
    from dllm_jax.generate import sdar as gen
    from dllm_jax.models import block_diffusion

    params = model.params()
    w = weight_bytes(params, config)
    s, n = plan.long_prompt, config.block_size
    options = gen.SDAROptions(**sdar_options(plan))
    mage = family_methods("SDAR", small=plan.small_methods)["mage"]
    # "mage/sort", "mage/threshold": the same selection found by lax.top_k and by the radix threshold;
    # "mage/per-layer": each sparse layer's top k found in the layer (instead of one batched selection after the
    # block's first forward); "mage/keys": its
    # scores from the keys read again (kv_scores) instead of the exact pass's logits; "mage/probs": from their
    # float16 form (half the bytes written and read)
    methods = family_methods("SDAR", small=plan.small_methods, names=("flashblock", "flashblock+mage"))
    known = {"mage": mage, "mage/sort": dataclasses.replace(mage, select_by="sort"),
             "mage/threshold": dataclasses.replace(mage, select_by="threshold"),
             "mage/per-layer": dataclasses.replace(mage, select_after_forward=False),
             "mage/keys": dataclasses.replace(mage, scores_from="keys"),
             "mage/probs": dataclasses.replace(mage, scores_from="probs"), "dense/apart": DenseApart(),
             "dense/fp8": Dense(), **methods}
    policies = {"dense": Dense()} | {name: known[name] for name in plan.long_methods}
    repeats = 3
    for batch in plan.long_batches:
        point = dict(cache=s, batch=batch, block=n, steps=plan.sdar_steps)
        capacity = loops.cache_capacity(s + (repeats + 2) * n, n)  # as generate allocates it (whole key tiles)
        need = batch * capacity * kv_bytes_per_position(config) + activation_bytes(config, 2 * batch * n)
        reason = OUT_OF_TIME if time.monotonic() > deadline else memory_verdict(need)
        if reason:
            yield dict(section="mage128k", **point, skipped=reason)
            continue
        masks = jnp.full((batch, n), config.mask_token_id, jnp.int32)
        dense_ms = dense_ideal = None
        forwards = plan.sdar_steps + 1 if baseline else plan.sdar_steps
        for name, policy in policies.items():
            what = dict(point, method=name)
            cache = state = None
            try:
                gc.collect()
                # zeros stand in for a prefill: attention cost does not depend on the values; "/fp8": the cache in
                # float8 rows (kv_cache_dtype="fp8")
                fp8 = name.endswith("/fp8")
                if fp8:
                    from dllm_jax.attention import kv_rows  # here: --baseline runs an older package without it
                    cache = block_diffusion.init_cache(config, batch, capacity, kv_rows.FP8)
                else:
                    cache = model.init_cache(batch, capacity)
                state = block_diffusion.init_policy_state(policy, config, batch, capacity)
                loop = block_loop(gen, params, masks, policy, options, config, batch, baseline)
                at = lambda c: c.replace(length=jnp.full(c.length.shape, s, jnp.int32))

                def one(carry):
                    cur, c, st = loop(at(carry[0]), carry[1])
                    return cur, (c, st)
                t, (cache, state) = time_carried(one, (cache, state), repeats=repeats, warmup=1)
                row = dict(section="mage128k", **what, config=describe(None if name == "dense" else policy),
                           block_ms=t * 1e3, commit="own forward" if baseline else "fused with the next block's "
                           "first step")
                if jax.default_backend() == "gpu":  # where the block's time goes: GPU kernels by name, launch gaps
                    held = [(cache, state)]

                    def traced():
                        held[0] = one(held[0])[1]
                        jax.block_until_ready(held[0])

                    with tempfile.TemporaryDirectory() as trace_dir:
                        row["profile"] = kernel_profile(traced, Path(trace_dir))
                    # the list and the closure hold the cache: at batch 4 a 128k cache is 77 GB, and the next
                    # method's would not fit beside it
                    (cache, state), held, traced = held[0], None, None
                # the commit's segment reads the cache in the first step's call where the policy joins them
                probe = jax.ShapeDtypeStruct((batch, 2 * n, config.num_heads, config.head_dim), params["embed"].dtype)
                cache_probe = jax.ShapeDtypeStruct((batch, capacity, config.num_kv_heads, config.head_dim),
                                                   params["embed"].dtype)
                ideal = block_bytes(policy, config, batch=batch, prefix=s, steps=plan.sdar_steps, forwards=forwards,
                                    weights=w, joined=not baseline and policy.joins_segments(probe, cache_probe),
                                    position_bytes=fp8_position_bytes(config) if fp8 else None)
                row["block_bytes"] = ideal
                if copy is not None:
                    ideal_ms = ideal / (copy["copy_tb_s"] * 1e12) * 1e3
                    row |= dict(ideal_ms=ideal_ms, of_ideal=ideal_ms / row["block_ms"])
                if name == "dense":
                    dense_ms, dense_ideal = t * 1e3, ideal
                    kv = batch * (s + n) * kv_bytes_per_position(config)
                    tb_s = ideal / t / 1e12  # what dense reads is its ideal
                    row = with_copy(row | dict(weight_bytes=w, kv_bytes=kv, forwards_per_block=forwards, tb_s=tb_s),
                                    tb_s, copy)
                elif dense_ms is not None:
                    row |= dict(speedup_vs_dense=dense_ms / (t * 1e3), ideal_speedup_vs_dense=dense_ideal / ideal)
            except Exception as e:
                row = error_row("mage128k", what, e)
            del cache, state
            print(json.dumps(row), flush=True)
            yield row
        gc.collect()


def block_modes(policy, steps: int) -> list[int]:
    """The policy modes of an output block's segments as the section runs them: the previous block's commit, then
    `steps` denoising forwards unmasking one token each (remasking low_confidence_static with as many steps as the
    block has tokens); `unmasked` counts as the loop counts it (`generate.sdar.denoise_block`)."""
    commit = policy.block_mode(jnp.int32(steps), unmasked=jnp.int32(0), commit=True)
    modes, unmasked = [int(commit)], 0
    for step in range(steps):
        mode = int(policy.block_mode(jnp.int32(step), unmasked=jnp.int32(unmasked), commit=False))
        unmasked = (unmasked if mode == int(Mode.SPARSE) else 0) + 1
        modes.append(mode)
    return modes


def fp8_position_bytes(config) -> int:
    """K and V of one position in every layer in float8 rows: a byte per element and a float32 scale per KV head."""
    return 2 * config.num_layers * config.num_kv_heads * (config.head_dim + 4)


def block_bytes(policy, config, *, batch: int, prefix: int, steps: int, forwards: int, weights: int,
                joined: bool = False, position_bytes: int | None = None) -> int:
    """The bytes an output block must read, the method's byte ideal: the weights once per forward, and per row and
    layer the whole prefix's K and V in every segment (`block_modes`; with `joined`, the commit's segment and the
    first step's read it once between them) but the SPARSE ones, where a selection of k
    keys (MAGE's; FlashBlock alone reads none) and the block's own are read instead; a method's exact layers read
    the whole prefix in every segment. What a method reads or writes besides is not counted (MAGE's Eq. 3 scores:
    the logits its first step's pass writes and reads back, or the keys read again with scores_from="keys")."""
    selector = getattr(policy, "inner", None) or policy  # FlashBlock + MAGE: MAGE's selection and exact layers
    exact, k = getattr(selector, "exact_layers", 0), getattr(selector, "k", 0)
    modes = block_modes(policy, steps)
    sparse = sum(mode == int(Mode.SPARSE) for mode in modes)
    full = config.num_layers * (len(modes) - joined) - (config.num_layers - exact) * sparse
    rows = full * prefix + (config.num_layers - exact) * sparse * (min(k, prefix) + config.block_size)
    return forwards * weights + batch * rows * (position_bytes or kv_bytes_per_position(config)) // config.num_layers


def block_loop(gen, params, masks, policy, options, config, batch: int, baseline: bool):
    """(cache, policy_state) -> (block, cache, policy_state): one output block of the generate loop,
    jitted with the cache and state donated. With `baseline` (a checkout whose loop committed each block in a
    forward of its own) the block runs as that loop ran it; the package's loop commits the previous block in the
    first step (here: one pending)."""
    from dllm_jax.generate import block_loop as loops

    key = jax.random.key(0)
    # params go in as an argument: captured by the closure they would be compiled in as constants
    if baseline:
        fn = jax.jit(lambda p, c, st: gen.denoise_block(p, masks, c, st, key, jnp.int32(0), config=config,
                                                        options=options, policy=policy)[:3], donate_argnums=(1, 2))
        return lambda c, st: fn(params, c, st)
    steps = jnp.full((batch,), options.denoising_steps, jnp.int32)
    finished = loops.Finished(ids=jnp.zeros_like(masks), pending=jnp.ones((batch,), bool),
                            mode=jnp.broadcast_to(policy.block_mode(steps, unmasked=jnp.zeros_like(steps), commit=True),
                                                  (batch,)).astype(jnp.int32))
    active = jnp.ones((batch,), bool)
    draws = jnp.zeros((batch,), jnp.int32)
    fn = jax.jit(lambda p, c, st: loops.denoise_block(p, masks, c, st, key, draws, active, finished, config=config,
                                                      options=options, policy=policy,
                                                      sampler=gen.SDAR_SAMPLER)[:3], donate_argnums=(1, 2))
    return lambda c, st: fn(params, c, st)


COMPARED = (("cache", "batch", "method"), "block_ms", "ms/block", False)


def table(meta: dict, rows: list[dict]) -> list[str]:
    header = ["cache", "batch", "method", "per block", "commit", "vs dense", "byte ideal", "of ideal",
              "ideal vs dense", "dense TB/s", "of copy"]
    cells = []
    for r in rows:
        head = [r["cache"], r["batch"], r.get("method", "")]
        if "skipped" in r or "error" in r:
            cells.append(head + [(r.get("skipped") or r["error"])[:140]])
            continue
        cells.append(head + [f"{r['block_ms']:.1f} ms", r["commit"], cell(r.get("speedup_vs_dense"), ".2f", "x"),
                             cell(r.get("ideal_ms"), ".1f", " ms"), cell(r.get("of_ideal"), ".0%"),
                             cell(r.get("ideal_speedup_vs_dense"), ".2f", "x"), cell(r.get("tb_s")),
                             cell(r.get("fraction_of_copy"), ".0%")])
    lines = ["", "## Long cache: time per output block (the generate loop's `denoise_block`: 4 steps + the commit)",
             "", *markdown_table(header, cells), "",
             "Byte ideal: the bytes the block must read (the weights per forward; the whole cache prefix per layer in "
             "every segment but the SPARSE ones, where the selected keys; exact layers always) at this run's copy "
             "bandwidth (`long_cache.block_bytes`). Dense TB/s: what dense reads, over its time."]
    for r in rows:  # on a GPU: one traced block per row, its kernels by time
        profile = r.get("profile")
        if profile:
            lines += ["", f"GPU kernels of one block, {r['cache']} cache, batch {r['batch']}, {r['method']}: "
                          f"{profile['gpu_ms']:.1f} ms in {profile['launches']} launches (the block took "
                          f"{r['block_ms']:.1f} ms)", "",
                      *markdown_table(["kernel", "ms", "launches"],
                                      [[f"`{k['name']}`", f"{k['ms']:.2f}", k["launches"]]
                                       for k in profile["kernels"]])]
    return lines


def headline(r: dict) -> str:
    extra = f", {r['speedup_vs_dense']:.2f}x dense" if "speedup_vs_dense" in r else ""
    if "ideal_ms" in r:
        extra += f" (byte ideal {r['ideal_ms']:.1f} ms)"
    return f"| {r['cache']} cache B={r['batch']} {r['method']} | {r['block_ms']:.1f} ms/block{extra} |"
