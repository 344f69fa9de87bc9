"""Tensor and sequence parallelism against one device, in one process (random bf16 weights).

Sections (`--sections`, comma-separated; results are rewritten after every row to
<out>/parallel<tag>_<device>_<date>.{json,md}, so a run cut short keeps what it measured):
  llada  one LLaDA-8B denoising step at `--llada-length` positions (64k): the full bidirectional
         forward with logits for the last `--llada-gen` positions (what `generate` runs per step),
         on one device and on each mesh of `--llada-meshes` (tp=2, sp=2); seconds per step (median
         of warm calls), speed-up = one device / mesh, and the mesh's logits against the one-device
         logits (max relative difference, argmax agreement).
  sdar   `dllm_jax.generate` on SDAR-8B at batch `--sdar-batch` (32), prompt `--sdar-prompt`,
         `--sdar-new` new tokens (block 4, 4 denoising steps, low_confidence_static, no stop token:
         fixed work), on one device and on each mesh of `--sdar-meshes` (tp=2); generated tokens/s
         of the warm call, speed-up, and the fraction of generated tokens equal to one device's.

    PYTHONPATH=. python -m benchmarks.parallel --out benchmarks/results          # two GPUs
    PYTHONPATH=. python -m benchmarks.parallel --layers 2 --llada-length 256 --sdar-batch 4 \\
        --sdar-prompt 64 --sdar-new 16                                           # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax import generate
from dllm_jax.attention.policy import Dense
from dllm_jax.attention.sharded import Sharded
from dllm_jax.bench import call_times, fmt, markdown_table, median_min_max, model_for, write_results
from dllm_jax.models.llada import forward
from dllm_jax.sharding import batch_sharding, make_mesh


def mesh_label(spec: str | None) -> str:
    return spec or "1 device"


def llada_rows(args):
    """One denoising step of LLaDA-8B on one device, then on each mesh (the same random weights)."""
    length, gen = args.llada_length, args.llada_gen
    ids = np.random.default_rng(0).integers(0, 126000, (1, length)).astype(np.int32)
    base = None
    for spec in [None, *args.llada_meshes]:
        mesh = None if spec is None else make_mesh(spec)
        model, config = model_for(args.llada_model, layers=args.layers, context=length, dtype=jnp.bfloat16,
                                  mesh=mesh)
        policy = Dense() if mesh is None else Sharded(Dense(), mesh)
        step = jax.jit(lambda p, x: forward(p, x, config=config, policy=policy, logits_from=length - gen)[0])
        placed = ids if mesh is None else jax.device_put(ids, batch_sharding(mesh, 2))
        start = time.perf_counter()
        logits = np.asarray(jax.block_until_ready(step(model.params(), placed)))
        first = time.perf_counter() - start
        seconds, low, high = median_min_max(call_times(step, model.params(), placed, repeats=args.repeats, warmup=0,
                                                       burst_s=0))
        row = dict(section="llada", mesh=mesh_label(spec), devices=1 if mesh is None else mesh.size, length=length,
                   gen=gen, layers=config.num_layers, step_s=seconds, min_s=low, max_s=high, first_call_s=first)
        if base is None:
            base = dict(step_s=seconds, logits=logits)
        else:
            scale = float(np.abs(base["logits"]).max())
            row |= dict(speedup=base["step_s"] / seconds,
                        max_rel_diff=float(np.abs(logits - base["logits"]).max() / scale),
                        argmax_agree=float((logits.argmax(-1) == base["logits"].argmax(-1)).mean()))
        print(row, flush=True)
        yield row
        del model, step, logits
        gc.collect()


def sdar_rows(args):
    """SDAR-8B generation at one batch on one device, then on each mesh (the same random weights)."""
    batch, prompt, new = args.sdar_batch, args.sdar_prompt, args.sdar_new
    options = dict(max_new_tokens=new, denoising_steps=4, remasking="low_confidence_static")
    ids = np.random.default_rng(1).integers(0, 150000, (batch, prompt)).astype(np.int32)
    base = None
    for spec in [None, *args.sdar_meshes]:
        mesh = None if spec is None else make_mesh(spec)
        model, config = model_for(args.sdar_model, layers=args.layers, context=prompt + new + 64, dtype=jnp.bfloat16,
                                  mesh=mesh)
        run = lambda: generate(model, ids, seed=0, attention_mask=np.ones_like(ids), **options)  # noqa: E731
        first = call_times(run, repeats=1, warmup=0, burst_s=0)[0]
        start = time.perf_counter()
        out = run()
        seconds = time.perf_counter() - start
        generated = out[:, prompt:]
        row = dict(section="sdar", mesh=mesh_label(spec), devices=1 if mesh is None else mesh.size, batch=batch,
                   prompt=prompt, new_tokens=new, layers=config.num_layers, total_s=seconds, first_call_s=first,
                   tokens_per_s=batch * generated.shape[1] / seconds)
        if base is None:
            base = dict(tokens_per_s=row["tokens_per_s"], generated=generated)
        else:
            row |= dict(speedup=row["tokens_per_s"] / base["tokens_per_s"],
                        tokens_agree=float((generated == base["generated"]).mean()))
        print(row, flush=True)
        yield row
        del model
        gc.collect()


def markdown(meta: dict, rows: list[dict]) -> list[str]:
    lines = [f"# Tensor and sequence parallelism: {meta['device']} x {meta['devices']}, jax {meta['jax']}, "
             f"{meta['date']}", "", "Random bf16 weights; one device vs meshes in one process (`benchmarks/parallel.py`).", ""]
    llada = [r for r in rows if r["section"] == "llada"]
    if llada:
        r0 = llada[0]
        lines += [f"## LLaDA-8B denoising step at {r0['length']} positions ({r0['layers']} layers, logits for the "
                  f"last {r0['gen']})", "",
                  *markdown_table(["mesh", "devices", "step (s)", "min–max (s)", "speed-up", "max rel. diff",
                                   "argmax agree"],
                                  [[r["mesh"], r["devices"], f"{r['step_s']:.3f}", f"{r['min_s']:.3f}–{r['max_s']:.3f}",
                                    fmt(r.get("speedup")), fmt(r.get("max_rel_diff")), fmt(r.get("argmax_agree"))]
                                   for r in llada]), ""]
    sdar = [r for r in rows if r["section"] == "sdar"]
    if sdar:
        r0 = sdar[0]
        lines += [f"## SDAR-8B generation, batch {r0['batch']}, prompt {r0['prompt']}, {r0['new_tokens']} new tokens "
                  f"({r0['layers']} layers, block 4, 4 steps)", "",
                  *markdown_table(["mesh", "devices", "tokens/s", "total (s)", "first call (s)", "speed-up",
                                   "tokens equal to 1 device"],
                                  [[r["mesh"], r["devices"], f"{r['tokens_per_s']:.1f}", f"{r['total_s']:.2f}",
                                    f"{r['first_call_s']:.1f}", fmt(r.get("speedup")), fmt(r.get("tokens_agree"))]
                                   for r in sdar])]
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default="llada,sdar")
    parser.add_argument("--llada-model", default="llada-8b-instruct")
    parser.add_argument("--llada-length", type=int, default=65536)
    parser.add_argument("--llada-gen", type=int, default=256)
    parser.add_argument("--llada-meshes", nargs="+", default=["tp=2", "sp=2"])
    parser.add_argument("--sdar-model", default="sdar-8b-chat")
    parser.add_argument("--sdar-batch", type=int, default=32)
    parser.add_argument("--sdar-prompt", type=int, default=1024)
    parser.add_argument("--sdar-new", type=int, default=256)
    parser.add_argument("--sdar-meshes", nargs="+", default=["tp=2"])
    parser.add_argument("--layers", type=int, default=None, help="override the layer count (smoke runs)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    meta = dict(benchmark=f"parallel{args.tag}", device=jax.devices()[0].device_kind, devices=jax.device_count(),
                jax=jax.__version__, date=datetime.date.today().isoformat(),
                args={k: v for k, v in vars(args).items() if k != "out"})
    rows = []
    sections = {"llada": llada_rows, "sdar": sdar_rows}
    for name in args.sections.split(","):
        for row in sections[name](args):
            rows.append(row)
            write_results(args.out, meta, rows, markdown(meta, rows))


if __name__ == "__main__":
    main()
