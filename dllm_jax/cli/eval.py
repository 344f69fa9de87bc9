"""`dllm-jax eval`: accuracy of a checkpoint on seeded samples of a synthetic long-context task."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dllm_jax.cli.common import add_mesh_flag, add_quantize_flag, checked_out_file, dtype_parent, mesh_of, write_files
from dllm_jax.cli.methods import method_from_args, methods_parent
from dllm_jax.flags import positive_int, seed_int

# eval builds every sample's prompt in memory before generating: these bound what one call may ask for
MAX_EVAL_SAMPLES = 100_000
MAX_EVAL_TOKENS = 2**28  # prompt tokens of all samples together (1 GiB as int32)


def add_parser(subparsers) -> None:
    from dllm_jax.eval import TASKS

    evaluation = subparsers.add_parser(
        "eval", parents=[dtype_parent(), methods_parent()], help="accuracy on a synthetic long-context task",
        description="Makes --samples seeded samples of --task (dllm_jax.eval.tasks) at --context tokens with the "
                    "checkpoint's tokenizer.json (the task vocabulary), generates greedily (dllm_jax.eval.evaluate) "
                    "and prints the accuracy.")
    evaluation.add_argument("--model", required=True, help="converted or HF checkpoint directory (with tokenizer.json)")
    evaluation.add_argument("--task", required=True, choices=list(TASKS))
    evaluation.add_argument("--context", type=positive_int, default=4096, metavar="N",
                            help="prompt tokens (4096; sanity prompts stop at 64); with the answer it must fit "
                                 "the model's max_position_embeddings")
    evaluation.add_argument("--samples", type=positive_int, default=100, metavar="N",
                            help=f"number of samples (100; at most {MAX_EVAL_SAMPLES:,}, and {MAX_EVAL_TOKENS:,} "
                                 "prompt tokens in all)")
    evaluation.add_argument("--seed", type=seed_int, default=0, metavar="N", help="seed of the samples (0)")
    evaluation.add_argument("--batch-size", type=positive_int, default=1, metavar="N",
                            help="samples generated together (1; greedy answers do not depend on it)")
    evaluation.add_argument("--json", default=None, metavar="FILE",
                            help="also write the result and every record here (checked before the run)")
    evaluation.add_argument("--quiet", action="store_true", help="no progress bar")
    add_mesh_flag(evaluation, "samples")
    add_quantize_flag(evaluation)
    evaluation.set_defaults(fn=run)


def run(args) -> None:
    """Generates answers to seeded samples of a synthetic task and prints the accuracy (--json: also
    every sample's record)."""
    from dllm_jax.checkpoint import load_model
    from dllm_jax.config import read_hf_config
    from dllm_jax.eval import evaluate, load_tokenizer, make_samples
    from dllm_jax.families import family_of

    method = method_from_args(args)  # every flag and sample error before the slow loading
    _, config = read_hf_config(args.model)
    family = family_of(config)
    if family.eval_options is None:
        raise ValueError("eval supports LLaDA and SDAR checkpoints (the synthetic tasks' tiny trained models); this "
                         f"one is {family.label}")
    family.check_method(method)
    check_eval_size(args, config)  # before the samples are built and the weights load: both may take minutes
    out = None if args.json is None else checked_out_file(Path(args.json), "--json")
    samples = make_samples(args.task, args.context, args.samples, args.seed, load_tokenizer(args.model))
    model = load_model(args.model, dtype=args.dtype, quantize=args.quantize, mesh=mesh_of(args))
    result = evaluate(model, samples, method=method, batch_size=args.batch_size, progress=not args.quiet)
    print_result(args, samples, result)
    if out is not None:
        write_files(out.parent, {out.name: (json.dumps(result.to_dict(), indent=2) + "\n").encode()})
        print(f"wrote {out}", file=sys.stderr)


def print_result(args, samples, result) -> None:
    """The accuracy line; for a task with distractors also which needle the wrong answers took."""
    print(f"{args.task} at {args.context} tokens, {result.method}: accuracy {result.accuracy:.3f} "
          f"({result.num_correct}/{result.num_samples}) in {result.seconds:.1f} s")
    wrong = result.num_samples - result.num_correct
    if wrong and any(len(s.values) > 1 for s in samples):
        places = result.distractors()
        taken = ", ".join(f"{ordinal(place)} {count}" for place, count in places.items())
        print(f"wrong answers: {sum(places.values())} of {wrong} a distractor's whole value"
              + (f" (by its place in the text: {taken})" if taken else ""))


def check_eval_size(args, config) -> None:
    """--context and --samples against the task and the model (config.json only): the task must fit the
    context, the prompt and its answer window the model's positions, and the samples the limits above."""
    from dllm_jax.eval import max_answer_length, min_context_length
    from dllm_jax.eval.tasks import prompt_length
    from dllm_jax.families import family_of

    least = min_context_length(args.task)
    if args.context < least:
        raise ValueError(f"--context {args.context} is too short for --task {args.task}: its statements and question "
                         f"alone take {least} tokens (the least --context)")
    prompt = prompt_length(args.task, args.context)
    family = family_of(config)
    window = family.eval_options(max_answer_length(args.task), config, {})[family.answer_option]
    limit = config.max_position_embeddings
    if prompt + window > limit:
        raise ValueError(f"--context {args.context} + {window} answer tokens = {prompt + window} positions exceeds the "
                         f"model's context of {limit} (config.json max_position_embeddings): pass --context <= "
                         f"{limit - window}")
    if args.samples > MAX_EVAL_SAMPLES:
        raise ValueError(f"--samples {args.samples} exceeds {MAX_EVAL_SAMPLES:,}, the most one eval builds: split the "
                         "run over several --seed values")
    check_eval_memory(args, config, prompt + window)
    if args.samples * prompt > MAX_EVAL_TOKENS:
        raise ValueError(f"--samples {args.samples} x {prompt} prompt tokens (--context {args.context}) = "
                         f"{args.samples * prompt:,} tokens exceeds the {MAX_EVAL_TOKENS:,} one eval holds in memory: "
                         f"pass --samples <= {MAX_EVAL_TOKENS // prompt}")


def check_eval_memory(args, config, length: int) -> None:
    """A ValueError, before the samples are built, when one forward of --batch-size rows of `length` positions
    cannot fit the memory the device (the host's, on CPU) has free besides the weights, by a lower bound
    (`dllm_jax.cli.budget.least_step_bytes`): the process would otherwise be killed without a message."""
    import jax

    from dllm_jax.cli import budget

    have = budget.available_bytes()
    if have is None:
        return
    mesh = args.mesh or {}
    devices = mesh.get("dp", 1)
    rows = -(-min(args.batch_size, args.samples) // devices)
    scores = jax.default_backend() == "cpu"
    free = have - budget.weight_bytes(config, args.dtype) // mesh.get("tp", 1)
    need = budget.least_step_bytes(config, length, rows, scores=scores)
    if need > free:
        fits = max(0, free) // budget.least_step_bytes(config, length, 1, scores=scores) * devices
        held = " (one layer's attention scores, as the CPU computes them)" if scores else ""
        advice = (f"pass a smaller --batch-size (this bound alone allows {fits}; the run holds more than it counts)"
                  if fits else "pass a shorter --context")
        raise ValueError(f"--batch-size {args.batch_size} at {length} positions (--context {args.context} and the "
                         f"answer) needs at least {need / 2**30:.1f} GiB for one forward{held}, and "
                         f"{free / 2**30:.1f} GiB is free besides the weights: {advice}")


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, 21st, ..."""
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
