"""What weight quantization (`load_model(quantize=...)`, issue 42) costs in accuracy, measured against the bf16
model in the same run.

Two parts (`--parts`):
  shapes   8B shapes with random bf16 weights (SDAR-8B, LLaDA-8B; `--tiny`: the tiny configs): the relative
           L2 error of the float32 logits of one forward over a random prompt (`--tokens`) against the bf16
           model's, and how often the two agree on the argmax token, per mode. Random weights make the
           logits nearly flat, so the agreement is a harsher test than on a trained model.
  trained  the trained checkpoints (`--models`): the same logits error on each task's prompts, and the task
           accuracy of greedy generation (`dllm_jax.eval.evaluate`'s defaults) on `--samples` fresh samples per
           task and context (`--contexts`: a checkpoint whose trained positions end below one skips it), bf16
           and each mode on the same samples.

    PYTHONPATH=. python -m benchmarks.quantization --out $OUT                 # GPU: int8 and fp8
    python -m benchmarks.quantization --tiny --modes int8 --samples 4         # CPU check (no fp8 on CPU)

Rows are written as they arrive to <out>/quantization<tag>_<device>_<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax import load_model
from dllm_jax.bench import markdown_table, model_for, write_results
from dllm_jax.eval import build_tokenizer, evaluate, make_samples
from dllm_jax.eval.evaluate import answer_room

CHECKPOINTS = ("checkpoints/tiny-sdar-tasks", "checkpoints/tiny-llada-tasks", "checkpoints/tiny-sdar-long",
               "checkpoints/tiny-llada-long")
TASKS = ("passkey", "niah_multikey", "variable_tracking")


def logits_error(reference, quantized) -> dict:
    """Relative L2 error of float32 logits [B, L, V] and the fraction of positions with the same argmax."""
    reference, quantized = np.asarray(reference, np.float32), np.asarray(quantized, np.float32)
    return dict(logits_rel_error=float(np.linalg.norm(quantized - reference) / np.linalg.norm(reference)),
                argmax_agreement=float(np.mean(reference.argmax(-1) == quantized.argmax(-1))))


def shapes_rows(names, modes, tokens: int):
    for name in names:
        logits = {}
        for mode in (None, *modes):
            start = time.perf_counter()
            model, config = model_for(name, layers=None, context=tokens, dtype=jnp.bfloat16, quantize=mode)
            ids = jax.random.randint(jax.random.key(1), (1, tokens), 3, config.vocab_size)
            logits[mode] = np.asarray(model(ids))
            weights = sum(leaf.nbytes for leaf in jax.tree.leaves(model.params()))
            del model
            gc.collect()
            row = dict(part="shapes", model=name, quantize=mode or "bf16", tokens=tokens, weight_bytes=weights)
            if mode is not None:
                row |= logits_error(logits[None], logits[mode])
            print(row, f"({time.perf_counter() - start:.0f} s)", flush=True)
            yield row


def trained_rows(paths, modes, contexts, samples: int, seed: int, batch_size: int):
    tokenizer = build_tokenizer()
    for path in paths:
        models = {mode: load_model(path, quantize=mode, progress=False) for mode in (None, *modes)}
        config = models[None].config
        for context in contexts:
            for task in TASKS:
                if context + answer_room(config, task) > config.max_position_embeddings:
                    continue  # the prompt and its answer do not fit the model's positions
                batch = make_samples(task, context, samples, seed, tokenizer)
                ids = jnp.asarray(np.stack([s.prompt_ids for s in batch[:4]]))
                reference = np.asarray(models[None](ids))
                records = {}
                for mode, model in models.items():
                    start = time.perf_counter()
                    result = evaluate(model, batch, tokenizer=tokenizer, batch_size=batch_size, progress=False)
                    row = dict(part="trained", model=Path(path).name, quantize=mode or "bf16", task=task,
                               context=context, samples=samples, seed=seed, correct=result.num_correct,
                               accuracy=result.accuracy)
                    records[mode] = result.records
                    if mode is not None:
                        row |= logits_error(reference, model(ids))
                        row["same_answers"] = sum(a.predicted_ids == b.predicted_ids for a, b in
                                                  zip(result.records, records[None]))
                    print(row, f"({time.perf_counter() - start:.0f} s)", flush=True)
                    yield row
        del models
        gc.collect()


def markdown(meta: dict, rows: list[dict]) -> list[str]:
    lines = [f"# Weight quantization: accuracy against bf16 — {meta['device']}, jax {meta['jax']}, {meta['date']}",
             ""]
    shapes = [r for r in rows if r["part"] == "shapes"]
    if shapes:
        cells = [[r["model"], r["quantize"], r["tokens"], f"{r['weight_bytes'] / 1e9:.2f} GB",
                  f"{r['logits_rel_error']:.4f}" if "logits_rel_error" in r else "-",
                  f"{r['argmax_agreement']:.1%}" if "argmax_agreement" in r else "-"] for r in shapes]
        lines += ["## Random weights at the real shapes: one forward's logits against bf16", "",
                  *markdown_table(["model", "weights", "tokens", "weights stored", "logits rel. L2 error",
                                   "argmax agreement"], cells), ""]
    trained = [r for r in rows if r["part"] == "trained"]
    if trained:
        cells = [[r["model"], r["task"], r["context"], r["quantize"], f"{r['correct']}/{r['samples']}",
                  f"{r['same_answers']}/{r['samples']}" if "same_answers" in r else "-",
                  f"{r['logits_rel_error']:.4f}" if "logits_rel_error" in r else "-",
                  f"{r['argmax_agreement']:.1%}" if "argmax_agreement" in r else "-"] for r in trained]
        lines += ["## Trained checkpoints: task accuracy (greedy, fresh samples) and logits against bf16", "",
                  *markdown_table(["model", "task", "context", "weights", "correct", "answers as bf16's",
                                   "logits rel. L2 error", "argmax agreement"], cells), ""]
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="shapes,trained", help="comma-separated subset of shapes, trained")
    p.add_argument("--modes", nargs="+", default=["int8", "fp8"], choices=["int8", "fp8"])
    p.add_argument("--tiny", action="store_true", help="tiny random configs for the shapes part")
    p.add_argument("--tokens", type=int, default=256, help="prompt tokens of the shapes part")
    p.add_argument("--models", default=",".join(CHECKPOINTS), help="comma-separated trained checkpoint directories")
    p.add_argument("--contexts", default="1024,4096", help="comma-separated context lengths of the trained part")
    p.add_argument("--samples", type=int, default=100, help="samples per task and context")
    p.add_argument("--seed", type=int, default=5, help="evaluation seed (below the training seeds, 2**31)")
    p.add_argument("--batch-size", type=int, default=25)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    if not parts or set(parts) - {"shapes", "trained"}:
        raise ValueError(f"--parts must be a subset of shapes,trained, got {args.parts!r}")
    device = jax.devices()[0].device_kind
    meta = dict(benchmark="quantization" + args.tag, device=device, jax=jax.__version__,
                date=datetime.date.today().isoformat(), args={k: str(v) for k, v in vars(args).items()})
    rows: list[dict] = []
    if "shapes" in parts:
        names = ("tiny-sdar", "tiny-llada") if args.tiny else ("sdar-8b-chat", "llada-8b-instruct")
        for row in shapes_rows(names, args.modes, args.tokens):
            rows.append(row)
            write_results(args.out, meta, rows, markdown(meta, rows))
    if "trained" in parts:
        contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
        models = [m for m in args.models.split(",") if m.strip()]
        for row in trained_rows(models, args.modes, contexts, args.samples, args.seed, args.batch_size):
            rows.append(row)
            write_results(args.out, meta, rows, markdown(meta, rows))


if __name__ == "__main__":
    main()
