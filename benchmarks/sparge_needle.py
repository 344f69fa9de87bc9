"""Why SpargeAttn misses the needle on the trained LLaDA (issue 39, part 4): where its block map puts the
needle's key block, per layer, next to the dense attention that block gets, and the accuracy it leaves.

Inputs are what a denoising step of `dllm_jax.eval.evaluate` sees: passkey prompts of `--context` tokens
(1024 by default) and the 6-token answer window, all masked (the first step). For every layer, from the
q/k that layer sees (`dllm_jax.analysis.calibration.layer_inputs`) and the calibrated policy's per-layer,
per-head values:
  - answer rows: whether the map keeps the needle's key block (the digits' 128-key tile) for the query
    block of the answer rows, and their dense attention mass on that block;
  - needle rows: whether the query block holding the digits keeps its own key block (the tile of the
    words around them), and the share of all key blocks it keeps;
  - the map's density.
Then the accuracy of the policy on fresh samples of the three tasks (greedy, as `dllm-jax eval`). An accuracy
run, not a timing: a CPU gives the same answers (`--accuracy-samples 0` skips it, e.g. at 4k on a CPU, where
`benchmarks/quality.py` measured it on a GPU).

    PYTHONPATH=. python -m benchmarks.sparge_needle --calibration FILE [--samples 20] --out benchmarks/results \
        [--checkpoint checkpoints/tiny-llada-long --context 4096 --accuracy-samples 0]
"""

import argparse
import datetime
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import dllm_jax
from dllm_jax.analysis.calibration import layer_inputs
from dllm_jax.attention.sparge import SpargeAttn
from dllm_jax.bench.results import write_results
from dllm_jax.bench.tables import markdown_table
from dllm_jax.eval import SPECIAL_IDS, evaluate, load_tokenizer, make_samples, max_answer_length
from pallas_kernels.sparge import predict_block_map

CHECKPOINT = Path("checkpoints/tiny-llada-tasks")
CONTEXT = 1024
TASKS = ("passkey", "niah_multikey", "variable_tracking")
PROBE_SEED, EVAL_SEED = 5, 1


def needle_position(sample, tokenizer) -> int:
    """The first digit of the passkey statement ("the pass key is D ..."): its first "pass" + 3."""
    ids = list(sample.prompt_ids)
    return ids.index(tokenizer.token_to_id("pass")) + 3


