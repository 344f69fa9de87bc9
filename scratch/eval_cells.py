"""Accuracy cells: eval_cells.py CKPT OUTFILE task:ctx:seed:n[:dtype] ..."""
import json, sys, time
import dllm_jax
from dllm_jax.eval import evaluate, make_samples, load_tokenizer

path, out = sys.argv[1], sys.argv[2]
tok = load_tokenizer(path)
models = {}
for cell in sys.argv[3:]:
    task, ctx, seed, n, *rest = cell.split(":")
    dtype = rest[0] if rest else "bfloat16"
    if dtype not in models:
        models[dtype] = dllm_jax.load_model(path, dtype=dtype, progress=False)
    t = time.perf_counter()
    r = evaluate(models[dtype], make_samples(task, int(ctx), int(n), int(seed), tok), tokenizer=tok, batch_size=4,
                 progress=False)
    row = dict(model=path, task=task, context=int(ctx), seed=int(seed), dtype=dtype, correct=r.num_correct,
               samples=r.num_samples, distractors=r.distractors(), seconds=round(time.perf_counter() - t, 1))
    print("CELL", json.dumps(row), flush=True)
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
