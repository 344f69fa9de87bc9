"""The accuracy table of issue 19: every sparse-attention method on the trained tiny models, per task
and context, at its defaults and at two sparsity levels, with recall and relative L1 against dense
attention.

    PYTHONPATH=. python -m benchmarks.quality --models checkpoints/tiny-sdar-tasks,checkpoints/tiny-llada-tasks \
        --contexts 1024,2048 --samples 40 --seed 1 --out benchmarks/results [--tag NAME] [--diagnostics 4] \
        [--methods dense,mage,sparsed:select=0.2,...] [--tasks passkey,...] [--time-repeats 2]
    PYTHONPATH=. python -m benchmarks.quality --merge a.json,b.json --out benchmarks/results [--tag NAME]
    PYTHONPATH=. python -m benchmarks.quality --plot results.json --out docs/images   # Pareto PNGs (matplotlib)

Per model (an HF checkpoint directory with the task tokenizer), per context and long task
(`dllm_jax.eval.TASKS` but sanity), every method configuration of the model's family (`SETTINGS`)
generates the answers of all `--samples` samples in one batch, or in batches of `--batch-size` where one
batch of every sample does not fit the GPU (`dllm_jax.eval.evaluate`: one compile
per answer window, context and method; the samples come from the evaluation `--seed`, never a training
one).
The sanity task's prompts are 64 tokens: it runs once per model, dense only.

Decoding is `dllm_jax.eval.evaluate`'s: greedy, one token unmasked per step, so that every method acts.
LLaDA runs one block of the answer window with one token per step; SDAR runs 4 denoising steps per
block of 4 with `low_confidence_static` remasking. (Under SDAR's default confidence threshold the
trained model fills each passkey answer block at its first step, so MAGE and FlashBlock, which act from
a block's second step on, would never run.)
The two Fast-dLLM rows of LLaDA (`dense:dual`, `sparsed:defaults+dual`) decode instead through the dual
cache with confidence threshold 0.9 (several tokens per step where the model is sure), as issue 39 asks;
their speed-ups are over the same dense baseline, and their diagnostics (SparseD's) follow the uncached
dense trajectory, as every LLaDA row's.

Diagnostics: on the first `--diagnostics` samples of each (task, context), `dllm_jax.analysis.analyze`
(LLaDA: the sparse steps) or `analyze_blocks` (SDAR: a block's steps after its first, along the dense
trajectory) give the method's recall against the per-step oracle and its relative L1 error against
dense attention on the same prompts; rows hold the means over those samples of the reports' `summary()`
(means over layers, heads and steps: MAGE's exact first layers count with L1 0), None where a method
has no such measure (SpargeAttn rebuilds its map inside each call, so it has no recall).

SpargeAttn is calibrated per head on each model and context (`calibrate_llada`, two L1 targets) from a
few prompts drawn with training seeds (>= `TRAIN_SEED_FLOOR`), never the evaluation prompts; the
calibration JSON files are written next to the results.

Speed (`--time-repeats N`, N >= 1): after a row's evaluation has compiled and run, `dllm_jax.generate`
runs again on the first batch of prompts with the same options, N times (`dllm_jax.bench.call_times`,
synchronised per call); a row's time per sample is the median over the batch size. Each setting's
speed-up is dense's time per sample over its own, dense measured in the same run, on the same prompts
and options, with the capacity `generate` allocates: the loop a user runs. `--plot` draws one Pareto
picture per model and context from a results file (x: speed-up over dense, y: accuracy over the tasks;
one labelled point per setting).

A row that fails records its error and the run goes on. Results: <out>/quality[_tag]_<device>_<date>.{json,md}.
`--merge` writes one table from the JSON files of several runs (e.g. one per model and context, each
within a time limit); a row present in several files is taken from the last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from benchmarks.merging import merge as merge_results, read_results, union
from dllm_jax import generate, load_model
from dllm_jax.analysis import analyze, analyze_blocks, calibrate_llada, save_calibration
from dllm_jax.attention.methods import METHODS, describe, make_method
from dllm_jax.bench import markdown_table, results_stem, write_results
from dllm_jax.bench.timing import call_times
from dllm_jax.config import read_hf_config
from dllm_jax.families import family_of as model_family
from dllm_jax.eval import TASKS, evaluate, load_tokenizer, make_samples, min_context_length
from dllm_jax.eval.evaluate import answer_room
from dllm_jax.eval.tasks import SANITY_CONTEXT, prompt_length
from dllm_jax.files import write_atomic
from dllm_jax.generate.requests import check_context
from dllm_jax.train.data import TRAIN_SEED_FLOOR

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the Pallas Triton backend warns on use

LONG_TASKS = tuple(task for task in TASKS if task != "sanity")
METHOD_NAMES = ("dense", *METHODS)
TITLES = {"dense": "dense", "sparsed": "SparseD", "pulsecol": "PulseCol", "sparge": "SpargeAttn", "mage": "MAGE",
          "flashblock": "FlashBlock", "flashblock+mage": "FlashBlock+MAGE"}
CALIBRATION_PROMPTS = 2  # per long task: the calibration inputs of SpargeAttn (training seeds)


def sparsed_block(context: int) -> int:
    """SparseD's pattern block: 32 for short contexts, 128 for long ones (its docstring; the official
    README runs 32 on short_context and 128 on its 4k-64k prompts)."""
    return 32 if context < 4096 else 128


FAST_DUAL = (("cache", "dual"), ("threshold", 0.9))  # Fast-dLLM's decoding (LLaDA): issue 39's rows


@dataclasses.dataclass(frozen=True)
class Setting:
    """One method configuration: a row of the table."""

    method: str  # "dense" or a dllm_jax.attention.methods.METHODS name
    level: str  # the row's name within its method (no spaces or commas: `--methods mage:k=ctx/16` picks it)
    meaning: str  # what the level means, for the Markdown
    params: Callable[[int], dict]  # context length -> make_method parameters
    calibration: tuple[float, float] | None = None  # SpargeAttn: calibrate_llada's (l1, pv_l1) targets
    decoding: tuple[tuple[str, object], ...] = ()  # generate options beyond evaluate's (Fast-dLLM's cache)

    @property
    def name(self) -> str:
        return f"{TITLES[self.method]} {self.level}" if self.level else TITLES[self.method]

    @property
    def key(self) -> str:
        return f"{self.method}:{self.level}" if self.level else self.method

    @property
    def baseline(self) -> bool:
        """Exact attention decoded as `evaluate` decodes: the row every speed-up is measured against."""
        return self.method == "dense" and not self.decoding

    @property
    def families(self) -> tuple[str, ...]:
        return ("LLaDA",) if self.decoding else family_of(self.method)  # Fast-dLLM's caches are LLaDA's


# The paper's defaults do not all fit 1k-2k contexts, so some are set per context (the Markdown says what
# each row means). Nominal sparsity lines up across the LLaDA methods: SparseD select 0.3 / 0.2 / 0.1 keeps
# about as many key blocks as PulseCol at sparsity 0.7 / 0.8 / 0.9 keeps keys (PulseCol's claim is at 80%).
SETTINGS = (
    Setting("dense", "", "exact attention", lambda c: {}),
    Setting("sparsed", "defaults", "skip 0.2, select 0.3; block 32 below 4k tokens (128 from 4k)",
            lambda c: dict(block_size=sparsed_block(c))),
    Setting("sparsed", "select=0.2", "as defaults, 20% of the key blocks kept",
            lambda c: dict(select=0.2, block_size=sparsed_block(c))),
    Setting("sparsed", "select=0.1", "as defaults, 10% of the key blocks kept",
            lambda c: dict(select=0.1, block_size=sparsed_block(c))),
    Setting("pulsecol", "defaults", "sparsity 0.8, query groups of 32, eta 0.3, 16 refreshes", lambda c: {}),
    Setting("pulsecol", "sparsity=0.7", "as defaults, 30% of the keys kept", lambda c: dict(sparsity=0.7)),
    Setting("pulsecol", "sparsity=0.9", "as defaults, 10% of the keys kept", lambda c: dict(sparsity=0.9)),
    Setting("sparge", "defaults", "uncalibrated: topk 0.5, simthreshd1 -0.1, pvthreshd 50 (the official entry point)",
            lambda c: {}),
    Setting("sparge", "l1=0.05", "calibrated per head: L1 < 0.05 (map), < 0.06 (with the PV filter)",
            lambda c: {}, calibration=(0.05, 0.06)),
    Setting("sparge", "l1=0.10", "calibrated per head: L1 < 0.10 (map), < 0.12 (with the PV filter)",
            lambda c: {}, calibration=(0.10, 0.12)),
    Setting("mage", "defaults", "k = context/4 (the policy's 512 at 2k; 512 over a 1k prefix keeps half); "
            "the first 2 layers exact", lambda c: dict(k=c // 4)),
    Setting("mage", "k=ctx/16", "k = context/16 prefix positions per layer and KV head", lambda c: dict(k=c // 16)),
    Setting("mage", "k=ctx/64", "k = context/64 prefix positions per layer and KV head", lambda c: dict(k=c // 64)),
    Setting("flashblock", "defaults", "tau 2 (refresh after 2 tokens unmasked)", lambda c: {}),
    Setting("flashblock", "tau=3", "refresh after 3 tokens unmasked", lambda c: dict(tau=3)),
    Setting("flashblock", "tau=4", "tau 4 = the block size: no refresh after a block's first step "
            "(the paper's ablation: tau 2, 3, 4)", lambda c: dict(tau=4)),
    Setting("flashblock+mage", "k=ctx/16", "FlashBlock tau 2 (residual reuse) around MAGE k = context/16",
            lambda c: dict(tau=2, k=c // 16)),
    Setting("dense", "dual", "Fast-dLLM's dual cache, confidence threshold 0.9", lambda c: {}, decoding=FAST_DUAL),
    Setting("sparsed", "defaults+dual", "SparseD at its defaults over Fast-dLLM's dual cache, threshold 0.9",
            lambda c: dict(block_size=sparsed_block(c)), decoding=FAST_DUAL),
)


def family_of(method: str) -> tuple[str, ...]:
    return ("LLaDA", "SDAR") if method == "dense" else METHODS[method][0]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    path: Path
    name: str  # the directory's name
    family: str  # the family's label: "LLaDA" | "SDAR" (those SETTINGS cover)
    config: object


@dataclasses.dataclass(frozen=True)
class Plan:
    """The checked request."""

    models: tuple[ModelSpec, ...]
    contexts: tuple[int, ...]
    tasks: tuple[str, ...]
    chosen: tuple[str, ...]  # Setting keys
    samples: int
    seed: int
    diagnostics: int
    out: Path
    tag: str
    batch_size: int  # prompts per generate call (--samples: all in one batch)
    time_repeats: int = 0  # timed generate calls per row after its evaluation (0: no speed measured)

    def settings(self, family: str) -> tuple[Setting, ...]:
        return tuple(s for s in SETTINGS if s.key in self.chosen and family in s.families)

    @property
    def benchmark(self) -> str:
        return "quality" + (f"_{self.tag}" if self.tag else "")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default=None, help="comma-separated HF checkpoint directories (with tokenizer.json)")
    p.add_argument("--contexts", default="1024,2048", help="comma-separated context lengths in tokens")
    p.add_argument("--samples", type=int, default=40, help="samples per task and context")
    p.add_argument("--seed", type=int, default=1, help="evaluation seed (must lie below the training seeds, 2**31)")
    p.add_argument("--out", default="benchmarks/results", help="output directory")
    p.add_argument("--tag", default="", help="name suffix of the results files")
    p.add_argument("--diagnostics", type=int, default=None,
                   help="samples per (task, context) measured for recall and L1 (default min(4, --samples); 0: none)")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated subset of {', '.join(METHOD_NAMES)} (each with all its levels) or of "
                   "the rows METHOD:LEVEL (e.g. mage:defaults, sparsed:select=0.2; see SETTINGS); default: all")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {', '.join(TASKS)}")
    p.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help="prompts per generate call for accuracy and speed (default: all --samples in one batch; "
                   "smaller where a batch of every sample does not fit the GPU)")
    p.add_argument("--time-repeats", type=int, default=0, metavar="N",
                   help="time N more generate calls of each row's batch (warm) for its speed-up over dense (0: none)")
    p.add_argument("--plot", default=None, metavar="JSON",
                   help="draw the Pareto PNGs (speed-up x accuracy) of a results file into --out (no model runs)")
    p.add_argument("--merge", default=None, metavar="JSON[,JSON]",
                   help="write one table from the JSON results of earlier runs (no model runs)")
    return p.parse_args(argv)


def split(flag: str, value: str, valid=None) -> tuple[str, ...]:
    items = tuple(dict.fromkeys(x.strip() for x in value.split(",") if x.strip()))
    if not items:
        raise ValueError(f"{flag} {value!r} names nothing")
    unknown = [x for x in items if valid is not None and x not in valid]
    if unknown:
        raise ValueError(f"{flag}: unknown {unknown}; valid: {', '.join(valid)}")
    return items


def checked_methods(value: str | None) -> tuple[str, ...]:
    """The Setting keys that --methods names (a method name stands for all its rows)."""
    if value is None:
        return tuple(s.key for s in SETTINGS)
    keys = [s.key for s in SETTINGS]
    chosen = []
    for item in split("--methods", value):
        picked = [s.key for s in SETTINGS if item in (s.method, s.key)]
        if not picked:
            raise ValueError(f"--methods: unknown method or row {item!r}; methods: {', '.join(METHOD_NAMES)}; "
                             f"rows: {', '.join(keys)}")
        chosen += picked
    return tuple(dict.fromkeys(chosen))


def checked_contexts(value: str, tasks: tuple[str, ...]) -> tuple[int, ...]:
    contexts = []
    for item in split("--contexts", value):
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"--contexts: {item!r} is not a positive integer")
        contexts.append(int(item))
    for task in (t for t in tasks if t != "sanity"):
        least = min_context_length(task)
        if min(contexts) < least:
            raise ValueError(f"--contexts {min(contexts)} is too short for {task}: it needs at least {least} tokens")
    return tuple(contexts)


def checked_tag(tag: str) -> str:
    if tag and not tag.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"--tag {tag!r}: use letters, digits, '-' and '_' (it names files)")
    return tag


def checked_model(path: str) -> ModelSpec:
    directory = Path(path)
    _, config = read_hf_config(directory)  # ValueError naming the file when missing or invalid
    if not (directory / "tokenizer.json").is_file():
        raise ValueError(f"--models {path}: no tokenizer.json (the task suite's tokenizer must ship with the model)")
    family = model_family(config).label
    if family not in {f for s in SETTINGS for f in s.families}:
        raise ValueError(f"--models {path}: a {family} model; this benchmark's method settings are for "
                         f"{' and '.join(sorted({f for s in SETTINGS for f in s.families}))} models")
    return ModelSpec(path=directory, name=directory.resolve().name, family=family, config=config)


def checked_plan(args: argparse.Namespace) -> Plan:
    """Every flag checked (methods built at every context, contexts against every model) before any
    weights load: ValueError naming the flag and the bad value."""
    tasks = split("--tasks", args.tasks, TASKS)
    chosen = checked_methods(args.methods)
    contexts = checked_contexts(args.contexts, tasks)
    if args.samples < 1:
        raise ValueError(f"--samples {args.samples} must be at least 1")
    if args.time_repeats < 0:
        raise ValueError(f"--time-repeats {args.time_repeats} must be at least 0")
    if not 0 <= args.seed < TRAIN_SEED_FLOOR:
        raise ValueError(f"--seed {args.seed} must lie in [0, {TRAIN_SEED_FLOOR}): seeds from {TRAIN_SEED_FLOOR} on "
                         "are training seeds (dllm_jax.train.data.TRAIN_SEED_FLOOR)")
    if args.batch_size is not None and not 1 <= args.batch_size <= args.samples:
        raise ValueError(f"--batch-size {args.batch_size} must lie in [1, --samples {args.samples}]")
    diagnostics = min(4, args.samples) if args.diagnostics is None else args.diagnostics
    if not 0 <= diagnostics <= args.samples:
        raise ValueError(f"--diagnostics {diagnostics} must lie in [0, --samples {args.samples}]")
    if args.models is None:
        raise ValueError("--models is required (or --merge)")
    models = tuple(checked_model(path) for path in split("--models", args.models))
    names = [m.name for m in models]
    if len(set(names)) < len(names):
        raise ValueError(f"--models {args.models}: two directories share a name ({names}); the table names models "
                         "by it")
    for key in chosen if args.methods is not None else ():
        families = next(s.families for s in SETTINGS if s.key == key)
        if not any(m.family in families for m in models):
            raise ValueError(f"--methods {key} serves {' and '.join(families)} models, and no --models is one")
    plan = Plan(models=models, contexts=contexts, tasks=tasks, chosen=chosen, samples=args.samples, seed=args.seed,
                diagnostics=diagnostics, out=Path(args.out), tag=checked_tag(args.tag), time_repeats=args.time_repeats,
                batch_size=args.samples if args.batch_size is None else args.batch_size)
    for spec in models:
        for task in tasks:
            for context in ([SANITY_CONTEXT] if task == "sanity" else contexts):
                check_context(spec.config, prompt_length(task, context), answer_room(spec.config, task))
        for setting in plan.settings(spec.family):
            for context in contexts:
                try:
                    make_method(setting.method, **setting.params(context))  # range errors now, not mid-run
                except ValueError as e:
                    raise ValueError(f"--contexts {context}: row {setting.key} is invalid there: {e}") from None
    return plan


# --- running ---

def mean(values) -> float | None:
    """The mean of the finite values, None if there are none (JSON-ready)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(finite)) if finite else None


