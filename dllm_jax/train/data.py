"""Training batches from task samples: packing and a deterministic, resumable batch source.

A sample is anything with `prompt_ids` and `answer_ids` (int arrays; the `Sample` of
dllm_jax.eval.tasks). Its training sequence is prompt_ids ++ answer_ids, right-padded; the answer is
where the loss applies (LLaDA-style SFT: the prompt is never masked). With an answer room (LLaDA), the
answer is followed by pad tokens up to the room, all in the loss, as LLaDA's SFT fills its generation
window: training then sees exactly the window `dllm_jax.eval.evaluate` generates into.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence
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
        if len(samples) != self.batch_size:
            raise ValueError(f"sample_fn returned {len(samples)} samples, asked for {self.batch_size}")
        room = None if self.answer_room is None else [self.answer_room(s) for s in samples]
        return pack(samples, self.length, self.pad_id, answer_room=room)

    def __iter__(self) -> Iterator[Batch]:
        return map(self, itertools.count())
