"""Generated tokens per second at the SDAR-8B and LLaDA-8B shapes (random bf16 weights), next to the
bytes each forward must read and the device's copy bandwidth measured in the same process.

Sections (`--sections`, comma-separated; every result is written as soon as it is measured, to
<out>/throughput<tag>_<device>_<date>.{json,md}, so a run cut short keeps what it measured):
  copy      copy bandwidth of the device: a large array copied under jit, (bytes read + written) /
            time; an elementwise negation of the same array is reported next to it. Runs first, and
            automatically whenever a section reports bandwidth (weights, sdar, mage128k): every
            bandwidth row carries its fraction of the copy bandwidth of its own process.
  weights   the weight-reading part of an SDAR-8B block step: the jitted `dllm_jax.models.sdar.block_step`
            of 4 and 32 tokens,
            batch 1, on an empty cache (no KV read); bytes = every weight a forward reads (layers,
            final norm, LM head; not the embedding table, which is only gathered). Wall time per call
            (back-to-back calls) and, on a GPU, the profiled GPU kernel time of one call.
  sdar      `dllm_jax.generate` on SDAR-8B: block 4, denoising_steps 4, low_confidence_static (one
            token per step: fixed work per block), stop tokens disabled (random weights would stop
            anywhere), `--sdar-new-tokens` new tokens, prompts `--sdar-prompts`, batches
            `--sdar-batches` (a point whose estimated memory exceeds 80% of the device is skipped
            with the estimate recorded); dense at every point, the methods (MAGE, FlashBlock,
            FlashBlock + MAGE, default parameters) only at `--method-points` (default: prompt 1024
            at batch 8, prompt 32768 at batch 1). Every row has the same prompt length (no padding;
            attention_mask all ones, none in --baseline). Tokens/s = generated
            tokens / wall time of the second (warm) call; the first call is timed separately
            (compile + run). The prefill is timed alone (`model.prefill`, warm) and subtracted to
            give the decode time, per forward (blocks x steps forwards: the commit rides on the next
            block's first step; blocks x (steps + 1) with --baseline), the bytes a dense
            forward must read (weights + the KV rows of the batch, averaged over the blocks) and the
            achieved bandwidth.
  llada     `dllm_jax.generate` on LLaDA-8B, prompt `--llada-prompt` (1024), block 32, the (batch,
            gen_length, steps) points of `--llada-runs` (default 1:256:256 1:256:64 8:256:64 8:64:64: at
            batch 8 the one-token-per-step point runs a shorter generation), each with every Fast-dLLM
            cache of `--llada-caches` (default none; prefix, dual: gen_length / steps tokens per step on
            the schedule, so random weights do fixed work); tokens/s of the warm call.
  mage128k  SDAR-8B against a `--long-prompt` cache (128k), batches `--long-batches`: the time of one
            output block of the generate loop itself (`dllm_jax.generate.sdar.denoise_block`, jitted,
            its 4 denoising forwards and the commit, which the current loop fuses into the next block's
            first step: here one pending commit), dense (the default implementation) and MAGE, on a
            zero cache whose fill length is set to the cache length (attention cost does not depend on
            the values; a real 128k prefill would cost minutes per call).
  compile   first-call time minus warm-call time of SDAR generate (batch 1, the first prompt, dense)
            and LLaDA generate (the first --llada-runs point). A run whose sdar / llada section timed
            that point reports it without this section (a second measurement in the same process
            would hit the compilation cache); the section times the points no other section did.

Memory: the script sets XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 unless the environment sets it (JAX's
75% would not hold a batch-4 128k cache). `--budget-s S` starts no measurement after S seconds, so a
run under a hard time limit still ends with its tables (what was left is recorded as skipped).

`--baseline` keeps to what the pre-issue-17 package also runs with the same public API (batch 1
SDAR without attention_mask, block_step on an empty cache, MAGE at batch 1, LLaDA without masks), so
the same script can time an old copy of the package: run it as a file, not with `-m` (with `-m` the
working directory, which holds the new package, comes first on sys.path):

    PYTHONPATH=. python benchmarks/throughput.py --sections copy,weights,sdar --out $OUT
    PYTHONPATH=/path/to/old/checkout python benchmarks/throughput.py --baseline --tag _baseline --out $OUT
    python benchmarks/throughput.py --tiny                        # every section, tiny configs, CPU
    python benchmarks/throughput.py --merge a.json b.json --out benchmarks/results   # one table
    python benchmarks/throughput.py --compare baseline.json new.json --out benchmarks/results
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import io
import json
import os
import tempfile
import time
import traceback
import warnings
from pathlib import Path

# JAX's GPU allocator takes 75% of the device by default; a batch-4 128k cache needs more. Set before
# the backend starts (the first device use); an explicit setting in the environment wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import dllm_jax  # noqa: E402
from dllm_jax.attention.methods import describe  # noqa: E402
from dllm_jax.bench import (family_methods, model_for, time_calls, time_carried, traced_kernels,  # noqa: E402
                            write_results)

SECTIONS = ("copy", "weights", "sdar", "llada", "mage128k", "compile")
BANDWIDTH_SECTIONS = {"weights", "sdar", "mage128k"}
MEMORY_FRACTION = 0.8  # points estimated to need more than this share of device memory are skipped
OUT_OF_TIME = "skipped: --budget-s spent before this measurement started"


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every size a run uses: the 8B shapes on a device, tiny configs with `--tiny`."""

    sdar_model: str = "sdar-8b-chat"
    llada_model: str = "llada-8b-instruct"
    small_methods: bool = False  # scaled-down method parameters (tiny configs)
    copy_bytes: int = 2 << 30  # far beyond the L2 cache
    weight_tokens: tuple[int, ...] = (4, 32)
    sdar_prompts: tuple[int, ...] = (1024, 32768)
    sdar_batches: tuple[int, ...] = (1, 8, 32, 64)
    sdar_new_tokens: int = 128
    sdar_steps: int = 4
    methods: tuple[str, ...] = ("mage", "flashblock", "flashblock+mage")
    # batched methods at a short prompt, long-context methods at batch 1 (which the baseline also runs)
    method_points: tuple[tuple[int, tuple[int, ...]], ...] = ((1024, (8,)), (32768, (1,)))
    llada_prompt: int = 1024
    llada_block: int = 32
    llada_runs: tuple[tuple[int, int, int], ...] = ((1, 256, 256), (1, 256, 64), (8, 256, 64), (8, 64, 64))
    llada_caches: tuple[str | None, ...] = (None,)  # Fast-dLLM cache modes timed at every llada point
    llada_methods: tuple[str, ...] = ("dense",)  # LLaDA methods (defaults) timed at every llada point and cache
    long_prompt: int = 131072
    long_batches: tuple[int, ...] = (4, 1)
    execution: str | None = None  # the models' layer execution (`load_model`'s); None: the package default


