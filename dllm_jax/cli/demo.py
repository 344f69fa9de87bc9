"""`dllm-jax demo` (make demo), the main job: each trained checkpoint -> Orbax -> load -> answers a fresh
passkey question, timed -> accuracy on a small batch of fresh samples of each task it was trained on."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from dllm_jax.cli.common import dtype_parent
from dllm_jax.flags import fresh_seed, positive_int

# The trained checkpoints the demo runs (checkpoints/README.md), in order: directory name -> the tasks it was
# trained on, which the demo evaluates. A missing one (not trained yet) is skipped with a note.
DEMO_CHECKPOINTS = {"tiny-sdar-tasks": ("passkey",), "tiny-llada-tasks": ("passkey",)}
REPOSITORY_CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"  # the clone's (editable install)


def add_parser(subparsers) -> None:
    demo = subparsers.add_parser(
        "demo", parents=[dtype_parent()], help="trained checkpoints answer a fresh passkey question",
        description="The main job (make demo): each trained checkpoint of checkpoints/ (tiny-sdar-tasks, "
                    "tiny-llada-tasks; a missing one is skipped with a note) is converted to Orbax and loaded; it "
                    "answers a passkey question it never saw (dllm_jax.eval.make_samples, greedy dllm_jax.generate), "
                    "timed; then --samples fresh samples of each task it was trained on give its accuracy.")
    demo.add_argument("--checkpoints", default=str(REPOSITORY_CHECKPOINTS), metavar="DIR",
                      help="directory of the trained checkpoints (default: the repository's checkpoints/)")
    demo.add_argument("--context", type=positive_int, default=1024, metavar="N",
                      help="prompt tokens (1024, the longest context trained)")
    demo.add_argument("--samples", type=positive_int, default=8, metavar="N", help="samples per task (8)")
    demo.add_argument("--seed", type=fresh_seed, default=None, metavar="N",
                      help="seed of the samples, in [0, 2**31): evaluation seeds never used in training "
                           "(default: from the clock)")
    demo.set_defaults(fn=run)


def run(args) -> None:
    """The demo over every trained checkpoint found in --checkpoints (the others get a note)."""
    import jax

    root = Path(args.checkpoints)
    found = found_checkpoints(root, args.context)
    seed = demo_seed(args.seed)
    print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind}); evaluation seed {seed} "
          f"(--seed {seed} repeats this run)")
    for name, tasks in DEMO_CHECKPOINTS.items():
        if name in found:
            demo_checkpoint(root / name, tasks, seed, args)
        else:
            print(f"\n== {name}: not in {root} (not trained yet); skipped")


def found_checkpoints(root: Path, context: int) -> list[str]:
    """The DEMO_CHECKPOINTS in `root`; ValueError when there is none, or --context is too short for their tasks."""
    from dllm_jax.eval import min_context_length

    found = [name for name in DEMO_CHECKPOINTS if (root / name / "config.json").is_file()]
    if not found:
        raise ValueError(f"--checkpoints {root} holds none of the trained checkpoints ({', '.join(DEMO_CHECKPOINTS)}"
                         "): run the demo from a clone of the repository, or point --checkpoints at its checkpoints/")
    shortest = max(min_context_length(task) for task in {"passkey", *(t for n in found for t in DEMO_CHECKPOINTS[n])})
    if context < shortest:
        raise ValueError(f"--context {context} is too short: the demo's prompts need at least {shortest} tokens")
    return found


def demo_seed(seed: int | None) -> int:
    """--seed, or one from the clock: below 2**31, where no training sample's seed lies, so the prompts are new."""
    from dllm_jax.train.data import TRAIN_SEED_FLOOR

    return time.time_ns() % TRAIN_SEED_FLOOR if seed is None else seed


def demo_checkpoint(path: Path, tasks: tuple[str, ...], seed: int, args) -> None:
    """One checkpoint's part of the demo."""
    from dllm_jax.eval import evaluate, load_tokenizer, make_samples

    tokenizer = load_tokenizer(path)
    question = make_samples("passkey", args.context, 1, seed, tokenizer)[0]  # a bad --context fails before loading
    print(f"\n== {path.name}")
    model = converted_model(path, args.dtype)
    show_question(question, tokenizer)
    answer_question(model, question, tokenizer)
    for task in tasks:
        samples = make_samples(task, args.context, args.samples, seed, tokenizer)
        result = evaluate(model, samples, tokenizer=tokenizer, batch_size=args.samples)  # progress bar on stderr
        first = "; the first is the question above" if task == "passkey" else ""
        print(f"{task} at {args.context} tokens, {args.samples} fresh samples (seed {seed}{first}): "
              f"{result.num_correct}/{result.num_samples} correct in {result.seconds:.1f} s (compilation included)")


def converted_model(path: Path, dtype: str):
    """The HF checkpoint converted to Orbax (in a temporary directory) and loaded from there, timed."""
    from dllm_jax.checkpoint import convert_hf_checkpoint, load_model

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        convert_hf_checkpoint(path, Path(tmp) / "orbax", progress=False)
        converted = time.perf_counter()
        model = load_model(Path(tmp) / "orbax", dtype=dtype, progress=False)
        loaded = time.perf_counter()
    c = model.config
    print(f"{type(model).__name__}: {c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads} heads, vocabulary "
          f"{c.vocab_size}; HF -> Orbax in {converted - start:.2f} s, loaded ({dtype}) in {loaded - converted:.2f} s")
    return model


def show_question(sample, tokenizer) -> None:
    """Where the key hides in the prompt, and the prompt's last words (the question)."""
    digits = sample.answer_ids[:-1]  # without the EOS
    windows = np.lib.stride_tricks.sliding_window_view(sample.prompt_ids, len(digits))
    at = int(np.flatnonzero((windows == digits).all(axis=1))[0])  # filler has no digits: the key's only place
    near = tokenizer.decode(sample.prompt_ids[max(0, at - 6):at + len(digits) + 5].tolist())
    tail = tokenizer.decode(sample.prompt_ids[-16:].tolist())
    print(f"passkey prompt of {len(sample.prompt_ids)} tokens; the key {sample.answer!r} hides at token {at}: "
          f"... {near} ...")
    print(f"the prompt ends: ... {tail}")


def answer_question(model, sample, tokenizer) -> None:
    """Generates the answer greedily with dllm_jax.generate (dllm_jax.eval's options), timed: the first
    call compiles the loop, the second reuses it."""
    from dllm_jax.eval.evaluate import default_options, record
    from dllm_jax.generate import generate

    options = default_options(model, [sample], {})
    ids = sample.prompt_ids[None]
    print(f"generate(model, ids, {', '.join(f'{k}={v}' for k, v in options.items())}) ...", flush=True)
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        new = np.asarray(generate(model, ids, **options))[0, ids.shape[1]:]
        seconds.append(time.perf_counter() - start)
    answer = record(sample, new, tokenizer)
    verdict = "correct" if answer.correct else f"wrong (the key is {sample.answer!r})"
    print(f"answer: {answer.predicted!r}: {verdict} ({seconds[0]:.2f} s with compilation, {seconds[1]:.2f} s compiled)")
