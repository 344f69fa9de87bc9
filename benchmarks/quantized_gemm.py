"""The GEMMs of quantized weights alone: the four projections of every SDAR-8B layer (qkv, o, gate/up, down;
`--layers` of them, one jitted program) at several row counts, bf16 against int8 and fp8 through
`dllm_jax.quantize.linear`, each quantized mode through every GEMM `linear` has (`gemm`: XLA's weight-only, W8A8)
and through the Pallas weight-only kernel `linear` does not use (`pallas_kernels.quantized_matmul`, where it takes
the rows), so that "auto"'s choices stand on a measurement. Weight bytes read / time against the copy bandwidth of
the same process.

    PYTHONPATH=. python -m benchmarks.quantized_gemm --out benchmarks/results
    python -m benchmarks.quantized_gemm --layers 2 --rows 4 --out /tmp/q      # CPU check
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.sections.bandwidth import copy_bandwidth
from dllm_jax.bench.results import write_results
from dllm_jax.bench.tables import markdown_table
from dllm_jax.bench.timing import time_calls
from dllm_jax.config import shipped_config
from dllm_jax.quantize import W8A8_MIN_ROWS, linear, quantize_weight, scale_name
from pallas_kernels.quantized_matmul import MAX_ROWS, X_DTYPES, fits, quantized_matmul

# the kernel's tiles, the first that divides a weight's sizes (a sweep of this benchmark on an H100)
GEMV_TILES = (dict(block_n=32, block_k=256, split_k=2), dict(block_n=16, block_k=128, split_k=1),
              dict(block_n=16, block_k=16, split_k=1))


def layer_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each fused projection of one layer (the inference layout of dllm_jax.models.layers)."""
    d, i, hd = config.hidden_size, config.intermediate_size, config.head_dim
    return {"qkv_proj": (d, (config.num_heads + 2 * config.num_kv_heads) * hd), "o_proj": (config.num_heads * hd, d),
            "gate_up_proj": (d, 2 * i), "down_proj": (i, d)}


def weights(config, layers: int, mode: str | None) -> tuple:
    """Random weights of `layers` layers: bf16 [in, out], or quantized values [out, in] with their scales."""
    out = []
    key = jax.random.key(0)
    for _ in range(layers):
        layer = {}
        for name, (n_in, n_out) in layer_shapes(config).items():
            key, sub = jax.random.split(key)
            w = jax.random.normal(sub, (n_in, n_out), jnp.float32) * 0.02
            if mode is None:
                layer[name] = w.astype(jnp.bfloat16)
            else:
                values, scale = quantize_weight(w, (0,), mode)
                layer[name], layer[scale_name(name)] = values.T, scale
        out.append(layer)
    return tuple(out)


def gemv_tiles(x, w) -> dict | None:
    """The kernel's tiles for x @ w.T, or None where it does not take them."""
    if w.ndim != 2 or jnp.dtype(x.dtype) not in X_DTYPES or x.size // x.shape[-1] > MAX_ROWS:
        return None
    n, k = w.shape
    for tiles in GEMV_TILES:
        if fits((1, k), (n, k), block_n=tiles["block_n"], block_k=tiles["block_k"], split_k=tiles["split_k"]):
            return tiles
    return None


def kernel_linear(x, p: dict, name: str):
    """`linear`'s weight-only GEMM of a quantized weight through the Pallas kernel instead of XLA."""
    w, scale = p[name], p[scale_name(name)]
    tiles = gemv_tiles(x, w)
    if tiles is None:
        raise ValueError(f"the quantized matmul kernel does not take x {x.shape} ({x.dtype}) @ w {w.shape}.T")
    return quantized_matmul(x.reshape(-1, x.shape[-1]), w, scale, **tiles).reshape(*x.shape[:-1], w.shape[0])


def stack(layers, x, *, attention_width: int, gemm: str):
    """Each layer's four GEMMs in sequence (the queries' columns of qkv into o, the MLP's SwiGLU between gate/up
    and down, residual adds); gemm "pallas" runs the kernel, any other `linear` with it."""
    def mm(x, p, name):
        return kernel_linear(x, p, name) if gemm == "pallas" else linear(x, p, name, gemm=gemm)

    for p in layers:
        x = x + mm(mm(x, p, "qkv_proj")[:, :attention_width], p, "o_proj")
        both = mm(x, p, "gate_up_proj")
        x = x + mm(jax.nn.silu(both[:, 0::2]) * both[:, 1::2], p, "down_proj")
    return x


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="sdar-8b-chat", help="a shipped config whose projection shapes to use")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    config = shipped_config(args.model)
    device = jax.devices()[0].device_kind
    copy = copy_bandwidth(2 << 30 if jax.default_backend() == "gpu" else 16 << 20)
    meta = dict(benchmark="quantized_gemm" + args.tag, device=device, jax=jax.__version__,
                date=datetime.date.today().isoformat(), model=args.model, layers=args.layers,
                copy_tb_s=copy["copy_tb_s"], w8a8_min_rows=W8A8_MIN_ROWS)
    variants = [("bf16", None, "auto")] + [(f"{mode} {gemm}", mode, gemm) for mode in ("int8", "fp8")
                                           for gemm in ("xla", "pallas", "w8a8", "auto")]
    rows = []
    for label, mode, gemm in variants:
        params = weights(config, args.layers, mode)
        nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
        width = config.num_heads * config.head_dim
        fn = jax.jit(lambda params, x, gemm=gemm: stack(params, x, attention_width=width, gemm=gemm))
        for n in args.rows:
            if gemm == "pallas" and (n > MAX_ROWS or jax.default_backend() != "gpu"):  # Triton: GPUs only
                continue
            x = jax.random.normal(jax.random.key(n), (n, config.hidden_size), jnp.bfloat16)
            ms = time_calls(fn, params, x) * 1e3
            rows.append(dict(variant=label, rows=n, ms=ms, weight_bytes=nbytes, tb_s=nbytes / ms / 1e9,
                             fraction_of_copy=nbytes / ms / 1e9 / copy["copy_tb_s"]))
            print(rows[-1], flush=True)
        del params
    bf16 = {r["rows"]: r["ms"] for r in rows if r["variant"] == "bf16"}
    cells = [[r["variant"], r["rows"], f"{r['ms']:.2f} ms", f"{r['weight_bytes'] / 1e9:.2f} GB", f"{r['tb_s']:.2f}",
              f"{r['fraction_of_copy']:.0%}", f"{bf16[r['rows']] / r['ms']:.2f}x"] for r in rows]
    lines = [f"# Quantized GEMMs — {device}, jax {jax.__version__}, {meta['date']}", "",
             f"The four projections of {args.layers} {args.model} layers in one jitted program; copy bandwidth "
             f"{copy['copy_tb_s']:.2f} TB/s in the same process. `auto` is what `linear` runs: XLA's weight-only "
             f"GEMM below {W8A8_MIN_ROWS} rows, W8A8 from there (the Pallas kernel takes up to {MAX_ROWS} rows and "
             "is not chosen).", "",
             *markdown_table(["variant", "rows", "time", "weights", "TB/s", "of copy", "vs bf16"], cells)]
    write_results(args.out, meta, rows, lines)


if __name__ == "__main__":
    main()
