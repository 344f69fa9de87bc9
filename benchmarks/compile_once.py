"""What compiling costs a user, and what traced sampling values cost the loop: at the 8B shapes (random bf16
weights, stop tokens disabled), per case

  first call   `dllm_jax.generate`'s first call in this process (compile + run), then a sweep of other
               sampling values (each call's wall time and the compile events it caused: none expected);
  warm loop    tokens/s of the jitted loop with the values traced (`rows`, the options' structure) against the
               same loop compiled with the values as static options (`rows=None`: for SDAR the sampler that takes
               them as Python numbers, the program before they were traced; for LLaDA the same sampler with the
               values as constants), the same inputs, timed alike (median of --repeats synchronised calls),
               interleaved;
  second process  a new process with the persistent compilation cache the first run filled: seconds from its
               start to `generate`'s first result, and the programs it compiled (none expected) or loaded. It runs
               as its own command after the first has exited (`--second-only`: on one GPU the first process holds
               the memory a second 8B model needs).

Cases: SDAR-8B dense at batch 1 and 64 (1k prompt, 128 new tokens, 4 steps per block of 4, one token per step),
SDAR-8B with MAGE at batch 1 and with fp8 weights at batch 64 (first call only), LLaDA-8B with Fast-dLLM's dual cache at batch 1 (1k prompt, 256
new tokens, 64 steps, blocks of 32). Results: <out>/compile_once_<device>_<date>.{json,md}.

    DLLM_JAX_CACHE_DIR=/tmp/cache PYTHONPATH=. python -m benchmarks.compile_once --out benchmarks/results
    DLLM_JAX_CACHE_DIR=/tmp/cache PYTHONPATH=. python -m benchmarks.compile_once --second-only sdar-b1 llada-dual-b1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

import dllm_jax
from dllm_jax.bench import write_results
from dllm_jax.bench.models import model_for
from dllm_jax.generate.llada import generate_llada_fast_jit
from dllm_jax.testing import compile_events

SDAR = dict(max_new_tokens=128, denoising_steps=4, remasking="low_confidence_static", top_k=1)
SDAR_SWEEP = [dict(temperature=0.7, top_k=0), dict(top_k=5), dict(temperature=0.9, top_p=0.9, top_k=0),
              dict(confidence_threshold=0.5)]
LLADA = dict(gen_length=256, steps=64, block_length=32, cache="dual")
LLADA_SWEEP = [dict(temperature=0.5), dict(temperature=1.0), dict(temperature=0.2)]
# case: (model, batch, attention method, weight quantization)
CASES = {"sdar-b1": ("sdar-8b-chat", 1, None, None), "sdar-b64": ("sdar-8b-chat", 64, None, None),
         "sdar-b1-mage": ("sdar-8b-chat", 1, "mage", None), "sdar-b64-fp8": ("sdar-8b-chat", 64, None, "fp8"),
         "sdar-b1-fp8": ("sdar-8b-chat", 1, None, "fp8"),
         "llada-dual-b1": ("llada-8b-instruct", 1, None, None)}
PROMPT = 1024
TINY = {"sdar-8b-chat": "tiny-sdar", "llada-8b-instruct": "tiny-llada"}  # --tiny: the same cases on CPU
TINY_PROMPT = 64

# the second process: the same model and call, timed from its own start
SECOND = """
import time; start = time.perf_counter()
import json, sys
import jax
counts = {"compiled": 0, "loaded": 0}
def count(event, *args, **kwargs):
    counts["compiled"] += (event == "/jax/core/compile/backend_compile_duration") - (event == "/jax/compilation_cache/cache_hits")
    counts["loaded"] += event == "/jax/compilation_cache/cache_hits"
jax.monitoring.register_event_listener(count)
jax.monitoring.register_event_duration_secs_listener(count)
from benchmarks.compile_once import build, call
model, ids, options = build(sys.argv[1], tiny=sys.argv[2] == "tiny")
built = time.perf_counter()
out = call(model, ids, options)
done = time.perf_counter()
print(json.dumps(dict(counts, to_model_s=built - start, generate_s=done - built, total_s=done - start,
                      cache=jax.config.jax_compilation_cache_dir)))
"""


def build(case: str, *, tiny: bool = False):
    """(model, prompt ids, options) of a case: random weights, the same in every process."""
    name, batch, method, quantize = CASES[case]
    prompt = TINY_PROMPT if tiny else PROMPT
    model, config = model_for(TINY[name] if tiny else name, layers=None, context=prompt + 256,
                              dtype="float32" if tiny else "bfloat16",
                              quantize="int8" if tiny and quantize else quantize)  # no fp8 dot on CPU
    ids = np.asarray(jax.random.randint(jax.random.key(batch), (batch, prompt), 0, config.mask_token_id), np.int32)
    options = dict(SDAR if name.startswith("sdar") else LLADA)
    if method is not None:
        options["method"] = method
    return model, ids, options


def call(model, ids, options, **values):
    return jax.block_until_ready(dllm_jax.generate(model, ids, seed=0, **options | values))


def loops(model, ids, options):
    """(traced, static): the case's jitted loop with the values traced and with them static, each a function of
    nothing returning its output (ready), on the same placed inputs."""
    from dllm_jax.families import family_of

    family = family_of(model.config)
    opts = family.options_class(**{k: v for k, v in options.items() if k != "method"})
    params, b = model.params(), len(ids)
    rows = opts.sampling(b)
    structure = opts.structure(model.config.vocab_size)
    if family.name == "sdar":
        from dllm_jax.generate.sdar import generate_sdar_jit
        mask = np.ones_like(ids)

        def run(rows, options):
            return jax.block_until_ready(generate_sdar_jit(params, ids, mask, 0, 0, rows, config=model.config,
                                                           options=options))
    else:
        def run(rows, options):
            return jax.block_until_ready(generate_llada_fast_jit(params, ids, None, 0, 0, rows, config=model.config,
                                                                 options=options))
    return (lambda: run(rows, structure)), (lambda: run(None, opts))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def second_process(case: str, tiny: bool) -> dict:
    """The second process's row (SECOND) for `case`: its counts and times, or the tail of its error."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", SECOND, case, "tiny" if tiny else "8b"], env=env,
                         capture_output=True, text=True, timeout=500)
    if run.returncode:
        return dict(second_process_error=run.stderr[-2000:])
    return dict(second_process=json.loads(run.stdout.strip().splitlines()[-1]))


