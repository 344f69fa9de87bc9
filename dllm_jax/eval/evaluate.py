"""Evaluation of a model on task samples: generate an answer for each prompt, score it, count.

Decoding is greedy unless the options say otherwise, and unmasks one token per step in both families:
LLaDA at temperature 0 with one block of gen_length tokens (steps = block_length = gen_length); SDAR
with top_k=1, denoising_steps = block_size and low_confidence_static remasking (SDAR's default
confidence threshold lets a trained model fill a whole block at its first step, so sparse methods that
act on a block's later steps, MAGE and FlashBlock, would never be exercised). The answer region is as long as the longest answer of the
samples' tasks (`max_answer_length`, EOS included), for SDAR rounded up to whole blocks: fixed per
task, so a sample's prediction does not depend on which other samples are evaluated with it.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from dllm_jax import validation as check
from dllm_jax.attention.methods import make_method
from dllm_jax.eval.tasks import Sample, as_tokenizer, max_answer_length, score
from dllm_jax.eval.vocab import build_tokenizer
from dllm_jax.families import FAMILIES, family_of, family_of_model
from dllm_jax.generate import generate


@dataclasses.dataclass(frozen=True)
class EvalRecord:
    """The outcome of one sample."""

    index: int  # the sample's index (make_samples)
    task: str
    context_length: int
    seed: int  # the sample's seed (make_samples)
    prompt_length: int
    answer: str  # the expected answer text
    predicted: str  # the generated text before the first EOS (special tokens dropped)
    predicted_ids: tuple[int, ...]  # every generated id (after the prompt), as generate returned them
    correct: bool  # score(sample, predicted_ids)
    distractor: int | None = None  # a wrong answer that is a distractor's whole value: that statement's place in
    # the text (1 = first; the prompt's values, `Sample.values`): the model took the wrong needle; else None


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """The accuracy over the samples and one record per sample, in the samples' order."""

    tasks: tuple[str, ...]  # the samples' tasks, in order of first appearance
    context_lengths: tuple[int, ...]  # the samples' context lengths, likewise
    method: str  # "dense", a method name, or the policy's repr
    options: dict  # generate's options as used (defaults filled in)
    accuracy: float  # num_correct / num_samples
    num_samples: int
    num_correct: int
    records: tuple[EvalRecord, ...]
    seconds: float = dataclasses.field(default=0.0, compare=False)  # wall time, compilation included

    def to_dict(self) -> dict:
        """JSON-ready (lists for tuples)."""
        return dataclasses.asdict(self)

    def distractors(self) -> dict[int, int]:
        """{place in the text: number of wrong answers that were that distractor's whole value}, by place."""
        return dict(sorted(collections.Counter(r.distractor for r in self.records if r.distractor).items()))


def evaluate(model, samples, *, tokenizer=None, method=None, batch_size: int = 1, progress: bool = True,
             **generate_options) -> EvalResult:
    """Generates an answer to every sample's prompt with `model` (LLaDA or SDAR) and scores it.

    `tokenizer` (a tokenizers.Tokenizer or ChatTokenizer; default `build_tokenizer()`) only decodes the
    predictions for the records. `method`: None (dense), a method name or an attention policy, as
    `dllm_jax.generate`. Consecutive samples with prompts of one length are generated `batch_size` at a
    time (no padding); greedy decoding gives each the answer it gets alone. `progress` shows a bar
    over the samples with the running accuracy. `generate_options` override the defaults of the module
    docstring (e.g. steps=..., seed=..., temperature=...). ValueError for no samples, a model whose stop
    token is not the samples' EOS, or a prompt holding the model's mask id.
    """
    samples = list(samples)
    if not samples or not all(isinstance(s, Sample) for s in samples):
        raise ValueError("evaluate needs one or more Samples (dllm_jax.eval.make_samples)")
    batch_size = check.integer("batch_size", batch_size)
    check.flag("progress", progress)
    tokenizer = build_tokenizer() if tokenizer is None else as_tokenizer(tokenizer)
    check_samples(model, samples)
    options = default_options(model, samples, generate_options) | generate_options
    check_answer_room(model, samples, options)
    name = "dense" if method is None else method if isinstance(method, str) else repr(method)
    method = make_method(method) if isinstance(method, str) else method
    records = []
    start = time.perf_counter()
    with tqdm(total=len(samples), desc=f"eval {', '.join(unique(s.task for s in samples))}", unit="sample",
              disable=not progress) as bar:
        for batch in batches(samples, batch_size):
            ids = np.stack([s.prompt_ids for s in batch])
            out = np.asarray(generate(model, ids, method=method, **options))
            for sample, row in zip(batch, out):
                records.append(record(sample, row[ids.shape[1]:], tokenizer))
            bar.update(len(batch))
            bar.set_postfix(accuracy=f"{np.mean([r.correct for r in records]):.3f}")
    correct = sum(r.correct for r in records)
    return EvalResult(tasks=unique(s.task for s in samples), context_lengths=unique(s.context_length for s in samples),
                      method=name, options=dict(options), accuracy=correct / len(records), num_samples=len(records),
                      num_correct=correct, records=tuple(records), seconds=time.perf_counter() - start)