def diagnose(spec: ModelSpec, model, samples, method, options: dict) -> tuple[float | None, float | None]:
    """(mean recall, mean relative L1) of `method` on `samples`, one prompt at a time (SDAR's report
    follows one row's blocks)."""
    fn = analyze if spec.family == "LLaDA" else analyze_blocks
    summaries = [fn(model, s.prompt_ids[None], method, **options).summary() for s in samples]
    return mean(s["recall"] for s in summaries), mean(s["l1"] for s in summaries)


def calibration_inputs(spec: ModelSpec, plan: Plan, context: int, tokenizer) -> list[np.ndarray]:
    """A few prompts per long task with their answer windows all [MASK] (a denoising step's input),
    drawn with a training seed: the evaluation prompts never tune the method."""
    inputs = []
    for task in LONG_TASKS:
        samples = make_samples(task, context, CALIBRATION_PROMPTS, TRAIN_SEED_FLOOR + plan.seed, tokenizer)
        ids = np.stack([s.prompt_ids for s in samples])
        masks = np.full((len(samples), answer_room(spec.config, task)), spec.config.mask_token_id, np.int32)
        inputs.append(np.concatenate([ids, masks], axis=1))
    return inputs


def calibrate(spec: ModelSpec, plan: Plan, model, tokenizer, context: int, targets: tuple[float, float]) -> dict:
    """Calibrates SpargeAttn on `model` for `context`; writes the JSON next to the results; returns its record."""
    start = time.perf_counter()
    l1, pv_l1 = targets
    calibration = calibrate_llada(model, calibration_inputs(spec, plan, context, tokenizer), progress=False, l1=l1,
                                  pv_l1=pv_l1)
    path = plan.out / f"{plan.benchmark}_calibration_{spec.name}_{context}_l1-{l1:.2f}.json"
    plan.out.mkdir(parents=True, exist_ok=True)
    save_calibration(path, calibration)
    record = dict(model=spec.name, context=context, l1_target=l1, pv_l1_target=pv_l1, file=path.name,
                  sparsity=float(np.mean(calibration.sparsity)), l1=float(np.mean(calibration.l1)),
                  seconds=time.perf_counter() - start)
    print(f"calibrated SpargeAttn on {spec.name} at {context}: L1 < {l1:g}, mean sparsity {record['sparsity']:.2f}, "
          f"mean L1 {record['l1']:.3f} ({record['seconds']:.1f} s) -> {path}", flush=True)
    return record


