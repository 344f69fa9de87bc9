"""One slot-engine step against one block of lockstep `generate` (issue 41): wall time and GPU kernels, so the gap
between the server's step and lockstep's block is measured, not guessed.

    PYTHONPATH=. python -m benchmarks.serving_step --model sdar-8b-chat --slots 16 --prompt-lengths 512:2048 \
        --out benchmarks/results [--tag NAME]
    PYTHONPATH=. python -m benchmarks.serving_step --model tiny-sdar --slots 2 --prompt-lengths 8:32 \
        --out /tmp/serving_step   # a CPU smoke run (no kernel tables)

Random weights with stop tokens off (`dllm_jax.bench.model_for`), greedy, SDAR's default sampling. Prompts: one
per slot, lengths log-uniform over `--prompt-lengths` (seeded).

- **engine step**: an `Engine` (`overlap=False`, so each call returns once its step has) with every slot busy,
  each request long enough to outlast the run; the median of `--steps` calls of `Engine.step` (admission, the
  jitted step, retiring: what the server's worker pays per step) and of the jitted step alone (`Engine.dispatch`),
  each synchronised (`dllm_jax.bench.time_calls` / `time_carried`).
- **lockstep block**: the same prompts left-padded to the longest, through `generate` at two answer lengths;
  (time at the longer - time at the shorter) / the blocks between them: one block without the prefill.
- On a GPU, each row's kernels from a profiler trace (`dllm_jax.bench.kernel_profile`): the mean of
  `--profile-steps` engine steps (a step's count of denoising forwards varies with the data), and the per-block
  difference of the two lockstep calls, kernel by kernel; both by class (attention, matrix products,
  the rest); GPU ms below wall ms is time the device idled. With XLA's command buffers on
  (`--xla_gpu_enable_command_buffer`) the trace misses kernels inside graphs (the lockstep difference came out
  negative, 2026-11-28): compare kernels without them.

Results: <out>/serving_step[_tag]_<device>_<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import re
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.serving import span
from dllm_jax import generate
from dllm_jax.bench import (ATTENTION_KERNEL, cell, kernel_profile, markdown_table, model_for, time_calls, time_carried,
                            write_results)
from dllm_jax.serve import Engine

SHORT, LONG = 16, 80  # lockstep answer lengths: (LONG - SHORT) / block size blocks between them
ALL_KERNELS, TOP = 100_000, 12  # every kernel of a trace is read (for the classes); the tables list the TOP
KERNEL_CLASSES = {"attention": ATTENTION_KERNEL, "matmul": re.compile(r"gemm|nvjet|cublas|cutlass|xmma|matmul"),
                  "other": re.compile("")}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-sdar", help="a shipped SDAR config name or tiny-sdar")
    parser.add_argument("--slots", type=int, default=16, help="busy slots = lockstep batch size")
    parser.add_argument("--prompt-lengths", type=span, default=(512, 2048), metavar="LOW:HIGH")
    parser.add_argument("--steps", type=int, default=20, help="engine steps timed")
    parser.add_argument("--profile-steps", type=int, default=8, help="engine steps in the kernel profile (averaged)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    if min(args.slots, args.steps, args.profile_steps) < 1:
        parser.error("--slots, --steps and --profile-steps must be >= 1")
    return args


def engine_row(model, prompts, args, trace_dir: Path) -> dict:
    engine = Engine(model, slots=args.slots, max_context=args.prompt_lengths[1] + LONG * 8, overlap=False)
    for i, prompt in enumerate(prompts):
        engine.submit(prompt, max_new_tokens=engine.room(len(prompt)), seed=i, temperature=0.0)
    for _ in range(2):  # admits every request, compiles, warms (time_calls' warm-up call is the third)
        engine.step()
    step_ms = time_calls(engine.step, repeats=args.steps, burst_s=0) * 1e3
    seconds, engine.state = time_carried(lambda state: engine.dispatch(state)[::-1], engine.state,
                                         repeats=args.steps)
    dispatch_ms = seconds * 1e3
    # several steps, as lockstep's row averages over its blocks: a step's count of denoising forwards varies
    profile = kernel_profile(lambda: [engine.step() for _ in range(args.profile_steps)], trace_dir / "engine",
                             top=ALL_KERNELS)
    assert engine.busy == args.slots, "a request finished during the run: raise max_context"
    row = dict(mode="engine step", wall_ms=step_ms, jitted_ms=dispatch_ms, gpu_ms=None, launches=None, classes=None,
               kernels=None)
    if profile is None:
        return row
    kernels = [k | dict(ms=k["ms"] / args.profile_steps, launches=k["launches"] / args.profile_steps)
               for k in profile["kernels"]]
    return row | dict(gpu_ms=profile["gpu_ms"] / args.profile_steps, launches=profile["launches"] / args.profile_steps,
                      classes=kernel_classes(kernels), kernels=kernels[:TOP])


def lockstep_row(model, prompts, args, trace_dir: Path) -> dict:
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
    runs = {n: (lambda n=n: jax.block_until_ready(generate(model, ids, attention_mask=mask, max_new_tokens=n,
                                                           top_k=1))) for n in (SHORT, LONG)}
    times = {n: time_calls(run, repeats=3, burst_s=0) * 1e3 for n, run in runs.items()}
    blocks = (LONG - SHORT) // model.config.block_size
    profiles = {n: kernel_profile(run, trace_dir / f"lockstep{n}", top=ALL_KERNELS) for n, run in runs.items()}
    row = dict(mode="lockstep block", wall_ms=(times[LONG] - times[SHORT]) / blocks, jitted_ms=None, gpu_ms=None,
               launches=None, classes=None, kernels=None)
    if profiles[LONG] is None or profiles[SHORT] is None:
        return row
    kernels = per_block(profiles[LONG]["kernels"], profiles[SHORT]["kernels"], blocks)
    return row | dict(gpu_ms=sum(k["ms"] for k in kernels), launches=sum(k["launches"] for k in kernels),
                      classes=kernel_classes(kernels), kernels=kernels[:TOP])


def per_block(long: list[dict], short: list[dict], blocks: int) -> list[dict]:
    """Each kernel's time and launches in the longer call less the shorter's, per block between them, by time."""
    totals = {k["name"]: [k["ms"], k["launches"]] for k in long}
    for k in short:
        entry = totals.setdefault(k["name"], [0.0, 0])
        entry[0] -= k["ms"]
        entry[1] -= k["launches"]
    rows = [dict(name=name, ms=ms / blocks, launches=n / blocks) for name, (ms, n) in totals.items()]
    return sorted(rows, key=lambda k: -k["ms"])


def kernel_classes(kernels: list[dict]) -> dict:
    """{class: [ms, launches]} of kernels by what they do: attention, matrix products (XLA's GEMM fusions, cuBLAS),
    everything else (elementwise and reduction fusions, copies, sorts)."""
    classes = {name: [0.0, 0] for name in KERNEL_CLASSES}
    for k in kernels:
        name = next(c for c, pattern in KERNEL_CLASSES.items() if pattern.search(k["name"]))
        classes[name][0] += k["ms"]
        classes[name][1] += k["launches"]
    return classes


def main(argv=None) -> Path:
    args = parse_args(argv)
    model, config = model_for(args.model, layers=None, context=args.prompt_lengths[1] + LONG * 8 + 64,
                              dtype=jnp.bfloat16)
    rng = np.random.default_rng(args.seed)
    low, high = args.prompt_lengths
    lengths = np.exp(rng.uniform(np.log(low), np.log(high), args.slots)).astype(int)
    prompts = [rng.integers(3, config.mask_token_id, n).astype(np.int32) for n in lengths]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [engine_row(model, prompts, args, Path(tmp)), lockstep_row(model, prompts, args, Path(tmp))]
    meta = dict(benchmark="serving_step" + (f"_{args.tag}" if args.tag else ""), device=jax.devices()[0].device_kind,
                jax=jax.__version__, date=datetime.date.today().isoformat(), model=args.model, slots=args.slots,
                prompt_lengths=[int(n) for n in lengths], steps=args.steps, lockstep_answers=[SHORT, LONG])
    lines = [f"# Engine step against lockstep block - {meta['device']}, jax {meta['jax']}, {meta['date']}", "",
             f"{args.model} (random weights, stops off, greedy), {args.slots} busy slots / rows, prompts "
             f"{min(lengths)}-{max(lengths)} tokens; the engine's step: the median of {args.steps} `Engine.step` calls "
             "and of the jitted step alone; lockstep's block: the difference of answers of "
             f"{SHORT} and {LONG} tokens per block. GPU ms below wall ms: the device idled.", "",
             *markdown_table(["mode", "wall ms", "jitted step ms", "GPU kernel ms", "launches"],
                             [[r["mode"], cell(r["wall_ms"]), cell(r["jitted_ms"]), cell(r["gpu_ms"]),
                               cell(r["launches"], ".0f")] for r in rows], align="lrrrr")]
    profiled = [r for r in rows if r["classes"]]
    if profiled:
        lines += ["", "GPU ms (launches) by kernel class:", "",
                  *markdown_table(["mode", *KERNEL_CLASSES],
                                  [[r["mode"], *(f"{ms:.2f} ({n:.0f})" for ms, n in r["classes"].values())]
                                   for r in profiled], align="l" + "r" * len(KERNEL_CLASSES))]
    for r in profiled:
        what = (f"one engine step (the mean of {args.profile_steps})" if r["mode"] == "engine step"
                else "one lockstep block (the two calls' difference per block)")
        lines += ["", f"Kernels of {what} by time:", "",
                  *markdown_table(["kernel", "ms", "launches"],
                                  [[f"`{k['name']}`", cell(k["ms"]), cell(k["launches"], ".1f")] for k in r["kernels"]],
                                  align="lrr")]
    return write_results(args.out, meta, rows, lines)


if __name__ == "__main__":
    main()
