"""Generated tokens per second at the SDAR-8B and LLaDA-8B shapes (random bf16 weights), next to the
bytes each forward must read and the device's copy bandwidth measured in the same process.

Sections (`--sections`, comma-separated; every result is written as soon as it is measured, to
<out>/throughput<tag>_<device>_<date>.{json,md}, so a run cut short keeps what it measured):
  copy      copy bandwidth of the device: a large array copied under jit, (bytes read + written) /
            time; an elementwise negation of the same array is reported next to it. Runs first, and
            automatically whenever a section reports bandwidth (weights, sdar, mage128k): every
            bandwidth row carries its fraction of the copy bandwidth of its own process.
  weights   the weight-reading part of an SDAR-8B block step: the jitted `dllm_jax.models.sdar.block_step`
            of 4 and 32 tokens,
            batch 1, on an empty cache (no KV read); bytes = every weight a forward reads (layers,
            final norm, LM head; not the embedding table, which is only gathered). Wall time per call
            (back-to-back calls) and, on a GPU, the profiled GPU kernel time of one call.
  sdar      `dllm_jax.generate` on SDAR-8B: block 4, denoising_steps 4, low_confidence_static (one
            token per step: fixed work per block), stop tokens disabled (random weights would stop
            anywhere), `--sdar-new-tokens` new tokens, prompts `--sdar-prompts`, batches
            `--sdar-batches` (a point whose estimated memory exceeds 80% of the device is skipped
            with the estimate recorded); dense at every point, the methods (MAGE, FlashBlock,
            FlashBlock + MAGE, default parameters) only at `--method-points` (default: prompt 1024
            at batch 8, prompt 32768 at batch 1). Every row has the same prompt length (no padding;
            attention_mask all ones, none in --baseline). Tokens/s = generated
            tokens / wall time of the second (warm) call; the first call is timed separately
            (compile + run). The prefill is timed alone (`model.prefill`, warm) and subtracted to
            give the decode time, per forward (blocks x steps forwards: the commit rides on the next
            block's first step; blocks x (steps + 1) with --baseline), the bytes a dense
            forward must read (weights + the KV rows of the batch, averaged over the blocks) and the
            achieved bandwidth.
  llada     `dllm_jax.generate` on LLaDA-8B, prompt `--llada-prompt` (1024), block 32, the (batch,
            gen_length, steps) points of `--llada-runs` (default 1:256:256 1:256:64 8:256:64 8:64:64: at
            batch 8 the one-token-per-step point runs a shorter generation), each with every Fast-dLLM
            cache of `--llada-caches` (default none; prefix, dual: gen_length / steps tokens per step on
            the schedule, so random weights do fixed work); tokens/s of the warm call.
  mage128k  SDAR-8B against a `--long-prompt` cache (128k), batches `--long-batches`: the time of one
            output block of the generate loop itself (`dllm_jax.generate.sdar.denoise_block`, jitted,
            its 4 denoising forwards and the commit, which the current loop fuses into the next block's
            first step: here one pending commit), dense (the default implementation) and MAGE, on a
            zero cache whose fill length is set to the cache length (attention cost does not depend on
            the values; a real 128k prefill would cost minutes per call), at the capacity generate
            allocates; the methods of `--long-methods` (default: MAGE with its top k by its default tile
            tournament, by lax.top_k ("mage/sort") and by the radix threshold ("mage/threshold"), with its
            scores from the keys read again ("mage/keys"), FlashBlock, FlashBlock + MAGE), each with its byte
            ideal, and "dense/apart" (dense with the commit's segment in a call of its own: the cache read
            twice in that forward) and "dense/fp8" (dense on a float8 cache, kv_cache_dtype="fp8"). On a GPU
            each row also holds one traced block's kernels by time (`dllm_jax.bench.kernel_profile`).
  compile   first-call time minus warm-call time of SDAR generate (batch 1, the first prompt, dense)
            and LLaDA generate (the first --llada-runs point). A run whose sdar / llada section timed
            that point reports it without this section (a second measurement in the same process
            would hit the compilation cache); the section times the points no other section did.

Memory: the script sets XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 unless the environment sets it (JAX's
75% would not hold a batch-4 128k cache). `--budget-s S` starts no measurement after S seconds, so a
run under a hard time limit still ends with its tables (what was left is recorded as skipped).

`--quantize int8|fp8` builds every model with its linear weights quantized (`load_model(quantize=...)`); time
the unquantized run on the same machine and join the two with `--compare`.

`--baseline` keeps to what the pre-issue-17 package also runs with the same public API (batch 1
SDAR without attention_mask, block_step on an empty cache, MAGE at batch 1, LLaDA without masks), so
the same script can time an old copy of the package: run it as a file, not with `-m` (with `-m` the
working directory, which holds the new package, comes first on sys.path):

    PYTHONPATH=. python benchmarks/throughput.py --sections copy,weights,sdar --out $OUT
    PYTHONPATH=/path/to/old/checkout python benchmarks/throughput.py --baseline --tag _baseline --out $OUT
    python benchmarks/throughput.py --tiny                        # every section, tiny configs, CPU
    python benchmarks/throughput.py --merge a.json b.json --out benchmarks/results   # one table
    python benchmarks/throughput.py --compare baseline.json new.json --out benchmarks/results

Each section is a module of benchmarks/sections/ (its rows, table and summary line); this script reads
the flags, runs the sections in order and writes the results as they arrive.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib
import io
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

# JAX's GPU allocator takes 75% of the device by default; a batch-4 128k cache needs more. Set before
# the backend starts (the first device use); an explicit setting in the environment wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

import jax  # noqa: E402

import dllm_jax  # noqa: E402
from dllm_jax.bench import write_results  # noqa: E402


def beside(name: str):
    """Module benchmarks.<name> of this checkout; run as a file beside an old package (--baseline, the old
    checkout first on sys.path), the module <name> of this file's folder (sys.path[0])."""
    try:
        return importlib.import_module(f"benchmarks.{name}")
    except ModuleNotFoundError as e:
        if e.name not in ("benchmarks", f"benchmarks.{name}"):
            raise
        return importlib.import_module(name)