def unique(values) -> tuple:
    return tuple(dict.fromkeys(values))


def check_samples(model, samples: list[Sample]) -> None:
    """The model must stop on the samples' EOS and must not read any prompt token as its mask."""
    family = family_of_model(model)
    if family is None or family.eval_options is None:  # a family without greedy defaults (the module docstring)
        evaluated = [f.label for f in FAMILIES.values() if f.eval_options is not None]
        raise ValueError(f"evaluate supports {' and '.join(evaluated)} models, got {type(model).__name__}")
    config = model.config
    stops = config.stop_ids
    eos = sorted({int(s.answer_ids[-1]) for s in samples})
    if not set(eos) <= set(stops):
        raise ValueError(f"the samples' answers end with EOS id(s) {eos}, but the model stops on {stops} (config "
                         "eos_token_id(s)): write the model config with the task tokenizer's ids "
                         "(dllm_jax.eval.SPECIAL_IDS)")
    for s in samples:
        if np.any(s.prompt_ids == config.mask_token_id):
            raise ValueError(f"sample {s.index} ({s.task}) holds the model's mask id {config.mask_token_id} in its "
                             "prompt: the model config's mask_token_id must be the task tokenizer's <mask> id "
                             "(dllm_jax.eval.SPECIAL_IDS.mask)")


def default_options(model, samples: list[Sample], given: dict) -> dict[str, Any]:
    """Greedy decoding with room for the longest answer of the samples' tasks (module docstring); a
    given LLaDA gen_length sets the default steps and block_length (one block, one token per step)."""
    length = max(max(max_answer_length(s.task) for s in samples), max(len(s.answer_ids) for s in samples))
    return family_of(model).eval_options(length, model.config, given)


def answer_room(config, task: str) -> int:
    """The answer region `evaluate`'s default options decode for samples of `task` (whole blocks for SDAR)."""
    family = family_of(config)
    return family.eval_options(max_answer_length(task), config, {})[family.answer_option]


def check_answer_room(model, samples: list[Sample], options: dict) -> None:
    """The answer region must hold every answer and its EOS (generate checks everything else)."""
    key = family_of(model).answer_option
    longest = max(len(s.answer_ids) for s in samples)
    if check.is_int(options[key]) and options[key] < longest:
        raise ValueError(f"{key}={options[key]} is shorter than the longest answer ({longest} tokens with its EOS): "
                         "no output could be scored correct")


def batches(samples: list[Sample], size: int):
    """Runs of at most `size` consecutive samples whose prompts have one length."""
    batch: list[Sample] = []
    for s in samples:
        if batch and (len(batch) == size or len(s.prompt_ids) != len(batch[0].prompt_ids)):
            yield batch
            batch = []
        batch.append(s)
    yield batch


def record(sample: Sample, generated: np.ndarray, tokenizer) -> EvalRecord:
    eos = int(sample.answer_ids[-1])
    ends = np.flatnonzero(generated == eos)
    text = tokenizer.decode(generated[:ends[0] if ends.size else len(generated)].tolist(), skip_special_tokens=True)
    correct = score(sample, generated)
    wrong_values = [place for place, value in enumerate(sample.values, 1) if value == text and value != sample.answer]
    return EvalRecord(index=sample.index, task=sample.task, context_length=sample.context_length, seed=sample.seed,
                      prompt_length=len(sample.prompt_ids), answer=sample.answer, predicted=text,
                      predicted_ids=tuple(int(i) for i in generated), correct=correct,
                      distractor=None if correct or not wrong_values else wrong_values[0])
