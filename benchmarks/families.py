"""Dream-7B and LLaDA2.0-mini at their real shapes (random bf16 weights): MoE implementations, block
steps and generation throughput, dense and each applicable method.

Sections (`--sections`, comma-separated; results are rewritten after every row to
<out>/families<tag>_<device>_<date>.{json,md}, so a run cut short keeps what it measured):
  moe       LLaDA2.0-mini's routed experts (256 experts, top-8, d 2048, expert width 512) over T tokens
            (`--moe-tokens`: 32 is one block at batch 1, 512 one block at batch 16, 4096 a prefill
            chunk), routing fixed: `ragged` the copies sorted by expert through two `jax.lax.ragged_dot`
            calls (the model's path before the kernel: the baseline); `pallas` the model's path
            (`dllm_jax.models.moe`: copies in tile-padded expert order, two
            `pallas_kernels.grouped_matmul` calls); `ragged_tiles` that dispatch through
            `jax.lax.ragged_dot` (the kernel's reference, what a CPU runs);
            `padded` an exact capacity-padded dispatch (every expert gets a [T, d] buffer, two batched
            einsums); `gather` each token copy's expert weights gathered, then einsums (T = 32 only);
            `all` every token through every expert, weighted by its routing (the dense loop the model
            must never run). Each is checked against `ragged` (max relative difference).
  step      one LLaDA2.0-mini block step (32 tokens per row, dense, cuDNN) against a cache filled to
            each of `--step-contexts` positions, at batch 1 and `--step-batch`.
  generate  `dllm_jax.generate` tokens/s, each point of `--points` (model:batch:context) with every
            method that applies to the family: Dream (bidirectional) dense / SparseD / PulseCol /
            SpargeAttn, `--dream-steps` steps for `--new-tokens` (alg entropy); LLaDA2 (block diffusion
            over a prefix cache) dense / MAGE / FlashBlock / FlashBlock+MAGE, `--llada2-steps` steps per
            32-token block. Second call timed (the first compiles); tokens/s counts the generated tokens
            actually returned (a row may stop at a random EOS).

    PYTHONPATH=. python -m benchmarks.families --out benchmarks/results            # one GPU
    PYTHONPATH=. python -m benchmarks.families --layers 2 --moe-tokens 32 --step-contexts 256 \\
        --points dream-v0-instruct-7b:1:512 llada2.0-mini:2:512 --new-tokens 64  # smoke run
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax import generate
from dllm_jax.attention.methods import describe
from dllm_jax.bench import (call_times, family_methods, fmt, markdown_table, model_for, time_calls,
                            write_results)
from dllm_jax.config import shipped_config
from dllm_jax.families import family_of
from dllm_jax.models.layers import swiglu_gate
from dllm_jax.models.llada2 import route
from dllm_jax.models.moe import routed_experts

# --- the MoE alternatives (measured against the earlier ragged_dot path) -------------------------------

def ragged_experts(x, idx, weights, gate_up, down):
    """The wave-2 model path before the kernel: the T * k copies sorted by expert, unpadded, through
    two `jax.lax.ragged_dot` calls."""
    t, k = idx.shape
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=gate_up.shape[0]).astype(jnp.int32)
    h = swiglu_gate(jax.lax.ragged_dot(x[order // k], gate_up, sizes))
    y = jax.lax.ragged_dot(h, down, sizes)
    y = jnp.zeros_like(y).at[order].set(y).reshape(t, k, -1)
    return jnp.sum(y.astype(jnp.float32) * weights[..., None], axis=1)


def padded_experts(x, idx, weights, gate_up, down):
    """Exact capacity-padded dispatch: each expert gets a buffer of T rows (a token picks an expert at
    most once), filled with its tokens in order; two batched einsums over all experts."""
    t, k = idx.shape
    e, d = gate_up.shape[0], x.shape[1]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    expert = flat[order]
    sizes = jnp.bincount(flat, length=e)
    slot = jnp.arange(t * k) - (jnp.cumsum(sizes) - sizes)[expert]
    buffer = jnp.zeros((e, t, d), x.dtype).at[expert, slot].set(x[order // k])
    h = swiglu_gate(jnp.einsum("ecd,edf->ecf", buffer, gate_up))
    y = jnp.einsum("ecf,efd->ecd", h, down)[expert, slot]
    y = jnp.zeros_like(y).at[order].set(y).reshape(t, k, d)
    return jnp.sum(y.astype(jnp.float32) * weights[..., None], axis=1)


def gathered_experts(x, idx, weights, gate_up, down):
    """Each token copy's expert weights gathered ([T, k, d, 2 Im]: memory grows with T), then einsums."""
    h = swiglu_gate(jnp.einsum("td,tkdf->tkf", x, gate_up[idx]))
    y = jnp.einsum("tkf,tkfd->tkd", h, down[idx])
    return jnp.sum(y.astype(jnp.float32) * weights[..., None], axis=1)


