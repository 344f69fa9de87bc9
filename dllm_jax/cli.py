"""`dllm-jax` command line: convert | generate | demo."""

from __future__ import annotations

import argparse
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
    from dllm_jax.checkpoint import load_model
    from dllm_jax.generate import generate
    from dllm_jax.models import LLaDA
    from dllm_jax.tokenizer import ChatTokenizer

    method = method_from_args(args)  # flag errors before the slow loading
    tokenizer = ChatTokenizer(args.model)
    model = load_model(args.model, dtype=args.dtype)
    ids = tokenizer.encode(args.prompt, chat=not args.raw)
    if isinstance(model, LLaDA):
        options = dict(gen_length=args.gen_length, steps=args.steps or args.gen_length,
                       block_length=args.block_length or args.gen_length, temperature=args.temperature,
                       cfg_scale=args.cfg_scale, remasking=args.remasking or "low_confidence")
    else:
        options = dict(max_new_tokens=args.gen_length, denoising_steps=args.steps or model.config.block_size,
                       remasking=args.remasking or "low_confidence_dynamic",
                       confidence_threshold=args.confidence_threshold,
                       temperature=args.temperature if args.temperature > 0 else 1.0, top_k=args.top_k,
                       top_p=args.top_p)
    start = time.perf_counter()
    out = np.asarray(generate(model, ids, seed=args.seed, progress=args.progress, method=method,
                              **options))
    elapsed = time.perf_counter() - start
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip=(model.config.mask_token_id,))
    print(answer)
    print(f"[{type(model).__name__}: {ids.shape[1]} prompt tokens, {out.shape[1] - ids.shape[1]} generated, "
          f"{elapsed:.2f} s including compilation]", file=sys.stderr)


