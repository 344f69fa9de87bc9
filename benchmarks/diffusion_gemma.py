"""DiffusionGemma-26B-A4B at its real shapes (random bf16 weights): generation tokens/s of this port against
transformers' own `DiffusionGemmaForBlockDiffusion.generate`, on the same GPU in the same run, same options.

The shapes are those of `google/diffusiongemma-26B-A4B-it`'s text model as public copies of its config.json give
them (`TEXT_26B_A4B`: 30 layers, 5 sliding (window 1024, head_dim 256, 8 KV heads) to 1 global (head_dim 512, 2 KV
heads), hidden 2816, a dense MLP of 2112 beside 128 experts of 704 (top 8), vocabulary 262144); the weights are
random (no hub access), so the timed work is exact but the tokens mean nothing. Both sides run the sampler's
defaults (entropy bound 0.1, t 0.8 -> 0.4, adaptive stopping on) with `--steps` denoising steps per 256-token
canvas: random weights are never confident, so every canvas runs all its steps on both sides.

Each point (`--points batch:prompt:new`) is timed on its second call (the first compiles): transformers in a
child process first (torch and JAX cannot both hold 26B of weights on an 80 GB card), then this port. tokens/s
counts the generated tokens returned (a row may stop at a random EOS). `--quantize int8|fp8` runs this port on
quantized weights (drawn, then quantized leaf by leaf) against transformers in bf16; `--profile` adds one call's GPU
kernels by time (`dllm_jax.bench.kernel_profile`; the trace in a temporary folder). `--mage-contexts N ...` times
one canvas's `--steps` forwards at batch 1 against a cache of N positions (random keys and values, updated in place
as in the sampler's loop), dense and with MAGE(k=`--mage-k`) on the global layers (`decode_mage`). Results:
<out>/diffusion_gemma<tag>_<device>_<date>.{json,md}, rewritten after every row.

    PYTHONPATH=. python -m benchmarks.diffusion_gemma --out benchmarks/results            # one GPU
    PYTHONPATH=. python -m benchmarks.diffusion_gemma --points --no-transformers --quantize fp8 \
        --mage-contexts 32768 65536 131072 --tag _mage_fp8                                 # MAGE on an 80 GB card
    PYTHONPATH=. python -m benchmarks.diffusion_gemma --layers 2 --points 1:64:256 --steps 2 --small  # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

# 52 GB of bf16 weights: JAX's default pool (75% of the card) would leave an 80 GB card too little for the loop
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

# vLLM's published figure for the same model and workload (its blog, FP8 weights, one H100), quoted as reported
VLLM_REPORTED = "vLLM (as reported, FP8, one H100): 895 output tokens/s at batch 1, 4k prompt, 512 new, 16 steps"

TEXT_26B_A4B = dict(
    vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
    num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2, sliding_window=1024,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5, num_experts=128, top_k_experts=8,
    moe_intermediate_size=704, final_logit_softcapping=30.0, rms_norm_eps=1e-6, max_position_embeddings=131072,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                        "rope_theta": 1000000.0}},
    tie_word_embeddings=True, eos_token_id=[1, 106], pad_token_id=0)
# a stand-in of the same layout small enough for a CPU smoke run (`--small`)
TEXT_SMALL = TEXT_26B_A4B | dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                                 sliding_window=16, num_experts=8, top_k_experts=2, moe_intermediate_size=32)
# the smallest vision tower transformers builds (the port skips it; transformers' model needs one)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=8, position_embedding_size=16, patch_size=2)


def text_config(args) -> dict:
    text = dict(TEXT_SMALL if args.small else TEXT_26B_A4B)
    if args.layers is not None:
        text["num_hidden_layers"] = args.layers
        text["layer_types"] = text["layer_types"][-args.layers:]  # keeps a global last
    return text


def points(args) -> list[tuple[int, int, int]]:
    out = []
    for point in args.points:
        try:
            batch, prompt, new = (int(x) for x in point.split(":"))
        except ValueError:
            raise SystemExit(f"--points entries are batch:prompt:new (three integers), got {point!r}") from None
        out.append((batch, prompt, new))
    return out


def prompt_ids(batch: int, prompt: int, vocab: int) -> np.ndarray:
    # ids from 3: clear of the pad, eos and bos ids
    return np.random.default_rng(batch).integers(3, vocab, (batch, prompt)).astype(np.int32)


def generated(tail: np.ndarray, pad_id: int) -> int:
    return int(np.sum(tail != pad_id))


# --- transformers (a child process: JAX never initialises the GPU there) ----------------------------------------

def transformers_rows(args) -> list[dict]:
    import torch
    from transformers import DiffusionGemmaConfig as HFConfig
    from transformers import DiffusionGemmaForBlockDiffusion

    from dllm_jax.bench import call_times

    text = text_config(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = transformers_model(DiffusionGemmaForBlockDiffusion, HFConfig(text_config=text, vision_config=VISION),
                               device)
    rows = []
    for batch, prompt, new in points(args):
        ids = torch.as_tensor(prompt_ids(batch, prompt, text["vocab_size"]), dtype=torch.long, device=device)

        def run():
            with torch.no_grad():
                out = model.generate(input_ids=ids, max_new_tokens=new, max_denoising_steps=args.steps)
            return out.sequences.cpu().numpy()  # synchronises

        what = dict(side="transformers", batch=batch, prompt=prompt, new_tokens=new, steps=args.steps)
        try:
            first, seconds = call_times(run, repeats=1, warmup=0, burst_s=0)[0], call_times(run, repeats=1,
                                                                                           warmup=0, burst_s=0)[0]
            tokens = generated(run()[:, prompt:prompt + new], text["pad_token_id"])
        except Exception as err:  # an out-of-memory point is a result, not the end of the run
            rows.append(what | dict(error=f"{type(err).__name__}: {err}"[:300]))
            continue
        rows.append(what | dict(first_call_s=first, seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds))
        print(rows[-1], flush=True)
    return rows


def transformers_model(model_class, config, device: str):
    """transformers' model with random bf16 weights on `device`. Built on the meta device, then given memory: its
    encoder and decoder share their weights, and a model built on the GPU holds both copies until they are tied
    (104 GB at 26B-A4B). `init_weights` draws the weights and recomputes the buffers, except the layer scalars,
    which the constructor sets to 1."""
    import torch

    with torch.device("meta"):
        model = model_class._from_config(config, dtype=torch.bfloat16)
    model.to_empty(device=device)
    model.init_weights()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.fill_(1.0)
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.bfloat16}:
        raise RuntimeError(f"transformers' model holds {dtypes} weights, not bfloat16 only")
    return model.eval()


def transformers_in_child(argv) -> list[dict]:
    """The transformers rows, measured in a child process (JSON on its last stdout line)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", "benchmarks.diffusion_gemma", *argv, "--transformers-child"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        last = (done.stderr.strip().splitlines() or [""])[-1]
        return [dict(side="transformers", error=f"child process exited {done.returncode}: {last}")]
    return json.loads(lines[-1])


