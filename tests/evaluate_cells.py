"""Evaluates a checkpoint on several (task, context, seed) cells in one process, as a user's process
compiles (tests/test_trained_checkpoints.py runs it without `make test`'s -O0 flags: the 1k-token
passes are execution-bound), and writes one record per cell; OPTIONS is a JSON object of `evaluate`'s
generate options (e.g. {"cache": "dual", "threshold": 0.9}); DTYPE is load_model's dtype, or DTYPE:QUANTIZE
(e.g. bfloat16:int8) with its quantize:
python tests/evaluate_cells.py CHECKPOINT DTYPE OUT.json OPTIONS TASK:CONTEXT:SEED [...]"""

import json
import sys
from pathlib import Path

import dllm_jax
from dllm_jax import eval as dev

SAMPLES = 10


def main(checkpoint: Path, dtype: str, out: Path, options: dict, cells: list[str]) -> None:
    tokenizer = dev.load_tokenizer(checkpoint)
    dtype, _, quantize = dtype.partition(":")
    model = dllm_jax.load_model(checkpoint, dtype=dtype, quantize=quantize or None, progress=False)
    rows = []
    for cell in cells:
        task, context, seed = cell.split(":")
        samples = dev.make_samples(task, int(context), SAMPLES, int(seed), tokenizer)
        result = dev.evaluate(model, samples, tokenizer=tokenizer, batch_size=SAMPLES, progress=False, **options)
        rows.append(dict(task=task, context=int(context), seed=int(seed), num_samples=result.num_samples,
                         tasks=list(result.tasks), context_lengths=list(result.context_lengths),
                         accuracy=result.accuracy, answers=[(r.answer, r.predicted) for r in result.records]))
    out.write_text(json.dumps(rows))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5:])
