"""Why does L6 get ~80% of 16k VT at evaluation while its training loss says ~100%?"""
import sys, time, jax, jax.numpy as jnp, numpy as np
import dllm_jax
from dllm_jax.eval import evaluate, make_samples, load_tokenizer
from dllm_jax.attention.policy import Dense
from dllm_jax.checkpoint.hf import read_hf_params
from dllm_jax.config import read_hf_config
from dllm_jax.train.losses import two_copy_logits

path, n, ctx, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tok = load_tokenizer(path)
samples = make_samples("variable_tracking", ctx, n, seed, tok)
model = dllm_jax.load_model(path, dtype="bfloat16", progress=False)
res = {}
for name, policy in [("auto", None), ("xla", Dense(backend="xla"))]:
    t = time.perf_counter()
    r = evaluate(model, samples, tokenizer=tok, method=policy, batch_size=4, progress=False)
    res[name] = r
    print(name, f"acc {r.accuracy:.3f} ({r.num_correct}/{r.num_samples}) {time.perf_counter()-t:.0f}s distractors {r.distractors()}",
          flush=True)
wrong = [i for i, rec in enumerate(res["auto"].records) if not rec.correct]
print("auto wrong:", [(i, res['auto'].records[i].answer, res['auto'].records[i].predicted) for i in wrong])
print("xla wrong:", [i for i, rec in enumerate(res["xla"].records) if not rec.correct])

_, cfg = read_hf_config(path)
params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), read_hf_params(path, cfg, dtype="float32", progress=False))
mask_id = cfg.mask_token_id


@jax.jit
def tf(params, noisy, clean):
    return two_copy_logits(params, noisy, clean, config=cfg, chunk=2048)


ok = []
for i, s in enumerate(samples):
    P, A = len(s.prompt_ids), len(s.answer_ids)
    L = P + 8
    clean = np.full((1, L), cfg.pad_token_id, np.int32)
    clean[0, :P] = s.prompt_ids
    clean[0, P:P + A] = s.answer_ids
    noisy = clean.copy()
    noisy[0, P:] = mask_id
    logits = np.asarray(tf(params, jnp.asarray(noisy), jnp.asarray(clean)))
    pred = logits[0, P:P + A].argmax(-1)
    ok.append(bool((pred == s.answer_ids).all()))
print("teacher-forced all-masked argmax correct:", sum(ok), "/", len(ok), "wrong:", [i for i, o in enumerate(ok) if not o])