# --- this port --------------------------------------------------------------------------------------------------

def random_inference_params(config, key, dtype) -> dict:
    """Random weights drawn leaf by leaf in the inference layout, one layer's tensor at a time (the checkpoint layout
    stacks each layer type's experts: 25.4 GB for the sliding layers' gate/up at 26B-A4B, a draw and a re-layout
    that leave an 80 GB card too fragmented for the loop); a quantized config's weights quantized as drawn."""
    import jax
    import jax.numpy as jnp

    from dllm_jax.models.diffusion_gemma_weights import inference_shapes
    from dllm_jax.quantize import is_scale, quantize_jit, scale_name
    from dllm_jax.testing import random_tree_leaf

    keys = iter(jax.random.split(key, 10_000))

    def draw(name: str, shape: tuple[int, ...]):
        if not shape:  # the layers' output scalars
            return jnp.ones((), dtype)
        return random_tree_leaf(next(keys), name=name, shape=shape, dtype=jnp.dtype(dtype))

    def weights(stored: dict) -> dict:
        out = {}
        for name, leaf in stored.items():
            if isinstance(leaf, dict):
                out[name] = weights(leaf)
            elif isinstance(leaf, tuple):
                out[name] = tuple(weights(layer) for layer in leaf)
            elif scale_name(name) in stored:  # stored [..., out, in]: drawn [..., in, out], quantized over `in`
                shape = (*leaf.shape[:-2], leaf.shape[-1], leaf.shape[-2])
                values, out[scale_name(name)] = quantize_jit(draw(name, shape), (len(shape) - 2,), config.quantize)
                out[name] = jnp.swapaxes(values, -1, -2)
            elif not (is_scale(name) and name.removesuffix("_scale") in stored):
                out[name] = draw(name, leaf.shape)
        return out

    return weights(inference_shapes(config, dtype))


def port_model(args):
    """This port's model with random weights (quantized with --quantize)."""
    import jax
    import jax.numpy as jnp

    from dllm_jax.checkpoint.api import model_from_params
    from dllm_jax.diffusion_gemma_config import DiffusionGemmaConfig

    config = DiffusionGemmaConfig.from_hf_config(dict(text_config=text_config(args), canvas_length=256,
                                                      architectures=["DiffusionGemmaForBlockDiffusion"],
                                                      model_type="diffusion_gemma", tie_word_embeddings=True))
    config = dataclasses.replace(config, quantize=args.quantize)
    return model_from_params(config, random_inference_params(config, jax.random.key(0), jnp.bfloat16))


