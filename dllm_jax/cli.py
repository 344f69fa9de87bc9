"""`dllm-jax` command line: convert | generate | analyze | bench | demo (`--help` on each)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def cmd_convert(args) -> None:
    from dllm_jax.checkpoint import convert_hf_checkpoint

    start = time.perf_counter()
    convert_hf_checkpoint(args.hf_dir, args.out_dir, dtype=args.dtype, overwrite=args.overwrite,
                          progress=not args.quiet)
    print(f"converted {args.hf_dir} -> {args.out_dir} ({args.dtype}) in {time.perf_counter() - start:.1f} s")


def cmd_generate(args) -> None:
    """Loads a model and its tokenizer, generates an answer to --prompt, prints it with timings."""
    from dllm_jax.generate import generate

    method = checked_method(args)  # flag and family errors before the slow loading
    model, tokenizer, ids, options = load_request(args)
    start = time.perf_counter()
    out = np.asarray(generate(model, ids, seed=args.seed, progress=args.progress, method=method, **options))
    elapsed = time.perf_counter() - start
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip=(model.config.mask_token_id,))
    print(answer)
    print(f"[{type(model).__name__}: {ids.shape[1]} prompt tokens, {out.shape[1] - ids.shape[1]} generated, "
          f"{elapsed:.2f} s including compilation]", file=sys.stderr)


def load_request(args):
    """(model, tokenizer, prompt ids, generate options) of the shared --model / --prompt / sampling flags."""
    from dllm_jax.checkpoint import load_model
    from dllm_jax.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer(args.model)
    model = load_model(args.model, dtype=args.dtype)
    ids = tokenizer.encode(args.prompt, chat=not args.raw)
    return model, tokenizer, ids, sampling_options(args, model.config)


def sampling_options(args, config) -> dict:
    """generate's options for the model family of `config` from the shared sampling flags."""
    from dllm_jax.config import LLaDAConfig

    if isinstance(config, LLaDAConfig):
        return dict(gen_length=args.gen_length, steps=args.steps or args.gen_length,
                    block_length=args.block_length or args.gen_length, temperature=args.temperature,
                    cfg_scale=args.cfg_scale, remasking=args.remasking or "low_confidence")
    if args.block_length is not None or args.cfg_scale:
        raise ValueError("--block-length and --cfg-scale are LLaDA options: SDAR's block length comes from its "
                         "config.json (block_size) and its sampler has no classifier-free guidance")
    return dict(max_new_tokens=args.gen_length, denoising_steps=args.steps or config.block_size,
                remasking=args.remasking or "low_confidence_dynamic", confidence_threshold=args.confidence_threshold,
                temperature=args.temperature if args.temperature > 0 else 1.0, top_k=args.top_k, top_p=args.top_p)


def checked_method(args):
    """The --method policy, checked against the family named by the checkpoint's config.json."""
    from dllm_jax.attention.methods import check_family
    from dllm_jax.config import LLaDAConfig, read_hf_config

    method = method_from_args(args)
    _, config = read_hf_config(args.model)
    check_family(method, "LLaDA" if isinstance(config, LLaDAConfig) else "SDAR")
    return method


def none_or(kind):
    """argparse type: `kind`, or the word 'none' for None."""
    def parse(text: str):
        if text.lower() == "none":
            return None
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__} or 'none', got {text!r}") from None
    parse.__name__ = f"{kind.__name__} or 'none'"
    return parse


# method parameter -> (flag, argparse type, help). One table for generate and analyze; which flags a
# method takes comes from dllm_jax.attention.methods.parameters.
METHOD_FLAGS = {
    "skip": ("--skip", float, "SparseD (0.2) / SpargeAttn (0): fraction of the steps run dense first"),
    "select": ("--select", float, "SparseD: fraction of key blocks kept per query block (0.3)"),
    "block_size": ("--sparse-block", int, "SparseD: pattern block size (128)"),
    "sparsity": ("--sparsity", float, "PulseCol: fraction of keys dropped per query group (0.8)"),
    "group_size": ("--group-size", int, "PulseCol: queries sharing one column set (32)"),
    "eta": ("--eta", float, "PulseCol: refresh-window ratio (0.3)"),
    "refreshes": ("--refreshes", int, "PulseCol: refresh budget (16)"),
    "k": ("--mage-k", int, "MAGE: prefix keys kept per KV head (512)"),
    "exact_layers": ("--exact-layers", int, "MAGE: first layers kept exact (2)"),
    "tau": ("--tau", none_or(int), "FlashBlock: refresh after this many unmasked tokens (2); 0 = always "
            "refresh, none = only at each block's first step"),
    "simthreshd1": ("--simthreshd1", float, "SpargeAttn: block self-similarity threshold (-0.1)"),
    "cdfthreshd": ("--cdfthreshd", float, "SpargeAttn: TopCdf threshold (instead of --topk)"),
    "topk": ("--topk", float, "SpargeAttn: fraction of key blocks kept (0.5 when no --cdfthreshd)"),
    "pvthreshd": ("--pvthreshd", none_or(float), "SpargeAttn: PV-skip threshold (50); none = no filter"),
    "calibration": ("--calibration", str, "SpargeAttn: per-layer, per-head values (JSON from "
                    "dllm_jax.attention.sparge.save_calibration)"),
}