TINY = Plan(sdar_model="tiny-sdar", llada_model="tiny-llada", small_methods=True, copy_bytes=16 << 20,
            weight_tokens=(4, 32), sdar_prompts=(16,), sdar_batches=(1, 2), sdar_new_tokens=8,
            methods=("mage",), method_points=((16, (1,)),), llada_prompt=16, llada_block=8,
            llada_runs=((1, 16, 16), (2, 16, 4)), llada_caches=(None, "prefix", "dual"), llada_methods=("dense", "sparsed"),
            long_prompt=128, long_batches=(2, 1))


def baseline_plan(plan: Plan) -> Plan:
    """What the pre-issue package runs: SDAR at batch 1 only (generate, the methods where the plan
    runs them at batch 1, MAGE against the long cache)."""
    return dataclasses.replace(plan, sdar_batches=(1,), long_batches=(1,),
                               method_points=tuple((p, (1,)) for p, batches in plan.method_points if 1 in batches))


# ---------------------------------------------------------------------------------------------- helpers

def copy_bandwidth(nbytes: int, *, repeats: int = 10) -> dict:
    """Copy bandwidth of the default device: a bf16 array of `nbytes` copied under jit (XLA emits a
    copy: the output cannot alias an undonated input), (read + written bytes) / median time; the same
    for an elementwise negation (a streaming kernel rather than a memcpy)."""
    x = jnp.ones((nbytes // 2 // 1024, 1024), jnp.bfloat16)  # 2-D: no single axis near 2**31
    copy_s = time_calls(jax.jit(jnp.copy), x, repeats=repeats, warmup=1)
    negate_s = time_calls(jax.jit(jnp.negative), x, repeats=repeats, warmup=1)
    del x
    return dict(bytes=nbytes, copy_ms=copy_s * 1e3, copy_tb_s=2 * nbytes / copy_s / 1e12,
                elementwise_ms=negate_s * 1e3, elementwise_tb_s=2 * nbytes / negate_s / 1e12)


def memory_budget() -> tuple[int | None, int]:
    """(bytes a run may fill, bytes in use) on the default device: MEMORY_FRACTION of the device's
    memory (the allocator's limit over its fraction), at most the allocator's limit; None where the
    backend does not say (CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if limit is None:
        return None, 0
    device = limit / float(os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"])
    return int(min(MEMORY_FRACTION * device, limit)), stats.get("bytes_in_use", 0)


def memory_verdict(need: int) -> str | None:
    """None if `need` more bytes fit in the memory budget next to what is in use, else the reason."""
    budget, in_use = memory_budget()
    if budget is None or in_use + need <= budget:
        return None
    return (f"skipped: needs ~{need / 1e9:.1f} GB (estimate) beside {in_use / 1e9:.1f} GB in use; the budget is "
            f"{budget / 1e9:.0f} GB ({MEMORY_FRACTION:.0%} of the device)")


def weight_bytes(params: dict, config) -> int:
    """Bytes of every weight one forward reads: all leaves but an untied embedding table (a gather
    of the step's rows; a tied one is read whole as the LM head)."""
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    return total if config.tie_word_embeddings else total - params["embed"].nbytes


def kv_bytes_per_position(config, itemsize: int = 2) -> int:
    """K and V of one position in every layer, for one row."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize


def activation_bytes(config, tokens: int) -> int:
    """A rough peak of one layer's bf16 activations over `tokens` tokens (gate/up and their product,
    the fused QKV, a few hidden-size buffers): the memory estimate's term for a prefill."""
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    return tokens * (3 * config.intermediate_size + qkv + 4 * config.hidden_size) * 2


def random_ids(config, batch: int, length: int, seed: int) -> np.ndarray:
    """int32 [batch, length] random token ids below the mask id (no mask id in the prompt)."""
    high = min(config.mask_token_id, config.vocab_size)
    return np.random.default_rng(seed).integers(0, high, (batch, length)).astype(np.int32)


def timed(fn):
    """(seconds, result) of one synchronised call."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - start, out


def with_copy(row: dict, tb_s: float | None, copy: dict | None) -> dict:
    """Adds the copy bandwidth of this process and the row's fraction of it."""
    if copy is None or tb_s is None:
        return row
    return row | dict(copy_tb_s=copy["copy_tb_s"], fraction_of_copy=tb_s / copy["copy_tb_s"])


def error_row(section: str, what: dict, e: BaseException) -> dict:
    print(f"{section} {what}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    traceback.print_exc()
    return dict(section=section, **what, error=f"{type(e).__name__}: {e}"[:400])


# ---------------------------------------------------------------------------------------------- models

def held_model(held: dict, family: str, plan: Plan):
    """The random model of `family` ("sdar" or "llada"), built once; building one drops the other (two
    8B models and a long cache would not fit together)."""
    if family not in held:
        for other in list(held):
            del held[other]
        gc.collect()
        if family == "sdar":
            context = max(max(plan.sdar_prompts) + plan.sdar_new_tokens, plan.long_prompt) + 64
            name = plan.sdar_model
        else:
            context = plan.llada_prompt + max(gen for _, gen, _ in plan.llada_runs)
            name = plan.llada_model
        start = time.perf_counter()
        layout = {} if plan.execution is None else dict(execution=plan.execution)  # the baseline's model_for has none
        held[family] = model_for(name, layers=None, context=context, dtype=jnp.bfloat16, **layout)
        print(f"{name}: random weights in {time.perf_counter() - start:.1f} s", flush=True)
    return held[family]


# ---------------------------------------------------------------------------------------------- sections

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
            from dllm_jax.models.sdar import block_step
            jitted = jax.jit(functools.partial(block_step, config=config))
            step = lambda: jitted(params, ids, cache)[0]
            first_s, _ = timed(step)
            seconds = time_calls(step, repeats=10, warmup=1)
            gpu_ms = None
            if jax.default_backend() == "gpu":
                with tempfile.TemporaryDirectory() as trace_dir:
                    _, gpu_ms = traced_kernels(lambda: jax.block_until_ready(step()), Path(trace_dir))
            tb_s = w / seconds / 1e12
            row = dict(section="weights", tokens=n, batch=1, weight_bytes=w, step_ms=seconds * 1e3,
                       first_call_s=first_s, tb_s=tb_s, gpu_kernel_ms=gpu_ms,
                       gpu_kernel_tb_s=None if not gpu_ms else w / (gpu_ms / 1e3) / 1e12)
            row = with_copy(row, tb_s, copy)
            if copy is not None and gpu_ms:
                row["gpu_kernel_fraction_of_copy"] = row["gpu_kernel_tb_s"] / copy["copy_tb_s"]
        except Exception as e:  # record it, go on with the other sizes
            row = error_row("weights", dict(tokens=n, batch=1), e)
        yield row


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
                        prefill = lambda: model.prefill(ids, model.init_cache(batch, prompt))
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


def long_rows(model, config, plan: Plan, *, baseline: bool, copy: dict | None, deadline: float):
    """Dense and MAGE: the time of one output block of the generate loop (`denoise_block`: the block's
    denoising forwards and its commit) against a long cache, in the loop's own code."""
    from dllm_jax.attention.policy import Dense
    from dllm_jax.generate import sdar as gen

    params = model.params()
    w = weight_bytes(params, config)
    s, n = plan.long_prompt, config.block_size
    options = gen.SDAROptions(**sdar_options(plan))
    policies = {"dense": Dense(), "mage": family_methods("SDAR", small=plan.small_methods)["mage"]}
    repeats = 3
    for batch in plan.long_batches:
        point = dict(cache=s, batch=batch, block=n, steps=plan.sdar_steps)
        capacity = s + (repeats + 3) * n
        need = batch * capacity * kv_bytes_per_position(config) + activation_bytes(config, 2 * batch * n)
        reason = OUT_OF_TIME if time.monotonic() > deadline else memory_verdict(need)
        if reason:
            yield dict(section="mage128k", **point, skipped=reason)
            continue
        masks = jnp.full((batch, n), config.mask_token_id, jnp.int32)
        dense_ms = None
        for name, policy in policies.items():
            what = dict(point, method=name)
            cache = state = None
            try:
                gc.collect()
                # zeros stand in for a prefill: attention cost does not depend on the values
                cache = model.init_cache(batch, capacity)
                state = gen.sdar_model.init_policy_state(policy, config, batch, capacity)
                loop = block_loop(gen, params, masks, policy, options, config, batch, baseline)
                at = lambda c: c.replace(length=jnp.full(c.length.shape, s, jnp.int32))

                def one(carry):
                    cur, c, st = loop(at(carry[0]), carry[1])
                    return cur, (c, st)
                t, (cache, state) = time_carried(one, (cache, state), repeats=repeats, warmup=1)
                row = dict(section="mage128k", **what, config=describe(None if name == "dense" else policy),
                           block_ms=t * 1e3, commit="own forward" if baseline else "fused with the next block's "
                           "first step")
                if name == "dense":
                    dense_ms = t * 1e3
                    kv = batch * (s + n) * kv_bytes_per_position(config)
                    forwards = plan.sdar_steps + 1 if baseline else plan.sdar_steps
                    tb_s = forwards * (w + kv) / t / 1e12
                    row = with_copy(row | dict(weight_bytes=w, kv_bytes=kv, forwards_per_block=forwards, tb_s=tb_s),
                                    tb_s, copy)
                elif dense_ms is not None:
                    row["speedup_vs_dense"] = dense_ms / (t * 1e3)
            except Exception as e:
                row = error_row("mage128k", what, e)
            del cache, state
            print(json.dumps(row), flush=True)
            yield row
        gc.collect()


def block_loop(gen, params, masks, policy, options, config, batch: int, baseline: bool):
    """(cache, policy_state) -> (block, cache, policy_state): one output block of the generate loop,
    jitted with the cache and state donated. The pre-issue-17 loop committed each block in a forward
    of its own; the current one commits the previous block in the first step (here: one pending)."""
    key = jax.random.key(0)
    # params go in as an argument: captured by the closure they would be compiled in as constants
    if baseline:
        fn = jax.jit(lambda p, c, st: gen.denoise_block(p, masks, c, st, key, jnp.int32(0), config=config,
                                                        options=options, policy=policy)[:3], donate_argnums=(1, 2))
        return lambda c, st: fn(params, c, st)
    steps = jnp.full((batch,), options.denoising_steps, jnp.int32)
    finished = gen.Finished(ids=jnp.zeros_like(masks), pending=jnp.ones((batch,), bool),
                            mode=jnp.broadcast_to(policy.block_mode(steps, unmasked=jnp.zeros_like(steps), commit=True),
                                                  (batch,)).astype(jnp.int32))
    active = jnp.ones((batch,), bool)
    draws = jnp.zeros((batch,), jnp.int32)
    fn = jax.jit(lambda p, c, st: gen.denoise_block(p, masks, c, st, key, draws, active, finished, config=config,
                                                    options=options, policy=policy)[:3], donate_argnums=(1, 2))
    return lambda c, st: fn(params, c, st)


def has_compile_source(rows: list[dict], section: str, match: dict) -> bool:
    """Whether `rows` hold a timed (first and warm call) `section` row at the point `match`."""
    return any(r.get("section") == section and "first_call_s" in r and all(r.get(k) == v for k, v in match.items())
               for r in rows)


def add_compile_row(rows: list[dict], section: str, match: dict, add) -> None:
    """Adds the compile-time row (first call - warm call) of the first `section` row at `match`,
    unless there is none or it was added already."""
    if any(r.get("section") == "compile" and r.get("model") == section for r in rows):
        return
    for r in rows:
        if r.get("section") == section and "first_call_s" in r and all(r.get(k) == v for k, v in match.items()):
            add(dict(section="compile", model=section, point={k: r[k] for k in match}, first_call_s=r["first_call_s"],
                     warm_s=r["warm_s"], compile_s=r["first_call_s"] - r["warm_s"]))
            return


# ---------------------------------------------------------------------------------------------- tables

def cell(value, fmt: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def markdown(meta: dict, rows: list[dict]) -> list[str]:
    lines = [f"# Throughput — {meta['device']}, jax {meta['jax']}, {meta['date']}", "",
             f"Random bf16 weights at the real shapes; package `{meta['package']}`"
             + (" (baseline mode: what the pre-issue API runs)" if meta.get("baseline") else "") + ".", ""]
    by = lambda s: [r for r in rows if r.get("section") == s]
    if by("copy"):
        lines += ["## Copy bandwidth", "", "| array | copy | elementwise (negate) |", "|---|---|---|"]
        lines += [f"| {r['bytes'] / 2**30:.2f} GiB | {r['copy_tb_s']:.2f} TB/s ({r['copy_ms']:.2f} ms) | "
                  f"{r['elementwise_tb_s']:.2f} TB/s |" for r in by("copy")]
        lines += ["", "(read + written bytes) / time."]
    if by("weights"):
        lines += ["", "## Weight-reading part of an SDAR block step (batch 1, empty cache)", "",
                  "| tokens | weights read | step (wall) | TB/s | of copy | GPU kernels | TB/s | of copy |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in by("weights"):
            if "skipped" in r or "error" in r:
                lines.append(f"| {r['tokens']} | {(r.get('skipped') or r['error'])[:140]} | | | | | | |")
                continue
            lines.append(f"| {r['tokens']} | {r['weight_bytes'] / 1e9:.2f} GB | {r['step_ms']:.2f} ms | "
                         f"{r['tb_s']:.2f} | {cell(r.get('fraction_of_copy'), '.0%')} | "
                         f"{cell(r['gpu_kernel_ms'], '.2f', ' ms')} | {cell(r['gpu_kernel_tb_s'])} | "
                         f"{cell(r.get('gpu_kernel_fraction_of_copy'), '.0%')} |")
    if by("sdar"):
        r0 = next((r for r in by("sdar") if "steps" in r), dict(block="?", steps=meta["plan"]["sdar_steps"]))
        lines += ["", "## SDAR generation", "",
                  f"Block {r0['block']}, {r0['steps']} denoising steps + the commit per block, low_confidence_static, "
                  "stop tokens disabled, every row the same prompt length (no padding). Dense at every point; "
                  f"the methods ({', '.join(meta['plan']['methods'])}; default parameters) only at "
                  + ("; ".join(f"prompt {p}, batch {', '.join(map(str, bs))}"
                               for p, bs in meta["plan"]["method_points"]) or "no point (dense only)")
                  + ". tok/s = generated tokens / warm call (prefill included); decode = warm call - prefill "
                  "(`model.prefill` timed alone); bytes per forward = weights + the batch's KV rows (mean over the "
                  "blocks), for dense attention.", "",
                  "| prompt | batch | method | new | tok/s | decode tok/s | per forward | GB per forward | TB/s | "
                  "of copy | vs dense | first call |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in by("sdar"):
            method = r.get("method", ", ".join(r.get("methods", [])))
            head = f"| {r['prompt']} | {r['batch']} | {method} | {r['new_tokens']} |"
            if "skipped" in r or "error" in r:
                lines.append(f"{head} {(r.get('skipped') or r['error'])[:140]} | | | | | | | |")
                continue
            lines.append(f"{head} {r['tokens_per_s']:.1f} | {cell(r['decode_tokens_per_s'], '.1f')} | "
                         f"{cell(r['per_forward_ms'], '.2f', ' ms')} | "
                         f"{(r['weight_bytes'] + r['kv_bytes_per_forward']) / 1e9:.1f} | "
                         f"{cell(r.get('tb_s'))} | {cell(r.get('fraction_of_copy'), '.0%')} | "
                         f"{cell(r.get('speedup_vs_dense'), '.2f', 'x')} | {r['first_call_s']:.1f} s |")
    if by("llada"):
        lines += ["", "## LLaDA generation", "",
                  "vs exact: against the exact sampler (no cache, dense, one token per step) at the same prompt, "
                  "batch and gen length, measured in the same run.", "",
                  "| prompt | batch | gen | steps | block | cache | method | tok/s | vs exact | per step | first call |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        exact = {(r["prompt"], r["batch"], r["gen_length"]): r["tokens_per_s"] for r in by("llada")
                 if "tokens_per_s" in r and not r.get("cache") and not r.get("method") and r["steps"] == r["gen_length"]}
        for r in by("llada"):
            head = (f"| {r['prompt']} | {r['batch']} | {r['gen_length']} | {r['steps']} | {r['block']} | "
                    f"{r.get('cache') or 'none'} | {r.get('method', 'dense')} |")
            if "skipped" in r or "error" in r:
                lines.append(f"{head} {(r.get('skipped') or r['error'])[:140]} | | | |")
                continue
            base = exact.get((r["prompt"], r["batch"], r["gen_length"]))
            ratio = cell(r["tokens_per_s"] / base if base else None, ".1f", "x")
            lines.append(f"{head} {r['tokens_per_s']:.1f} | {ratio} | {r['per_step_ms']:.1f} ms | "
                         f"{r['first_call_s']:.1f} s |")
    if by("mage128k"):
        lines += ["", "## Long cache: time per output block (the generate loop's `denoise_block`: 4 steps + the commit)",
                  "", "| cache | batch | method | per block | commit | vs dense | dense TB/s | of copy |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in by("mage128k"):
            head = f"| {r['cache']} | {r['batch']} | {r.get('method', '')} |"
            if "skipped" in r or "error" in r:
                lines.append(f"{head} {(r.get('skipped') or r['error'])[:140]} | | | | |")
                continue
            lines.append(f"{head} {r['block_ms']:.1f} ms | {r['commit']} | "
                         f"{cell(r.get('speedup_vs_dense'), '.2f', 'x')} | {cell(r.get('tb_s'))} | "
                         f"{cell(r.get('fraction_of_copy'), '.0%')} |")
    if by("compile"):
        lines += ["", "## First-call compile time (first call - warm call)", "",
                  "| model | point | first call | warm | compile |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['point']} | {r['first_call_s']:.1f} s | {r['warm_s']:.1f} s | "
                  f"{r['compile_s']:.1f} s |"
                  for r in by("compile")]
    notes = [r["text"] for r in rows if r.get("section") == "note"]
    return lines + (["", "Notes: " + "; ".join(notes) + "."] if notes else [])


def summary(rows: list[dict]) -> list[str]:
    """The short table printed last: one headline per measured row kind."""
    out = ["| result | value |", "|---|---|"]
    for r in rows:
        if "skipped" in r or "error" in r:
            continue
        s = r["section"]
        if s == "copy":
            out.append(f"| copy bandwidth | {r['copy_tb_s']:.2f} TB/s |")
        elif s == "weights":
            out.append(f"| weights, {r['tokens']} tokens | {r['step_ms']:.2f} ms, {r['tb_s']:.2f} TB/s "
                       f"({cell(r.get('fraction_of_copy'), '.0%')} of copy) |")
        elif s == "sdar":
            extra = f", {r['speedup_vs_dense']:.2f}x dense" if "speedup_vs_dense" in r else ""
            out.append(f"| SDAR P={r['prompt']} B={r['batch']} {r['method']} | {r['tokens_per_s']:.1f} tok/s{extra} |")
        elif s == "llada":
            out.append(f"| LLaDA P={r['prompt']} B={r['batch']} gen {r['gen_length']} steps {r['steps']} cache "
                       f"{r.get('cache')} {r.get('method', 'dense')} | "
                       f"{r['tokens_per_s']:.1f} tok/s |")
        elif s == "mage128k":
            extra = f", {r['speedup_vs_dense']:.2f}x dense" if "speedup_vs_dense" in r else ""
            out.append(f"| {r['cache']} cache B={r['batch']} {r['method']} | {r['block_ms']:.1f} ms/block{extra} |")
        elif s == "compile":
            out.append(f"| compile {r['model']} {r['point']} | {r['compile_s']:.1f} s |")
    return out


# ---------------------------------------------------------------------------------------------- main

def parse_sections(text: str) -> list[str]:
    sections = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad or not sections:
        raise ValueError(f"--sections must be a comma-separated subset of {','.join(SECTIONS)}, got {text!r}")
    if BANDWIDTH_SECTIONS & set(sections) and "copy" not in sections:
        sections.insert(0, "copy")  # every bandwidth row needs the copy bandwidth of its own process
    return sorted(sections, key=SECTIONS.index)


def parse_points(texts, name: str, parts: int) -> tuple:
    """"a:b:c" strings into int tuples (method points "prompt:b1,b2" have a batch list last)."""
    out = []
    for text in texts:
        try:
            fields = text.split(":")
            if len(fields) != parts:
                raise ValueError
            if name == "--method-points":
                out.append((int(fields[0]), tuple(int(b) for b in fields[1].split(","))))
            else:
                out.append(tuple(int(f) for f in fields))
        except ValueError:
            raise ValueError(f"{name} takes {'prompt:batch,batch' if parts == 2 else 'batch:gen_length:steps'} "
                             f"items, got {text!r}") from None
    return tuple(out)


def sdar_block_size(name: str) -> int:
    from dllm_jax.config import shipped_config
    from dllm_jax.testing import tiny_sdar_config

    return (tiny_sdar_config() if name == "tiny-sdar" else shipped_config(name)).block_size


def plan_from(args) -> Plan:
    plan = TINY if args.tiny else Plan()
    changes = {}
    if args.sdar_prompts:
        changes["sdar_prompts"] = tuple(args.sdar_prompts)
    if args.sdar_batches:
        changes["sdar_batches"] = tuple(args.sdar_batches)
    if args.sdar_new_tokens:
        changes["sdar_new_tokens"] = args.sdar_new_tokens
    if args.method_points is not None:
        changes["method_points"] = parse_points(args.method_points, "--method-points", 2)
    if args.llada_runs:
        changes["llada_runs"] = parse_points(args.llada_runs, "--llada-runs", 3)
    if args.llada_prompt:
        changes["llada_prompt"] = args.llada_prompt
    if args.llada_caches:
        unknown = [c for c in args.llada_caches if c not in ("none", "prefix", "dual")]
        if unknown:
            raise ValueError(f"--llada-caches: unknown cache mode(s) {unknown}; choose from none, prefix, dual")
        if args.baseline and args.llada_caches != ["none"]:
            raise ValueError("--llada-caches prefix/dual need the current package (the baseline has no cache)")
        changes["llada_caches"] = tuple(None if c == "none" else c for c in args.llada_caches)
    if args.llada_methods:
        unknown = [m for m in args.llada_methods if m not in ("dense", "sparsed", "pulsecol", "sparge")]
        if unknown:
            raise ValueError(f"--llada-methods: unknown method(s) {unknown}; choose from dense, sparsed, pulsecol, sparge")
        if args.baseline and args.llada_methods != ["dense"]:
            raise ValueError("--llada-methods other than dense need the current package")
        changes["llada_methods"] = tuple(args.llada_methods)
    if args.long_prompt:
        changes["long_prompt"] = args.long_prompt
    if args.execution:
        if args.baseline:
            raise ValueError("--execution needs the current package (the baseline has one layer execution)")
        changes["execution"] = args.execution
    if args.long_batches:
        changes["long_batches"] = tuple(args.long_batches)
    plan = dataclasses.replace(plan, **changes)
    values = [*plan.sdar_prompts, *plan.sdar_batches, plan.sdar_new_tokens, plan.long_prompt, *plan.long_batches,
              plan.llada_prompt, *(v for run in plan.llada_runs for v in run)]
    if min(values) <= 0:
        raise ValueError(f"sizes must be positive, got {values}")
    block = sdar_block_size(plan.sdar_model)
    uneven = [p for p in (*plan.sdar_prompts, plan.long_prompt) if p % block]
    if uneven:  # the prefill timed alone takes whole blocks
        raise ValueError(f"--sdar-prompts and --long-prompt must be multiples of the block size {block}, got {uneven}")
    return baseline_plan(plan) if args.baseline else plan


def run(args) -> list[dict]:
    sections = parse_sections(args.sections)
    plan = plan_from(args)
    device = jax.devices()[0].device_kind
    meta = dict(benchmark="throughput" + args.tag, device=device, backend=jax.default_backend(), jax=jax.__version__,
                date=datetime.date.today().isoformat(), package=str(Path(dllm_jax.__file__).parent),
                budget_s=None if args.budget_s == float("inf") else args.budget_s,
                baseline=args.baseline, tiny=args.tiny, sections=sections, plan=dataclasses.asdict(plan),
                started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    stem = args.out / f"{meta['benchmark']}_{device.replace(' ', '_')}_{meta['date']}.json"
    rows: list[dict] = json.loads(stem.read_text())["rows"] if args.append and stem.exists() else []
    print(f"throughput on {device} (jax {jax.__version__}, {jax.default_backend()}), package {meta['package']}, "
          f"sections {sections}{' [baseline]' if args.baseline else ''}", flush=True)

    def add(row: dict) -> None:
        rows.append(row)
        with contextlib.redirect_stdout(io.StringIO()):  # write_results prints the table: only at the end
            write_results(args.out, meta, rows, markdown(meta, rows))

    deadline = time.monotonic() + args.budget_s

    def in_time(section: str) -> bool:
        """Whether the budget allows starting `section` (building its random model alone takes a while)."""
        if time.monotonic() <= deadline:
            return True
        add(dict(section="note", text=f"{section}: not started, --budget-s {args.budget_s:g} s spent"))
        return False

    held: dict = {}  # the one random model alive; section calls never keep it in a local of run()
    copy = None
    if "copy" in sections:
        copy = copy_bandwidth(plan.copy_bytes)
        add(dict(section="copy", **copy))
        print(json.dumps(rows[-1]), flush=True)
    if "weights" in sections and in_time("weights"):
        for row in weights_rows(*held_model(held, "sdar", plan), plan, copy, deadline=deadline):
            print(json.dumps(row), flush=True)
            add(row)
    prefills: dict = {}
    sdar_first = dict(prompt=plan.sdar_prompts[0], batch=1, method="dense")
    if "sdar" in sections and in_time("sdar"):
        for row in sdar_rows(*held_model(held, "sdar", plan), plan, baseline=args.baseline, copy=copy,
                             prefills=prefills, deadline=deadline):
            add(row)
    if "compile" in sections and not has_compile_source(rows, "sdar", sdar_first) and in_time("compile (SDAR)"):
        one = dataclasses.replace(plan, sdar_prompts=plan.sdar_prompts[:1], sdar_batches=(1,), method_points=())
        for row in sdar_rows(*held_model(held, "sdar", plan), one, baseline=args.baseline, copy=copy,
                             prefills=prefills, deadline=deadline):
            add(row)
    add_compile_row(rows, "sdar", sdar_first, add)  # any run that timed this point reports its compile time
    if "mage128k" in sections and in_time("mage128k"):
        for row in long_rows(*held_model(held, "sdar", plan), plan, baseline=args.baseline, copy=copy,
                             deadline=deadline):
            add(row)
    batch, gen, steps = plan.llada_runs[0]
    llada_first = dict(batch=batch, gen_length=gen, steps=steps)
    if ("llada" in sections or ("compile" in sections and not has_compile_source(rows, "llada", llada_first))) \
            and in_time("llada"):
        runs = plan.llada_runs if "llada" in sections else plan.llada_runs[:1]
        for row in llada_rows(*held_model(held, "llada", plan), dataclasses.replace(plan, llada_runs=runs),
                              deadline=deadline):
            add(row)
    add_compile_row(rows, "llada", llada_first, add)
    write_results(args.out, meta, rows, markdown(meta, rows))
    print("\n".join(summary(rows)))
    return rows


def merge(paths: list[Path], out: Path, tag: str) -> None:
    """One table from the result files of one package split over several processes."""
    parts = [json.loads(p.read_text()) for p in paths]
    if len({(p["baseline"], p["package"], p["device"]) for p in parts}) > 1:
        raise ValueError(f"--merge combines the parts of one run (same package, mode and device); "
                         f"{[str(p) for p in paths]} differ: use --compare for a baseline against a new run")
    meta = {k: v for k, v in parts[0].items() if k != "rows"}
    meta["benchmark"] = "throughput" + tag
    meta["merged_from"] = [p.name for p in paths]
    meta["sections"] = [s for s in SECTIONS if any(s in p["sections"] for p in parts)]
    points = {tuple(pt[0:1]) + (tuple(pt[1]),) for p in parts for pt in p["plan"]["method_points"]}
    meta["plan"] = dict(meta["plan"], method_points=sorted(points))
    rows = [r for p in parts for r in p["rows"]]
    write_results(out, meta, rows, markdown(meta, rows))
    print("\n".join(summary(rows)))


COMPARED = {  # section: (the fields naming a point, the value compared, its unit, whether larger is better)
    "weights": (("tokens",), "step_ms", "ms", False),
    "sdar": (("prompt", "batch", "method", "new_tokens"), "tokens_per_s", "tok/s", True),
    "llada": (("prompt", "batch", "gen_length", "steps", "cache", "method"), "tokens_per_s", "tok/s", True),
    "mage128k": (("cache", "batch", "method"), "block_ms", "ms/block", False),
    "compile": (("model", "point"), "compile_s", "s", False),
}


def compare(baseline_path: Path, new_path: Path, out: Path) -> None:
    """A baseline run against a new one, point by point: value before, after, and the speed-up."""
    before, after = (json.loads(p.read_text()) for p in (baseline_path, new_path))

    def points(data):
        found = {}
        for r in data["rows"]:
            spec = COMPARED.get(r.get("section"))
            if spec and spec[1] in r:
                found.setdefault((r["section"], tuple(str(r.get(k)) for k in spec[0])), r)
        return found

    old, new = points(before), points(after)
    title = f"# Throughput: baseline against new — {after['device']}, jax {after['jax']}, {after['date']}"
    rows, lines = [], [title, "",
                       f"Baseline `{before['package']}` ({baseline_path.name}); new `{after['package']}` "
                       f"({new_path.name}). Speed-up > 1: the new package is faster.", "",
                       "| section | point | baseline | new | speed-up |", "|---|---|---|---|---|"]
    for key, r in new.items():
        if key not in old:
            continue
        section, point = key
        _, field, unit, larger_better = COMPARED[section]
        a, b = old[key][field], r[field]
        speedup = (b / a if larger_better else a / b) if a and b else None
        rows.append(dict(section=section, point=list(point), field=field, baseline=a, new=b, speedup=speedup))
        names = ", ".join(f"{k}={v}" for k, v in zip(COMPARED[section][0], point))
        lines.append(f"| {section} | {names} | {a:.2f} {unit} | {b:.2f} {unit} | {cell(speedup, '.2f', 'x')} |")
    meta = dict(benchmark="throughput_compare", device=after["device"], jax=after["jax"], date=after["date"],
                baseline=baseline_path.name, new=new_path.name)
    write_results(out, meta, rows, lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--baseline", action="store_true", help="only what the pre-issue-17 API runs")
    parser.add_argument("--tiny", action="store_true", help="tiny configs and sizes (a CPU check of every section)")
    parser.add_argument("--sdar-prompts", type=int, nargs="+", help="prompt lengths (multiples of the block size)")
    parser.add_argument("--sdar-batches", type=int, nargs="+")
    parser.add_argument("--sdar-new-tokens", type=int)
    parser.add_argument("--method-points", nargs="*", help="prompt:batch,batch items where the methods run "
                                                           "(none: dense only)")
    parser.add_argument("--llada-runs", nargs="+", help="batch:gen_length:steps items")
    parser.add_argument("--llada-prompt", type=int, help="LLaDA prompt length (1024)")
    parser.add_argument("--llada-caches", nargs="+", help="Fast-dLLM cache modes timed at every LLaDA point: "
                                                          "none (the exact sampler), prefix, dual")
    parser.add_argument("--llada-methods", nargs="+", help="LLaDA methods (defaults) timed at every point and "
                                                           "cache: dense (default), sparsed, pulsecol, sparge")
    parser.add_argument("--long-prompt", type=int, help="cache length of mage128k")
    parser.add_argument("--execution", choices=("unrolled", "scan"), help="layer execution of the models "
                        "(default: the package's); not with --baseline")
    parser.add_argument("--long-batches", type=int, nargs="+")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no new measurement after this many seconds (rows left are recorded as skipped), "
                             "so a run ends with its tables before a hard time limit")
    parser.add_argument("--tag", default="", help="suffix of the benchmark name in the result files")
    parser.add_argument("--append", action="store_true", help="extend this tag's result file of today if present")
    parser.add_argument("--merge", type=Path, nargs="+", help="combine result JSONs of one run into one table")
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("BASELINE", "NEW"),
                        help="a table of a baseline result JSON against a new one")
    parser.add_argument("--out", type=Path, help="result folder (default benchmarks/results; with --tiny a "
                                                 "temporary folder: tiny CPU numbers are no results)")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "throughput_tiny" if args.tiny else Path("benchmarks/results")
    if args.merge:
        return merge(args.merge, args.out, args.tag)
    if args.compare:
        return compare(*args.compare, args.out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas Triton backend warns on use
        return run(args)


if __name__ == "__main__":
    main()
