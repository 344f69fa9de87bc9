"""`dllm-jax generate`: answers to prompts, batch by batch, with a checkpoint's model and tokenizer."""

from __future__ import annotations

import functools
import itertools
import sys
import time

import numpy as np

from dllm_jax.cli.common import add_mesh_flag, add_quantize_flag, dtype_parent, mesh_of
from dllm_jax.cli.methods import methods_parent
from dllm_jax.cli.prompts import PromptBatch, batch_rule, encode_row, opened_prompts, prompt_batch
from dllm_jax.cli.request import checked_request
from dllm_jax.cli.sampling import sampling_parent
from dllm_jax.flags import positive_int
from dllm_jax.generate.requests import until_stop


def add_parser(subparsers) -> None:
    from dllm_jax.cli import budget

    gen = subparsers.add_parser(
        "generate", parents=[sampling_parent(), dtype_parent(), methods_parent()],
        help="generate answers with a checkpoint's model and tokenizer",
        description="Encodes each prompt (--prompt, repeatable, or --prompts-file, streamed) with the checkpoint's "
                    "chat template and generates them in batches (--batch-size), each left-padded to its longest "
                    "prompt and run with the official sampler of its family (one compiled loop); prints each batch's "
                    "answers, numbered when there are several, and a timing line before reading the next.")
    gen.add_argument("--batch-size", type=positive_int, default=None, metavar="N",
                     help="prompts generated together, a batch printed before the next is read (default: as many "
                          "as an estimate of a step's memory fits in half the device's free memory after the "
                          f"weights, or in {budget.CPU_BUDGET // 2**30} GiB where jax reports no memory (CPU), at most "
                          f"{budget.MAX_ROWS}; dllm_jax.cli.budget); greedy answers do not depend on it")
    gen.add_argument("--progress", action="store_true", help="progress bar from inside the compiled loop")
    add_mesh_flag(gen, "prompts")
    add_quantize_flag(gen)
    gen.set_defaults(fn=run)


def run(args) -> None:
    """Loads a model and its tokenizer and generates the answers to the prompts batch by batch (a batch: one
    compiled loop). Each batch's answers are printed, then one line of its timings, before the next batch is
    read (the second prompt is read first in any case: one prompt's answer is printed without a number); the
    first batch is read and checked before the weights load."""
    from dllm_jax.checkpoint import load_model
    from dllm_jax.cli.prompt_stream import encoded, prompt_batches
    from dllm_jax.tokenizer import ChatTokenizer

    request = checked_request(args)  # every flag error before the slow loading
    dp = data_parallel(args)
    with opened_prompts(args, request.config) as prompts:
        first = next(prompts)  # a prompts file without a prompt is refused before the tokenizer is read
        tokenizer = ChatTokenizer(args.model)
        encode = functools.partial(encode_row, tokenizer, raw=args.raw, config=request.config,
                                   gen_length=args.gen_length)
        items = encoded(itertools.chain([first], prompts), encode)
        head = list(itertools.islice(items, 2))  # whether a second prompt follows: one prompt's answer has no number
        batches = (prompt_batch(rows, request.config.pad_token_id) for rows in prompt_batches(
            itertools.chain(head, items), batch_rule(args, request.config), multiple=dp))
        batch = next(batches)
        batch_options(args, request, batch)  # refused before loading, as every error of the first batch
        model = load_model(args.model, dtype=args.dtype, quantize=args.quantize, mesh=mesh_of(args))
        for batch in itertools.chain([batch], batches):
            run_batch(model, tokenizer, args, request, batch, alone=len(head) == 1)


def data_parallel(args) -> int:
    """The --mesh dp (1 without a mesh), which --batch-size must be a multiple of."""
    dp = 1 if args.mesh is None else args.mesh["dp"]
    if args.batch_size is not None and args.batch_size % dp:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the --mesh dp={dp} (a batch's prompts "
                         "are split over dp)")
    return dp


