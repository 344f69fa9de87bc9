"""Training attention at long contexts (issue 39): step time and memory of the training loss's value and
gradients, materialised masks against the query-chunked attention (dllm_jax.train.attention), for the
long-context model shape (head_dim 64, GQA), LLaDA and SDAR, 1k to 32k tokens; SDAR at three chunk sizes
(on a GPU in bf16, LLaDA's chunked path is one cuDNN call with key lengths). Memory is XLA's temp allocation
of the compiled step; a variant whose program needs more than the device holds is reported, not run.

    PYTHONPATH=. python -m benchmarks.train_attention --out benchmarks/results
"""

import argparse
import datetime
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.bench.results import write_results
from dllm_jax.bench.tables import markdown_table
from dllm_jax.bench.timing import time_calls
from dllm_jax.config import LLaDAConfig, SDARConfig
from dllm_jax.train import TrainConfig, init_params
from dllm_jax.train.loop import loss_fn

SHAPE = dict(hidden_size=256, num_layers=8, num_heads=4, num_kv_heads=2, intermediate_size=768)  # head_dim 64
VOCAB = 512
CONTEXTS = (1024, 4096, 16384, 32768)
TOKENS_PER_STEP = 65536  # batch = this / context (at least 1): the same tokens per step at every context
# LLaDA's memory-light path on a GPU in bf16 is one cuDNN call with key lengths, whatever the chunk: one row
VARIANTS = {"llada": ("materialised", "chunked-2048"), "sdar": ("materialised", "chunked-1024", "chunked-2048",
                                                               "chunked-4096")}
FITS = 0.8  # of the device's memory: a bigger program is reported, not run


def model(family: str, length: int):
    common = dict(SHAPE, vocab_size=VOCAB, max_position_embeddings=length, mask_token_id=1, pad_token_id=0)
    if family == "llada":
        return LLaDAConfig(**common, tokenizer_vocab_size=VOCAB, eos_token_id=2, eot_token_id=2)
    return SDARConfig(**common, head_dim=64, block_size=4, eos_token_ids=(2,))


def measure(family: str, length: int, variant: str, capacity: int) -> dict:
    config = model(family, length)
    batch = max(1, TOKENS_PER_STEP // length)
    rng = np.random.default_rng(0)
    params = init_params(config, jax.random.PRNGKey(0))
    tokens = jnp.asarray(rng.integers(3, VOCAB, (batch, length)), jnp.int32)
    lengths = jnp.full((batch,), length - 8, jnp.int32)  # a little right padding, as training batches have
    loss_mask = jnp.arange(length)[None] < lengths[:, None]
    args = (params, tokens, loss_mask, lengths, jax.random.PRNGKey(1))
    chunk = None if variant == "materialised" else int(variant.split("-")[1])
    # the training loop's own loss (bf16 compute from fp32 weights), as `train` runs it
    loss = loss_fn(TrainConfig(model=config, steps=2, batch_size=batch, seq_length=length, attention_chunk=chunk))
    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    row = dict(family=family, context=length, batch=batch, variant=variant)
    try:
        compiled = step.lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - a program XLA cannot build is a result here
        return row | dict(status=f"does not compile: {type(e).__name__}: {str(e)[:200]}")
    memory = compiled.memory_analysis()
    temp = int(memory.temp_size_in_bytes)
    row |= dict(temp_gib=temp / 2**30)
    if temp > FITS * capacity:
        return row | dict(status="does not fit")
    (loss, _), _ = compiled(*args)
    seconds = time_calls(compiled, *args, repeats=3, burst_s=0)
    return row | dict(status="ok", loss=float(loss), step_ms=seconds * 1e3, tokens_per_s=batch * length / seconds)


def report(rows: list[dict], meta: dict, out: Path) -> None:
    """Writes the results so far (the run rewrites them as rows arrive)."""
    baseline = {(r["family"], r["context"]): r["step_ms"] for r in rows
                if r["status"] == "ok" and r["variant"] == "materialised"}
    cells = []
    for r in rows:
        ok, base = r["status"] == "ok", baseline.get((r["family"], r["context"]))
        cells.append([r["family"], r["context"], r["batch"], r["variant"], f"{r.get('temp_gib', float('nan')):.2f}",
                      f"{r['step_ms']:.1f}" if ok else r["status"][:40], f"{r['tokens_per_s'] / 1e3:.0f}" if ok else "",
                      f"{base / r['step_ms']:.2f}" if ok and base else "", f"{r['loss']:.4f}" if ok else ""])
    lines = [f"# Training attention at long contexts, {meta['device']}, jax {meta['jax']}, {meta['date']}", "",
             f"Model: {SHAPE}, vocabulary {VOCAB}; one step = loss value and gradients (no optimizer), bf16 compute, "
             f"{TOKENS_PER_STEP} tokens per step (batch = that / context; SDAR's forward runs both copies, 2x the "
             "tokens). Memory: XLA's temp allocation of the compiled step. Speed-up: over the materialised masks "
             "in the same run, where they fit.", "",
             *markdown_table(["family", "context", "batch", "attention", "temp GiB", "step ms", "k tokens/s",
                              "vs materialised", "loss"], cells)]
    write_results(out, meta, rows, lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=list(CONTEXTS))
    args = parser.parse_args()
    device = jax.devices()[0]
    capacity = (device.memory_stats() or {}).get("bytes_limit", 64 * 2**30)
    meta = dict(benchmark="train_attention", device=device.device_kind, jax=jax.__version__,
                date=datetime.date.today().isoformat(), shape=SHAPE, vocab=VOCAB, tokens_per_step=TOKENS_PER_STEP,
                compute="bfloat16, float32 weights", timing="time_calls (median of 3 synchronised steps)")
    rows = []
    for length in args.contexts:
        for family in ("llada", "sdar"):
            for variant in VARIANTS[family]:
                rows.append(measure(family, length, variant, capacity))
                print(rows[-1], flush=True)
                report(rows, meta, args.out)


if __name__ == "__main__":
    main()