def port_rows(args, model, reference: list[dict]):
    from dllm_jax import generate
    from dllm_jax.bench import call_times, kernel_profile

    config = model.config
    for batch, prompt, new in points(args):
        ids = prompt_ids(batch, prompt, config.vocab_size)
        run = functools.partial(generate, model, ids, max_new_tokens=new, max_denoising_steps=args.steps, seed=0)
        side = "dllm_jax" + (f" {args.quantize}" if args.quantize else "")
        what = dict(side=side, batch=batch, prompt=prompt, new_tokens=new, steps=args.steps)
        try:
            first, seconds = call_times(run, repeats=2, warmup=0, burst_s=0)[:2]
            tokens = generated(np.asarray(run())[:, prompt:], config.pad_token_id)
            kernels = None
            if args.profile:  # one more call under the profiler: its GPU kernels by time (None on a CPU)
                with tempfile.TemporaryDirectory(prefix="dg_trace_") as trace:
                    kernels = kernel_profile(lambda: np.asarray(run()), Path(trace))
        except Exception as err:
            yield what | dict(error=f"{type(err).__name__}: {err}"[:300])
            continue
        base = next((r for r in reference if (r.get("batch"), r.get("prompt"), r.get("new_tokens")) ==
                     (batch, prompt, new) and "tokens_per_s" in r), None)
        yield what | dict(first_call_s=first, seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds,
                          vs_transformers=None if base is None else tokens / seconds / base["tokens_per_s"],
                          kernels=kernels)


# --- MAGE on the canvas step -------------------------------------------------------------------------------------

def canvas_steps(params, canvas, cache, *, config, method, steps: int):
    """(logits, cache) after `steps` denoising forwards of one canvas against `cache` (updated in place), at one call
    site as in the sampler's loop: dense, or with MAGE selecting at the first forward (`decode_mage`'s `select`).
    Jit it with the cache donated."""
    import jax

    from dllm_jax.models.diffusion_gemma import decode, decode_mage, init_selection

    def step(i, carry):
        logits, cache, selection = carry
        if method is None:
            out, cache = decode(params, canvas, cache, logits, config=config)
        else:
            out, cache, selection = decode_mage(params, canvas, cache, logits, selection, config=config,
                                                method=method, select=i == 0)
        return out.astype(logits.dtype), cache, selection

    logits = jax.numpy.zeros((*canvas.shape, config.vocab_size), params["embed"].dtype)
    selection = None if method is None else init_selection(config, method, canvas.shape[0])
    return jax.lax.fori_loop(0, steps, step, (logits, cache, selection))[:2]


def canvas_step_rows(args, model):
    """One canvas's `--steps` denoising forwards against a cache of each --mage-contexts length (random keys and
    values), dense and with MAGE(k=--mage-k) on the global layers, at batch 1: milliseconds per canvas."""
    import jax
    import jax.numpy as jnp

    from dllm_jax.attention.mage import MAGE
    from dllm_jax.bench import call_times
    from dllm_jax.models.diffusion_gemma import init_cache

    config, params = model.config, model.params()
    c = config.canvas_length
    steps_jit = jax.jit(canvas_steps, static_argnames=("config", "method", "steps"), donate_argnames=("cache",))
    for context in args.mage_contexts:
        cache = init_cache(config, 1, context + c, params["embed"].dtype)
        keys = iter(jax.random.split(jax.random.key(context), 2 * config.num_layers))
        draw = jax.jit(lambda key, like: jax.random.normal(key, like.shape, like.dtype), donate_argnums=1)
        # the cache lives in `held` alone, so it is freed before the next context's is drawn
        held = dict(cache=cache.replace(k=tuple(draw(next(keys), b) for b in cache.k),
                                        v=tuple(draw(next(keys), b) for b in cache.v),
                                        length=jnp.full((1,), context, jnp.int32)))
        del cache
        canvas = jnp.asarray(prompt_ids(1, c, config.vocab_size))
        row = dict(side="canvas step", context=context, steps=args.steps, k=args.mage_k)
        for name, method in (("dense", None), ("mage", MAGE(k=args.mage_k))):
            def run(method=method):
                logits, held["cache"] = steps_jit(params, canvas, held["cache"], config=config, method=method,
                                                  steps=args.steps)
                np.asarray(logits[0, 0, :1])  # synchronises
            try:
                first, seconds = call_times(run, repeats=2, warmup=0, burst_s=0)[:2]
            except Exception as err:
                row[f"{name}_error"] = f"{type(err).__name__}: {err}"[:300]
                break
            row[f"{name}_ms"], row[f"{name}_first_s"] = seconds * 1e3, first
        if "dense_ms" in row and "mage_ms" in row:
            row["speedup"] = row["dense_ms"] / row["mage_ms"]
        held.clear()
        yield row


