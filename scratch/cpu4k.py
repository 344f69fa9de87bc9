import sys, time
t0 = time.perf_counter()
import jax, dllm_jax
from dllm_jax.eval import evaluate, make_samples, load_tokenizer
path, dtype, task, n, bs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
tok = load_tokenizer(path)
model = dllm_jax.load_model(path, dtype=dtype, progress=False)
t1 = time.perf_counter()
r = evaluate(model, make_samples(task, 4096, n, 21, tok), tokenizer=tok, batch_size=bs, progress=False)
t2 = time.perf_counter()
r2 = evaluate(model, make_samples(task, 4096, n, 22, tok), tokenizer=tok, batch_size=bs, progress=False)
t3 = time.perf_counter()
print(f"{dtype} {task} n={n} bs={bs}: load {t1-t0:.1f}s first {t2-t1:.1f}s ({r.num_correct}) again {t3-t2:.1f}s ({r2.num_correct})")
