"""`dllm-jax bench`: attention kernels and generation timed on this device (dllm_jax.bench)."""

from __future__ import annotations

import sys
from pathlib import Path

from dllm_jax.cli.common import checked_out_dir, dtype_parent
from dllm_jax.flags import fraction, positive_int


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", parents=[dtype_parent()], help="time attention kernels and generation on this device",
        description="Attention kernels (dense cuDNN/XLA vs our flash, block- and column-sparse kernels) and the "
                    "generate loop per method with random weights; writes bench_<device>_<date>.json and .md to --out "
                    "(_2, _3, ... for later runs of the day: none is replaced). Defaults fit the device: LLaDA-8B / "
                    "SDAR-8B dims on a GPU, tiny models on a CPU.")
    bench.add_argument("--sections", nargs="+", default=["attention", "generate"], choices=["attention", "generate"])
    bench.add_argument("--lengths", type=positive_int, nargs="+", default=None,
                       help="attention sequence lengths (GPU 4096 16384; CPU 256 512)")
    bench.add_argument("--densities", type=fraction, nargs="+", default=[0.5, 0.3, 0.1],
                       help="fractions of key blocks / columns kept by the sparse kernels")
    bench.add_argument("--heads", type=positive_int, default=32,
                       help="attention heads (head_dim 128; at most 4 on a CPU)")
    bench.add_argument("--models", nargs="+", default=None,
                       help="shipped config names (e.g. dream-v0-instruct-7b) or tiny-llada / tiny-sdar / tiny-dream / "
                            "tiny-llada2 (GPU llada-8b-instruct sdar-8b-chat; CPU tiny-llada tiny-sdar)")
    bench.add_argument("--methods", nargs="+", default=None, metavar="NAME",
                       help="the generate section's methods (dense, sparsed, mage, ...; default: dense and every "
                            "method of each model's family)")
    bench.add_argument("--context", type=positive_int, default=None, help="prompt + new tokens (GPU 8192; CPU 256)")
    bench.add_argument("--new-tokens", type=positive_int, default=None, help="generated tokens (GPU 128; CPU 32)")
    bench.add_argument("--layers", type=positive_int, default=None,
                       help="use only this many layers (faster, same per-layer shapes)")
    bench.add_argument("--repeats", type=positive_int, default=5, help="timing repeats of the attention section")
    bench.add_argument("--out", default="bench_results", help="output directory (default ./bench_results)")
    bench.add_argument("--progress", action="store_true", help="progress bars of the generate loops")
    bench.set_defaults(fn=run)


def run(args) -> None:
    from dllm_jax.bench import run as bench

    checked_out_dir(Path(args.out))  # before the run, which may take minutes
    path = bench(out=Path(args.out), sections=args.sections, lengths=args.lengths, densities=args.densities,
                 models=args.models, context=args.context, new_tokens=args.new_tokens, layers=args.layers,
                 heads=args.heads, dtype=args.dtype, repeats=args.repeats, progress=args.progress,
                 methods=args.methods)
    print(f"wrote {path} and {path.with_suffix('.json')}", file=sys.stderr)