def all_experts(x, idx, weights, gate_up, down):
    """Every token through every expert, zero-weighted where not routed: the dense loop."""
    t, e = x.shape[0], gate_up.shape[0]
    h = swiglu_gate(jnp.einsum("td,edf->tef", x, gate_up))
    y = jnp.einsum("tef,efd->ted", h, down)
    dense_w = jnp.zeros((t, e), jnp.float32).at[jnp.arange(t)[:, None], idx].set(weights)
    return jnp.einsum("ted,te->td", y.astype(jnp.float32), dense_w)


MOE_VARIANTS = {"ragged": ragged_experts, "pallas": routed_experts,
               "ragged_tiles": functools.partial(routed_experts, backend="reference"),
               "padded": padded_experts, "gather": gathered_experts, "all": all_experts}


def moe_rows(args):
    config = shipped_config("llada2.0-mini")
    d, e, im = config.hidden_size, config.num_experts, config.moe_intermediate_size
    keys = jax.random.split(jax.random.key(0), 5)
    gate_up = (0.02 * jax.random.normal(keys[0], (e, d, 2 * im))).astype(jnp.bfloat16)
    down = (0.02 * jax.random.normal(keys[1], (e, im, d))).astype(jnp.bfloat16)
    router = 0.02 * jax.random.normal(keys[2], (d, e))
    bias = 0.1 * jax.random.normal(keys[3], (e,))
    weight_bytes = (gate_up.size + down.size) * 2
    for t in args.moe_tokens:
        x = jax.random.normal(jax.random.fold_in(keys[4], t), (t, d)).astype(jnp.bfloat16)
        idx, weights = jax.jit(functools.partial(route, config=config))(x, router, bias)
        touched = int(np.unique(np.asarray(idx)).size)
        reference = None
        for name, fn in MOE_VARIANTS.items():
            if name == "gather" and t > 32:
                continue  # [T, 8, 2048, 1024] gathered weights: 1 GiB at T = 32, out of memory long before 4096
            run = jax.jit(fn)
            try:
                out = np.asarray(run(x, idx, weights, gate_up, down))
                seconds = time_calls(run, x, idx, weights, gate_up, down, repeats=args.repeats)
            except Exception as err:  # e.g. out of memory: record it, go on
                yield dict(section="moe", tokens=t, variant=name, error=f"{type(err).__name__}: {err}"[:300])
                continue
            reference = out if name == "ragged" else reference
            diff = float(np.max(np.abs(out - reference)) / np.max(np.abs(reference)))
            yield dict(section="moe", tokens=t, variant=name, experts_touched=touched, ms=seconds * 1e3,
                       diff_vs_ragged=diff, weight_gbps=touched / e * weight_bytes / seconds / 1e9)


# --- block steps and generation -------------------------------------------------------------------------