def method_from_args(args):
    """The --method config (None = dense); unset method flags keep each method's defaults."""
    from dllm_jax.attention.flashblock import FlashBlock
    from dllm_jax.attention.mage import MAGE
    from dllm_jax.attention.pulsecol import PulseCol
    from dllm_jax.attention.sparge import SpargeAttn
    from dllm_jax.attention.sparsed import SparseD

    given = {name: value for name, value in (("skip", args.skip), ("select", args.select),
                                              ("block_size", args.sparse_block), ("sparsity", args.sparsity),
                                              ("group_size", args.group_size), ("eta", args.eta),
                                              ("refreshes", args.refreshes), ("k", args.mage_k),
                                              ("exact_layers", args.exact_layers), ("tau", args.tau),
                                              ("simthreshd1", args.simthreshd1), ("cdfthreshd", args.cdfthreshd),
                                              ("topk", args.topk), ("pvthreshd", args.pvthreshd),
                                              ("calibration", args.calibration))
             if value is not None}
    fields = {"sparsed": {"skip", "select", "block_size"}, "pulsecol": {"sparsity", "group_size", "eta", "refreshes"},
              "mage": {"k", "exact_layers"}, "flashblock": {"tau"}, "flashblock+mage": {"tau", "k", "exact_layers"},
              "sparge": {"simthreshd1", "cdfthreshd", "topk", "pvthreshd", "calibration", "skip"}}
    if args.method == "dense":
        if given:
            raise SystemExit(f"error: {sorted(given)} need --method {', '.join(sorted(fields))}")
        return None
    stray = set(given) - fields[args.method]
    if stray:
        raise SystemExit(f"error: {sorted(stray)} do not apply to --method {args.method}")
    if args.method.startswith("flashblock"):
        tau = given.pop("tau", "2")
        if tau != "none" and not tau.isdigit():
            raise SystemExit(f"error: --tau takes an integer >= 0 or 'none', got {tau!r}")
        tau = None if tau == "none" else int(tau)
        inner = MAGE(**given) if args.method == "flashblock+mage" else None
        return FlashBlock(tau=tau, inner=inner)
    if args.method == "sparge":
        if given.get("pvthreshd") == "none":
            given["pvthreshd"] = None
        elif "pvthreshd" in given:
            try:
                given["pvthreshd"] = float(given["pvthreshd"])
            except ValueError:
                raise SystemExit(f"error: --pvthreshd takes a number or 'none', got {given['pvthreshd']!r}") from None
        calibration = given.pop("calibration", None)
        return SpargeAttn.from_calibration(calibration, **given) if calibration else SpargeAttn(**given)
    return {"sparsed": SparseD, "pulsecol": PulseCol, "mage": MAGE}[args.method](**given)


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
    parser = argparse.ArgumentParser(prog="dllm-jax", description="Diffusion-LLM inference in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    convert = sub.add_parser("convert", help="convert an HF safetensors checkpoint to Orbax")
    convert.add_argument("hf_dir", help="directory with config.json and *.safetensors")
    convert.add_argument("out_dir", help="output directory (created; must not exist)")
    convert.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    convert.add_argument("--overwrite", action="store_true", help="replace an existing out_dir")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(fn=cmd_convert)

    gen = sub.add_parser("generate", help="generate an answer with a checkpoint's model and tokenizer")
    gen.add_argument("--model", required=True, help="converted or HF checkpoint directory (with tokenizer.json)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", action="store_true", help="encode the prompt as is, without the chat template")
    gen.add_argument("--gen-length", type=int, default=128, help="LLaDA gen_length / SDAR max_new_tokens")
    gen.add_argument("--steps", type=int, default=None,
                     help="LLaDA steps (default gen-length) / SDAR denoising_steps (default block size)")
    gen.add_argument("--block-length", type=int, default=None, help="LLaDA block_length (default gen-length)")
    gen.add_argument("--temperature", type=float, default=0.0, help="LLaDA default 0; SDAR uses 1 when 0")
    gen.add_argument("--cfg-scale", type=float, default=0.0, help="LLaDA classifier-free guidance")
    gen.add_argument("--remasking", default=None, help="LLaDA: low_confidence|random; SDAR: "
                     "low_confidence_dynamic|low_confidence_static|sequential")
    gen.add_argument("--confidence-threshold", type=float, default=0.85, help="SDAR dynamic remasking")
    gen.add_argument("--top-k", type=int, default=0, help="SDAR top-k (0: off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="SDAR top-p")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    gen.add_argument("--progress", action="store_true", help="tqdm bar from inside the compiled loop")
    gen.add_argument("--method", default="dense",
                     choices=["dense", "sparsed", "pulsecol", "sparge", "mage", "flashblock", "flashblock+mage"],
                     help="sparse attention: sparsed / pulsecol / sparge (LLaDA); mage, flashblock, flashblock+mage "
                          "(SDAR); default dense")
    gen.add_argument("--skip", type=float, default=None,
                     help="SparseD: dense fraction of the steps (0.2); SpargeAttn: the same (0)")
    gen.add_argument("--select", type=float, default=None, help="SparseD: fraction of key blocks kept (0.3)")
    gen.add_argument("--sparse-block", type=int, default=None, help="SparseD: pattern block size (128)")
    gen.add_argument("--sparsity", type=float, default=None, help="PulseCol: fraction of keys dropped (0.8)")
    gen.add_argument("--group-size", type=int, default=None, help="PulseCol: queries per group (32)")
    gen.add_argument("--eta", type=float, default=None, help="PulseCol: refresh-window ratio (0.3)")
    gen.add_argument("--refreshes", type=int, default=None, help="PulseCol: refresh budget (16)")
    gen.add_argument("--mage-k", type=int, default=None, help="MAGE: prefix keys kept per KV head (512)")
    gen.add_argument("--exact-layers", type=int, default=None, help="MAGE: first layers kept exact (2)")
    gen.add_argument("--tau", default=None, help="FlashBlock: refresh after this many unmasked tokens (2); "
                     "0 = always refresh, none = only at each block's first step")
    gen.add_argument("--simthreshd1", type=float, default=None, help="SpargeAttn: block self-similarity threshold (-0.1)")
    gen.add_argument("--cdfthreshd", type=float, default=None, help="SpargeAttn: TopCdf threshold (instead of --topk)")
    gen.add_argument("--topk", type=float, default=None, help="SpargeAttn: fraction of key blocks kept (0.5)")
    gen.add_argument("--pvthreshd", default=None, help="SpargeAttn: PV-skip threshold (50), 'none' = no filter")
    gen.add_argument("--calibration", default=None,
                     help="SpargeAttn: per-layer, per-head values from dllm_jax.attention.sparge.save_calibration")
    gen.set_defaults(fn=cmd_generate)

    demo = sub.add_parser("demo", help="build, convert, load and time tiny random LLaDA and SDAR models")
    demo.add_argument("--hidden", type=int, default=256)
    demo.add_argument("--layers", type=int, default=4)
    demo.add_argument("--heads", type=int, default=4)
    demo.add_argument("--batch", type=int, default=2)
    demo.add_argument("--seq-len", type=int, default=256)
    demo.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
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
