"""Synthetic long-context tasks and their evaluation: `make_samples` builds seeded samples of TASKS
in the vocabulary of `build_tokenizer`; `evaluate` generates an answer for each and scores it
(`score`: exact match up to EOS)."""

from dllm_jax.eval.evaluate import EvalRecord, EvalResult, evaluate
from dllm_jax.eval.tasks import TASKS, Sample, make_samples, max_answer_length, min_context_length, score
from dllm_jax.eval.vocab import SPECIAL_IDS, VOCAB_SIZE, SpecialIds, build_tokenizer, load_tokenizer

__all__ = ["EvalRecord", "EvalResult", "SPECIAL_IDS", "Sample", "SpecialIds", "TASKS", "VOCAB_SIZE", "build_tokenizer",
           "evaluate", "load_tokenizer", "make_samples", "max_answer_length", "min_context_length", "score"]