# --- output -----------------------------------------------------------------------------------------------------

def markdown(meta: dict, rows: list[dict]) -> list[str]:
    from dllm_jax.bench import cell, markdown_table

    steps = [r for r in rows if r["side"] == "canvas step"]
    rows = [r for r in rows if r["side"] != "canvas step"]
    step_table = [] if not steps else ["", "One canvas's denoising forwards at batch 1 against a cache of `context` "
                                       "positions (random keys and values), dense and with MAGE on the global layers:",
                                       "", *markdown_table(
        ["context", "steps", "k", "dense ms", "MAGE ms", "dense / MAGE"],
        [[r["context"], r["steps"], r["k"], cell(r.get("dense_ms"), ".1f"), cell(r.get("mage_ms"), ".1f"),
          cell(r.get("speedup"), ".2f", "x") if "speedup" in r else r.get("dense_error", r.get("mage_error", ""))[:80]]
         for r in steps])]
    table = markdown_table(
        ["side", "batch", "prompt", "new", "steps", "first call s", "s", "tokens", "tokens/s", "vs transformers"],
        [[r["side"], r.get("batch", "-"), r.get("prompt", "-"), r.get("new_tokens", "-"), r.get("steps", "-"),
          cell(r.get("first_call_s"), ".1f"), cell(r.get("seconds"), ".2f"), r.get("tokens", "-"),
          cell(r.get("tokens_per_s"), ".1f"), cell(r.get("vs_transformers"), ".2f", "x") if "error" not in r
          else r["error"][:80]] for r in rows])
    profiles = []
    for r in rows:
        if r.get("kernels"):
            top = "; ".join(f"{k['name']} {k['ms']:.1f} ms ({k['launches']})" for k in r["kernels"]["kinds"][:8])
            profiles.append(f"- {r['side']} batch {r['batch']}: GPU kernels {r['kernels']['gpu_ms']:.1f} ms in "
                            f"{r['kernels']['launches']} launches; by kind: {top}")
    return [f"# {meta['benchmark']}: DiffusionGemma {meta['shapes']}, random bf16 weights",
            "", f"{meta['device']}, jax {meta['jax']}, {meta['date']}; transformers {meta['transformers']}, "
                f"torch {meta['torch']}", "", *table, "", VLLM_REPORTED, *([""] + profiles if profiles else []),
            *step_table]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", nargs="*", default=["1:4096:512", "16:4096:512"], help="batch:prompt:new points")
    parser.add_argument("--steps", type=int, default=16, help="denoising steps per canvas")
    parser.add_argument("--layers", type=int, default=None, help="the last N layers only (smoke runs)")
    parser.add_argument("--small", action="store_true", help="a tiny stand-in of the same layout (CPU smoke runs)")
    parser.add_argument("--quantize", choices=["int8", "fp8"], default=None,
                        help="this port's weights quantized (transformers runs bf16)")
    parser.add_argument("--no-transformers", action="store_true", help="time this port only")
    parser.add_argument("--profile", action="store_true",
                        help="one more call of this port under the profiler: its GPU kernels by time in the results")
    parser.add_argument("--mage-contexts", nargs="*", type=int, default=[],
                        help="cache lengths at which one canvas's forwards are timed dense and with MAGE")
    parser.add_argument("--mage-k", type=int, default=512, help="MAGE's k for --mage-contexts")
    parser.add_argument("--transformers-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if args.transformers_child:
        print(json.dumps(transformers_rows(args)), flush=True)
        return
    reference = [] if args.no_transformers else transformers_in_child(
        [a for a in argv if a != "--no-transformers"])

    import jax
    import torch
    import transformers

    from dllm_jax.bench import write_results

    shapes = "26B-A4B" if not args.small else "small stand-in"
    meta = dict(benchmark=f"diffusion_gemma{args.tag}", device=jax.devices()[0].device_kind, jax=jax.__version__,
                transformers=transformers.__version__, torch=torch.__version__, shapes=shapes,
                date=datetime.date.today().isoformat(), args={k: str(v) for k, v in vars(args).items()})
    rows = list(reference)
    model = port_model(args)
    for row in itertools.chain(port_rows(args, model, reference), canvas_step_rows(args, model)):
        rows.append(row)
        print(row, flush=True)
        write_results(args.out, meta, rows, markdown(meta, rows))
    if all(r["side"] == "transformers" for r in rows):
        write_results(args.out, meta, rows, markdown(meta, rows))


if __name__ == "__main__":
    main()
