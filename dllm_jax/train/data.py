"""Training batches from task samples: packing and a deterministic, resumable batch source.

A sample is anything with `prompt_ids` and `answer_ids` (int arrays; the `Sample` of
dllm_jax.eval.tasks). Its training sequence is prompt_ids ++ answer_ids, right-padded; the answer is
where the loss applies (LLaDA-style SFT: the prompt is never masked). With an answer room (LLaDA), the
answer is followed by pad tokens up to the room, all in the loss, as LLaDA's SFT fills its generation
window: training then sees exactly the window `dllm_jax.eval.evaluate` generates into.

`BatchSource` packs every batch to one length; `BucketedSource` draws one context length per step and
packs the batch to that context's bucket, so short contexts are not padded to the longest one.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import multiprocessing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from dllm_jax.validation import integer

TRAIN_SEED_FLOOR = 2**31  # every training sample's seed is at least this (evaluation seeds stay below)



@dataclasses.dataclass(frozen=True)
class Batch:
    """A packed batch of training sequences."""

    tokens: np.ndarray  # int32 [B, L]: prompt ++ answer, right-padded with the pad id
    loss_mask: np.ndarray  # bool [B, L]: the answer tokens (and the rest of the answer room)
    lengths: np.ndarray  # int32 [B]: each row's real tokens: prompt + answer (room), the rest is padding

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)


def pack(samples: Sequence[Any], length: int, pad_id: int, *, answer_room: Sequence[int] | None = None) -> Batch:
    """Packs samples (with `prompt_ids`, `answer_ids`) into one Batch of `length` columns.

    answer_room: per sample, the generation window after its prompt (>= its answer): the answer is
    followed by pad tokens up to it, all loss-eligible and counted in `lengths` (LLaDA's SFT trains the
    model to fill its window). ValueError for an empty list, a room shorter than its answer, or a row
    longer than `length`.
    """
    length = integer("length", length)
    if not samples:
        raise ValueError("pack needs at least one sample")
    tokens = np.full((len(samples), length), pad_id, np.int32)
    loss_mask = np.zeros((len(samples), length), bool)
    lengths = np.zeros(len(samples), np.int32)
    for row, sample in enumerate(samples):
        prompt = np.asarray(sample.prompt_ids, np.int32).reshape(-1)
        answer = np.asarray(sample.answer_ids, np.int32).reshape(-1)
        room = answer.size if answer_room is None else integer("answer_room", answer_room[row])
        if room < answer.size:
            raise ValueError(f"sample {row}: answer_room {room} is shorter than its {answer.size} answer tokens")
        total = prompt.size + room
        if total > length:
            raise ValueError(f"sample {row} (index {getattr(sample, 'index', '?')}) has {prompt.size} prompt + "
                             f"{room} answer = {total} tokens, more than the sequence length {length}")
        tokens[row, :prompt.size + answer.size] = np.concatenate([prompt, answer])
        loss_mask[row, prompt.size:total] = True
        lengths[row] = total
    return Batch(tokens=tokens, loss_mask=loss_mask, lengths=lengths)


def step_seed(seed: int, step: int) -> int:
    """The sample seed of training step `step` of a run seeded `seed` (a uint32 hashed from both, so
    steps and runs draw unrelated samples; evaluation should use seeds outside this stream)."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1)[0])


@dataclasses.dataclass(frozen=True)
class BatchSource:
    """The batch of every training step, drawn from `sample_fn(seed, count) -> samples`.

    `source(step)` is a pure function of (seed, step), so a resumed run asks for exactly the batches
    an uninterrupted one would see; iterating yields the batches of steps 0, 1, 2, ... forever.
    """

    sample_fn: Callable[[int, int], Sequence[Any]]
    batch_size: int
    length: int
    pad_id: int
    seed: int = 0
    answer_room: Callable[[Any], int] | None = None  # sample -> its generation window (see pack)

    def __post_init__(self):
        integer("BatchSource.batch_size", self.batch_size)
        integer("BatchSource.length", self.length)
        integer("BatchSource.seed", self.seed, minimum=0)

    def __call__(self, step: int) -> Batch:
        samples = self.sample_fn(step_seed(self.seed, step), self.batch_size)
        return pack_batch(samples, self.batch_size, self.length, self.pad_id, self.answer_room)

    def __iter__(self) -> Iterator[Batch]:
        return map(self, itertools.count())


