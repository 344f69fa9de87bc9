"""Where a first call's seconds go, and what XLA's flags change: each (case, flags) pair runs in a process of its
own with the persistent cache off, and reports

  build s      building the model (random weights, placed on the device);
  trace / lower / compile s   JAX's own compile events inside `generate`'s first call, summed over every program
               it made (tracing to a jaxpr, lowering to StableHLO, XLA's backend compile), and the programs' count;
  run s        the rest of the first call (running, transfers, host work);
  warm s       the median of three more calls with the same inputs (what the flags cost the compiled loop);
  ops          StableHLO operations in the case's main program (SDAR cases: the whole jitted generation);
  slowest      the programs that took longest in XLA.

Cases are compile_once's (the same models, shapes and options). Flag sets: `default` (none), `autotune0`
(`--xla_gpu_autotune_level=0`: no autotuning of GEMMs and fusions), `no-triton-gemm`
(`--xla_gpu_enable_triton_gemm=false`: GEMMs go to cuBLAS instead of Triton fusions XLA autotunes), `parallel16`
(`--xla_gpu_force_compilation_parallelism=16`: XLA's codegen split over 16 threads), `no-command-buffer`
(`--xla_gpu_enable_command_buffer=`: no CUDA graphs), `parallel16-no-triton-gemm` (both of theirs).
Results: <out>/compile_profile_<device>_<date>.{json,md}.

    PYTHONPATH=. python -m benchmarks.compile_profile --cases sdar-b1 --flags default autotune0 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

FLAGS = {"default": "", "autotune0": "--xla_gpu_autotune_level=0",
         "no-triton-gemm": "--xla_gpu_enable_triton_gemm=false",
         "parallel16": "--xla_gpu_force_compilation_parallelism=16",
         "no-command-buffer": "--xla_gpu_enable_command_buffer=",
         "parallel16-no-triton-gemm": "--xla_gpu_force_compilation_parallelism=16 --xla_gpu_enable_triton_gemm=false"}
STAGES = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "compile_s"}


def main_program_ops(model, ids, options) -> int | None:
    """StableHLO operations in the main program of an SDAR case (None for other families)."""
    import numpy as np

    from dllm_jax.families import family_of
    from dllm_jax.generate.sdar import generate_sdar_jit

    family = family_of(model.config)
    if family.name != "sdar":
        return None
    opts = family.options_class(**{k: v for k, v in options.items() if k != "method"})
    policy = family.policy(options.get("method"))
    text = generate_sdar_jit.lower(model.params(), ids, np.ones_like(ids), 0, np.int32(0), opts.sampling(len(ids)),
                                   config=model.config, options=opts.structure(model.config.vocab_size),
                                   policy=policy).as_text()
    return len(re.findall(r"^\s*(?:%\S+(?:, %\S+)* = )?\"?[a-z_]+\.[a-z_]+", text, re.MULTILINE))


def profile(case: str, tiny: bool) -> dict:
    """One (case, the process's flags) row: run in a process of its own (main)."""
    import jax

    from benchmarks.compile_once import build, call

    durations = collections.defaultdict(float)
    counts = collections.Counter()
    compiles = collections.defaultdict(float)

    def listen(event, seconds, fun_name=None, **kwargs):
        if event in STAGES:
            durations[STAGES[event]] += seconds
            counts[STAGES[event]] += 1
            if STAGES[event] == "compile_s":
                compiles[fun_name] += seconds

    start = time.perf_counter()
    model, ids, options = build(case, tiny=tiny)
    jax.block_until_ready(model.params())
    row = dict(case=case, device=jax.devices()[0].device_kind, build_s=time.perf_counter() - start)
    jax.monitoring.register_event_duration_secs_listener(listen)
    start = time.perf_counter()
    call(model, ids, options)
    row["first_call_s"] = time.perf_counter() - start
    jax.monitoring.unregister_event_duration_listener(listen)
    row |= dict(durations, programs=counts["compile_s"])
    row["run_s"] = row["first_call_s"] - sum(durations.values())
    warm = []
    for _ in range(3):
        start = time.perf_counter()
        call(model, ids, options)
        warm.append(time.perf_counter() - start)
    row["warm_s"] = statistics.median(warm)
    row["slowest"] = sorted(((round(s, 2), name) for name, s in compiles.items()), reverse=True)[:5]
    row["ops"] = main_program_ops(model, ids, options)
    return row


def run_one(case: str, flags: str, tiny: bool, timeout: float) -> dict:
    """profile() of `case` in a new process under the flag set `flags`, the cache off; a row saying why not where
    it failed or ran past `timeout` seconds."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, XLA_FLAGS=" ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), FLAGS[flags]])),
               DLLM_JAX_CACHE_DIR="off", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    code = ("import json, sys; from benchmarks.compile_profile import profile; "
            "print(json.dumps(profile(sys.argv[1], sys.argv[2] == 'tiny')))")
    try:
        done = subprocess.run([sys.executable, "-c", code, case, "tiny" if tiny else "8b"], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(case=case, flags=flags, error=f"still compiling after {timeout:.0f} s")
    if done.returncode:
        return dict(case=case, flags=flags, error=done.stderr[-1500:])
    return dict(json.loads(done.stdout.strip().splitlines()[-1]), flags=flags)


def table(rows: list[dict]) -> list[str]:
    lines = ["| case | flags | build s | first call s | trace s | lower s | XLA compile s (programs) | run s | "
             "warm s | main program ops | slowest programs (XLA s) |", "|" + "---|" * 11]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['flags']} | {r['error'].splitlines()[-1]} |" + " |" * 9)
            continue
        slowest = ", ".join(f"{name} {s}" for s, name in r["slowest"][:3])
        lines.append(f"| {r['case']} | {r['flags']} | {r['build_s']:.1f} | {r['first_call_s']:.1f} | "
                     f"{r.get('trace_s', 0):.1f} | {r.get('lower_s', 0):.1f} | {r.get('compile_s', 0):.1f} "
                     f"({r['programs']}) | {r['run_s']:.1f} | {r['warm_s']:.3f} | {r['ops'] or ''} | {slowest} |")
    return lines


def main(argv=None) -> None:
    from benchmarks.compile_once import CASES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["sdar-b1"], choices=list(CASES))
    parser.add_argument("--flags", nargs="+", default=list(FLAGS), choices=list(FLAGS))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one (case, flags) process may take")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tag", default="")
    parser.add_argument("--tiny", action="store_true", help="the same cases at tiny configs (a CPU check)")
    args = parser.parse_args(argv)

    import jax  # the parent only names versions: the device stays free for the processes that measure

    from dllm_jax.bench import write_results

    name = "_".join(filter(None, ["compile_profile", args.tag, "tiny" if args.tiny else ""]))
    meta = dict(benchmark=name, device=None,
                jax=jax.__version__, date=datetime.date.today().isoformat(), flag_sets=FLAGS,
                xla_flags=os.environ.get("XLA_FLAGS", ""))
    rows = []
    for case in args.cases:
        for flags in args.flags:
            rows.append(run_one(case, flags, args.tiny, args.timeout))
            print(json.dumps(rows[-1]), flush=True)
            device = meta["device"] = meta["device"] or rows[-1].get("device") or "unknown device"
            write_results(args.out, meta, rows, [f"compile_profile on {device}, jax {jax.__version__}, "
                                                 f"{meta['date']}", "", *table(rows)])


if __name__ == "__main__":
    main()