def build(setting: Setting, context: int, calibration: dict | None, out: Path):
    """(policy or None, label) of a setting at a context."""
    params = setting.params(context)
    if setting.calibration is None:
        method = make_method(setting.method, **params)
        return method, describe(method)
    if calibration is None or "error" in calibration:
        raise RuntimeError(f"no calibration: {None if calibration is None else calibration['error']}")
    method = make_method(setting.method, calibration=str(out / calibration["file"]), **params)
    return method, f"sparge(calibration={calibration['file']})"  # describe would list every per-head value


def run_row(spec: ModelSpec, plan: Plan, model, tokenizer, samples, setting: Setting, context: int,
            calibration: dict | None) -> dict:
    """One (model, task, context, setting): accuracy over all samples (in batches of `plan.batch_size`), then
    diagnostics."""
    row = dict(model=spec.name, family=spec.family, task=samples[0].task, context=context, method=setting.method,
               level=setting.level, name=setting.name, label=None, accuracy=None, correct=None, n=len(samples),
               distractor_answers=None, recall=None, l1=None, seconds=None, sample_seconds=None, speedup=None,
               diagnostics_seconds=None, error=None, diagnostics_error=None, decoding=None)
    try:
        method, row["label"] = build(setting, context, calibration, plan.out)
        result = evaluate(model, samples, tokenizer=tokenizer, method=method, batch_size=plan.batch_size,
                          progress=False, **dict(setting.decoding))
        # wrong answers that were a distractor's whole value: the wrong needle taken, not a garbled copy
        row.update(accuracy=result.accuracy, correct=result.num_correct, seconds=result.seconds,
                   distractor_answers=sum(result.distractors().values()),
                   decoding={k: result.options[k] for k, _ in setting.decoding} or None)
        if plan.time_repeats:
            row["sample_seconds"] = time_per_sample(model, samples[:plan.batch_size], method, result.options,
                                                    plan.time_repeats)
    except Exception as e:  # one failing row must not lose the others' results
        row["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        return row
    if method is not None and plan.diagnostics:
        start = time.perf_counter()
        try:
            # the method against exact attention on the dense trajectory: the probes decode without a cache
            options = {k: v for k, v in result.options.items() if k not in dict(setting.decoding)}
            row["recall"], row["l1"] = diagnose(spec, model, samples[:plan.diagnostics], method, options)
        except Exception as e:  # the accuracy stands; the table says n/a
            row["diagnostics_error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        row["diagnostics_seconds"] = time.perf_counter() - start
    return row


def time_per_sample(model, samples, method, options: dict, repeats: int) -> float:
    """Median seconds of `generate` on the samples' prompts as one batch (a batch `evaluate` just ran, so
    compiled), over the batch size."""
    ids = np.stack([s.prompt_ids for s in samples])
    times = call_times(lambda: generate(model, ids, method=method, **options), repeats=repeats, warmup=0, burst_s=0)
    return float(np.median(times)) / len(samples)


def add_speedups(rows: list[dict]) -> None:
    """Each timed row's speed-up: the same (model, task, context)'s dense time per sample over its own."""
    dense = {(r["model"], r["task"], r["context"]): r["sample_seconds"] for r in rows
             if r["method"] == "dense" and not r["level"]}
    for r in rows:
        base = dense.get((r["model"], r["task"], r["context"]))
        if base and r["sample_seconds"]:
            r["speedup"] = base / r["sample_seconds"]


def progress_line(row: dict) -> str:
    where = f"{row['model']} {row['task']}@{row['context']} {row['label'] or row['name']}"
    if row["error"]:
        return f"{where}: ERROR {row['error']}"
    diag = "" if row["diagnostics_seconds"] is None else (
        f", recall {fmt(row['recall'], '.3f')}, L1 {fmt(row['l1'], '.3f')} ({row['diagnostics_seconds']:.1f} s)")
    timed = "" if row["sample_seconds"] is None else f", {1e3 * row['sample_seconds']:.1f} ms/sample warm"
    return f"{where}: {row['accuracy']:.1%} ({row['correct']}/{row['n']}) in {row['seconds']:.1f} s{timed}{diag}"


def run_model(spec: ModelSpec, plan: Plan, calibrations: list[dict], on_row=lambda rows: None) -> list[dict]:
    """Every row of one model, in the order: sanity (dense), then per context, task and setting;
    `on_row(rows so far)` after each."""
    model = load_model(spec.path, progress=False)
    tokenizer = load_tokenizer(spec.path)
    rows = []
    settings = plan.settings(spec.family)
    jobs = [("sanity", SANITY_CONTEXT, [s for s in settings if s.baseline])] if "sanity" in plan.tasks else []
    jobs += [(task, c, settings) for c in plan.contexts for task in plan.tasks if task != "sanity"]
    calibrated: dict[tuple[int, tuple], dict] = {}
    for task, context, chosen in jobs:
        samples = make_samples(task, context, plan.samples, plan.seed, tokenizer)
        for setting in chosen:
            key = (context, setting.calibration)
            if setting.calibration is not None and key not in calibrated:
                try:
                    calibrated[key] = calibrate(spec, plan, model, tokenizer, context, setting.calibration)
                except Exception as e:
                    calibrated[key] = dict(model=spec.name, context=context, l1_target=setting.calibration[0],
                                           error=f"{type(e).__name__}: {e}")
                    traceback.print_exc()
                calibrations.append(calibrated[key])
            rows.append(run_row(spec, plan, model, tokenizer, samples, setting, context, calibrated.get(key)))
            print(progress_line(rows[-1]), flush=True)
            add_speedups(rows)
            on_row(rows)
    return rows


# --- the report ---

def fmt(value, spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def columns(meta: dict) -> list[tuple[str, int]]:
    cols = [(task, c) for c in meta["contexts"] for task in meta["tasks"] if task != "sanity"]
    return cols + ([("sanity", SANITY_CONTEXT)] if "sanity" in meta["tasks"] else [])


def family_settings(meta: dict, family: str) -> list[Setting]:
    return [s for s in SETTINGS if s.key in meta["methods"] and family in s.families]


def accuracy_cell(row: dict | None) -> str:
    if row is None:
        return "–"
    return "error" if row["error"] else f"{100 * row['accuracy']:.1f}"


def model_table(meta: dict, model: str, rows: list[dict]) -> list[str]:
    cols = columns(meta)
    family = meta["families"][model]
    lines = [f"## {model} ({family})", ""]
    cells = []
    for setting in family_settings(meta, family):
        mine = [r for r in rows if (r["model"], r["method"], r["level"]) == (model, setting.method, setting.level)]
        by_cell = {(r["task"], r["context"]): r for r in mine}
        measured = setting.method != "dense" and meta["diagnostics"] > 0
        recall = fmt(mean(r["recall"] for r in mine), ".3f") if measured else "–"
        l1 = fmt(mean(r["l1"] for r in mine), ".3f") if measured else "–"
        cells.append([setting.name, *(accuracy_cell(by_cell.get(c)) for c in cols), recall, l1])
    header = ["method", *(f"{t}@{c}" for t, c in cols), "recall", "L1"]
    return lines + markdown_table(header, cells, align="l" + "r" * (len(cols) + 2)) + [""]


def speed_table(meta: dict, model: str, rows: list[dict]) -> list[str]:
    """Per setting and (task, context): the speed-up over dense in the same run; dense's row gives its
    warm milliseconds per sample. Nothing when the run timed no row."""
    mine = [r for r in rows if r["model"] == model]
    if not any(r.get("sample_seconds") for r in mine):
        return []
    cols = [c for c in columns(meta) if c[0] != "sanity"]
    cells = []
    for setting in family_settings(meta, meta["families"][model]):
        by_cell = {(r["task"], r["context"]): r for r in mine if (r["method"], r["level"]) == (setting.method,
                                                                                                setting.level)}
        if setting.baseline:
            values = [f"{1e3 * by_cell[c]['sample_seconds']:.1f} ms" if by_cell.get(c, {}).get("sample_seconds")
                      else "–" for c in cols]
        else:
            values = [f"{by_cell[c]['speedup']:.2f}×" if by_cell.get(c, {}).get("speedup") else "–" for c in cols]
        cells.append([setting.name, *values])
    batches = per_context(meta, "batch_size")
    batch = (str(batches[meta["contexts"][0]]) if len(set(batches.values())) == 1 else
             "per context, the last merged run's: " + ", ".join(f"{n} at {c}" for c, n in batches.items()) +
             "; each run's file in `merged_from` has its own")
    lines = [f"Speed of {model}: warm `generate` time per sample of one batch ({batch} prompts, "
             f"median of {meta.get('time_repeats')} calls) for dense, and each setting's speed-up over it (same run, "
             "same prompts and options):", ""]
    return lines + markdown_table(["method", *(f"{t}@{c}" for t, c in cols)], cells, align="l" + "r" * len(cols)) + [""]


def settings_table(meta: dict, model: str, rows: list[dict]) -> list[str]:
    contexts = meta["contexts"]
    lines = [f"What the rows of {model} run at each context (`describe` of the policy):", ""]
    cells = []
    for setting in family_settings(meta, meta["families"][model]):
        labels = []
        for c in contexts:
            label = next((r["label"] for r in rows if r["model"] == model and r["context"] == c
                          and r["method"] == setting.method and r["level"] == setting.level and r["label"]), None)
            labels.append(f"`{label}`" if label else "–")
        cells.append([setting.name, setting.meaning, *labels])
    return lines + markdown_table(["row", "meaning", *(str(c) for c in contexts)], cells) + [""]


def per_context(meta: dict, key: str) -> dict[int, int]:
    """{context: the run's `key`} (a merge of runs that differ in it keeps one value per context)."""
    by_context = meta.get(f"{key}_by_context")
    return ({int(c): n for c, n in by_context.items()} if by_context else
            {c: run_value(meta, key) for c in meta["contexts"]})


def run_value(meta: dict, key: str) -> int:
    """A run's diagnostics or batch size (runs from before --batch-size ran every sample in one batch)."""
    value = meta.get(key)
    return meta["samples"] if value is None else value


def diagnosed(meta: dict) -> str:
    """Which samples the recall and L1 columns average, for the header."""
    by_context = per_context(meta, "diagnostics")
    if len(set(by_context.values())) == 1:
        return f"the first {meta['diagnostics']} samples of every task and context"
    measured = [c for c, n in by_context.items() if n]
    return (f"the first {max(by_context.values())} samples of every task at {', '.join(map(str, measured))} tokens "
            f"only (not measured at {', '.join(str(c) for c, n in by_context.items() if not n)})")


def report(meta: dict, rows: list[dict]) -> list[str]:
    """The Markdown: a header, then per model the accuracy table and what its rows mean, the
    calibrations and any errors."""
    lines = [f"# Accuracy of the sparse-attention methods on trained tiny models — {meta['device']}, "
             f"jax {meta['jax']}, {meta['date']}", "",
             f"{meta['samples']} samples per task and context, evaluation seed {meta['seed']} (fresh: training seeds "
             "are >= 2**31). Accuracy in % (exact match up to EOS), greedy decoding, one token unmasked per step "
             "(LLaDA: one block over the answer window; SDAR: 4 steps per block of 4, low_confidence_static). Recall "
             f"and relative L1 vs dense attention: means over {diagnosed(meta)} "
             "(LLaDA: `analyze`, sparse steps; SDAR: `analyze_blocks`, a block's steps after its first, "
             "dense trajectory; means over layers, heads and steps, MAGE's exact first 2 layers counting with L1 0); "
             "n/a: not measurable for the method (SpargeAttn has no fixed pattern, so no recall) or failed; –: not "
             "run. The sanity task (64-token prompts) runs dense only.", ""]
    for model in meta["models"]:
        lines += model_table(meta, model, rows) + speed_table(meta, model, rows) + settings_table(meta, model, rows)
    if meta["calibrations"]:
        lines += ["SpargeAttn calibrations (per head, on prompts drawn with training seeds; JSON next to this file):",
                  ""]
        for c in meta["calibrations"]:
            lines.append(f"- {c['model']} at {c['context']}, L1 < {c['l1_target']:g}: " + (
                f"error {c['error']}" if "error" in c else
                f"mean sparsity {c['sparsity']:.2f}, mean L1 {c['l1']:.3f}, {c['seconds']:.0f} s, `{c['file']}`"))
        lines.append("")
    errors = [r for r in rows if r["error"] or r["diagnostics_error"]]
    if errors:
        lines += ["Errors:", ""] + [f"- {r['model']} {r['task']}@{r['context']} {r['name']}: "
                                    f"{r['error'] or 'diagnostics: ' + r['diagnostics_error']}" for r in errors]
    return lines


def run(plan: Plan) -> Path:
    meta = dict(benchmark=plan.benchmark, tag=plan.tag or None, device=jax.devices()[0].device_kind,
                jax=jax.__version__, date=datetime.date.today().isoformat(), models=[m.name for m in plan.models],
                families={m.name: m.family for m in plan.models}, model_paths=[str(m.path) for m in plan.models],
                contexts=list(plan.contexts), tasks=list(plan.tasks), methods=list(plan.chosen), samples=plan.samples,
                seed=plan.seed, diagnostics=plan.diagnostics, time_repeats=plan.time_repeats,
                batch_size=plan.batch_size)
    print(f"quality on {meta['device']}: models {meta['models']}, contexts {meta['contexts']}, {plan.samples} samples, "
          f"seed {plan.seed}", flush=True)
    start = time.perf_counter()
    rows: list[dict] = []
    calibrations: list[dict] = []
    for spec in plan.models:
        rows += run_model(spec, plan, calibrations, on_row=lambda mine: save_partial(
            plan, meta | dict(calibrations=calibrations, seconds=time.perf_counter() - start), rows + mine))
    meta |= dict(calibrations=calibrations, seconds=time.perf_counter() - start)
    return write_results(plan.out, meta, rows, report(meta, rows))


def save_partial(plan: Plan, meta: dict, rows: list[dict]) -> None:
    """The rows so far, under the name the finished run's JSON takes (a run cut short keeps them)."""
    plan.out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(dict(meta, partial=True, rows=rows), indent=2) + "\n"
    write_atomic(plan.out / f"{results_stem(meta)}.json", text)


# --- merging the results of several runs (e.g. one per model and context, each within a time limit) ---

def merge(paths: tuple[str, ...], out: Path, tag: str) -> Path:
    """One table from several runs' JSON files (same samples, seed and device; the diagnostics and batch
    size are kept per context, from the last file holding it); a row that appears in several files (model,
    task, context, method, level) is taken from the last, so a rerun of failed rows replaces them."""
    def changes(parts: list[dict]) -> dict:
        return dict(benchmark="quality" + (f"_{tag}" if tag else ""), tag=tag or None,
                    date=max(p["date"] for p in parts), models=union(p["models"] for p in parts),
                    families={k: v for p in parts for k, v in p["families"].items()},
                    model_paths=union(p["model_paths"] for p in parts),
                    contexts=sorted(union(p["contexts"] for p in parts)),
                    tasks=union((p["tasks"] for p in parts), TASKS),
                    methods=union((p["methods"] for p in parts), [s.key for s in SETTINGS]),
                    calibrations=[c for p in parts for c in p["calibrations"]],
                    seconds=sum(p["seconds"] for p in parts),
                    diagnostics=max(p["diagnostics"] for p in parts),
                    diagnostics_by_context=context_values(parts, "diagnostics"),
                    batch_size_by_context=context_values(parts, "batch_size"))

    def context_values(parts: list[dict], key: str) -> dict[str, int]:
        # the last file's value at a context, as its rows replace the earlier ones'
        return {str(c): n for c, n in sorted({c: run_value(p, key) for p in parts
                                              for c in p["contexts"]}.items())}

    return merge_results(paths, out, report=report, same=("samples", "seed", "device"),
                         changes=changes, key=lambda r: (r["model"], r["task"], r["context"], r["method"], r["level"]))


# --- the Pareto pictures ---

def pareto_points(data: dict, model: str, context: int) -> list[dict]:
    """Per setting run on (model, context) with a speed-up on every task dense ran there: its mean accuracy
    and mean speed-up over the tasks (dense: 1), and its samples. A setting missing a task is left out (a
    point over fewer tasks would not compare)."""
    def rows(setting: Setting) -> list[dict]:
        return [r for r in data["rows"] if (r["model"], r["context"], r["method"], r["level"]) ==
                (model, context, setting.method, setting.level) and not r["error"] and r["task"] != "sanity"]

    settings = family_settings(data, data["families"][model])
    tasks = {r["task"] for s in settings if s.baseline for r in rows(s)}
    points = []
    for setting in settings:
        mine = rows(setting)
        speedups = [1.0 if setting.baseline else r.get("speedup") for r in mine]
        if mine and {r["task"] for r in mine} == tasks and all(v is not None for v in speedups):
            points.append(dict(name=setting.name, speedup=float(np.mean(speedups)),
                               accuracy=100 * sum(r["correct"] for r in mine) / sum(r["n"] for r in mine),
                               samples=sum(r["n"] for r in mine)))
    return points


def plot(path: str, out: Path) -> list[Path]:
    """One PNG per (model, context) of a results file: x the mean speed-up over dense, y the accuracy over
    the tasks, a labelled point per setting, the Pareto front joined. Returns the files written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install 'dllm-jax[analysis]'") from e
    data = read_results([path], flag="--plot")[0]
    if not any(r.get("speedup") for r in data["rows"]):
        raise ValueError(f"--plot {path}: no row has a speed-up (run with --time-repeats N)")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for model in data["models"]:
        for context in data["contexts"]:
            points = pareto_points(data, model, context)
            if len(points) < 2:
                continue
            fig, ax = plt.subplots(figsize=(6.4, 4.4))
            ax.scatter([p["speedup"] for p in points], [p["accuracy"] for p in points], zorder=3)
            # the labels of settings with one accuracy stepped down in turn, so that ties stay readable
            ties: dict[float, int] = {}
            for p in sorted(points, key=lambda p: p["speedup"]):
                rank = ties[p["accuracy"]] = ties.get(p["accuracy"], -1) + 1
                ax.annotate(p["name"], (p["speedup"], p["accuracy"]), textcoords="offset points",
                            xytext=(5, 4 - 10 * rank), fontsize=8)
            low, high = min(p["speedup"] for p in points), max(p["speedup"] for p in points)
            ax.set_xlim(min(0.9, low - 0.05), max(1.3, high * 1.15))  # a 1% difference does not fill the axis
            front = pareto_front(points)
            ax.plot([p["speedup"] for p in front], [p["accuracy"] for p in front], "--", color="gray", zorder=2)
            tasks = sorted({r["task"] for r in data["rows"] if r["model"] == model and r["context"] == context
                            and r["task"] != "sanity"})
            ax.set(xlabel="speed-up over dense (warm generate, same run)",
                   ylabel=f"accuracy % ({', '.join(tasks)}; {points[0]['samples']} samples)")
            ax.set_title(f"{model} at {context} tokens — {data['device']}, {data['date']}", fontsize=9)
            ax.grid(alpha=0.3)
            target = out / f"{data['benchmark']}_pareto_{model}_{context}.png"
            fig.tight_layout()
            fig.savefig(target, dpi=120, bbox_inches="tight")
            plt.close(fig)
            written.append(target)
            print(f"wrote {target}")
    return written


def pareto_front(points: list[dict]) -> list[dict]:
    """The points no other point beats in both speed-up and accuracy, by speed-up."""
    front = [p for p in points if not any(q["speedup"] >= p["speedup"] and q["accuracy"] >= p["accuracy"] and
                                          (q["speedup"], q["accuracy"]) != (p["speedup"], p["accuracy"])
                                          for q in points)]
    return sorted(front, key=lambda p: p["speedup"])


def main(argv=None) -> Path | list[Path]:
    args = parse_args(argv)
    if args.plot is not None:
        return plot(args.plot, Path(args.out))
    if args.merge is not None:
        if args.models is not None:
            raise ValueError("--merge rebuilds a table from results files: it takes no --models")
        return merge(split("--merge", args.merge), Path(args.out), checked_tag(args.tag))
    return run(checked_plan(args))  # every flag error before any weights load


if __name__ == "__main__":
    main()