def case_rows(case: str, repeats: int, second: bool, tiny: bool):
    model, ids, options = build(case, tiny=tiny)
    name, batch, method, quantize = CASES[case]
    generated = batch * (SDAR["max_new_tokens"] if name.startswith("sdar") else LLADA["gen_length"])
    row = dict(case=case, model=model.config.family if tiny else name, batch=batch, prompt=ids.shape[1],
               method=method or "dense", quantize=quantize, generated=generated)
    row["first_call_s"] = timed(lambda: call(model, ids, options))
    sweep = SDAR_SWEEP if name.startswith("sdar") else LLADA_SWEEP
    with compile_events() as events:
        row["sweep_s"] = [round(timed(lambda: call(model, ids, options, **v)), 3) for v in sweep]
    row["sweep_compile_events"] = len(events)
    print(json.dumps(row), flush=True)
    if method is None and quantize is None:
        traced, static = loops(model, ids, options)
        row["traced_first_s"] = timed(traced)
        row["static_first_s"] = timed(static)
        times = {"traced": [], "static": []}
        for _ in range(repeats):  # interleaved: a drift of the card's clock reaches both alike
            times["traced"].append(timed(traced))
            times["static"].append(timed(static))
        for kind, values in times.items():
            row[f"{kind}_warm_s"] = statistics.median(values)
            row[f"{kind}_tokens_per_s"] = generated / row[f"{kind}_warm_s"]
        row["traced_over_static"] = row["traced_tokens_per_s"] / row["static_tokens_per_s"]
        print(json.dumps(row), flush=True)
    if second:
        row |= second_process(case, tiny)
        print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict]) -> list[str]:
    def f(value, digits=2):
        return "" if value is None else f"{value:.{digits}f}"

    lines = ["| case | first call s | sweep s (compiles) | traced tok/s | static tok/s | traced / static | "
             "2nd process: to first result s (generate s; compiled / loaded) |", "|" + "---|" * 7]
    for r in rows:
        second = r.get("second_process")
        lines.append(f"| {r['case']} | {f(r['first_call_s'], 1)} | {', '.join(map(str, r['sweep_s']))} "
                     f"({r['sweep_compile_events']}) | {f(r.get('traced_tokens_per_s'), 1)} | "
                     f"{f(r.get('static_tokens_per_s'), 1)} | {f(r.get('traced_over_static'), 3)} | "
                     + ("" if second is None else f"{second['total_s']:.1f} ({second['generate_s']:.1f}; "
                        f"{second['compiled']} / {second['loaded']})") + " |")
    return lines


def second_table(rows: list[dict]) -> list[str]:
    lines = ["| case | to first result s | of which generate s | programs compiled / loaded |", "|---|---|---|---|"]
    for r in rows:
        s = r.get("second_process")
        lines.append(f"| {r['case']} | " + ("failed | | |" if s is None else
                     f"{s['total_s']:.1f} | {s['generate_s']:.1f} | {s['compiled']} / {s['loaded']} |"))
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--second", nargs="*", default=["sdar-b1"], help="cases also run in a second process")
    parser.add_argument("--second-only", nargs="+", default=None, choices=list(CASES), metavar="CASE",
                        help="only the second-process measurement of these cases (run after the first run exited)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tag", default="")
    parser.add_argument("--tiny", action="store_true", help="the same cases at tiny configs (a CPU check)")
    args = parser.parse_args(argv)
    device = jax.devices()[0].device_kind
    name = "_".join(filter(None, ["compile_once", args.tag, "tiny" if args.tiny else ""]))
    meta = dict(benchmark=name, device=device, jax=jax.__version__,
                date=datetime.date.today().isoformat(), cache=jax.config.jax_compilation_cache_dir,
                xla_flags=os.environ.get("XLA_FLAGS", ""), sdar=SDAR, llada=LLADA, prompt=PROMPT)
    rows = []
    if args.second_only:
        meta["benchmark"] += "_second"
        rows = [dict(case=case, **second_process(case, args.tiny)) for case in args.second_only]
        write_results(args.out, meta, rows, [f"compile_once, second processes, on {device}, jax {jax.__version__}, "
                                             f"{meta['date']}", "", *second_table(rows)])
        return
    for case in args.cases:
        rows.append(case_rows(case, args.repeats, case in args.second, args.tiny))
        write_results(args.out, meta, rows, [f"compile_once on {device}, jax {jax.__version__}, {meta['date']}", "",
                                             *table(rows)])


if __name__ == "__main__":
    main()
