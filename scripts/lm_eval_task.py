"""Writes a local lm-evaluation-harness task of one of `dllm_jax.eval`'s synthetic tasks, so that the harness's
`local-completions` model can be pointed at `dllm-jax serve` without a dataset download (docs/serving.md):

    python scripts/lm_eval_task.py --checkpoint checkpoints/tiny-sdar-tasks --task passkey --context 256 \\
        --samples 20 --out /tmp/lm_task
    lm_eval --model local-completions --include_path /tmp/lm_task --tasks dllm_passkey_256 \\
        --model_args model=tiny-sdar-tasks,base_url=http://127.0.0.1:8000/v1/completions,tokenizer_backend=None

The prompts are the samples' token ids as text in the checkpoint's tokenizer (they encode back to the same ids);
the answer is scored by exact match after stripping surrounding whitespace, greedy, as `dllm_jax.eval` scores it
(`--kind choice`: multiple choice among the answer and random values of its shape, by log-likelihood, for
`python -m dllm_jax.eval.harness`). `dllm_jax.eval.harness_tasks` writes them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dllm_jax.eval import TASKS, load_tokenizer, make_samples
from dllm_jax.eval.harness_tasks import KINDS, write_task


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="a checkpoint directory with the task tokenizer")
    p.add_argument("--task", choices=TASKS, default="passkey")
    p.add_argument("--kind", choices=KINDS, default="generate",
                   help="generate (generate_until, exact match) or choice (multiple choice by log-likelihood)")
    p.add_argument("--context", type=int, default=256, help="prompt tokens")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--seed", type=int, default=11, help="evaluation seed (below the training seeds, 2**31)")
    p.add_argument("--answer-tokens", type=int, default=12, help="max_gen_toks of the task")
    p.add_argument("--out", type=Path, required=True, help="directory for the task's .yaml and .jsonl")
    args = p.parse_args(argv)
    tokenizer = load_tokenizer(args.checkpoint)
    samples = make_samples(args.task, args.context, args.samples, args.seed, tokenizer)
    name = f"dllm_{args.task}_{args.context}" + ("_choice" if args.kind == "choice" else "")
    write_task(args.out, name, samples, tokenizer, kind=args.kind, answer_tokens=args.answer_tokens, seed=args.seed)
    print(f"task {name}: {len(samples)} samples in {args.out}; lm_eval --include_path {args.out} --tasks {name}")


if __name__ == "__main__":
    main()