def run_batch(model, tokenizer, args, request, batch, *, alone: bool) -> None:
    """Generates one batch and prints its answers (numbered across the run, unless the run is one prompt)
    and its timing line."""
    from dllm_jax.generate import generate

    options = batch_options(args, request, batch)
    start = time.perf_counter()
    out = np.asarray(generate(model, batch.ids, attention_mask=batch.mask, seed=args.seed, progress=args.progress,
                              method=request.method, **options))
    elapsed = time.perf_counter() - start
    prompt, decoded = batch.ids.shape[1], out.shape[1] - batch.ids.shape[1]
    stops = request.config.stop_ids
    # SDAR decodes whole blocks, so it may return up to block_size - 1 tokens past --gen-length: --gen-length
    # is a maximum (as its help says), so the rest is cut here, and the report says it was decoded.
    new = out[:, prompt:prompt + args.gen_length]
    answers = [answer_ids(row, stops, request.config.pad_token_id, padded=batch.mask is not None) for row in new]
    texts = [tokenizer.decode(ids, skip=request.config.placeholder_ids) for ids in answers]
    # LLaDA and Dream denoise every position of the answer region; SDAR stops a row at its stop token
    counts = [len(row) if request.family in ("LLaDA", "Dream") else len(ids) for row, ids in zip(new, answers)]
    print_answers(texts, batch, alone=alone)
    rounded = f" of {decoded} decoded in whole blocks of {request.config.block_size}" if decoded > new.shape[1] else ""
    label = "" if alone else batch_label(batch)
    print(f"[{type(model).__name__}: {label}{summary(batch, counts, rounded)}, {elapsed:.2f} s including compilation, "
          f"{sum(counts) / elapsed:.1f} tok/s]", file=sys.stderr, flush=True)


def print_answers(texts: list[str], batch: PromptBatch, *, alone: bool) -> None:
    """The answers on stdout: the run's one prompt's as it is, others numbered across the run."""
    if alone:
        print(texts[0], flush=True)
        return
    for number, text in zip(batch.numbers, texts):
        print(f"[{number}] {text}")
    sys.stdout.flush()


def batch_options(args, request, batch: PromptBatch) -> dict:
    """generate's options for this batch. Left-padded LLaDA rows hide their pad keys (padding="mask"), so
    each row's answer is the one it gets alone; the default "ignore" (the official file) lets every token
    attend to the pads. The LLaDA sparse methods take no padding mask: refused before any loading."""
    padded = batch.mask is not None and not batch.mask.all()
    if request.family == "Dream" and request.method is not None and padded:
        raise ValueError(unpadded_only(args, batch))
    if request.family != "LLaDA" or not padded:
        return request.options
    if request.method is not None:
        raise ValueError(unpadded_only(args, batch))
    return request.options | dict(padding="mask")


def unpadded_only(args, batch: PromptBatch) -> str:
    return (f"--method {args.method} runs on unpadded prompts only (its kernels take no padding mask), and these "
            f"{len(batch.lengths)} prompts differ in length ({batch.lengths} tokens): give prompts of one length, run "
            "them one at a time, or use --method dense")


def batch_label(batch: PromptBatch) -> str:
    first, last = batch.numbers[0], batch.numbers[-1]
    return f"prompt {first}: " if first == last else f"prompts {first}..{last}: "


def summary(batch: PromptBatch, counts: list[int], rounded: str) -> str:
    """The token counts of the timing line: one prompt as before; several as a batch, with the total generated."""
    if len(counts) == 1:
        return f"{batch.lengths[0]} prompt tokens, {counts[0]} generated{rounded}"
    shortest, longest = min(batch.lengths), max(batch.lengths)
    sizes = f"{longest} tokens each" if shortest == longest else \
        f"{shortest}..{longest} tokens, left-padded to {batch.ids.shape[1]}"
    rows = f" ({' + '.join(map(str, counts))})" if len(counts) <= 8 else ""  # one line, also for large batches
    return f"{len(counts)} prompts ({sizes}) in one batch, {sum(counts)} generated in all{rows}{rounded}"



def answer_ids(new: np.ndarray, stops: tuple[int, ...], pad_id: int, *, padded: bool) -> np.ndarray:
    """A row's new tokens cut after its first stop token; in a padded batch also without the pad ids that
    batched SDAR writes after a row's end (trailing only: inside an answer the pad id may be a real token)."""
    cut = until_stop(new, stops)
    if not padded or (cut.size and np.isin(cut[-1], stops)):
        return cut
    kept = np.flatnonzero(new != pad_id)
    return new[:kept[-1] + 1] if kept.size else new[:0]
