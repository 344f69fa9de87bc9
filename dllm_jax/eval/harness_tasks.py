"""Local lm-evaluation-harness tasks of `dllm_jax.eval`'s synthetic samples (no dataset download): a JSON-lines
file and the task's YAML, for `--include_path`.

  * "generate" (`generate_until`): the prompt, the answer generated greedily and scored by exact match after
    stripping surrounding whitespace, as `dllm_jax.eval` scores it;
  * "choice" (`multiple_choice`, scored by log-likelihood): the answer among `distractors` random values of its
    shape (the same number of digits), in a random position, accuracy.

The prompts are the samples' token ids as text in the checkpoint's tokenizer, which must encode them back to the
same ids (checked).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dllm_jax.files import write_atomic

KINDS = ("generate", "choice")
HEAD = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "{{{{prompt}}}}"
"""
GENERATE = """output_type: generate_until
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["<eos>"]
  max_gen_toks: {answer_tokens}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
filter_list:
  - name: strip
    filter:
      - function: regex
        regex_pattern: "^\\\\s*(.*?)\\\\s*$"
      - function: take_first
"""
CHOICE = """output_type: multiple_choice
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def distractor(answer: str, rng: np.random.Generator) -> str:
    """A value of the answer's shape: its words, each digit replaced by a random digit."""
    return " ".join(str(rng.integers(10)) if word.isdigit() else word for word in answer.split())


def write_task(out: Path, name: str, samples, tokenizer, *, kind: str = "generate", answer_tokens: int = 12,
               distractors: int = 3, seed: int = 0) -> Path:
    """Writes <out>/<name>.jsonl and <out>/<name>.yaml of `samples` (`dllm_jax.eval.make_samples`'s) as a task of
    `kind` (KINDS); returns the YAML's path. ValueError for an unknown kind or a prompt the tokenizer does not
    encode back to its ids."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {KINDS}")
    rng = np.random.default_rng(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = (out / f"{name}.jsonl").absolute()
    lines = []
    for sample in samples:
        text = tokenizer.decode(sample.prompt_ids.tolist(), skip_special_tokens=False)
        if tokenizer.encode(text).ids != sample.prompt_ids.tolist():
            raise ValueError("the tokenizer does not encode a prompt's text back to its ids")
        doc = {"prompt": text, "answer": sample.answer}
        if kind == "choice":
            if not any(word.isdigit() for word in sample.answer.split()):
                raise ValueError(f"a choice task needs answers holding digits (the distractors vary them), got "
                                 f"{sample.answer!r} ({sample.task})")
            others = set()
            while len(others) < distractors:
                value = distractor(sample.answer, rng)
                others |= {value} - {sample.answer}
            label = int(rng.integers(distractors + 1))
            choices = sorted(others)
            doc |= {"choices": choices[:label] + [sample.answer] + choices[label:], "label": label}
        lines.append(json.dumps(doc) + "\n")
    write_atomic(data, "".join(lines))
    body = GENERATE.format(answer_tokens=answer_tokens) if kind == "generate" else CHOICE.format()
    yaml = out / f"{name}.yaml"
    write_atomic(yaml, HEAD.format(name=name, data=data) + body)
    return yaml
