"""Training batches of the synthetic tasks of `dllm_jax.eval`: which tasks and contexts a step draws, the
answer window each sample is padded to, and the bucket length of each context.

Everything here is a module-level value or function, so a batch source pickles and background
processes can build the batches (`dllm_jax.train.data.Prefetcher`): a class defined in the
`python -m dllm_jax.train` script would pickle as `__main__.X`, which a spawned worker cannot import.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from typing import Any

import numpy as np

from dllm_jax.train.data import TRAIN_SEED_FLOOR, BucketedSource

SDAR_BLOCK = 4  # the block size of the trained SDAR models (and of --init checkpoints, which are checked)


@dataclasses.dataclass(frozen=True)
class TaskSampler:
    """sample_fn(seed, count, context): `count` samples of `context` tokens, each of a task drawn from
    `tasks` (the batch's context is drawn per step, `dllm_jax.train.data.BucketedSource`). A picklable
    value, so background processes can build batches (`dllm_jax.train.data.Prefetcher`). `options`:
    {task: {knob: the values it draws from}} (`make_samples`' options, e.g. {"variable_tracking": {"hops":
    (0, 1)}}), for a curriculum: each sample of the task draws one combination of the values
    (`option_variants`); a task not in it is drawn at its defaults."""

    tasks: tuple[str, ...]
    tokenizer: Any
    options: dict = dataclasses.field(default_factory=dict)

    def __call__(self, seed: int, count: int, context: int):
        from dllm_jax.eval import make_samples

        rng = np.random.default_rng(seed)
        variants = {task: option_variants(self.options.get(task)) for task in set(self.tasks)}
        tasks = [self.tasks[i] for i in rng.choice(len(self.tasks), count)]
        kinds = collections.Counter((task, int(rng.integers(len(variants[task])))) for task in tasks)
        samples = []
        for (task, variant), n in sorted(kinds.items()):  # one make_samples call per kind: its checks run once
            samples += make_samples(task, context, n, int(rng.integers(TRAIN_SEED_FLOOR, 2**62)), self.tokenizer,
                                    options=variants[task][variant])
        return [samples[i] for i in rng.permutation(count)]


def option_variants(knobs: dict[str, tuple[int, ...]] | None) -> list[dict[str, int] | None]:
    """The `make_samples` options a task's samples draw from: every combination of its knobs' values
    ({"needles": (2, 4)} -> [{"needles": 2}, {"needles": 4}]); [None] (the defaults) for no knobs."""
    if not knobs:
        return [None]
    return [dict(zip(knobs, values)) for values in itertools.product(*knobs.values())]


BUCKET_MULTIPLE = 8


def bucket_lengths(tasks: list[str], contexts: list[int], family: str) -> dict[int, int]:
    """{context: its batches' length}: the longest prompt + answer room over the tasks at that context,
    rounded up to a multiple of BUCKET_MULTIPLE (cuDNN's training attention with a mask takes even
    lengths only: a 73-token bucket fails on the GPU)."""
    from dllm_jax.eval.tasks import prompt_length

    def rounded(n: int) -> int:
        return -(-n // BUCKET_MULTIPLE) * BUCKET_MULTIPLE

    return {c: rounded(max(prompt_length(t, c) + room_for(t, family) for t in tasks)) for c in sorted(set(contexts))}


def batch_source(args, tokenizer):
    """The run's batches: each step draws one --context (a context listed twice twice as often), its
    samples draw their tasks, packed to that context's bucket (`bucket_lengths`)."""
    from dllm_jax.eval import vocab

    return BucketedSource(TaskSampler(tuple(args.task), tokenizer, task_options_of(args)), batch_size=args.batch,
                          contexts=args.context,
                          lengths=bucket_lengths(args.task, args.context, args.family),
                          pad_id=vocab.special_ids(tokenizer).pad, seed=args.seed,
                          answer_room=functools.partial(sample_room, family=args.family) if args.pad_in_loss else None)


def task_options_of(args) -> dict[str, dict[str, tuple[int, ...]]]:
    """{task: {knob: its values}} from the command line's --niah-needles, --vt-hops and --vt-ask-back
    (unset: the defaults), as `TaskSampler` takes them."""
    options = {"niah_multikey": {"needles": args.niah_needles},
               "variable_tracking": {"hops": args.vt_hops, "ask_back": args.vt_ask_back}}
    return {task: {k: tuple(v) for k, v in knobs.items() if v is not None} for task, knobs in options.items()
            if any(v is not None for v in knobs.values())}


def room_for(task: str, family: str) -> int:
    """The answer window `dllm_jax.eval.evaluate` generates into for `task` (`answer_window`). For SDAR
    that is whole blocks (every task prompt fills whole blocks of 4): a block is denoised as one, so its
    positions after the EOS must be trained as masked positions too, not shown as padding that gives
    away where the answer ends."""
    from dllm_jax.eval import max_answer_length
    from dllm_jax.generate.requests import answer_window

    return answer_window(max_answer_length(task), None if family == "llada" else SDAR_BLOCK)


def sample_room(sample, *, family: str) -> int:
    """`room_for` the sample's task: a module-level function, so a batch source that uses it pickles."""
    return room_for(sample.task, family)