def probe(model, tokenizer, policy: SpargeAttn, samples: int, context: int) -> list[dict]:
    cases = make_samples("passkey", context, samples, PROBE_SEED, tokenizer)
    answer = max_answer_length("passkey")
    ids = np.stack([np.concatenate([s.prompt_ids, np.full(answer, SPECIAL_IDS.mask)]) for s in cases])
    needles = np.array([needle_position(s, tokenizer) for s in cases])
    n = ids.shape[1]
    bq, bk = policy.block_q, policy.block_kv
    q, k, _ = (np.asarray(x, np.float32) for x in layer_inputs(model, ids))  # [L, B, N, H, D]
    rows = np.arange(len(cases))
    needle_kb, needle_qb, answer_qb = needles // bk, needles // bq, (n - answer) // bq
    out = []
    for layer in range(q.shape[0]):
        # the map the policy's kernel gets at this layer (its PV filter aside)
        selection = {policy.selection_param: np.asarray(getattr(policy, policy.selection_param))[layer]}
        keep = np.asarray(predict_block_map(
            jnp.asarray(q[layer]), jnp.asarray(k[layer]), block_q=bq, block_kv=bk, smooth_k=policy.smooth_k,
            attention_sink=policy.attention_sink, simthreshd1=np.asarray(policy.simthreshd1)[layer],
            **selection))  # [B, H, nqb, nkb]
        kk = np.repeat(k[layer], q.shape[3] // k.shape[3], axis=2)
        logits = np.einsum("bqhd,bkhd->bhqk", q[layer][:, n - answer:], kk) / np.sqrt(q.shape[-1])
        probs = np.asarray(jax.nn.softmax(logits, axis=-1))
        on_needle = [probs[b, :, :, needle_kb[b] * bk:(needle_kb[b] + 1) * bk].sum(-1).mean() for b in rows]
        out.append(dict(layer=layer, answer_rows_keep_needle=float(keep[rows, :, answer_qb, needle_kb].mean()),
                        answer_mass_on_needle=float(np.mean(on_needle)),
                        needle_rows_keep_own=float(keep[rows, :, needle_qb, needle_kb].mean()),
                        needle_rows_density=float(keep[rows, :, needle_qb].mean()), density=float(keep.mean())))
    return out


def accuracy(model, tokenizer, policy, samples: int, context: int) -> list[dict]:
    rows = []
    for task in TASKS if samples else ():
        result = evaluate(model, make_samples(task, context, samples, EVAL_SEED, tokenizer), tokenizer=tokenizer,
                          method=policy, batch_size=samples, progress=False)
        rows.append(dict(task=task, correct=result.num_correct, samples=result.num_samples))
        print(rows[-1], flush=True)
    return rows


def report(meta: dict, layers: list[dict], scores: list[dict], out: Path) -> None:
    lines = [f"# SpargeAttn and the needle, {meta['device']}, jax {meta['jax']}, {meta['date']}", "",
             f"Model {meta['checkpoint']} (float32), calibration {meta['calibration']}; probe: {meta['probe']}.", "",
             *markdown_table(["layer", "answer rows keep the needle's block", "their dense mass on it",
                              "needle rows keep their own block", "blocks the needle rows keep", "map density"],
                             [[r["layer"], f"{r['answer_rows_keep_needle']:.2f}", f"{r['answer_mass_on_needle']:.3f}",
                               f"{r['needle_rows_keep_own']:.2f}", f"{r['needle_rows_density']:.2f}",
                               f"{r['density']:.2f}"] for r in layers], align="rrrrrr"), "",
             *([f"Accuracy with this policy ({meta['accuracy']}):", "",
                *markdown_table(["task", "correct"], [[s["task"], f"{s['correct']}/{s['samples']}"] for s in scores])]
               if scores else ["Accuracy: not run here (`--accuracy-samples 0`)."])]
    write_results(out, meta, [dict(kind="layer", **r) for r in layers] + [dict(kind="accuracy", **s) for s in scores],
                  lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calibration", type=Path, required=True, help="a calibrate_llada JSON for the checkpoint")
    parser.add_argument("--samples", type=int, default=20, help="probe prompts (and fresh samples per task)")
    parser.add_argument("--accuracy-samples", type=int, default=None,
                        help="fresh samples per task for the accuracy (default --samples; 0: not run)")
    parser.add_argument("--checkpoint", type=Path, default=CHECKPOINT, help="the trained LLaDA (HF format)")
    parser.add_argument("--context", type=int, default=CONTEXT, help="prompt length in tokens")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    scored = args.samples if args.accuracy_samples is None else args.accuracy_samples
    if args.samples < 1 or scored < 0:
        parser.error(f"--samples {args.samples} must be >= 1 and --accuracy-samples {scored} >= 0")
    policy = SpargeAttn.from_calibration(args.calibration)  # a bad file fails before the model loads
    model = dllm_jax.load_model(args.checkpoint, dtype="float32", progress=False)
    tokenizer = load_tokenizer(args.checkpoint)
    default = (args.checkpoint, args.context) == (CHECKPOINT, CONTEXT)
    name = "sparge_needle" + ("" if default else f"_{args.checkpoint.resolve().name}_{args.context}")
    meta = dict(benchmark=name, device=jax.devices()[0].device_kind, jax=jax.__version__,
                date=datetime.date.today().isoformat(), checkpoint=str(args.checkpoint),
                calibration=str(args.calibration), context=args.context,
                probe=f"{args.samples} passkey prompts at {args.context} tokens (seed {PROBE_SEED}) + "
                      f"{max_answer_length('passkey')} masks, the first denoising step; shares over samples x heads",
                accuracy=f"{scored} fresh samples per task at {args.context} tokens, evaluation seed {EVAL_SEED}")
    layers = probe(model, tokenizer, policy, args.samples, args.context)
    scores = accuracy(model, tokenizer, policy, scored, args.context)
    report(meta, layers, scores, args.out)


if __name__ == "__main__":
    main()
