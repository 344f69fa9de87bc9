"""Synthetic long-context tasks, generated from a seed, in the vocabulary of `dllm_jax.eval.vocab`.

Every prompt is haystack text (filler sentences of random filler words, ending in ".") with the
task's statements inserted at random sentence boundaries, then a question ending in "answer :"; the
answer is a digit sequence followed by EOS. Prompts are exactly `context_length` tokens long
(sanity: min(context_length, SANITY_CONTEXT)), so the samples of one (task, context_length) batch
without padding.

- passkey: "the pass key is D D D D D . remember it ." at a random depth; "what is the pass key ?".
- niah_multikey (RULER's multi-key needle in a haystack): NIAH_NEEDLES needles (option `needles`)
  "the special magic number for KEY is D D D D ." with distinct keys and numbers;
  "what is the special magic number for KEY ?" asks for one of them.
- variable_tracking (RULER's, asked the other way round): VT_CHAINS chains
  "VAR X = D D D D D ." "VAR Y = VAR X ." ... (VT_HOPS assignments after the value, option `hops`; each chain's
  statements in order, the chains interleaved); "what is the value of VAR Z ?" asks for the value of
  the last variable of one chain (option `ask_back` k > 0: the variable k assignments before it, e.g.
  with one hop, 1 asks the variable the value is assigned to). Chains have distinct values and variables.
- sanity: "copy D ... D ." or "reverse D ... D ." (4..8 digits) after a short filler; the answer is
  the digits, copied or reversed.

Sample i of make_samples(task, context_length, n, seed) depends on (task, context_length, seed, i)
only (a numpy Generator seeded by a SHA-256 of them): the same on every machine and Python run, and
the first samples of a larger n are the samples of a smaller one.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
from tokenizers import Tokenizer

from dllm_jax import validation as check
from dllm_jax.eval import vocab
from dllm_jax.tokenizer import ChatTokenizer

TASKS = ("passkey", "niah_multikey", "variable_tracking", "sanity")

PASSKEY_DIGITS = 5
NIAH_NEEDLES, NIAH_DIGITS = 4, 4  # one queried needle and three distractors
VT_CHAINS, VT_HOPS, VT_DIGITS = 2, 1, 5  # one queried chain and one distractor, 2 variables each (one hop:
# what the tiny trained models are trained on; RULER uses 4 hops for billion-parameter models)
SANITY_DIGITS = (4, 8)  # the shortest and longest sequence
SANITY_CONTEXT = 64  # the sanity task's prompts stop growing here
SENTENCE_TOKENS = (5, 13)  # filler sentence length in tokens, the period included: [low, high)


@dataclasses.dataclass(frozen=True)
class Sample:
    task: str                 # "passkey" | "niah_multikey" | "variable_tracking" | "sanity"
    prompt_ids: np.ndarray    # int32 [P], the whole prompt (context + question), no padding, no special tokens except as the task defines
    answer_ids: np.ndarray    # int32 [A], the answer tokens, ending with the tokenizer's EOS id
    answer: str               # the answer text (what counts as correct)
    context_length: int       # the requested context length in tokens (prompt length is close to it, <= it)
    seed: int
    index: int
    values: tuple[str, ...] = ()  # the digit values the prompt's statements hold, in text order, as `answer` is
    # written: the answer's own and the distractors' (passkey: the key alone; sanity: none)


@dataclasses.dataclass(frozen=True)
class Parts:
    """One sample in words, before the filler: statements to hide, the question, the answer digits."""

    statements: tuple[tuple[str, ...], ...]  # each a sentence; inserted in this order
    question: tuple[str, ...]
    answer: tuple[str, ...]


def digits(rng, count: int) -> tuple[str, ...]:
    return tuple(str(d) for d in rng.integers(0, 10, count))


def distinct_numbers(rng, count: int, length: int) -> list[tuple[str, ...]]:
    """`count` different digit sequences of `length` (distractors never share the answer)."""
    numbers: list[tuple[str, ...]] = []
    while len(numbers) < count:
        number = digits(rng, length)
        if number not in numbers:
            numbers.append(number)
    return numbers


def passkey(rng) -> Parts:
    key = digits(rng, PASSKEY_DIGITS)
    return Parts(statements=(("the", "pass", "key", "is", *key, ".", "remember", "it", "."),),
                 question=("what", "is", "the", "pass", "key", "?", "answer", ":"), answer=key)


def niah_multikey(rng, needles: int = NIAH_NEEDLES) -> Parts:
    keys = rng.choice(vocab.KEYS, needles, replace=False)
    numbers = distinct_numbers(rng, needles, NIAH_DIGITS)
    sentences = tuple(("the", "special", "magic", "number", "for", str(key), "is", *number, ".")
                      for key, number in zip(keys, numbers))
    order = rng.permutation(needles)  # the queried needle (0) is not always the first in the text
    return Parts(statements=tuple(sentences[i] for i in order),
                 question=("what", "is", "the", "special", "magic", "number", "for", str(keys[0]), "?", "answer", ":"),
                 answer=numbers[0])


def variable_tracking(rng, hops: int = VT_HOPS, ask_back: int = 0) -> Parts:
    names = rng.choice(vocab.VARIABLES, (VT_CHAINS, hops + 1), replace=False)
    values = distinct_numbers(rng, VT_CHAINS, VT_DIGITS)
    chains = [[("VAR", str(chain[0]), "=", *value, ".")]
              + [("VAR", str(name), "=", "VAR", str(previous), ".") for previous, name in zip(chain, chain[1:])]
              for chain, value in zip(names, values)]
    # a random interleaving of the chains that keeps each chain's assignments in order
    labels = rng.permutation(np.repeat(np.arange(VT_CHAINS), hops + 1))
    statements = tuple(chains[c].pop(0) for c in labels)
    return Parts(statements=statements,
                 question=("what", "is", "the", "value", "of", "VAR", str(names[0, hops - ask_back]), "?", "answer",
                           ":"),
                 answer=values[0])


def sanity(rng) -> Parts:
    sequence = digits(rng, int(rng.integers(SANITY_DIGITS[0], SANITY_DIGITS[1] + 1)))
    reverse = bool(rng.integers(2))
    return Parts(statements=(), question=("reverse" if reverse else "copy", *sequence, ".", "answer", ":"),
                 answer=sequence[::-1] if reverse else sequence)


BUILDERS = {"passkey": passkey, "niah_multikey": niah_multikey, "variable_tracking": variable_tracking,
            "sanity": sanity}

# Each task's difficulty knobs and their defaults (what evaluation and the shipped models use); other values
# make easier or harder variants, e.g. a training curriculum of the lookup (one needle, or no hop, first).
# variable_tracking's ask_back (at most its hops) asks a variable before the chain's last: in a text with
# hops, each earlier variable's name occurs twice (assigned, then assigned from), so "copy the digits
# after the asked name" no longer answers it.
OPTIONS = {"passkey": {}, "niah_multikey": {"needles": NIAH_NEEDLES},
           "variable_tracking": {"hops": VT_HOPS, "ask_back": 0}, "sanity": {}}
LEAST = {"needles": 1, "hops": 0, "ask_back": 0}
VT_MOST_HOPS = len(vocab.VARIABLES) // VT_CHAINS - 1  # distinct variable names suffice
MOST = {"needles": 16, "hops": VT_MOST_HOPS, "ask_back": VT_MOST_HOPS}  # distinct keys / names suffice


def task_options(task: str, options: dict | None = None) -> dict[str, int]:
    """The task's knobs (`OPTIONS`) with `options` applied; ValueError for a knob the task lacks or a value
    out of range."""
    defaults = OPTIONS[check.choice("task", task, TASKS)]
    options = dict(options or {})
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ValueError(f"task {task} has no option(s) {unknown}; its options: {sorted(defaults) or 'none'}")
    knobs = defaults | {name: check.integer(f"{task} {name}", value, minimum=LEAST[name], maximum=MOST[name])
                        for name, value in options.items()}
    if knobs.get("ask_back", 0) > knobs.get("hops", 0):
        raise ValueError(f"{task} ask_back={knobs['ask_back']} goes past the chain's first variable: at most "
                         f"hops={knobs['hops']}")
    return knobs


def min_context_length(task: str, options: dict | None = None) -> int:
    """The least context_length `make_samples` accepts for `task` with `options` (its statements and
    question, no filler)."""
    knobs = task_options(task, options)
    if task == "niah_multikey":
        return knobs["needles"] * 12 + 11
    if task == "variable_tracking":
        return VT_CHAINS * (3 + VT_DIGITS + 1 + knobs["hops"] * 6) + 10
    return {"passkey": 13 + 8, "sanity": 1 + SANITY_DIGITS[1] + 3}[task]


def statement_values(parts: Parts) -> tuple[str, ...]:
    """The digit values of the statements (each statement's digits, space-joined), in text order."""
    held = (" ".join(word for word in statement if word.isdigit()) for statement in parts.statements)
    return tuple(value for value in held if value)


def max_answer_length(task: str) -> int:
    """The most answer tokens (EOS included) a sample of `task` has: what generation must leave room for."""
    longest = {"passkey": PASSKEY_DIGITS, "niah_multikey": NIAH_DIGITS, "variable_tracking": VT_DIGITS,
               "sanity": SANITY_DIGITS[1]}
    return longest[check.choice("task", task, TASKS)] + 1


def prompt_length(task: str, context_length: int) -> int:
    """The length of every prompt of (task, context_length)."""
    return min(context_length, SANITY_CONTEXT) if task == "sanity" else context_length


def generator(task: str, context_length: int, seed: int, index: int) -> np.random.Generator:
    """The Generator of one sample, from a stable hash (Python's hash() of a str changes per process)."""
    digest = hashlib.sha256(f"{task}/{context_length}/{seed}/{index}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "little"))


def filler_sentences(rng, tokens: int) -> list[list[str]]:
    """Filler sentences of `tokens` tokens in all, each of SENTENCE_TOKENS tokens (a last one may be
    shorter), made of filler words and ending in "."."""
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(int(rng.integers(*SENTENCE_TOKENS)))
    if lengths:
        lengths[-1] -= sum(lengths) - tokens
        if lengths[-1] < 2 and len(lengths) > 1:  # no sentence of a lone "."
            last = lengths.pop()
            lengths[-1] += last
    words = iter(rng.choice(vocab.FILLER_WORDS, sum(lengths)).tolist())
    return [[next(words) for _ in range(n - 1)] + ["."] for n in lengths]


def compose(rng, parts: Parts, length: int) -> list[str]:
    """The prompt's words: filler with the statements inserted at random sentence boundaries (in order),
    then the question; `length` words in all."""
    fixed = sum(map(len, parts.statements)) + len(parts.question)
    sentences = filler_sentences(rng, length - fixed)
    # boundary b is before sentence b (b = len(sentences): after the last one)
    at = np.sort(rng.integers(0, len(sentences) + 1, len(parts.statements)))
    words: list[str] = []
    pending = list(zip(at.tolist(), parts.statements))
    for b in range(len(sentences) + 1):
        while pending and pending[0][0] == b:
            words.extend(pending.pop(0)[1])
        if b < len(sentences):
            words.extend(sentences[b])
    return words + list(parts.question)


def as_tokenizer(tokenizer) -> Tokenizer:
    """A `tokenizers.Tokenizer` (as given, or the one inside a ChatTokenizer)."""
    if isinstance(tokenizer, ChatTokenizer):
        return tokenizer.tokenizer
    if not isinstance(tokenizer, Tokenizer):
        raise ValueError(f"tokenizer must be a tokenizers.Tokenizer or a ChatTokenizer (dllm_jax.eval.build_tokenizer "
                         f"makes one), got {type(tokenizer).__name__}")
    return tokenizer


def check_coverage(tokenizer: Tokenizer) -> None:
    """The tokenizer must know every word the tasks write."""
    known = tokenizer.get_vocab()
    missing = [word for word in vocab.VOCABULARY[len(vocab.SPECIAL_TOKENS):] if word not in known]
    if missing:
        raise ValueError(f"the tokenizer lacks {len(missing)} words of the task vocabulary (e.g. {missing[:5]}): "
                         "use dllm_jax.eval.build_tokenizer, or a checkpoint trained with it")


def encode(tokenizer: Tokenizer, words: list[str]) -> np.ndarray:
    ids = tokenizer.encode(" ".join(words), add_special_tokens=False).ids
    if len(ids) != len(words):
        raise ValueError(f"the tokenizer splits the task words differently ({len(words)} words -> {len(ids)} "
                         "tokens): the tasks need a word-level tokenizer (dllm_jax.eval.build_tokenizer)")
    return read_only(ids)


def read_only(ids) -> np.ndarray:
    array = np.asarray(ids, np.int32)
    array.setflags(write=False)  # a Sample is frozen: so are its arrays
    return array


def make_samples(task: str, context_length: int, num_samples: int, seed: int, tokenizer, *,
                 options: dict | None = None) -> list[Sample]:
    """`num_samples` samples of `task` (one of TASKS) whose prompts are `context_length` tokens
    (sanity: min(context_length, SANITY_CONTEXT)), generated from `seed` (any int) with `tokenizer`
    (a tokenizers.Tokenizer or ChatTokenizer covering `dllm_jax.eval.vocab.VOCABULARY`). `options`
    sets the task's difficulty knobs (`OPTIONS`: niah_multikey's `needles`, variable_tracking's `hops`
    and `ask_back`);
    the defaults are the tasks evaluation reports.

    ValueError for an unknown task or option, num_samples < 1, context_length below
    `min_context_length(task, options)`, or a tokenizer that lacks the task words.
    """
    knobs = task_options(task, options)
    context_length = check.integer("context_length", context_length)
    num_samples = check.integer("num_samples", num_samples)
    seed = check.integer("seed", seed, minimum=None)
    least = min_context_length(task, knobs)
    if context_length < least:
        raise ValueError(f"context_length={context_length} is too short for {task}: its statements and question "
                         f"alone take {least} tokens (the minimum context_length)")
    tokenizer = as_tokenizer(tokenizer)
    check_coverage(tokenizer)
    eos = vocab.special_ids(tokenizer).eos
    samples = []
    for index in range(num_samples):
        rng = generator(task, context_length, seed, index)
        parts = BUILDERS[task](rng, **knobs)
        prompt = encode(tokenizer, compose(rng, parts, prompt_length(task, context_length)))
        answer_ids = read_only([*encode(tokenizer, list(parts.answer)), eos])
        samples.append(Sample(task=task, prompt_ids=prompt, answer_ids=answer_ids, answer=" ".join(parts.answer),
                              context_length=context_length, seed=seed, index=index, values=statement_values(parts)))
    return samples


def score(sample: Sample, generated_ids) -> bool:
    """Exact match: True iff the generated tokens (the ids after the prompt, in order) begin with
    sample.answer_ids, i.e. the answer's tokens and then EOS. Whatever follows that EOS is ignored
    (LLaDA fills its whole answer region, SDAR decodes whole blocks); an output that stops short,
    lacks the EOS, or differs anywhere before it is wrong."""
    generated = np.asarray(generated_ids).reshape(-1)
    n = len(sample.answer_ids)
    return len(generated) >= n and bool(np.array_equal(generated[:n], sample.answer_ids))
