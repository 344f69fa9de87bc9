"""The prompts of generate and analyze: --prompt / --prompts-file read, encoded, checked against the model's
context and gathered into left-padded batches."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import numpy as np

# A prompts file line may hold this many bytes per position of the model's context: far more than a token of
# these models' vocabularies covers in any text, so a longer line could not fit; an endless line (/dev/zero)
# stops there instead of filling the memory.
LINE_BYTES_PER_POSITION = 256


@dataclasses.dataclass(frozen=True, eq=False)
class PromptBatch:
    """The encoded prompts of one generate call."""

    ids: np.ndarray  # int32 [B, P], left-padded to the longest prompt
    mask: np.ndarray | None  # int32 [B, P] (1 token, 0 pad); None for one prompt (generate's unbatched call)
    lengths: tuple[int, ...]  # each prompt's own token count
    numbers: tuple[int, ...] = ()  # each prompt's number in the run (1, 2, ...)


def prompt_batch(rows, pad_id: int) -> PromptBatch:
    """The PromptBatch of (Prompt, int32 ids [1, P]) rows; one row goes unpadded (generate's one-prompt call:
    its answer is the one the prompt gets alone)."""
    from dllm_jax.tokenizer import left_pad

    numbers, lengths = tuple(p.number for p, _ in rows), tuple(ids.shape[1] for _, ids in rows)
    if len(rows) == 1:
        return PromptBatch(ids=rows[0][1], mask=None, lengths=lengths, numbers=numbers)
    ids, mask = left_pad([ids[0] for _, ids in rows], pad_id)
    return PromptBatch(ids=ids, mask=mask, lengths=lengths, numbers=numbers)


@contextlib.contextmanager
def opened_prompts(args, config):
    """The prompts (dllm_jax.cli.prompt_stream.Prompt) of --prompt (repeatable) or --prompts-file, streamed
    line by line from the file while it is open; its lines are capped at LINE_BYTES_PER_POSITION bytes per
    position of config.max_position_embeddings."""
    from dllm_jax.cli.prompt_stream import file_prompts, flag_prompts

    if args.prompts_file is None:
        yield flag_prompts(list(args.prompt))
        return
    path = Path(args.prompts_file)
    try:
        file = open(path, "rb")  # a pipe is fine (read as a stream): e.g. --prompts-file <(command)
    except OSError as e:
        raise ValueError(f"--prompts-file {path} cannot be opened: {e.strerror or e}") from None
    with file:
        yield file_prompts(file, f"--prompts-file {path}", config.max_position_embeddings * LINE_BYTES_PER_POSITION)


def encode_row(tokenizer, prompt, *, raw: bool, config, gen_length: int) -> np.ndarray:
    """int32 [1, P] of one prompt (a dllm_jax.cli.prompt_stream.Prompt), which with --gen-length must fit the
    model's context; an error names the prompt when there are several."""
    which = "the prompt" if prompt.where is None else f"{prompt.where} ({prompt.text[:40]!r})"
    try:
        ids = tokenizer.encode(prompt.text, chat=not raw)
    except ValueError as e:
        if prompt.where is None:
            raise
        raise ValueError(f"{which}: {e}") from None
    limit = config.max_position_embeddings
    if ids.shape[1] + gen_length > limit:
        raise ValueError(f"{which} has {ids.shape[1]} tokens: with --gen-length {gen_length} that is "
                         f"{ids.shape[1] + gen_length} positions, more than the model's context of {limit} "
                         "(config.json max_position_embeddings)")
    return ids


def batch_rule(args, config):
    """fits(rows, longest prompt tokens) of a batch: --batch-size rows, or by default as many as the memory
    estimate of dllm_jax.cli.budget allows (per device of the mesh's dp, the weights split over its tp)."""
    from dllm_jax.cli import budget

    if args.batch_size is not None:
        return lambda rows, longest: rows <= args.batch_size
    mesh = args.mesh or {}
    room = budget.activation_budget(config, args.dtype, tensor_parallel=mesh.get("tp", 1)) * mesh.get("dp", 1)
    return lambda rows, longest: (rows <= budget.MAX_ROWS
                                  and rows * budget.row_bytes(config, longest + args.gen_length) <= room)


def encode_prompts(args, config) -> tuple[object, PromptBatch]:
    """(tokenizer, every prompt of --prompt / --prompts-file / --raw in one PromptBatch, left-padded with
    config.pad_token_id)."""
    from dllm_jax.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer(args.model)
    with opened_prompts(args, config) as prompts:
        rows = [(p, encode_row(tokenizer, p, raw=args.raw, config=config, gen_length=args.gen_length))
                for p in prompts]
    return tokenizer, prompt_batch(rows, config.pad_token_id)


def encode_prompt(args, config):
    """(tokenizer, int32 prompt ids [1, P]) of --model and the one prompt of --prompt / --prompts-file
    (analyze takes one), --raw: fast, so before the weights load."""
    from dllm_jax.tokenizer import ChatTokenizer

    with opened_prompts(args, config) as prompts:
        first = next(prompts)
        count = 1 + sum(1 for _ in prompts)  # streamed: a long file is counted, not held
    if count != 1:
        source = f"--prompts-file {args.prompts_file} holds" if args.prompts_file is not None else "--prompt given"
        raise ValueError(f"{args.command} takes one prompt, but {source} {count}: run it once per prompt")
    tokenizer = ChatTokenizer(args.model)
    return tokenizer, encode_row(tokenizer, first, raw=args.raw, config=config, gen_length=args.gen_length)
