"""Cost of the per-tensor checksums: `load_model` of a converted checkpoint with verify=True (the
default: a CRC-32 of every stored tensor, compared with the manifest) against verify=False.

A random LLaDA-shaped checkpoint (d=1024, 6 layers, 32k vocabulary: 141M parameters, 282 MB in
bfloat16, 564 MB in float32) is written in HF format, converted (stored dtype = the source's), and
loaded in its stored dtype; times are medians of `--repeats` loads after one warm-up load (the
files are in the page cache: this is the CPU cost of verification, not disk speed). The checksum
pass (CRC-32 of every tensor, what verify=True adds when the load dtype is the stored one) is also
timed alone, since on a loaded machine the difference of two load times is within their noise.

    PYTHONPATH=. python -m benchmarks.checkpoint_verify --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import tempfile
import time
from pathlib import Path

import jax
from flax import nnx

from dllm_jax import convert_hf_checkpoint, load_model
from dllm_jax.bench import markdown_table, time_calls, write_results
from dllm_jax.checkpoint.hf import param_shapes_for
from dllm_jax.checkpoint.manifest import tree_checksums
from dllm_jax.testing import tiny_llada_config, write_hf_checkpoint


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def bench_config(layers: int):
    return tiny_llada_config(hidden_size=1024, num_layers=layers, num_heads=8, num_kv_heads=8, intermediate_size=2816,
                             vocab_size=32000, tokenizer_vocab_size=31900, mask_token_id=31890, eos_token_id=31891,
                             pad_token_id=31891, eot_token_id=31892)


def rows_for(dtype: str, *, layers: int, repeats: int, root: Path) -> dict:
    config = bench_config(layers)
    hf = write_hf_checkpoint(root / f"hf-{dtype}", config, dtype=dtype)
    out = root / f"converted-{dtype}"
    start = time.perf_counter()
    convert_hf_checkpoint(hf, out, progress=False)
    convert_s = time.perf_counter() - start
    size = sum(p.stat().st_size for p in (out / "params").rglob("*") if p.is_file())

    def load(verify):
        return lambda: jax.tree.leaves(nnx.state(load_model(out, dtype=dtype, verify=verify, progress=False)))

    plain = time_calls(load(False), repeats=repeats, burst_s=0)
    verified = time_calls(load(True), repeats=repeats, burst_s=0)
    params = nnx.state(load_model(out, dtype=dtype, verify=False, progress=False))
    checksum_s = time_calls(lambda: tree_checksums(params) and [], repeats=repeats, burst_s=0)  # the pass alone
    row = dict(stored_dtype=dtype, load_dtype=dtype, params_m=round(config_params(config) / 1e6, 1),
               stored_mb=round(size / 1e6, 1), convert_s=round(convert_s, 3), load_s=round(plain, 3),
               load_verified_s=round(verified, 3), difference_s=round(verified - plain, 3),
               checksum_pass_s=round(checksum_s, 3), checksum_pct_of_load=round(100 * checksum_s / plain, 1),
               checksum_gb_per_s=round(raw_bytes(params) / 1e9 / checksum_s, 2))
    print(row, flush=True)
    return row


def raw_bytes(tree) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def config_params(config) -> int:
    return sum(math.prod(s) for s in jax.tree.leaves(param_shapes_for(config), is_leaf=lambda x: isinstance(x, tuple)))


def markdown(meta: dict, rows: list[dict]) -> list[str]:
    lines = [f"# load_model with and without checksum verification — {meta['cpu']} ({meta['device']}), "
             f"jax {meta['jax']}, {meta['date']}", "",
             f"Random LLaDA-shaped checkpoint, {meta['layers']} layers, d=1024, vocab 32000; median of "
             f"{meta['repeats']} loads after a warm-up (page cache warm). {meta['note']}", "",
             *markdown_table(["stored = load dtype", "params", "on disk", "load, verify=False", "load, verify=True",
                              "difference", "checksum pass alone", "pass / load", "checksum throughput",
                              "convert (once)"], [cells(r) for r in rows])]
    return lines


def cells(r: dict) -> list[str]:
    return [r["stored_dtype"], f"{r['params_m']}M", f"{r['stored_mb']} MB", f"{r['load_s']:.2f} s",
            f"{r['load_verified_s']:.2f} s", f"{r['difference_s']:+.2f} s", f"{r['checksum_pass_s']:.2f} s",
            f"{r['checksum_pct_of_load']:.0f}%", f"{r['checksum_gb_per_s']:.2f} GB/s", f"{r['convert_s']:.1f} s"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--note", default="", help="a line for the Markdown (e.g. machine load)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [rows_for(dtype, layers=args.layers, repeats=args.repeats, root=Path(tmp)) for dtype in args.dtypes]
    meta = dict(benchmark="checkpoint_verify", device=jax.devices()[0].device_kind, cpu=cpu_model(),
                cores=os.cpu_count(), backend=jax.default_backend(),
                jax=jax.__version__, date=datetime.date.today().isoformat(), layers=args.layers,
                repeats=args.repeats, note=args.note)
    write_results(args.out, meta, rows, markdown(meta, rows))


if __name__ == "__main__":
    main()