def step_rows(args):
    model, config = model_for("llada2.0-mini", layers=args.layers, context=max(args.step_contexts) + 64,
                              dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    for batch in (1, args.step_batch):
        for context in args.step_contexts:
            block = rng.integers(0, config.mask_token_id, (batch, config.block_size)).astype(np.int32)
            try:
                cache = model.init_cache(batch, context + 64)
                cache = cache.replace(length=jnp.full((batch,), context, jnp.int32))
                seconds = time_calls(lambda: model.block_step(block, cache)[0], repeats=args.repeats)
            except Exception as err:
                yield dict(section="step", model="llada2.0-mini", batch=batch, context=context,
                           error=f"{type(err).__name__}: {err}"[:300])
                continue
            yield dict(section="step", model="llada2.0-mini", layers=config.num_layers, batch=batch, context=context,
                       method="dense", ms=seconds * 1e3, tokens_per_s=batch * config.block_size / seconds)
            del cache
    del model
    gc.collect()


def options_for(family: str, args) -> dict:
    if family == "Dream":
        return dict(max_new_tokens=args.new_tokens, steps=args.dream_steps, alg="entropy")
    return dict(gen_length=args.new_tokens, block_length=32, steps=args.llada2_steps)


def generated_tokens(out: np.ndarray, prompt: int, config) -> int:
    """Tokens returned after the prompt: LLaDA2 pads a row after its EOS; nothing is left masked."""
    tail = out[:, prompt:]
    return int(np.sum((tail != config.mask_token_id) & (tail != config.pad_token_id)))


def generate_rows(args):
    held = {}
    for point in args.points:
        name, batch, context = point.split(":")
        batch, context = int(batch), int(context)
        if name not in held:
            held.clear()
            gc.collect()
            held[name] = model_for(name, layers=args.layers, context=context + 64, dtype=jnp.bfloat16)
        model, config = held[name]
        family = family_of(config).label
        options = options_for(family, args)
        prompt = context - args.new_tokens
        ids = np.random.default_rng(batch).integers(0, config.mask_token_id, (batch, prompt)).astype(np.int32)
        dense_tps = None
        for method_name, method in family_methods(family, small=False).items():
            if args.methods and method_name not in args.methods.split(","):
                continue
            what = dict(section="generate", model=name, family=family, batch=batch, context=context,
                        new_tokens=args.new_tokens, method=method_name, options=options)
            try:
                run = functools.partial(generate, model, ids, method=method, **options)
                first, seconds = call_times(run, repeats=2, warmup=0, burst_s=0)
                tokens = generated_tokens(run(), prompt, config)
            except Exception as err:
                yield what | dict(error=f"{type(err).__name__}: {err}"[:300])
                continue
            tps = tokens / seconds
            dense_tps = tps if method is None else dense_tps
            yield what | dict(layers=config.num_layers, config=describe(method), first_call_s=first, seconds=seconds,
                              tokens=tokens, tokens_per_s=tps, speedup=None if dense_tps is None else tps / dense_tps)


# --- output ----------------------------------------------------------------------------------------------

def markdown(meta: dict, rows: list[dict]) -> list[str]:
    lines = [f"# Dream-7B and LLaDA2.0-mini — {meta['device']}, jax {meta['jax']}, {meta['date']}", "",
             "Random bf16 weights at the shipped configs' shapes; " + (
                 f"layers overridden to {meta['args']['layers']}; " if meta["args"]["layers"] else "")
             + "one GPU, one process.", ""]
    errors = [r for r in rows if "error" in r]
    moe = [r for r in rows if r["section"] == "moe" and "error" not in r]
    if moe:
        lines += ["## LLaDA2.0-mini routed experts (one MoE layer, routing fixed)", "",
                  *markdown_table(["tokens", "experts touched", "variant", "time", "vs ragged", "weight read GB/s",
                                   "max rel. diff"], [moe_cells(r, moe) for r in moe]), ""]
    step = [r for r in rows if r["section"] == "step" and "error" not in r]
    if step:
        lines += ["## LLaDA2.0-mini block step (32 tokens per row, dense, cuDNN)", "",
                  *markdown_table(["batch", "cache positions", "step", "block tokens/s"],
                                  [[r["batch"], r["context"], f"{r['ms']:.2f} ms", f"{r['tokens_per_s']:.0f}"]
                                   for r in step]), ""]
    gen = [r for r in rows if r["section"] == "generate" and "error" not in r]
    if gen:
        lines += ["## Generation (`dllm_jax.generate`, second call; prompt = context - new tokens)", "",
                  "Options: " + "; ".join(sorted({f"{r['family']}: {r['options']}" for r in gen})), "",
                  *markdown_table(["model", "batch", "context", "method", "tokens/s", "speed-up vs dense", "seconds",
                                   "first call"], [generate_cells(r) for r in gen]), ""]
    if errors:
        lines += ["## Not measured", ""] + [f"- {r['section']} {({k: v for k, v in r.items() if k not in ('section', 'error', 'options')})}: "
                                            f"{r['error'][:160]}" for r in errors]
    return lines


def moe_cells(r: dict, moe: list[dict]) -> list[str]:
    base = next(x["ms"] for x in moe if x["tokens"] == r["tokens"] and x["variant"] == "ragged")
    return [r["tokens"], r["experts_touched"], r["variant"], f"{r['ms']:.3f} ms", f"{base / r['ms']:.2f}×",
            f"{r['weight_gbps']:.0f}", f"{r['diff_vs_ragged']:.1e}"]


def generate_cells(r: dict) -> list[str]:
    speed = "" if r["speedup"] is None else f"{r['speedup']:.2f}×"
    return [r["model"], r["batch"], r["context"], f"`{r['config']}`", f"{r['tokens_per_s']:.1f}", speed,
            fmt(r["seconds"]), fmt(r["first_call_s"])]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default="moe,step,generate")
    parser.add_argument("--moe-tokens", type=int, nargs="+", default=[32, 512, 4096])
    parser.add_argument("--step-contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--step-batch", type=int, default=16)
    parser.add_argument("--points", nargs="+", default=["dream-v0-instruct-7b:1:8192", "dream-v0-instruct-7b:16:1024",
                                                        "llada2.0-mini:1:8192", "llada2.0-mini:16:8192"],
                        help="model:batch:context generation points")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--dream-steps", type=int, default=64, help="Dream steps for all new tokens")
    parser.add_argument("--llada2-steps", type=int, default=8, help="LLaDA2 steps per 32-token block")
    parser.add_argument("--methods", default="", help="comma-separated subset of the family's methods (default all)")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count (smoke runs)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    meta = dict(benchmark=f"families{args.tag}", device=jax.devices()[0].device_kind, jax=jax.__version__,
                date=datetime.date.today().isoformat(), args={k: v for k, v in vars(args).items() if k != "out"})
    rows = []
    sections = {"moe": moe_rows, "step": step_rows, "generate": generate_rows}
    for name in args.sections.split(","):
        for row in sections[name](args):
            rows.append(row)
            print({k: v for k, v in row.items() if k != "options"}, flush=True)
            write_results(args.out, meta, rows, markdown(meta, rows))


if __name__ == "__main__":
    main()