def pack_batch(samples: Sequence[Any], batch_size: int, length: int, pad_id: int,
               answer_room: Callable[[Any], int] | None) -> Batch:
    """`pack` of what a sample_fn returned, after checking it returned `batch_size` samples."""
    if len(samples) != batch_size:
        raise ValueError(f"sample_fn returned {len(samples)} samples, asked for {batch_size}")
    room = None if answer_room is None else [answer_room(s) for s in samples]
    return pack(samples, length, pad_id, answer_room=room)


# a step's context comes from SeedSequence([seed, step, CONTEXT_STREAM]): a stream apart from its samples' seed
CONTEXT_STREAM = 1


@dataclasses.dataclass(frozen=True)
class BucketedSource:
    """The batch of every training step, its samples all of ONE context length, packed to that
    context's bucket: `lengths[context]` columns (its longest prompt + answer room over the run's tasks).

    Each step draws its context uniformly from `contexts` (a context listed twice is drawn twice as
    often), then asks `sample_fn(seed, count, context) -> samples` for the batch. Batches come in one
    shape per distinct context, so a jitted step compiles a handful of times, and a 64-token context is
    not padded to the longest one. `source(step)` is a pure function of (seed, step), as `BatchSource`.
    """

    sample_fn: Callable[[int, int, int], Sequence[Any]]
    batch_size: int
    contexts: Sequence[int]
    lengths: Mapping[int, int]  # context -> its bucket's length (at least every row of that context)
    pad_id: int
    seed: int = 0
    answer_room: Callable[[Any], int] | None = None  # sample -> its generation window (see pack)

    def __post_init__(self):
        integer("BucketedSource.batch_size", self.batch_size)
        integer("BucketedSource.seed", self.seed, minimum=0)
        contexts = tuple(integer("BucketedSource.contexts", c) for c in self.contexts)
        if not contexts:
            raise ValueError("BucketedSource.contexts needs at least one context length")
        missing = sorted(set(contexts) - set(self.lengths))
        if missing:
            raise ValueError(f"BucketedSource.lengths has no bucket length for the context(s) {missing}")
        object.__setattr__(self, "contexts", contexts)
        object.__setattr__(self, "lengths", {c: integer(f"BucketedSource.lengths[{c}]", self.lengths[c])
                                             for c in sorted(set(contexts))})

    @property
    def length(self) -> int:
        """The longest bucket: the run's seq_length."""
        return max(self.lengths.values())

    def context(self, step: int) -> int:
        """The context length of step `step`'s batch."""
        draw = np.random.default_rng(np.random.SeedSequence([self.seed, step, CONTEXT_STREAM]))
        return self.contexts[int(draw.integers(len(self.contexts)))]

    def __call__(self, step: int) -> Batch:
        context = self.context(step)
        samples = self.sample_fn(step_seed(self.seed, step), self.batch_size, context)
        return pack_batch(samples, self.batch_size, self.lengths[context], self.pad_id, self.answer_room)

    def __iter__(self) -> Iterator[Batch]:
        return map(self, itertools.count())


class Prefetcher:
    """`source(step)` computed ahead in background processes: calling it with steps start, start + 1,
    ... returns exactly the batches `source` returns (it is a pure function of the step), while
    `workers` processes already build the next `ahead` ones. Building task samples is Python work that
    would otherwise leave a small model's GPU step waiting on the host.

    `source` must pickle (e.g. `BucketedSource` of module-level callables). Workers start with
    "spawn" (a forked JAX process can deadlock); an exception in a worker is raised by the call that
    asks for that step. A step out of order restarts the read-ahead from it. Use as a context manager
    (or `close()`), which stops the workers.
    """

    def __init__(self, source: Callable[[int], Batch], workers: int, ahead: int | None = None):
        self.source = source
        self.workers = integer("workers", workers)
        self.ahead = 4 * self.workers if ahead is None else integer("ahead", ahead)
        self.pending: dict[int, Any] = {}
        self.pool = concurrent.futures.ProcessPoolExecutor(self.workers,
                                                           mp_context=multiprocessing.get_context("spawn"))

    def __call__(self, step: int) -> Batch:
        if step not in self.pending:
            for future in self.pending.values():
                future.cancel()
            self.pending = {}
        for ahead in range(step, step + self.ahead + 1):
            if ahead not in self.pending:
                self.pending[ahead] = self.pool.submit(self.source, ahead)
        try:
            return self.pending.pop(step).result()
        except concurrent.futures.process.BrokenProcessPool as e:
            raise RuntimeError("a batch-building worker process died (its traceback is printed above); with no "
                               "workers (data_workers=0, --data-workers 0) the batches are built in the training loop"
                               ) from e

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.pending = {}

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
