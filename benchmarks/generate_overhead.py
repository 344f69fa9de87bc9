"""Loop overhead of the compiled generate loops on the GPU: time per step inside `generate` against
the time of the same model call alone.

LLaDA-8B dimensions (random bf16 weights), 4096 tokens (prompt 3968 + 128 generated, one block,
16 steps, greedy): the bare step is `forward` with logits for the answer region, as the loop calls it.
SDAR-8B dimensions, a 16k prompt: the bare step is `block_step` against the filled cache (donated); the loop
(sequential remasking, top_k=1, 4 steps + a commit per block, stop tokens disabled) is timed after
subtracting the prefill, timed alone. Both loops also run with progress=True.

    PYTHONPATH=. python -m benchmarks.generate_overhead --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.bench import markdown_table, time_calls, write_results
from dllm_jax import shipped_config
from dllm_jax.generate.llada import LLaDAOptions, generate_llada_jit
from dllm_jax.generate.progress import progress_bar, tick
from dllm_jax.generate.sdar import SDAROptions, generate_sdar_jit
from dllm_jax.models import block_diffusion, llada, sdar
from dllm_jax.models.layers import prepare_params
from dllm_jax.testing import random_params


def llada_rows(repeats):
    config = shipped_config("llada-8b-instruct")
    params = prepare_params(random_params(config, jax.random.key(0)), config)
    p, gen, steps = 3968, 128, 16
    prompt = jax.random.randint(jax.random.key(1), (1, p), 0, config.mask_token_id)
    x = jnp.concatenate([prompt, jnp.full((1, gen), config.mask_token_id, jnp.int32)], axis=1)
    bare = jax.jit(lambda params, x: llada.forward(params, x, config=config, logits_from=p)[0])
    t_bare = time_calls(bare, params, x, repeats=repeats, warmup=2, burst_s=0)
    opts = LLaDAOptions(gen_length=gen, steps=steps, block_length=gen)
    rows = []
    for progress in (False, True):
        def run(seed):
            with progress_bar(steps, "LLaDA", progress) as run_id:
                out = generate_llada_jit(params, prompt, None, seed, run_id, config=config, options=opts,
                                         on_step=tick if progress else None)
                return jax.block_until_ready(out)
        t_loop = time_calls(run, np.int32(0), warmup=1, repeats=max(3, repeats // 3), burst_s=0)
        rows.append(dict(model="LLaDA-8B", tokens=p + gen, steps=steps, progress=progress,
                         bare_step_ms=t_bare * 1e3, loop_step_ms=t_loop / steps * 1e3,
                         overhead=t_loop / steps / t_bare - 1))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def sdar_rows(repeats):
    config = dataclasses.replace(shipped_config("sdar-8b-chat"), eos_token_ids=())  # never stop early
    params = prepare_params(random_params(config, jax.random.key(0)), config)
    p, new, steps = 16384, 32, 4
    prompt = jax.random.randint(jax.random.key(1), (1, p), 0, config.mask_token_id)
    total = p + new
    prefill = jax.jit(lambda params, ids: sdar.prefill(params, ids, block_diffusion.init_cache(config, 1, total), config=config))
    t_prefill = time_calls(prefill, params, prompt, warmup=1, repeats=max(3, repeats // 3), burst_s=0)
    cache = prefill(params, prompt)
    block = jnp.full((1, config.block_size), config.mask_token_id, jnp.int32)
    # donated, as the loop's carry is: otherwise every call copies the whole cache for its scratch write
    step = jax.jit(functools.partial(sdar.block_step, config=config), donate_argnames=("cache",))

    def bare(state=[cache]):
        logits, state[0], _ = step(params, block, state[0])
        return logits

    del cache
    t_bare = time_calls(bare, repeats=repeats, warmup=2, burst_s=0)
    del bare
    opts = SDAROptions(max_new_tokens=new, denoising_steps=steps, remasking="sequential", top_k=1)
    blocks = new // config.block_size
    forwards = blocks * (steps + 1)
    rows = []
    for progress in (False, True):
        def run(seed):
            with progress_bar(blocks, "SDAR", progress) as run_id:
                out = generate_sdar_jit(params, prompt, None, seed, run_id, config=config, options=opts,
                                        on_step=tick if progress else None)
                return jax.block_until_ready(out)
        x, end = run(np.int32(0))
        assert int(end) == total, f"expected every block decoded, got {int(end)}"
        t_loop = time_calls(run, np.int32(0), warmup=0, repeats=max(3, repeats // 3), burst_s=0)
        per_step = (t_loop - t_prefill) / forwards
        rows.append(dict(model="SDAR-8B", tokens=total, cache=p, steps=forwards, progress=progress,
                         prefill_ms=t_prefill * 1e3, bare_step_ms=t_bare * 1e3, loop_step_ms=per_step * 1e3,
                         overhead=per_step / t_bare - 1))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    device = jax.devices()[0].device_kind
    print(f"{device}, jax {jax.__version__}", flush=True)
    rows = llada_rows(args.repeats) + sdar_rows(args.repeats)
    meta = dict(benchmark="generate_overhead", device=device, jax=jax.__version__,
                date=datetime.date.today().isoformat(), batch=1, dtype="bfloat16 random weights")
    write_results(args.out, meta, rows, markdown(meta, rows))


def markdown(meta: dict, rows: list[dict]) -> list[str]:
    cells = [[r["model"], r["tokens"], r["steps"], "yes" if r["progress"] else "no", f"{r['bare_step_ms']:.2f} ms",
              f"{r['loop_step_ms']:.2f} ms", f"{r['overhead'] * 100:+.1f}%"] for r in rows]
    lines = [f"# Generate-loop overhead, {meta['device']}, jax {meta['jax']}, {meta['date']}", "",
             *markdown_table(["model", "tokens", "steps timed", "progress bar", "bare step", "step inside the loop",
                              "overhead"], cells)]
    return lines + ["", "LLaDA: 4096 tokens (3968 prompt + 128 generated in one block), 16 greedy steps; the bare step is the",
              "forward with answer-region logits. SDAR: 16k-token prompt prefilled (its time subtracted), 32 new tokens",
              "= 8 blocks x (4 steps + commit); the bare step is one 4-token block_step against the 16k cache."]


if __name__ == "__main__":
    main()