modules = beside("sections")  # the sections, one module each
plans, report, held_model = modules.plan, modules.report, modules.models.held_model
bandwidth, weights, sdar, llada, long_cache, compile_time = (modules.bandwidth, modules.weights, modules.sdar,
                                                             modules.llada, modules.long_cache, modules.compile_time)
Plan = plans.Plan
SECTIONS = report.SECTIONS
BANDWIDTH_SECTIONS = {"weights", "sdar", "mage128k"}


def parse_sections(text: str) -> list[str]:
    sections = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad or not sections:
        raise ValueError(f"--sections must be a comma-separated subset of {','.join(SECTIONS)}, got {text!r}")
    if BANDWIDTH_SECTIONS & set(sections) and "copy" not in sections:
        sections.insert(0, "copy")  # every bandwidth row needs the copy bandwidth of its own process
    return sorted(sections, key=SECTIONS.index)


def parse_points(texts, name: str, parts: int) -> tuple:
    """"a:b:c" strings into int tuples (method points "prompt:b1,b2" have a batch list last)."""
    out = []
    for text in texts:
        try:
            fields = text.split(":")
            if len(fields) != parts:
                raise ValueError
            if name == "--method-points":
                out.append((int(fields[0]), tuple(int(b) for b in fields[1].split(","))))
            else:
                out.append(tuple(int(f) for f in fields))
        except ValueError:
            raise ValueError(f"{name} takes {'prompt:batch,batch' if parts == 2 else 'batch:gen_length:steps'} "
                             f"items, got {text!r}") from None
    return tuple(out)


def sdar_block_size(name: str) -> int:
    from dllm_jax.config import shipped_config
    from dllm_jax.testing import tiny_sdar_config

    return (tiny_sdar_config() if name == "tiny-sdar" else shipped_config(name)).block_size


