"""Does SpargeAttn's map keep the needle's key block for the answer rows? Ours vs the official partial-block rule."""
import json, sys
import jax, jax.numpy as jnp, numpy as np
import dllm_jax
from dllm_jax.analysis.calibration import layer_inputs
from dllm_jax.eval import make_samples, load_tokenizer, SPECIAL_IDS
from pallas_kernels.sparge import predict_block_map

ck = "checkpoints/tiny-llada-tasks"
tok = load_tokenizer(ck)
model = dllm_jax.load_model(ck, dtype="float32", progress=False)
cal = json.load(open(sys.argv[1]))
n = int(sys.argv[2]) if len(sys.argv) > 2 else 8
samples = make_samples("passkey", 1024, n, 5, tok)
P = len(samples[0].prompt_ids)
ids = np.stack([np.concatenate([s.prompt_ids, np.full(6, SPECIAL_IDS.mask)]) for s in samples])
N = ids.shape[1]
q, k, v = (np.asarray(x) for x in layer_inputs(model, ids))  # [L, B, N, H, D]
bq, bk = cal["block_q"], cal["block_kv"]
print("N", N, "prompt", P, "blocks q", bq, "k", bk, "last q block rows", N - (N - 1) // bq * bq)
# the needle's key block per sample: where "pass key is" sits
key_pos = []
for s in samples:
    text_ids = s.prompt_ids
    pk = tok.token_to_id("pass")
    pos = [i for i in range(len(text_ids) - 10) if text_ids[i] == pk][0]  # first "pass": the statement
    key_pos.append(pos + 3)  # the digits start after "pass key is"
L, B, _, H, D = q.shape
ans_qb = (N - 6) // bq  # query block of the first answer row
res = {"ours": [], "official": []}
mass = []
for layer in range(L):
    thr = dict(simthreshd1=np.asarray(cal["simthreshd1"][layer]), cdfthreshd=np.asarray(cal["cdfthreshd"][layer]))
    keep = np.asarray(predict_block_map(jnp.asarray(q[layer]), jnp.asarray(k[layer]), block_q=bq, block_kv=bk, **thr))
    # official: a partial last block (q or k) is never "similar" (zero padding -> 0/0 -> NaN similarity)
    offq, offk = N % bq != 0, N % bk != 0
    off = keep.copy()
    if offq: off[:, :, -1, :] = True
    if offk: off[:, :, :, -1] = True
    for name, m in (("ours", keep), ("official", off)):
        hit = np.array([[m[b, h, (N - 1) // bq, key_pos[b] // bk] for h in range(H)] for b in range(B)])
        res[name].append(hit.mean())
    # dense attention mass of the answer rows on the needle's key block
    qa = q[layer][:, N - 6:]  # [B, 6, H, D]
    g = H // k.shape[3]
    kk = np.repeat(k[layer], g, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", qa, kk) / np.sqrt(D)
    p = np.exp(logits - logits.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
    mass.append(np.mean([p[b, :, :, key_pos[b] // bk * bk:(key_pos[b] // bk + 1) * bk].sum(-1).mean() for b in range(B)]))
    print(f"layer {layer}: needle block kept for the answer rows (share of samples x heads): ours {res['ours'][-1]:.2f}"
          f" official-rule {res['official'][-1]:.2f}; dense mass of answer rows on it {mass[-1]:.3f}; map density "
          f"{keep.mean():.2f}", flush=True)

print("--- the needle's own rows (query block holding the digits) ---")
for layer in range(L):
    thr = dict(simthreshd1=np.asarray(cal["simthreshd1"][layer]), cdfthreshd=np.asarray(cal["cdfthreshd"][layer]))
    keep = np.asarray(predict_block_map(jnp.asarray(q[layer]), jnp.asarray(k[layer]), block_q=bq, block_kv=bk, **thr))
    own = np.array([[keep[b, h, key_pos[b] // bq, key_pos[b] // bk] for h in range(H)] for b in range(B)])
    rows = np.array([[keep[b, h, key_pos[b] // bq].mean() for h in range(H)] for b in range(B)])
    print(f"layer {layer}: needle rows keep their own key block {own.mean():.2f}; share of key blocks they keep {rows.mean():.2f}")
