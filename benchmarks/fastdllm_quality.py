"""Fast-dLLM decoding on the trained tiny LLaDA: accuracy, forwards (NFE) and tokens per forward, exact
sampler vs prefix cache vs dual cache vs + confidence threshold vs + SparseD / PulseCol, on fresh task
samples.

    PYTHONPATH=. python -m benchmarks.fastdllm_quality --out benchmarks/results [--samples 40 --context 1024]
        [--tasks passkey,niah_multikey,variable_tracking,sanity] [--tag NAME]

The answer window is the task's (`dllm_jax.eval.max_answer_length`) in blocks of `--block` tokens, one
token per step for the schedule-driven rows; every row decodes the same samples (evaluation seed 1). The
long tasks run at `--context` tokens, sanity at its 64. Results: <out>/fastdllm_quality[_tag]_<device>_<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.quality import checked_tag, split
from dllm_jax import PulseCol, SparseD, generate, load_model
from dllm_jax import eval as dev
from dllm_jax.bench import markdown_table, write_results
from dllm_jax.generate.requests import answer_window

DECODINGS = {  # row -> generate options on top of the window and schedule
    "exact": {},
    "prefix cache": dict(cache="prefix"),
    "dual cache": dict(cache="dual"),
    "threshold 0.9": dict(threshold=0.9),
    "dual cache + threshold 0.9": dict(cache="dual", threshold=0.9),
    # the methods at their defaults (SparseD's block of 32 for contexts below 4k): their patterns, built by
    # the full forwards, apply to the cached steps' windows
    "SparseD": dict(method=SparseD(block_size=32)),
    "dual cache + SparseD": dict(cache="dual", method=SparseD(block_size=32)),
    "dual cache + threshold 0.9 + SparseD": dict(cache="dual", threshold=0.9, method=SparseD(block_size=32)),
    "PulseCol": dict(method=PulseCol()),
    "dual cache + threshold 0.9 + PulseCol": dict(cache="dual", threshold=0.9, method=PulseCol()),
}


def rows_for(model, samples, *, block: int, task: str, context: int) -> list[dict]:
    ids = np.stack([s.prompt_ids for s in samples])
    window = answer_window(dev.max_answer_length(task), block)  # whole blocks of the answer window
    rows = []
    for name, options in DECODINGS.items():
        start = time.perf_counter()
        out, nfe = generate(model, ids, gen_length=window, steps=window, block_length=block, return_nfe=True,
                            **options)
        seconds = time.perf_counter() - start
        correct = sum(dev.score(s, row[ids.shape[1]:]) for s, row in zip(samples, out))
        rows.append(dict(task=task, context=context, decoding=name, correct=int(correct), samples=len(samples),
                         accuracy=correct / len(samples), nfe=nfe, tokens_per_forward=window / nfe,
                         seconds=seconds))
        print(f"{task}@{context} {name}: {correct}/{len(samples)}, NFE {nfe}, {window / nfe:.2f} tokens/forward, "
              f"{seconds:.1f} s", flush=True)
    return rows


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="checkpoints/tiny-llada-tasks")
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--block", type=int, default=3, help="block length (the answer window holds 2-3 blocks)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tasks", default=",".join(dev.TASKS), help="comma-separated tasks (dllm_jax.eval.TASKS)")
    p.add_argument("--tag", default="", help="name suffix of the results files (letters, digits, '-', '_')")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    try:  # the accuracy table's flag checks, so both benchmarks accept and refuse the same values
        tasks, tag = split("--tasks", args.tasks, dev.TASKS), checked_tag(args.tag)
    except ValueError as e:
        p.error(str(e))
    model = load_model(args.model, dtype="float32", progress=False)
    tokenizer = dev.load_tokenizer(args.model)
    rows = []
    for task, context in ((t, 64 if t == "sanity" else args.context) for t in tasks):
        samples = dev.make_samples(task, context, args.samples, args.seed, tokenizer)
        rows += rows_for(model, samples, block=args.block, task=task, context=context)
    device = jax.devices()[0]
    meta = dict(benchmark="fastdllm_quality" + (f"_{tag}" if tag else ""), device=device.device_kind,
                platform=device.platform, jax=jax.__version__, date=datetime.date.today().isoformat(), model=args.model,
                samples=args.samples, seed=args.seed, block=args.block)
    lines = [f"# Fast-dLLM decoding on {Path(args.model).name} — {meta['device']}, jax {meta['jax']}, {meta['date']}",
             "",
             f"{args.samples} fresh samples per task (evaluation seed {args.seed}), greedy, float32; answer window "
             f"in blocks of {args.block}; schedule rows commit one token per step.", "",
             *markdown_table(["task", "decoding", "accuracy", "NFE", "tokens / forward"],
                             [[f"{r['task']}@{r['context']}", r["decoding"], f"{r['correct']}/{r['samples']}", r["nfe"],
                               f"{r['tokens_per_forward']:.2f}"] for r in rows], align="llrrr")]
    return write_results(args.out, meta, rows, lines)


if __name__ == "__main__":
    main()