def plan_from(args) -> Plan:
    plan = plans.TINY if args.tiny else Plan()
    changes = {}
    if args.sdar_prompts:
        changes["sdar_prompts"] = tuple(args.sdar_prompts)
    if args.sdar_batches:
        changes["sdar_batches"] = tuple(args.sdar_batches)
    if args.sdar_new_tokens:
        changes["sdar_new_tokens"] = args.sdar_new_tokens
    if args.method_points is not None:
        changes["method_points"] = parse_points(args.method_points, "--method-points", 2)
    if args.llada_runs:
        changes["llada_runs"] = parse_points(args.llada_runs, "--llada-runs", 3)
    if args.llada_prompt:
        changes["llada_prompt"] = args.llada_prompt
    if args.llada_caches:
        unknown = [c for c in args.llada_caches if c not in ("none", "prefix", "dual")]
        if unknown:
            raise ValueError(f"--llada-caches: unknown cache mode(s) {unknown}; choose from none, prefix, dual")
        if args.baseline and args.llada_caches != ["none"]:
            raise ValueError("--llada-caches prefix/dual need the current package (the baseline has no cache)")
        changes["llada_caches"] = tuple(None if c == "none" else c for c in args.llada_caches)
    if args.llada_methods:
        unknown = [m for m in args.llada_methods if m not in ("dense", "sparsed", "pulsecol", "sparge")]
        if unknown:
            raise ValueError(f"--llada-methods: unknown method(s) {unknown}; choose from dense, sparsed, pulsecol, sparge")
        if args.baseline and args.llada_methods != ["dense"]:
            raise ValueError("--llada-methods other than dense need the current package")
        changes["llada_methods"] = tuple(args.llada_methods)
    if args.long_prompt:
        changes["long_prompt"] = args.long_prompt
    if args.execution:
        if args.baseline:
            raise ValueError("--execution needs the current package (the baseline has one layer execution)")
        changes["execution"] = args.execution
    if args.long_batches:
        changes["long_batches"] = tuple(args.long_batches)
    if args.long_methods:
        unknown = [m for m in args.long_methods if m not in Plan.long_methods]
        if unknown:
            raise ValueError(f"--long-methods: unknown method(s) {unknown}; choose from {', '.join(Plan.long_methods)}")
        changes["long_methods"] = tuple(args.long_methods)
    if args.quantize:
        if args.baseline:
            raise ValueError("--quantize needs the current package (the baseline has no quantization)")
        changes["quantize"] = args.quantize
    plan = dataclasses.replace(plan, **changes)
    values = [*plan.sdar_prompts, *plan.sdar_batches, plan.sdar_new_tokens, plan.long_prompt, *plan.long_batches,
              plan.llada_prompt, *(v for run in plan.llada_runs for v in run)]
    if min(values) <= 0:
        raise ValueError(f"sizes must be positive, got {values}")
    block = sdar_block_size(plan.sdar_model)
    uneven = [p for p in (*plan.sdar_prompts, plan.long_prompt) if p % block]
    if uneven:  # the prefill timed alone takes whole blocks
        raise ValueError(f"--sdar-prompts and --long-prompt must be multiples of the block size {block}, got {uneven}")
    return plans.baseline_plan(plan) if args.baseline else plan


