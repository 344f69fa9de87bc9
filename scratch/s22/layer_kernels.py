"""Which kernels one SDAR layer launches per forward at batch 1 (issues 40 and 42: batch 1 is launch-bound).

Generates one block with SDAR-8B shapes cut to 4 layers (random bf16 weights), dense and MAGE, under the profiler,
and prints the last 300 runs of the second call's GPU kernels in launch order (kind x count), then the call's
tally by kind; the per-layer pattern repeats 4 times per forward.
  PYTHONPATH=. python scratch/s22/layer_kernels.py [--prompt 1024] [--model sdar-8b-chat] [--layers 4]
"""

import argparse
import gzip
import json
import tempfile
from itertools import groupby
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax import generate
from dllm_jax.attention.mage import MAGE
from dllm_jax.bench.models import model_for
from dllm_jax.bench.profile import kernel_kind


def kernels_in_order(run):
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            run()
        files = sorted(Path(d).rglob("*.trace.json.gz")) or sorted(Path(d).rglob("perfetto_trace.json.gz"))
        if not files:
            return []
        events = json.loads(gzip.decompress(files[-1].read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e),
                     key=lambda e: e["ts"])
    return [(kernel_kind(e["name"]), e["dur"]) for e in kernels]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="sdar-8b-chat")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=1024)
    args = p.parse_args()
    model, config = model_for(args.model, layers=args.layers, context=args.prompt + 64, dtype=jnp.bfloat16)
    prompt = np.arange(args.prompt, dtype=np.int32)[None] % 1000 + 10
    for name, method in (("dense", None), ("mage", MAGE(k=512, exact_layers=1))):
        kwargs = dict(max_new_tokens=2 * config.block_size, denoising_steps=4, top_k=1)
        if method is not None:
            kwargs["method"] = method

        def run():
            jax.block_until_ready(generate(model, prompt, **kwargs))

        run()
        seq = kernels_in_order(run)
        print(f"\n## {name}: {len(seq)} kernels, {sum(d for _, d in seq) / 1e3:.2f} ms")
        runs = [(kind, list(group)) for kind, group in groupby(seq, key=lambda kd: kd[0])]
        for kind, group in runs[-300:]:  # the last forwards (the prefill's kernels come first)
            print(f"  {kind:50s} x{len(group):3d}  {sum(d for _, d in group):8.1f} us")
        tally = {}
        for kind, dur in seq:
            tally.setdefault(kind, [0, 0.0])
            tally[kind][0] += 1
            tally[kind][1] += dur
        print("  by kind: " + "; ".join(f"{k} {n} ({us / 1e3:.2f} ms)"
                                        for k, (n, us) in sorted(tally.items(), key=lambda kv: -kv[1][0])))


if __name__ == "__main__":
    main()