def method_from_args(args):
    """The --method policy (None = dense); unset method flags keep the method's defaults."""
    from dllm_jax.attention.methods import make_method, parameters

    given = {param: getattr(args, param) for param in METHOD_FLAGS if hasattr(args, param)}
    if args.method == "dense":
        if given:
            flags = sorted(METHOD_FLAGS[p][0] for p in given)
            raise ValueError(f"{', '.join(flags)} {'needs' if len(flags) == 1 else 'need'} a sparse --method "
                             "(dense attention has no parameters)")
        return None
    valid = parameters(args.method)
    stray = sorted(METHOD_FLAGS[p][0] for p in given if p not in valid)
    if stray:
        raise ValueError(f"{', '.join(stray)} {'does' if len(stray) == 1 else 'do'} not apply to --method "
                         f"{args.method}; its flags: "
                         + ", ".join(METHOD_FLAGS[p][0] for p in METHOD_FLAGS if p in valid))
    return make_method(args.method, **given)


def cmd_analyze(args) -> None:
    """Generates under a pattern probe and writes the diagnostics plots and a summary."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    from dllm_jax.analysis import analyze, analyze_blocks, plot_error, plot_head_patterns, plot_jaccard, plot_recall
    from dllm_jax.models import LLaDA

    method = checked_method(args)
    if method is None:
        raise ValueError("analyze compares a sparse --method with dense attention: pass one")
    model, tokenizer, ids, options = load_request(args)
    start = time.perf_counter()
    if isinstance(model, LLaDA):
        report = analyze(model, ids, method, seed=args.seed, **options)
        plots = {"recall": plot_recall, "jaccard": plot_jaccard, "error": plot_error}
    else:
        report = analyze_blocks(model, ids, method, seed=args.seed, **options)
        plots = {"recall": plot_recall, "error": plot_error}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, plot in plots.items():
        ax = plot(report)
        ax.figure.savefig(out / f"{name}.png", dpi=120, bbox_inches="tight")
        plt.close(ax.figure)
        written.append(out / f"{name}.png")
    if isinstance(model, LLaDA):
        layer = model.config.num_layers - 1 if args.layer is None else args.layer
        fig = plot_head_patterns(report, layer=layer)
        fig.savefig(out / "head_patterns.png", dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(out / "head_patterns.png")
    summary = dict(method=repr(method), prompt_tokens=int(ids.shape[1]), options=options,
                   **{k: None if v != v else v for k, v in report.summary().items()})  # NaN -> null (valid JSON)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    print(f"wrote {', '.join(str(p) for p in written)} and {out / 'summary.json'} "
          f"({time.perf_counter() - start:.1f} s)", file=sys.stderr)


def cmd_bench(args) -> None:
    from dllm_jax.bench import run

    path = run(out=Path(args.out), sections=args.sections, lengths=args.lengths, densities=args.densities,
               models=args.models, context=args.context, new_tokens=args.new_tokens, layers=args.layers,
               heads=args.heads, dtype=args.dtype, repeats=args.repeats, progress=args.progress)
    print(f"wrote {path} and {path.with_suffix('.json')}", file=sys.stderr)


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn().block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def cmd_demo(args) -> None:
    """Tiny random LLaDA checkpoint in HF format -> convert -> load -> jitted forward, timed; then SDAR."""
    import jax
    from flax import nnx

    from dllm_jax.checkpoint import convert_hf_checkpoint, load_model
    from dllm_jax.testing import tiny_llada_config, write_hf_checkpoint

    config = tiny_llada_config(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                               num_kv_heads=args.heads, intermediate_size=3 * args.hidden,
                               vocab_size=1024, tokenizer_vocab_size=1000, mask_token_id=999,
                               eos_token_id=998, pad_token_id=998)
    print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind})")
    print(f"config: {config}")
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, out_dir = Path(tmp) / "hf", Path(tmp) / "converted"
        write_hf_checkpoint(hf_dir, config, dtype="bfloat16", shards=2)
        print(f"wrote a random HF-format LLaDA checkpoint (2 safetensors shards) to {hf_dir}")
        start = time.perf_counter()
        convert_hf_checkpoint(hf_dir, out_dir, progress=False)
        print(f"converted to Orbax in {time.perf_counter() - start:.2f} s")
        model = load_model(out_dir, dtype=args.dtype)

    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.tokenizer_vocab_size, (args.batch, args.seq_len)).astype(np.int32)
    ids[:, -args.seq_len // 4:] = config.mask_token_id  # a masked answer region, as in generation
    forward = nnx.jit(lambda m, x: m(x))
    start = time.perf_counter()
    logits = forward(model, ids).block_until_ready()
    compile_s = time.perf_counter() - start
    step_s = median_time(lambda: forward(model, ids), args.repeats)
    predicted = np.asarray(logits.argmax(-1))
    print(f"forward [batch {args.batch}, length {args.seq_len}] -> logits {tuple(logits.shape)} {logits.dtype}")
    print(f"first call (compile + run): {compile_s:.2f} s; median of {args.repeats}: {step_s * 1e3:.1f} ms")
    print(f"argmax at the first masked position of row 0: token {predicted[0, -args.seq_len // 4]}")
    demo_sdar(args)


def demo_sdar(args) -> None:
    """Tiny random SDAR checkpoint -> load -> prefill a prompt into the KV cache -> timed block steps."""
    from dllm_jax.checkpoint import load_model
    from dllm_jax.testing import tiny_sdar_config, write_hf_checkpoint

    config = tiny_sdar_config(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                              num_kv_heads=max(1, args.heads // 2), head_dim=args.hidden // args.heads,
                              intermediate_size=3 * args.hidden)
    with tempfile.TemporaryDirectory() as tmp:
        write_hf_checkpoint(Path(tmp), config, dtype="bfloat16")
        model = load_model(tmp, dtype=args.dtype, progress=False)
    bs = config.block_size
    prompt_len = (args.seq_len // bs) * bs
    prompt = np.random.default_rng(1).integers(0, config.mask_token_id, (1, prompt_len)).astype(np.int32)
    cache = model.prefill(prompt, model.init_cache(1, prompt_len + 2 * bs))
    block = np.full((1, bs), config.mask_token_id, np.int32)
    logits, _ = model.block_step(block, cache)  # compile
    step_s = median_time(lambda: model.block_step(block, cache)[0], args.repeats)
    _, cache = model.block_step(block, cache, commit=True)
    print(f"SDAR (block {bs}): prefilled {prompt_len} prompt tokens into a static KV cache of "
          f"{cache.max_length}; one {bs}-token block step: {step_s * 1e3:.2f} ms (median of {args.repeats}); "
          f"after commit the cache holds {int(cache.length)} positions")


def build_parser() -> argparse.ArgumentParser:
    from dllm_jax.attention.methods import METHODS

    parser = argparse.ArgumentParser(prog="dllm-jax", description="Diffusion-LLM inference in JAX: LLaDA and SDAR "
                                     "with sparse-attention methods.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{convert,generate,analyze,bench,demo}")

    dtype = argparse.ArgumentParser(add_help=False)
    dtype.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                       help="parameter and compute dtype (default bfloat16)")

    sampling = argparse.ArgumentParser(add_help=False)
    sampling.add_argument("--model", required=True, help="converted or HF checkpoint directory (with tokenizer.json)")
    sampling.add_argument("--prompt", required=True)
    sampling.add_argument("--raw", action="store_true", help="encode the prompt as is, without the chat template")
    sampling.add_argument("--gen-length", type=int, default=128, help="LLaDA gen_length / SDAR max_new_tokens (128)")
    sampling.add_argument("--steps", type=int, default=None,
                          help="LLaDA steps (default gen-length) / SDAR denoising_steps (default block size)")
    sampling.add_argument("--block-length", type=int, default=None, help="LLaDA block_length (default gen-length)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="LLaDA default 0; SDAR uses 1 when 0")
    sampling.add_argument("--cfg-scale", type=float, default=0.0, help="LLaDA classifier-free guidance (0)")
    sampling.add_argument("--remasking", default=None, help="LLaDA: low_confidence|random; SDAR: "
                          "low_confidence_dynamic|low_confidence_static|sequential")
    sampling.add_argument("--confidence-threshold", type=float, default=0.85, help="SDAR dynamic remasking (0.85)")
    sampling.add_argument("--top-k", type=int, default=0, help="SDAR top-k (0: off)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="SDAR top-p (1: off)")
    sampling.add_argument("--seed", type=int, default=0)

    methods = argparse.ArgumentParser(add_help=False)
    group = methods.add_argument_group("sparse attention (unset parameters keep the method's defaults)")
    group.add_argument("--method", default="dense", choices=["dense", *METHODS],
                       help="sparsed, pulsecol, sparge: LLaDA; mage, flashblock, flashblock+mage: SDAR (default dense)")
    for param, (flag, kind, text) in METHOD_FLAGS.items():
        metavar = {int: "N", float: "X", str: "FILE"}.get(kind, "N|none" if param == "tau" else "X|none")
        group.add_argument(flag, dest=param, type=kind, default=argparse.SUPPRESS, metavar=metavar, help=text)

    convert = sub.add_parser("convert", parents=[dtype], help="convert an HF safetensors checkpoint to Orbax",
                             description="Validates every tensor of an HF checkpoint against its config.json, then "
                                         "streams it into an Orbax checkpoint (tokenizer files travel along).")
    convert.add_argument("hf_dir", help="directory with config.json and *.safetensors")
    convert.add_argument("out_dir", help="output directory (created; must not exist)")
    convert.add_argument("--overwrite", action="store_true", help="replace an existing out_dir")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(fn=cmd_convert)

    gen = sub.add_parser("generate", parents=[sampling, dtype, methods],
                         help="generate an answer with a checkpoint's model and tokenizer",
                         description="Encodes --prompt with the checkpoint's chat template, generates with the "
                                     "official sampler of its family (one compiled loop) and prints the answer.")
    gen.add_argument("--progress", action="store_true", help="progress bar from inside the compiled loop")
    gen.set_defaults(fn=cmd_generate)

    analyze = sub.add_parser("analyze", parents=[sampling, dtype, methods],
                             help="pattern diagnostics of a sparse method for a prompt (PNG plots)",
                             description="Generates with --method under a probe that also computes dense attention "
                                         "and writes to --out: recall.png (kept pattern vs the per-step top-k "
                                         "oracle), error.png (relative L1 vs dense), for LLaDA jaccard.png (oracle "
                                         "stability over steps) and head_patterns.png (per-head heat maps), and "
                                         "summary.json. Builds [B, H, N, N] arrays: for short prompts.")
    analyze.add_argument("--out", default="analysis", help="output directory (default ./analysis)")
    analyze.add_argument("--layer", type=int, default=None, help="layer of the per-head heat maps (default last)")
    analyze.set_defaults(fn=cmd_analyze)

    bench = sub.add_parser("bench", parents=[dtype], help="time attention kernels and generation on this device",
                           description="Attention kernels (dense cuDNN/XLA vs our flash, block- and column-sparse "
                                       "kernels) and the generate loop per method with random weights; writes "
                                       "bench_<device>_<date>.json and .md to --out. Defaults fit the device: "
                                       "LLaDA-8B / SDAR-8B dims on a GPU, tiny models on a CPU.")
    bench.add_argument("--sections", nargs="+", default=["attention", "generate"], choices=["attention", "generate"])
    bench.add_argument("--lengths", type=int, nargs="+", default=None,
                       help="attention sequence lengths (GPU 4096 16384; CPU 256 512)")
    bench.add_argument("--densities", type=float, nargs="+", default=[0.5, 0.3, 0.1],
                       help="fractions of key blocks / columns kept by the sparse kernels")
    bench.add_argument("--heads", type=int, default=32, help="attention heads (head_dim 128; at most 4 on a CPU)")
    bench.add_argument("--models", nargs="+", default=None,
                       help="shipped config names or tiny-llada / tiny-sdar (GPU llada-8b-instruct sdar-8b-chat; "
                            "CPU tiny-llada tiny-sdar)")
    bench.add_argument("--context", type=int, default=None, help="prompt + new tokens (GPU 8192; CPU 256)")
    bench.add_argument("--new-tokens", type=int, default=None, help="generated tokens (GPU 128; CPU 32)")
    bench.add_argument("--layers", type=int, default=None, help="use only this many layers (faster, same per-layer shapes)")
    bench.add_argument("--repeats", type=int, default=5, help="timing repeats of the attention section")
    bench.add_argument("--out", default="bench_results", help="output directory (default ./bench_results)")
    bench.add_argument("--progress", action="store_true", help="progress bars of the generate loops")
    bench.set_defaults(fn=cmd_bench)

    demo = sub.add_parser("demo", parents=[dtype], help="build, convert, load and time tiny random LLaDA and SDAR models",
                          description="The embedded default job: a random HF-format checkpoint is written, converted, "
                                      "loaded and timed (no weights needed).")
    demo.add_argument("--hidden", type=int, default=256)
    demo.add_argument("--layers", type=int, default=4)
    demo.add_argument("--heads", type=int, default=4)
    demo.add_argument("--batch", type=int, default=2)
    demo.add_argument("--seq-len", type=int, default=256)
    demo.add_argument("--repeats", type=int, default=5)
    demo.set_defaults(fn=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
