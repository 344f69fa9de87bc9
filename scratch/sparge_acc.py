import sys, time
import dllm_jax
from dllm_jax.attention.sparge import SpargeAttn
from dllm_jax.eval import evaluate, make_samples, load_tokenizer
ck = "checkpoints/tiny-llada-tasks"
tok = load_tokenizer(ck)
model = dllm_jax.load_model(ck, dtype="float32", progress=False)
policy = SpargeAttn.from_calibration(sys.argv[1])
n = int(sys.argv[2])
for task in sys.argv[3:]:
    t = time.perf_counter()
    r = evaluate(model, make_samples(task, 1024, n, 1, tok), tokenizer=tok, method=policy, batch_size=n, progress=False)
    print(f"{sys.argv[4] if False else ''}{task}: {r.num_correct}/{r.num_samples} {time.perf_counter()-t:.0f}s", flush=True)