def run(args) -> list[dict]:
    sections = parse_sections(args.sections)
    plan = plan_from(args)
    device = jax.devices()[0].device_kind
    meta = dict(benchmark="throughput" + args.tag, device=device, backend=jax.default_backend(), jax=jax.__version__,
                date=datetime.date.today().isoformat(), package=str(Path(dllm_jax.__file__).parent),
                budget_s=None if args.budget_s == float("inf") else args.budget_s,
                baseline=args.baseline, tiny=args.tiny, sections=sections, plan=dataclasses.asdict(plan),
                xla_flags=os.environ.get("XLA_FLAGS", ""),
                started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    stem = args.out / f"{meta['benchmark']}_{device.replace(' ', '_')}_{meta['date']}.json"
    rows: list[dict] = json.loads(stem.read_text())["rows"] if args.append and stem.exists() else []
    print(f"throughput on {device} (jax {jax.__version__}, {jax.default_backend()}), package {meta['package']}, "
          f"sections {sections}{' [baseline]' if args.baseline else ''}", flush=True)

    def add(row: dict) -> None:
        rows.append(row)
        with contextlib.redirect_stdout(io.StringIO()):  # write_results prints the table: only at the end
            write_results(args.out, meta, rows, report.markdown(meta, rows))

    deadline = time.monotonic() + args.budget_s

    def in_time(section: str) -> bool:
        """Whether the budget allows starting `section` (building its random model alone takes a while)."""
        if time.monotonic() <= deadline:
            return True
        add(dict(section="note", text=f"{section}: not started, --budget-s {args.budget_s:g} s spent"))
        return False

    held: dict = {}  # the one random model alive; section calls never keep it in a local of run()
    copy = None
    if "copy" in sections:
        copy = bandwidth.copy_bandwidth(plan.copy_bytes)
        add(dict(section="copy", **copy))
        print(json.dumps(rows[-1]), flush=True)
    if "weights" in sections and in_time("weights"):
        for row in weights.weights_rows(*held_model(held, "sdar", plan), plan, copy, deadline=deadline):
            print(json.dumps(row), flush=True)
            add(row)
    prefills: dict = {}
    sdar_first = dict(prompt=plan.sdar_prompts[0], batch=1, method="dense")
    if "sdar" in sections and in_time("sdar"):
        for row in sdar.sdar_rows(*held_model(held, "sdar", plan), plan, baseline=args.baseline, copy=copy,
                             prefills=prefills, deadline=deadline):
            add(row)
    if "compile" in sections and not compile_time.has_compile_source(rows, "sdar", sdar_first) and in_time("compile (SDAR)"):
        one = dataclasses.replace(plan, sdar_prompts=plan.sdar_prompts[:1], sdar_batches=(1,), method_points=())
        for row in sdar.sdar_rows(*held_model(held, "sdar", plan), one, baseline=args.baseline, copy=copy,
                             prefills=prefills, deadline=deadline):
            add(row)
    compile_time.add_compile_row(rows, "sdar", sdar_first, add)  # any run that timed this point reports its compile time
    if "mage128k" in sections and in_time("mage128k"):
        for row in long_cache.long_rows(*held_model(held, "sdar", plan), plan, baseline=args.baseline, copy=copy,
                             deadline=deadline):
            add(row)
    batch, gen, steps = plan.llada_runs[0]
    llada_first = dict(batch=batch, gen_length=gen, steps=steps)
    if ("llada" in sections or ("compile" in sections and not compile_time.has_compile_source(rows, "llada", llada_first))) \
            and in_time("llada"):
        runs = plan.llada_runs if "llada" in sections else plan.llada_runs[:1]
        for row in llada.llada_rows(*held_model(held, "llada", plan), dataclasses.replace(plan, llada_runs=runs),
                              deadline=deadline):
            add(row)
    compile_time.add_compile_row(rows, "llada", llada_first, add)
    write_results(args.out, meta, rows, report.markdown(meta, rows))
    print("\n".join(report.summary(rows)))
    return rows


def merge(paths: list[Path], out: Path, tag: str) -> Path:
    """One table from the result files of one package split over several processes."""
    def changes(parts):
        points = {tuple(pt[0:1]) + (tuple(pt[1]),) for p in parts for pt in p["plan"]["method_points"]}
        return dict(benchmark="throughput" + tag, sections=[s for s in SECTIONS if any(s in p["sections"] for p in parts)],
                    plan=dict(parts[0]["plan"], method_points=sorted(points)))

    # the one merge of results files (it needs this checkout's package: imported only here)
    path = beside("merging").merge(paths, out, report=report.markdown, same=("baseline", "package", "device"), changes=changes,
                         hint=": use --compare for a baseline against a new run")
    print("\n".join(report.summary(json.loads(path.with_suffix(".json").read_text())["rows"])))
    return path


def compare(baseline_path: Path, new_path: Path, out: Path) -> Path:
    """A baseline run against a new one, point by point: value before, after, and the speed-up."""
    return beside("merging").compare(baseline_path, new_path, out, compared=report.COMPARED,
                                   benchmark="throughput_compare", title="Throughput: baseline against new")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--baseline", action="store_true", help="only what the pre-issue-17 API runs")
    parser.add_argument("--tiny", action="store_true", help="tiny configs and sizes (a CPU check of every section)")
    parser.add_argument("--sdar-prompts", type=int, nargs="+", help="prompt lengths (multiples of the block size)")
    parser.add_argument("--sdar-batches", type=int, nargs="+")
    parser.add_argument("--sdar-new-tokens", type=int)
    parser.add_argument("--method-points", nargs="*", help="prompt:batch,batch items where the methods run "
                                                           "(none: dense only)")
    parser.add_argument("--llada-runs", nargs="+", help="batch:gen_length:steps items")
    parser.add_argument("--llada-prompt", type=int, help="LLaDA prompt length (1024)")
    parser.add_argument("--llada-caches", nargs="+", help="Fast-dLLM cache modes timed at every LLaDA point: "
                                                          "none (the exact sampler), prefix, dual")
    parser.add_argument("--llada-methods", nargs="+", help="LLaDA methods (defaults) timed at every point and "
                                                           "cache: dense (default), sparsed, pulsecol, sparge")
    parser.add_argument("--long-prompt", type=int, help="cache length of mage128k")
    parser.add_argument("--quantize", choices=("int8", "fp8"),
                        help="the models' linear weights quantized (load_model's quantize; compare against an "
                             "unquantized run of the same machine with --compare)")
    parser.add_argument("--execution", choices=("unrolled", "scan"), help="layer execution of the models "
                        "(default: the package's); not with --baseline")
    parser.add_argument("--long-batches", type=int, nargs="+")
    parser.add_argument("--long-methods", nargs="+", help="mage128k's methods timed against dense (default: all of "
                                                          f"{', '.join(Plan.long_methods)})")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no new measurement after this many seconds (rows left are recorded as skipped), "
                             "so a run ends with its tables before a hard time limit")
    parser.add_argument("--tag", default="", help="suffix of the benchmark name in the result files")
    parser.add_argument("--append", action="store_true", help="extend this tag's result file of today if present")
    parser.add_argument("--merge", type=Path, nargs="+", help="combine result JSONs of one run into one table")
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("BASELINE", "NEW"),
                        help="a table of a baseline result JSON against a new one")
    parser.add_argument("--out", type=Path, help="result folder (default benchmarks/results; with --tiny a "
                                                 "temporary folder: tiny CPU numbers are no results)")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "throughput_tiny" if args.tiny else Path("benchmarks/results")
    if args.merge:
        return merge(args.merge, args.out, args.tag)
    if args.compare:
        return compare(*args.compare, args.out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas Triton backend warns on use
        return run(args)


if __name__ == "__main__":
    main()
