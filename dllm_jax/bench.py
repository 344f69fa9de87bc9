"""`dllm-jax bench`: attention kernels and end-to-end generation steps on the current device.

Two sections, both written to <out>/bench_<device>_<date>.{json,md} (bench_<device>_<date>_2, _3, ... for
later runs of the day: a result is never replaced):
  attention   dense attention of the platform (cuDNN on a GPU, XLA elsewhere) against our flash,
              block-sparse and column-sparse kernels at several densities (random per-row patterns),
              batch 1, bf16, bidirectional; ratio = dense time / time (> 1 is faster). Off a GPU the
              Pallas kernels only run interpreted, so their jnp references are timed instead, and
              the table says so.
  generate    the public `generate` loop with random weights, dense and every method of the family,
              time per model forward (a LLaDA denoising step; an SDAR block step or commit) from the
              second call (the first compiles); speed-up = dense time / time.
This module is also the harness of the studies in benchmarks/*.py: one timer (`call_times`, with
`time_calls` its median and `time_carried` for calls that thread state), one results writer
(`write_results`) and the profiler helpers (`traced_kernels`, `profiled_attention_share`); random
weights come from `dllm_jax.testing.random_params`.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import gzip
import json
import os
import re
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def call_times(fn, *args, repeats: int = 5, warmup: int = 1, burst_s: float = 0.05) -> list[float]:
    """Seconds per call of fn(*args), one value per timed burst, after `warmup` untimed calls (the
    first compiles).

    burst_s > 0: each of the `repeats` bursts holds about `burst_s` of back-to-back calls (1 to 50,
    sized by one more untimed call), synchronising only after the burst, so that dispatch overlaps
    the previous call (fair to sub-ms kernels). burst_s = 0: one call per burst, synchronised after
    it (the latency of a call: whole loops, or calls that thread state, see `time_carried`).
    """
    if repeats < 1 or warmup < 0 or not burst_s >= 0:
        raise ValueError(f"call_times needs repeats >= 1, warmup >= 0 and burst_s >= 0, got {repeats=}, {warmup=}, "
                         f"{burst_s=}")
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    calls = 1
    if burst_s > 0:
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        calls = int(min(50, max(1, burst_s / (time.perf_counter() - start))))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return times


def time_calls(fn, *args, repeats: int = 5, warmup: int = 1, burst_s: float = 0.05) -> float:
    """Median seconds per call of `call_times` (same arguments)."""
    return float(np.median(call_times(fn, *args, repeats=repeats, warmup=warmup, burst_s=burst_s)))


def median_min_max(times: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of `call_times`' values."""
    return float(np.median(times)), min(times), max(times)


def time_carried(step, carry, *, repeats: int = 5, warmup: int = 1):
    """(median seconds, last carry) of step(carry) -> (out, carry), each call taking the carry the
    previous one returned (a donated cache or policy state) and synchronised on both outputs."""
    held = [carry]

    def call():
        out, held[0] = step(held[0])
        return out, held[0]

    return time_calls(call, repeats=repeats, warmup=warmup, burst_s=0), held[0]


def write_results(out_dir: Path, meta: dict, rows: list[dict], lines: list[str], *,
                  keep_existing: bool = False) -> Path:
    """Writes <benchmark>_<device>_<date>.json (meta + rows) and .md (`lines`), each whole or not at all
    (`dllm_jax.files.write_atomic`), prints the table and returns the Markdown path.

    keep_existing=False replaces a result of that name (the studies of benchmarks/*.py rewrite theirs as
    rows arrive). keep_existing=True (`dllm-jax bench`) never replaces one: the run takes the first free
    stem of <stem>, <stem>_2, <stem>_3, ..., claimed by creating both files exclusively, so two runs on
    one day (even at once) each keep their own."""
    from dllm_jax.files import write_atomic

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{meta['benchmark']}_{meta['device'].replace(' ', '_')}_{meta['date']}"
    if keep_existing:
        stem = claim_stem(out_dir, stem)
    write_atomic(out_dir / f"{stem}.json", json.dumps(dict(meta, rows=rows), indent=2) + "\n")
    table = "\n".join(lines) + "\n"
    write_atomic(out_dir / f"{stem}.md", table)
    print(table)
    return out_dir / f"{stem}.md"


def claim_stem(out_dir: Path, stem: str) -> str:
    """The first of stem, stem_2, stem_3, ... whose .json and .md this call creates (empty, exclusively:
    a name another run holds, or takes at the same moment, is skipped)."""
    number = 1
    while True:
        name = stem if number == 1 else f"{stem}_{number}"
        if claim(out_dir / f"{name}.json"):
            if claim(out_dir / f"{name}.md"):
                return name
            (out_dir / f"{name}.json").unlink()  # the .md is another run's: leave the name to it
        number += 1


