"""`dllm-jax convert`: an HF safetensors checkpoint to Orbax."""

from __future__ import annotations

import time


def add_parser(subparsers) -> None:
    convert = subparsers.add_parser(
        "convert", help="convert an HF safetensors checkpoint to Orbax",
        description="Validates every tensor of an HF checkpoint against its config.json, then streams it into an "
                    "Orbax checkpoint (tokenizer files travel along).")
    convert.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                         help="stored parameter dtype (default: the source checkpoint's)")
    convert.add_argument("--quantize", default=None, choices=["int8", "fp8"],
                         help="store the linear layers' weights quantized (a float32 scale per output channel; the "
                              "rest in bfloat16): half the bytes of bf16, lossy by request")
    convert.add_argument("hf_dir", help="directory with config.json and *.safetensors")
    convert.add_argument("out_dir", help="output directory (created; must not exist)")
    convert.add_argument("--overwrite", action="store_true", help="replace an existing out_dir")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(fn=run)


def run(args) -> None:
    from dllm_jax.checkpoint import convert_hf_checkpoint

    start = time.perf_counter()
    convert_hf_checkpoint(args.hf_dir, args.out_dir, dtype=args.dtype, quantize=args.quantize, overwrite=args.overwrite,
                          progress=not args.quiet)
    stored = args.dtype or "the source's dtype"
    if args.quantize:
        stored = f"{args.quantize} linear weights, the rest bfloat16"
    print(f"converted {args.hf_dir} -> {args.out_dir} ({stored}) in {time.perf_counter() - start:.1f} s")
