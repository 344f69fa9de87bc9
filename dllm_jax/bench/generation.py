"""`dllm-jax bench`'s generate section: the public `generate` loop with random weights, dense and every
method of the family, time per model forward from the second call (the first compiles)."""

from __future__ import annotations

import functools

import numpy as np

from dllm_jax.bench.models import family_methods, model_for
from dllm_jax.bench.tables import markdown_table
from dllm_jax.bench.timing import call_times


def generate_rows(model_names, *, context: int, new_tokens: int, layers, dtype, progress: bool, methods=None):
    """A row per (model, method): each model's family's methods (`family_methods`; `methods`: those named)."""
    from dllm_jax.attention.methods import describe
    from dllm_jax.families import family_of
    from dllm_jax.generate import generate
    rows = []
    for name in model_names:
        model, config = model_for(name, layers=layers, context=context, dtype=dtype)
        family, sampler = family_of(config).label, family_of(config).sampler
        prompt_len = context - new_tokens
        if sampler == "LLaDA2":  # 8 steps per 32-token block (4 tokens each); a block's commit rides on the next
            options = dict(gen_length=new_tokens, block_length=32, steps=8)  # block's first step: 8 forwards
            forwards = 8 * (-(-(prompt_len + new_tokens) // 32) - prompt_len // 32)
        elif sampler == "SDAR":
            bs = config.block_size
            options = dict(max_new_tokens=new_tokens, denoising_steps=bs, remasking="low_confidence_static")
            blocks = -(-(prompt_len + new_tokens) // bs) - prompt_len // bs
            forwards = blocks * (bs + 1)  # bs denoising steps + the commit forward per block
        elif sampler == "Dream":  # one forward per step, like LLaDA; a confidence-based alg (the official demos')
            options = dict(max_new_tokens=new_tokens, steps=new_tokens // 2, alg="entropy")
            forwards = new_tokens // 2
        else:
            options = dict(gen_length=new_tokens, steps=new_tokens // 2, block_length=new_tokens)
            forwards = new_tokens // 2
        ids = np.random.default_rng(0).integers(0, config.mask_token_id, (1, prompt_len)).astype(np.int32)
        dense_s = None
        for method_name, method in family_methods(family, small=context < 2048, names=methods).items():
            try:
                run = functools.partial(generate, model, ids, method=method, progress=progress, **options)
                # generate returns host arrays (synchronised); the first call compiles, the second is timed
                first = call_times(run, repeats=1, warmup=0, burst_s=0)[0]
                seconds = call_times(run, repeats=1, warmup=0, burst_s=0)[0]
            except Exception as e:  # e.g. out of memory: record it, go on with the others
                rows.append(dict(section="generate", model=name, family=family, method=method_name, error=f"{type(e).__name__}: {e}"[:300]))
                print(f"{name} {method_name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            dense_s = seconds if method is None else dense_s
            rows.append(dict(section="generate", model=name, family=family, layers=config.num_layers, method=method_name,
                             config=describe(method), context=context, new_tokens=new_tokens, forwards=forwards,
                             options=options, first_call_s=first, total_s=seconds, per_forward_ms=seconds / forwards * 1e3,
                             speedup=None if dense_s is None else dense_s / seconds))
            print(f"{name} {method_name}: {seconds / forwards * 1e3:.2f} ms per forward "
                  f"(first call {first:.1f} s incl. compilation)", flush=True)
        del model
    return rows


def generation_markdown(generation: list[dict]) -> list[str]:
    """The section's table: per model and method, time per forward and the speed-up against dense."""
    rows = []
    for r in generation:
        if "error" in r:
            rows.append([r["model"], "", "", r["method"], r["error"][:80]])
            continue
        speed = "" if r["speedup"] is None else f"{r['speedup']:.2f}×"
        rows.append([r["model"], r["layers"], r["context"], f"`{r['config']}`", f"{r['per_forward_ms']:.2f} ms", speed,
                     f"{r['first_call_s']:.1f} s"])
    header = ["model", "layers", "context", "method", "per forward", "speed-up vs dense", "first call (compile)"]
    return ["## Generation (random weights, batch 1; time per model forward in the compiled loop, second call)", "",
            "Options per model (prompt = context - new tokens): " + "; ".join(
                sorted({f"{r['model']}: {r['options']}" for r in generation if "options" in r})), "",
            *markdown_table(header, rows)]