def claim(path: Path) -> bool:
    """Creates `path` empty unless it exists (O_EXCL: atomic); True if this call created it."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    except FileExistsError:
        return False
    return True


ATTENTION_KERNEL = re.compile(r"sdpa|fmha|flash|attention", re.IGNORECASE)


def profiled_attention_share(fn, *args, trace_dir: Path):
    """(share of GPU kernel time spent in attention kernels, total GPU kernel ms) for one call,
    from a profiler trace; (None, None) if the trace holds no GPU kernels."""
    jax.block_until_ready(fn(*args))
    return traced_kernels(lambda: jax.block_until_ready(fn(*args)), trace_dir)


def traced_kernels(run, trace_dir: Path):
    """Runs `run()` once under the profiler, prints the top GPU kernels and returns (attention share,
    total GPU kernel ms), or (None, None) if the trace holds no GPU kernels."""
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        run()
    files = sorted(trace_dir.rglob("*.trace.json.gz")) or sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        return None, None
    events = json.loads(gzip.decompress(files[-1].read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e]
    total = sum(e["dur"] for e in kernels)
    if not total:
        return None, None
    attention = sum(e["dur"] for e in kernels if ATTENTION_KERNEL.search(e["name"]))
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e["name"][:70]] = by_name.get(e["name"][:70], 0.0) + e["dur"]
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    print(f"GPU kernels {total / 1e3:.2f} ms; top: " + "; ".join(f"{name} {us / 1e3:.2f} ms" for name, us in top),
          flush=True)
    return attention / total, total / 1e3


def fmt(x):
    """A ratio for a table cell: two decimals, "n/a" for None (no GPU kernels traced)."""
    return "n/a" if x is None else f"{x:.2f}"


@functools.partial(jax.jit, static_argnames=("rows", "items", "width", "heads"))
def random_lists(key, *, rows, items, width, heads):
    """[1, heads, rows, width] distinct sorted random picks from range(items) (all of them at width =
    items), with counts [1, heads, rows] = width."""
    if width == items:
        idx = jnp.broadcast_to(jnp.arange(items, dtype=jnp.int32), (1, heads, rows, items))
    else:
        _, idx = jax.lax.top_k(jax.random.uniform(key, (1, heads, rows, items)), width)
        idx = jnp.sort(idx.astype(jnp.int32), axis=-1)
    return idx, jnp.full((1, heads, rows), width, jnp.int32)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def attention_rows(lengths, densities, *, heads: int, head_dim: int, block: int = 128, group: int = 128,
                   repeats: int = 5):
    import pallas_kernels as pk

    gpu = on_gpu()
    ours = "pallas" if gpu else "reference (jnp; Pallas needs a GPU)"
    flash = pk.flash_attention if gpu else pk.flash_attention_reference
    block_sparse = pk.block_sparse_attention if gpu else pk.block_sparse_attention_reference
    column_sparse = pk.column_sparse_attention if gpu else pk.column_sparse_attention_reference
    baseline = "cudnn" if gpu else "xla"
    rows = []
    for n in lengths:
        keys = jax.random.split(jax.random.key(n), 4)
        q, k, v = (jax.random.normal(kk, (1, n, heads, head_dim), jnp.bfloat16) for kk in keys[:3])
        dense = jax.jit(functools.partial(jax.nn.dot_product_attention, implementation=baseline))
        t_dense = time_calls(dense, q, k, v, repeats=repeats)
        t_flash = time_calls(jax.jit(flash), q, k, v, repeats=repeats)
        row = dict(section="attention", n=n, heads=heads, head_dim=head_dim, baseline=baseline, kernels=ours, dense_ms=t_dense * 1e3,
                   flash_ms=t_flash * 1e3, block_sparse_ms={}, column_sparse_ms={})
        nb, ng = -(-n // block), -(-n // group)
        for d in densities:
            idx, cnt = random_lists(keys[3], rows=nb, items=nb, width=max(1, round(d * nb)), heads=heads)
            fn = jax.jit(functools.partial(block_sparse, block_q=block, block_kv=block))
            row["block_sparse_ms"][str(d)] = time_calls(fn, q, k, v, idx, cnt, repeats=repeats) * 1e3
            idx, cnt = random_lists(keys[3], rows=ng, items=n, width=max(1, round(d * n)), heads=heads)
            fn = jax.jit(functools.partial(column_sparse, group_size=group))
            row["column_sparse_ms"][str(d)] = time_calls(fn, q, k, v, idx, cnt, repeats=repeats) * 1e3
        print(f"attention N={n}: {baseline} {t_dense * 1e3:.3f} ms, flash {t_flash * 1e3:.3f} ms", flush=True)
        rows.append(row)
    return rows


FAMILIES = {"llada": "LLaDA", "sdar": "SDAR", "dream": "Dream", "llada2": "LLaDA2"}  # config.family -> name


def family_methods(family: str, small: bool) -> dict:
    """The methods timed per family: the defaults at real sizes, scaled-down blocks for tiny ones."""
    from dllm_jax.attention.methods import make_method

    if family in ("LLaDA", "Dream"):  # both bidirectional: the same methods
        params = dict(sparsed=dict(block_size=16), pulsecol=dict(group_size=16), sparge=dict(block_q=16, block_kv=16))
        names = ["sparsed", "pulsecol", "sparge"]
    else:
        params = {"mage": dict(k=16, exact_layers=1), "flashblock+mage": dict(k=16, exact_layers=1)}
        names = ["mage", "flashblock", "flashblock+mage"]
    return {"dense": None} | {name: make_method(name, **(params.get(name, {}) if small else {})) for name in names}


def model_for(name: str, *, layers: int | None, context: int, dtype, execution: str | None = None, mesh=None):
    """(model, config) with random weights: a shipped config name, or "tiny-llada" / "tiny-sdar" / "tiny-dream" /
    "tiny-llada2"; `execution` and `mesh` as `load_model` takes them (None: its default, one device)."""
    from dllm_jax.checkpoint.api import model_from_params
    from dllm_jax.config import shipped_config
    from dllm_jax.testing import (random_params, tiny_dream_config, tiny_llada2_config, tiny_llada_config,
                                  tiny_sdar_config)

    tiny = {"tiny-llada": tiny_llada_config, "tiny-sdar": tiny_sdar_config, "tiny-dream": tiny_dream_config,
            "tiny-llada2": tiny_llada2_config}
    config = tiny.get(name, lambda: shipped_config(name))()
    changes = dict(max_position_embeddings=max(config.max_position_embeddings, context))  # random weights: no limit
    if layers is not None:
        changes["num_layers"] = layers
    if hasattr(config, "eos_token_ids"):
        changes["eos_token_ids"] = ()  # no stop token: random weights would stop at a random EOS
    config = dataclasses.replace(config, **changes)
    layout = {} if execution is None else dict(execution=execution)
    return model_from_params(config, random_params(config, jax.random.key(0), dtype), mesh=mesh, **layout), config


def generate_rows(model_names, *, context: int, new_tokens: int, layers, dtype, progress: bool):
    from dllm_jax.attention.methods import describe
    from dllm_jax.generate import generate
    rows = []
    for name in model_names:
        model, config = model_for(name, layers=layers, context=context, dtype=dtype)
        family = FAMILIES[config.family]
        prompt_len = context - new_tokens
        if family == "LLaDA2":  # 8 steps per 32-token block (4 tokens each); a block's commit rides on the next
            options = dict(gen_length=new_tokens, block_length=32, steps=8)  # block's first step: 8 forwards
            forwards = 8 * (-(-(prompt_len + new_tokens) // 32) - prompt_len // 32)
        elif family == "SDAR":
            bs = config.block_size
            options = dict(max_new_tokens=new_tokens, denoising_steps=bs, remasking="low_confidence_static")
            blocks = -(-(prompt_len + new_tokens) // bs) - prompt_len // bs
            forwards = blocks * (bs + 1)  # bs denoising steps + the commit forward per block
        elif family == "Dream":  # one forward per step, like LLaDA; a confidence-based alg (the official demos')
            options = dict(max_new_tokens=new_tokens, steps=new_tokens // 2, alg="entropy")
            forwards = new_tokens // 2
        else:
            options = dict(gen_length=new_tokens, steps=new_tokens // 2, block_length=new_tokens)
            forwards = new_tokens // 2
        ids = np.random.default_rng(0).integers(0, config.mask_token_id, (1, prompt_len)).astype(np.int32)
        dense_s = None
        for method_name, method in family_methods(family, small=context < 2048).items():
            try:
                run = functools.partial(generate, model, ids, method=method, progress=progress, **options)
                # generate returns host arrays (synchronised); the first call compiles, the second is timed
                first = call_times(run, repeats=1, warmup=0, burst_s=0)[0]
                seconds = call_times(run, repeats=1, warmup=0, burst_s=0)[0]
            except Exception as e:  # e.g. out of memory: record it, go on with the others
                rows.append(dict(section="generate", model=name, family=family, method=method_name, error=f"{type(e).__name__}: {e}"[:300]))
                print(f"{name} {method_name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            dense_s = seconds if method is None else dense_s
            rows.append(dict(section="generate", model=name, family=family, layers=config.num_layers, method=method_name,
                             config=describe(method), context=context, new_tokens=new_tokens, forwards=forwards,
                             options=options, first_call_s=first, total_s=seconds, per_forward_ms=seconds / forwards * 1e3,
                             speedup=None if dense_s is None else dense_s / seconds))
            print(f"{name} {method_name}: {seconds / forwards * 1e3:.2f} ms per forward "
                  f"(first call {first:.1f} s incl. compilation)", flush=True)
        del model
    return rows


def markdown(meta: dict, attention: list[dict], generation: list[dict]) -> list[str]:
    lines = [f"# dllm-jax bench — {meta['device']}, jax {meta['jax']}, {meta['date']}", ""]
    if attention:
        densities = list(attention[0]["block_sparse_ms"])
        lines += [f"## Attention (batch 1, {attention[0]['heads']} heads, head_dim {attention[0]['head_dim']}, bf16, "
                  f"bidirectional; ours: {attention[0]['kernels']})", "",
                  f"Ratio = {attention[0]['baseline']} dense time / time (> 1 is faster). Sparse patterns are random "
                  "per (head, row): blocks of 128 / groups of 128 queries, at density d.", "",
                  f"| N | {attention[0]['baseline']} dense | flash | "
                  + " | ".join(f"block-sparse d={d}" for d in densities) + " | "
                  + " | ".join(f"column-sparse d={d}" for d in densities) + " |",
                  "|" + "---|" * (3 + 2 * len(densities))]
        for r in attention:
            cell = lambda ms: f"{ms:.3f} ms ({r['dense_ms'] / ms:.2f}×)"
            lines.append(f"| {r['n']} | {r['dense_ms']:.3f} ms | {cell(r['flash_ms'])} | "
                         + " | ".join(cell(r["block_sparse_ms"][d]) for d in densities) + " | "
                         + " | ".join(cell(r["column_sparse_ms"][d]) for d in densities) + " |")
        lines.append("")
    if generation:
        lines += ["## Generation (random weights, batch 1; time per model forward in the compiled loop, "
                  "second call)", "",
                  "Options per model (prompt = context - new tokens): " + "; ".join(
                      sorted({f"{r['model']}: {r['options']}" for r in generation if "options" in r})), "",
                  "| model | layers | context | method | per forward | speed-up vs dense | first call (compile) |",
                  "|---|---|---|---|---|---|---|"]
        for r in generation:
            if "error" in r:
                lines.append(f"| {r['model']} | | | {r['method']} | {r['error'][:80]} | | |")
                continue
            speed = "" if r["speedup"] is None else f"{r['speedup']:.2f}×"
            lines.append(f"| {r['model']} | {r['layers']} | {r['context']} | `{r['config']}` | "
                         f"{r['per_forward_ms']:.2f} ms | {speed} | {r['first_call_s']:.1f} s |")
    return lines


def run(*, out: Path, sections, lengths=None, densities=(0.5, 0.3, 0.1), models=None, context=None,
        new_tokens=None, layers=None, heads: int = 32, head_dim: int = 128, dtype="bfloat16", repeats: int = 5,
        progress: bool = False) -> Path:
    """Runs the chosen sections with device-sized defaults and writes the results; returns the .md path."""
    gpu = on_gpu()
    lengths = lengths or ([4096, 16384] if gpu else [256, 512])
    models = models or (["llada-8b-instruct", "sdar-8b-chat"] if gpu else ["tiny-llada", "tiny-sdar"])
    context = context or (8192 if gpu else 256)
    new_tokens = new_tokens or (128 if gpu else 32)
    if new_tokens % 2 or new_tokens >= context:
        raise ValueError(f"--new-tokens must be even and smaller than --context, got {new_tokens} and {context}")
    heads = heads if gpu else min(heads, 4)
    device = jax.devices()[0].device_kind
    print(f"dllm-jax bench on {device} (jax {jax.__version__}, {jax.default_backend()})", flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas Triton backend warns on use
        attention = (attention_rows(lengths, densities, heads=heads, head_dim=head_dim, repeats=repeats)
                     if "attention" in sections else [])
        generation = (generate_rows(models, context=context, new_tokens=new_tokens, layers=layers,
                                    dtype=jnp.dtype(dtype), progress=progress) if "generate" in sections else [])
    meta = dict(benchmark="bench", device=device, backend=jax.default_backend(), jax=jax.__version__,
                date=datetime.date.today().isoformat(), sections=list(sections), lengths=list(lengths),
                densities=list(densities), models=list(models), context=context, new_tokens=new_tokens,
                layers=layers, dtype=str(dtype))
    return write_results(out, meta, attention + generation, markdown(meta, attention, generation), keep_existing=True)
