"""`dllm-jax` command line: convert | generate | analyze | eval | train | bench | demo (`--help` on each)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import itertools
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dllm_jax.flags import (finite_float, fraction, fresh_seed, non_negative_float, non_negative_int, none_or,
                            one_line, positive_float, positive_int, probability, seed_int)


def cmd_convert(args) -> None:
    from dllm_jax.checkpoint import convert_hf_checkpoint

    start = time.perf_counter()
    convert_hf_checkpoint(args.hf_dir, args.out_dir, dtype=args.dtype, overwrite=args.overwrite,
                          progress=not args.quiet)
    stored = args.dtype or "the source's dtype"
    print(f"converted {args.hf_dir} -> {args.out_dir} ({stored}) in {time.perf_counter() - start:.1f} s")


def cmd_generate(args) -> None:
    """Loads a model and its tokenizer and generates the answers to the prompts batch by batch (a batch: one
    compiled loop). Each batch's answers are printed, then one line of its timings, before the next batch is
    read (the second prompt is read first in any case: one prompt's answer is printed without a number); the
    first batch is read and checked before the weights load."""
    from dllm_jax.checkpoint import load_model
    from dllm_jax.generate.prompts import encoded, prompt_batches
    from dllm_jax.tokenizer import ChatTokenizer

    request = checked_request(args)  # every flag error before the slow loading
    dp = 1 if args.mesh is None else args.mesh["dp"]
    if args.batch_size is not None and args.batch_size % dp:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the --mesh dp={dp} (a batch's prompts "
                         "are split over dp)")
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
        model = load_model(args.model, dtype=args.dtype, mesh=mesh_of(args))
        for batch in itertools.chain([batch], batches):
            run_batch(model, tokenizer, args, request, batch, alone=len(head) == 1)


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
    stops = stop_ids(request.config)
    # SDAR decodes whole blocks, so it may return up to block_size - 1 tokens past --gen-length: --gen-length
    # is a maximum (as its help says), so the rest is cut here, and the report says it was decoded.
    new = out[:, prompt:prompt + args.gen_length]
    answers = [answer_ids(row, stops, request.config.pad_token_id, padded=batch.mask is not None) for row in new]
    texts = [tokenizer.decode(ids, skip=(request.config.mask_token_id,)) for ids in answers]
    # LLaDA and Dream denoise every position of the answer region; SDAR stops a row at its stop token
    counts = [len(row) if request.family in ("LLaDA", "Dream") else len(ids) for row, ids in zip(new, answers)]
    if alone:  # the run's one prompt
        print(texts[0], flush=True)
    else:
        for number, text in zip(batch.numbers, texts):
            print(f"[{number}] {text}")
        sys.stdout.flush()
    rounded = f" of {decoded} decoded in whole blocks of {request.config.block_size}" if decoded > new.shape[1] else ""
    label = "" if alone else batch_label(batch)
    print(f"[{type(model).__name__}: {label}{summary(batch, counts, rounded)}, {elapsed:.2f} s including compilation, "
          f"{sum(counts) / elapsed:.1f} tok/s]", file=sys.stderr, flush=True)


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


def stop_ids(config) -> tuple[int, ...]:
    """The ids that end an answer: SDAR's stop tokens (config eos_token_ids), LLaDA's EOS."""
    return tuple(config.eos_token_ids) if hasattr(config, "eos_token_ids") else (config.eos_token_id,)


def answer_ids(new: np.ndarray, stops: tuple[int, ...], pad_id: int, *, padded: bool) -> np.ndarray:
    """A row's new tokens cut after its first stop token; in a padded batch also without the pad ids that
    batched SDAR writes after a row's end (trailing only: inside an answer the pad id may be a real token)."""
    hits = np.flatnonzero(np.isin(new, stops))
    if hits.size:
        return new[:hits[0] + 1]
    kept = np.flatnonzero(new != pad_id) if padded else np.arange(len(new))
    return new[:kept[-1] + 1] if kept.size else new[:0]


# A prompts file line may hold this many bytes per position of the model's context: far more than a token of
# these models' vocabularies covers in any text, so a longer line could not fit; an endless line (/dev/zero)
# stops there instead of filling the memory.
LINE_BYTES_PER_POSITION = 256


@contextlib.contextmanager
def opened_prompts(args, config):
    """The prompts (dllm_jax.generate.prompts.Prompt) of --prompt (repeatable) or --prompts-file, streamed
    line by line from the file while it is open; its lines are capped at LINE_BYTES_PER_POSITION bytes per
    position of config.max_position_embeddings."""
    from dllm_jax.generate.prompts import file_prompts, flag_prompts

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
    """int32 [1, P] of one prompt (a dllm_jax.generate.prompts.Prompt), which with --gen-length must fit the
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
    estimate of dllm_jax.generate.budget allows (per device of the mesh's dp, the weights split over its tp)."""
    from dllm_jax.generate import budget

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


def batch_options(args, request, batch: PromptBatch) -> dict:
    """generate's options for this batch. Left-padded LLaDA rows hide their pad keys (padding="mask"), so
    each row's answer is the one it gets alone; the default "ignore" (the official file) lets every token
    attend to the pads. The LLaDA sparse methods take no padding mask: refused before any loading."""
    if request.family == "Dream" and request.method is not None and batch.mask is not None and not batch.mask.all():
        raise ValueError(f"--method {args.method} runs on unpadded prompts only (its kernels take no padding "
                         f"mask), and these {len(batch.lengths)} prompts differ in length ({batch.lengths} tokens): "
                         "give prompts of one length, run them one at a time, or use --method dense")
    if request.family != "LLaDA" or batch.mask is None or batch.mask.all():
        return request.options
    if request.method is not None:
        raise ValueError(f"--method {args.method} runs on unpadded prompts only (its kernels take no padding "
                         f"mask), and these {len(batch.lengths)} prompts differ in length ({batch.lengths} tokens): "
                         "give prompts of one length, run them one at a time, or use --method dense")
    return request.options | dict(padding="mask")


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


@dataclasses.dataclass(frozen=True)
class Request:
    """The generate / analyze flags, checked against the checkpoint's config.json before any weights load."""

    config: object  # the checkpoint's LLaDAConfig, SDARConfig, DreamConfig or LLaDA2Config
    family: str  # "LLaDA", "SDAR", "Dream" or "LLaDA2"
    method: object  # the --method attention policy; None for dense
    options: dict  # generate's options of the family


# Sampling flags read by one family's sampler only. Their defaults are None, so a flag given for the
# other family is refused by name instead of being ignored (even when its value equals a default).
FAMILY_FLAGS = {"block_length": ("--block-length", "LLaDA"), "cfg_scale": ("--cfg-scale", "LLaDA"),
                "top_k": ("--top-k", "SDAR"), "top_p": ("--top-p", "SDAR"),
                "confidence_threshold": ("--confidence-threshold", "SDAR"), "cache": ("--cache", "LLaDA"),
                "threshold": ("--threshold", "LLaDA"), "factor": ("--factor", "LLaDA"),
                "cache_refresh": ("--cache-refresh", "LLaDA"), "alg_temp": ("--alg-temp", "Dream")}
# Flags a second family's sampler reads too (Dream's official sampler has top-k and top-p, as SDAR's).
# LLaDA2's official sampler reads block length, threshold, top-k and top-p.
SHARED_FLAGS = {"top_k": ("Dream", "LLaDA2"), "top_p": ("Dream", "LLaDA2"), "block_length": ("LLaDA2",),
                "threshold": ("LLaDA2",)}


def flag_families(dest: str) -> tuple[str, ...]:
    """The families whose sampler reads the flag of `dest` (FAMILY_FLAGS' owner first)."""
    return (FAMILY_FLAGS[dest][1], *SHARED_FLAGS.get(dest, ()))


def remasking_families() -> dict:
    """{--remasking value: the family whose sampler has it}."""
    from dllm_jax.generate import dream, llada, sdar

    return ({name: "LLaDA" for name in llada.REMASKING} | {name: "SDAR" for name in sdar.REMASKING}
            | {name: "Dream" for name in dream.ALGS})  # Dream's alg: its remasking strategy


def checked_request(args) -> Request:
    """The request of the generate / analyze flags; ValueError naming the flag for anything the
    checkpoint's family would refuse or ignore (reads config.json only)."""
    from dllm_jax.attention.methods import check_family
    from dllm_jax.config import DreamConfig, LLaDA2Config, LLaDAConfig, read_hf_config
    from dllm_jax.generate import DreamOptions, LLaDAOptions, SDAROptions
    from dllm_jax.generate.llada2 import LLaDA2Options

    method = method_from_args(args)
    _, config = read_hf_config(args.model)
    families = {LLaDAConfig: "LLaDA", DreamConfig: "Dream", LLaDA2Config: "LLaDA2"}
    family = families.get(type(config), "SDAR")
    check_family_flags(args, family)
    check_family(method, family)
    check_steps(args, family, config)
    check_top_k(args, config)
    if family == "Dream":
        options, kind = dream_options(args), DreamOptions
    elif family == "LLaDA2":
        options, kind = llada2_options(args), LLaDA2Options
    elif family == "LLaDA":
        options, kind = llada_options(args), LLaDAOptions
    else:
        options, kind = sdar_options(args, config), SDAROptions
    try:
        kind(**options)  # generate's own checks (e.g. Fast-dLLM's rules), before loading
    except ValueError as e:
        raise ValueError(flag_names(str(e))) from None
    return Request(config=config, family=family, method=method, options=options)


# generate's option fields -> the flags that set them (every family), for its errors' messages
OPTION_FLAGS = {"gen_length": "--gen-length", "max_new_tokens": "--gen-length", "steps": "--steps",
                "denoising_steps": "--steps", "block_length": "--block-length", "temperature": "--temperature",
                "cfg_scale": "--cfg-scale", "remasking": "--remasking", "alg": "--remasking", "alg_temp": "--alg-temp",
                "cache": "--cache", "threshold": "--threshold", "factor": "--factor",
                "cache_refresh": "--cache-refresh", "confidence_threshold": "--confidence-threshold",
                "top_k": "--top-k", "top_p": "--top-p"}
OPTION_FIELD = re.compile(r"(?<![\w.-])(" + "|".join(sorted(OPTION_FLAGS, key=len, reverse=True)) + r")(?:(=)|(?!\w))")


def flag_names(message: str) -> str:
    """An options error as `dllm-jax` words: `field=value` becomes `--flag value`, and a field named
    without a value becomes its flag where the name cannot be an English word (it holds an underscore)."""
    def flag(match):
        field, equals = match.groups()
        if not equals:
            return OPTION_FLAGS[field] if "_" in field else field
        value_follows = match.end() < len(message) and message[match.end()] not in " ,;:)"
        return OPTION_FLAGS[field] + (" " if value_follows else "")
    return OPTION_FIELD.sub(flag, message)


def check_steps(args, family: str, config) -> None:
    """--steps at most the tokens it unmasks (LLaDA, Dream: --gen-length; SDAR: a block): each step is a full
    forward, and one past the last mask unmasks nothing. LLaDA2 runs at most min(steps, gen_length) steps."""
    if family == "LLaDA" and args.block_length is not None and args.gen_length % args.block_length:
        raise ValueError(f"--gen-length {args.gen_length} must be a multiple of --block-length {args.block_length} "
                         "(LLaDA decodes the answer in blocks of --block-length; default: one block of --gen-length)")
    if args.steps is None:
        return
    if family in ("LLaDA", "Dream") and args.steps > args.gen_length:
        raise ValueError(f"--steps {args.steps} exceeds --gen-length {args.gen_length}: {family} unmasks at least one "
                         f"token a step, so the {args.steps - args.gen_length} steps past them would unmask none; pass "
                         f"--steps <= {args.gen_length}")
    if family == "SDAR" and args.steps > config.block_size:
        raise ValueError(f"--steps {args.steps} exceeds the model's block_size of {config.block_size} (config.json): "
                         f"SDAR decodes a block within {config.block_size} steps; pass --steps <= {config.block_size}")


def check_top_k(args, config) -> None:
    """--top-k at most the vocabulary (generate checks it too, but only once the weights are loaded)."""
    if args.top_k is not None and args.top_k > config.vocab_size:
        raise ValueError(f"--top-k {args.top_k} exceeds the model's vocabulary of {config.vocab_size} tokens "
                         "(config.json vocab_size)")


def check_family_flags(args, family: str) -> None:
    """Refuses, by name, sampling flags and --remasking values of the other family."""
    stray = [flag for dest, (flag, _) in FAMILY_FLAGS.items()
             if family not in flag_families(dest) and getattr(args, dest) is not None]
    owners = [owner for dest, (_, owner) in FAMILY_FLAGS.items()
              if family not in flag_families(dest) and getattr(args, dest) is not None]
    if args.remasking is not None and remasking_families()[args.remasking] != family:
        stray.append(f"--remasking {args.remasking}")
        owners.append(remasking_families()[args.remasking])
    if stray:
        other = " / ".join(dict.fromkeys(owners))  # the families the stray flags belong to, in order
        own = [flag for dest, (flag, _) in FAMILY_FLAGS.items() if family in flag_families(dest)]
        own += [f"--remasking {name}" for name, owner in remasking_families().items() if owner == family]
        raise ValueError(f"{', '.join(stray)} {'applies' if len(stray) == 1 else 'apply'} to {other} models; this "
                         f"checkpoint is {family} (its own sampling flags: {', '.join(own)})")


def llada_options(args) -> dict:
    """generate's LLaDA options from the flags; unset flags take the official sampler's defaults."""
    length = args.gen_length
    return dict(gen_length=length, steps=length if args.steps is None else args.steps,
                block_length=length if args.block_length is None else args.block_length,
                temperature=0.0 if args.temperature is None else args.temperature,
                cfg_scale=0.0 if args.cfg_scale is None else args.cfg_scale,
                remasking=args.remasking or "low_confidence", cache=args.cache, threshold=args.threshold,
                factor=args.factor, cache_refresh=args.cache_refresh or 0)


def dream_options(args) -> dict:
    """generate's Dream options from the flags; unset flags take the official sampler's defaults (steps:
    --gen-length, one token per step as the official README's examples)."""
    return dict(max_new_tokens=args.gen_length, steps=args.gen_length if args.steps is None else args.steps,
                alg=args.remasking or "origin", alg_temp=args.alg_temp or 0.0,
                temperature=0.0 if args.temperature is None else args.temperature,
                top_k=0 if args.top_k is None else args.top_k, top_p=1.0 if args.top_p is None else args.top_p)


def llada2_options(args) -> dict:
    """generate's LLaDA2 options from the flags; unset flags take the official sampler's defaults."""
    return dict(gen_length=args.gen_length, block_length=32 if args.block_length is None else args.block_length,
                steps=32 if args.steps is None else args.steps,
                temperature=0.0 if args.temperature is None else args.temperature,
                top_k=0 if args.top_k is None else args.top_k, top_p=1.0 if args.top_p is None else args.top_p,
                threshold=0.95 if args.threshold is None else args.threshold)


def sdar_options(args, config) -> dict:
    """generate's SDAR options from the flags; unset flags take the official sampler's defaults."""
    remasking = args.remasking or "low_confidence_dynamic"
    if args.temperature == 0:
        raise ValueError("--temperature 0: SDAR's sampler divides the logits by the temperature (default 1); "
                         "for greedy decoding pass --top-k 1")
    if args.confidence_threshold is not None and remasking != "low_confidence_dynamic":
        raise ValueError(f"--confidence-threshold applies to --remasking low_confidence_dynamic only, not {remasking}")
    return dict(max_new_tokens=args.gen_length,
                denoising_steps=config.block_size if args.steps is None else args.steps, remasking=remasking,
                confidence_threshold=0.85 if args.confidence_threshold is None else args.confidence_threshold,
                temperature=1.0 if args.temperature is None else args.temperature,
                top_k=0 if args.top_k is None else args.top_k, top_p=1.0 if args.top_p is None else args.top_p)


def mesh_spec(text: str) -> dict[str, int]:
    """--mesh tp=2,dp=2 -> {"dp": 2, "tp": 2} (dllm_jax.sharding.parse_mesh), an argparse error otherwise."""
    from dllm_jax.sharding import parse_mesh

    try:
        return parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def mesh_of(args):
    """The jax Mesh of --mesh (over this machine's devices), or None."""
    from dllm_jax.sharding import make_mesh

    return None if args.mesh is None else make_mesh(args.mesh)


# method parameter -> (flag, argparse type, help). One table for generate and analyze; which flags a
# method takes comes from dllm_jax.attention.methods.parameters.
METHOD_FLAGS = {
    "skip": ("--skip", probability, "SparseD (0.2) / SpargeAttn (0): fraction of the steps run dense first"),
    "select": ("--select", fraction, "SparseD: fraction of key blocks kept per query block (0.3)"),
    "block_size": ("--sparse-block", positive_int, "SparseD: pattern block size (128)"),
    "sparsity": ("--sparsity", finite_float, "PulseCol: fraction of keys dropped per query group (0.8)"),
    "group_size": ("--group-size", positive_int, "PulseCol: queries sharing one column set (32)"),
    "eta": ("--eta", finite_float, "PulseCol: refresh-window ratio (0.3)"),
    "refreshes": ("--refreshes", non_negative_int, "PulseCol: refresh budget (16)"),
    "k": ("--mage-k", positive_int, "MAGE: prefix keys kept per KV head (512)"),
    "exact_layers": ("--exact-layers", non_negative_int, "MAGE: first layers kept exact (2)"),
    "tau": ("--tau", none_or(non_negative_int), "FlashBlock: refresh after this many unmasked tokens (2); 0 = "
            "always refresh, none = only at each block's first step"),
    "simthreshd1": ("--simthreshd1", finite_float, "SpargeAttn: block self-similarity threshold (-0.1)"),
    "cdfthreshd": ("--cdfthreshd", finite_float, "SpargeAttn: TopCdf threshold (instead of --topk)"),
    "topk": ("--topk", finite_float, "SpargeAttn: fraction of key blocks kept (0.5 when no --cdfthreshd)"),
    "pvthreshd": ("--pvthreshd", none_or(finite_float), "SpargeAttn: PV-skip threshold (50); none = no filter"),
    "calibration": ("--calibration", str, "SpargeAttn: per-layer, per-head values (JSON from "
                    "dllm_jax.analysis.calibration.save_calibration)"),
}


def method_from_args(args):
    """The --method policy (None = dense); unset method flags keep the method's defaults."""
    from dllm_jax.attention.methods import make_method, parameters

    given = {param: getattr(args, param) for param in METHOD_FLAGS if hasattr(args, param)}
    if args.method == "dense":
        if given:
            flags = sorted(METHOD_FLAGS[p][0] for p in given)
            raise ValueError(f"{', '.join(flags)} {'needs' if len(flags) == 1 else 'need'} a sparse --method "
                             "(dense attention has no parameters)")
        return None
    valid = parameters(args.method)
    stray = sorted(METHOD_FLAGS[p][0] for p in given if p not in valid)
    if stray:
        raise ValueError(f"{', '.join(stray)} {'does' if len(stray) == 1 else 'do'} not apply to --method "
                         f"{args.method}; its flags: "
                         + ", ".join(METHOD_FLAGS[p][0] for p in METHOD_FLAGS if p in valid))
    return make_method(args.method, **given)


def cmd_analyze(args) -> None:
    """Generates under a pattern probe and writes the diagnostics plots and a summary."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed

    from dllm_jax.analysis import analyze, analyze_blocks, plot_error, plot_head_patterns, plot_jaccard, plot_recall
    from dllm_jax.checkpoint import load_model

    request = checked_request(args)
    if request.method is None:
        raise ValueError("analyze compares a sparse --method with dense attention: pass one")
    layer = checked_layer(args.layer, request)
    out = checked_out_dir(Path(args.out))  # all checked before the run, which may take minutes
    tokenizer, ids = encode_prompt(args, request.config)
    model = load_model(args.model, dtype=args.dtype)
    start = time.perf_counter()
    if request.family in BIDIRECTIONAL:
        report = analyze(model, ids, request.method, seed=args.seed, **request.options)
        plots = {"recall": plot_recall, "jaccard": plot_jaccard, "error": plot_error}
    else:  # SDAR, LLaDA2: block diffusion over a prefix cache
        report = analyze_blocks(model, ids, request.method, seed=args.seed, **request.options)
        plots = {"recall": plot_recall, "error": plot_error}
    figures = {f"{name}.png": plot(report).figure for name, plot in plots.items()}
    if layer is not None:
        figures["head_patterns.png"] = plot_head_patterns(report, layer=layer)
    files = {name: png_bytes(fig) for name, fig in figures.items()}  # rendered before anything is written
    summary = dict(method=repr(request.method), prompt_tokens=int(ids.shape[1]), options=request.options,
                   **{k: None if v != v else v for k, v in report.summary().items()})  # NaN -> null (valid JSON)
    files["summary.json"] = (json.dumps(summary, indent=2) + "\n").encode()
    write_files(out, files)
    print(json.dumps(summary))
    print(f"wrote {', '.join(str(out / name) for name in files)} ({time.perf_counter() - start:.1f} s)",
          file=sys.stderr)


BIDIRECTIONAL = ("LLaDA", "Dream")  # analyze's families (per-step patterns); the others: analyze_blocks


def checked_layer(layer: int | None, request: Request) -> int | None:
    """The layer of the per-head heat maps of LLaDA and Dream (default the last; None for SDAR and LLaDA2,
    which have no such plot)."""
    if request.family not in BIDIRECTIONAL:
        if layer is not None:
            raise ValueError(f"--layer applies to LLaDA models and Dream ones (the per-head heat maps); this "
                             f"checkpoint is {request.family}")
        return None
    count = request.config.num_layers
    if layer is None:
        return count - 1
    if not 0 <= layer < count:
        raise ValueError(f"--layer {layer} is not a layer of this model: it has {count} (0..{count - 1}, "
                         "from config.json)")
    return layer


def checked_out_dir(path: Path) -> Path:
    """`path` if it is a directory that exists or can be created, and can be written into (not created here:
    a failed run leaves nothing behind)."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {path} is an existing file, not a directory")
    nearest = next(p for p in (path, *path.parents) if p.exists())
    if not nearest.is_dir():
        raise ValueError(f"--out {path} cannot be created: {nearest} is a file")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ValueError(f"--out {path} is not writable: no write permission in {nearest}")
    return path


def png_bytes(figure) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue()


def write_files(directory: Path, files: dict[str, bytes]) -> None:
    """Writes {name: content} into `directory` (created), each file whole or not at all
    (`dllm_jax.files.write_atomic`: a temporary name and a rename), so no reader ever sees half of one."""
    from dllm_jax.files import write_atomic

    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        write_atomic(directory / name, content)


def cmd_eval(args) -> None:
    """Generates answers to seeded samples of a synthetic task and prints the accuracy (--json: also
    every sample's record)."""
    from dllm_jax.attention.methods import check_family
    from dllm_jax.checkpoint import load_model
    from dllm_jax.config import LLaDAConfig, read_hf_config
    from dllm_jax.eval import evaluate, load_tokenizer, make_samples

    method = method_from_args(args)  # every flag and sample error before the slow loading
    _, config = read_hf_config(args.model)
    if config.family in ("dream", "llada2"):
        raise ValueError("eval supports LLaDA and SDAR checkpoints (the synthetic tasks' tiny trained models); this "
                         f"one is {type(config).__name__.removesuffix('Config')}")
    check_family(method, "LLaDA" if isinstance(config, LLaDAConfig) else "SDAR")
    check_eval_size(args, config)  # before the samples are built and the weights load: both may take minutes
    out = None if args.json is None else checked_out_file(Path(args.json), "--json")
    samples = make_samples(args.task, args.context, args.samples, args.seed, load_tokenizer(args.model))
    model = load_model(args.model, dtype=args.dtype, mesh=mesh_of(args))
    result = evaluate(model, samples, method=method, batch_size=args.batch_size, progress=not args.quiet)
    print(f"{args.task} at {args.context} tokens, {result.method}: accuracy {result.accuracy:.3f} "
          f"({result.num_correct}/{result.num_samples}) in {result.seconds:.1f} s")
    wrong = result.num_samples - result.num_correct
    if wrong and any(len(s.values) > 1 for s in samples):  # a task with distractors: which needle was taken
        places = result.distractors()
        taken = ", ".join(f"{ordinal(place)} {count}" for place, count in places.items())
        print(f"wrong answers: {sum(places.values())} of {wrong} a distractor's whole value"
              + (f" (by its place in the text: {taken})" if taken else ""))
    if out is not None:
        write_files(out.parent, {out.name: (json.dumps(result.to_dict(), indent=2) + "\n").encode()})
        print(f"wrote {out}", file=sys.stderr)


# eval builds every sample's prompt in memory before generating: these bound what one call may ask for
MAX_EVAL_SAMPLES = 100_000
MAX_EVAL_TOKENS = 2**28  # prompt tokens of all samples together (1 GiB as int32)


def check_eval_size(args, config) -> None:
    """--context and --samples against the task and the model (config.json only): the task must fit the
    context, the prompt and its answer window the model's positions, and the samples the limits above."""
    from dllm_jax.config import SDARConfig
    from dllm_jax.eval import max_answer_length, min_context_length
    from dllm_jax.eval.evaluate import answer_window
    from dllm_jax.eval.tasks import prompt_length

    least = min_context_length(args.task)
    if args.context < least:
        raise ValueError(f"--context {args.context} is too short for --task {args.task}: its statements and question "
                         f"alone take {least} tokens (the least --context)")
    prompt = prompt_length(args.task, args.context)
    window = answer_window(max_answer_length(args.task), config.block_size if isinstance(config, SDARConfig) else None)
    limit = config.max_position_embeddings
    if prompt + window > limit:
        raise ValueError(f"--context {args.context} + {window} answer tokens = {prompt + window} positions exceeds the "
                         f"model's context of {limit} (config.json max_position_embeddings): pass --context <= "
                         f"{limit - window}")
    if args.samples > MAX_EVAL_SAMPLES:
        raise ValueError(f"--samples {args.samples} exceeds {MAX_EVAL_SAMPLES:,}, the most one eval builds: split the "
                         "run over several --seed values")
    if args.samples * prompt > MAX_EVAL_TOKENS:
        raise ValueError(f"--samples {args.samples} x {prompt} prompt tokens (--context {args.context}) = "
                         f"{args.samples * prompt:,} tokens exceeds the {MAX_EVAL_TOKENS:,} one eval holds in memory: "
                         f"pass --samples <= {MAX_EVAL_TOKENS // prompt}")


def checked_out_file(path: Path, flag: str) -> Path:
    """`path` if a file can be written there: not a directory, in a directory that exists or can be created
    and can be written into (nothing is created here: a refused run leaves nothing behind)."""
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory: name the file to write")
    nearest = next(p for p in (path.parent, *path.parent.parents) if p.exists())
    if not nearest.is_dir():
        raise ValueError(f"{flag} {path} cannot be written: {nearest} is a file, not a directory")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path} is not writable: no write permission in {nearest}")
    return path


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, 21st, ..."""
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def cmd_train(args) -> None:
    """`python -m dllm_jax.train`: the flags are its `arguments()`, the run is its `run`."""
    from dllm_jax.train.__main__ import run

    run(args)


def cmd_bench(args) -> None:
    from dllm_jax.bench import run

    checked_out_dir(Path(args.out))  # before the run, which may take minutes
    path = run(out=Path(args.out), sections=args.sections, lengths=args.lengths, densities=args.densities,
               models=args.models, context=args.context, new_tokens=args.new_tokens, layers=args.layers,
               heads=args.heads, dtype=args.dtype, repeats=args.repeats, progress=args.progress)
    print(f"wrote {path} and {path.with_suffix('.json')}", file=sys.stderr)


# The trained checkpoints the demo runs (checkpoints/README.md), in order: directory name -> the tasks it was
# trained on, which the demo evaluates. A missing one (not trained yet) is skipped with a note.
DEMO_CHECKPOINTS = {"tiny-sdar-tasks": ("passkey",), "tiny-llada-tasks": ("passkey",)}
REPOSITORY_CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"  # the clone's (editable install)


def cmd_demo(args) -> None:
    """The main job: each trained checkpoint -> Orbax -> load -> answers a fresh passkey question, timed
    -> accuracy on a small batch of fresh samples of each task it was trained on."""
    import jax

    from dllm_jax.eval import min_context_length

    root = Path(args.checkpoints)
    found = [name for name in DEMO_CHECKPOINTS if (root / name / "config.json").is_file()]
    if not found:
        raise ValueError(f"--checkpoints {root} holds none of the trained checkpoints ({', '.join(DEMO_CHECKPOINTS)}"
                         "): run the demo from a clone of the repository, or point --checkpoints at its checkpoints/")
    shortest = max(min_context_length(task) for task in {"passkey", *(t for n in found for t in DEMO_CHECKPOINTS[n])})
    if args.context < shortest:
        raise ValueError(f"--context {args.context} is too short: the demo's prompts need at least {shortest} tokens")
    seed = demo_seed(args.seed)
    print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind}); evaluation seed {seed} "
          f"(--seed {seed} repeats this run)")
    for name, tasks in DEMO_CHECKPOINTS.items():
        if name in found:
            demo_checkpoint(root / name, tasks, seed, args)
        else:
            print(f"\n== {name}: not in {root} (not trained yet); skipped")


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


def build_parser() -> argparse.ArgumentParser:
    from dllm_jax.attention.methods import METHODS
    from dllm_jax.eval import TASKS
    from dllm_jax.generate import budget
    from dllm_jax.train import __main__ as train_main

    parser = argparse.ArgumentParser(prog="dllm-jax", description="Diffusion-LLM inference in JAX: LLaDA and SDAR "
                                     "with sparse-attention methods.")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{convert,generate,analyze,eval,train,bench,demo}")

    dtype = argparse.ArgumentParser(add_help=False)
    dtype.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                       help="parameter and compute dtype (default bfloat16)")

    sampling = argparse.ArgumentParser(add_help=False)
    sampling.add_argument("--model", required=True, help="converted or HF checkpoint directory (with tokenizer.json)")
    prompts = sampling.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", metavar="TEXT",
                         help="a prompt; repeat it for several, generated in batches (--batch-size; analyze: one)")
    prompts.add_argument("--prompts-file", metavar="FILE",
                         help="a UTF-8 file of prompts, one per line (\\n or \\r\\n; blank lines skipped; a leading "
                              "byte-order mark dropped; a lone \\r refused; a line at most "
                              f"{LINE_BYTES_PER_POSITION} bytes per position of the model's context), read as it is "
                              "generated, batch by batch")
    sampling.add_argument("--raw", action="store_true", help="encode the prompts as they are, without the chat template")
    # Family-specific flags default to None ("not given"): given for the other family they are refused by name.
    sampling.add_argument("--gen-length", type=positive_int, default=128, metavar="N",
                          help="new tokens (128). LLaDA: gen_length, exactly this many (Dream: max_new_tokens, too). SDAR: max_new_tokens; "
                               "SDAR decodes whole blocks of its block_size, and at most this many are printed "
                               "(fewer after a stop token)")
    sampling.add_argument("--steps", type=positive_int, default=None, metavar="N",
                          help="LLaDA and Dream steps in all (default gen-length) / SDAR denoising_steps per block "
                               "(default block_size)")
    sampling.add_argument("--block-length", type=positive_int, default=None, metavar="N",
                          help="LLaDA only: block_length (default gen-length)")
    sampling.add_argument("--temperature", type=non_negative_float, default=None, metavar="T",
                          help="sampling temperature: LLaDA and Dream default 0 (greedy); SDAR default 1, must be > 0 "
                               "(--top-k 1 is greedy)")
    sampling.add_argument("--cfg-scale", type=non_negative_float, default=None, metavar="S",
                          help="LLaDA only: classifier-free guidance (0: off)")
    sampling.add_argument("--remasking", default=None, choices=list(remasking_families()), metavar="NAME",
                          help="LLaDA: low_confidence (default) | random; SDAR: low_confidence_dynamic (default) | "
                               "low_confidence_static | sequential; Dream (its alg): origin (default) | maskgit_plus "
                               "| topk_margin | entropy")
    sampling.add_argument("--confidence-threshold", type=probability, default=None, metavar="X",
                          help="SDAR only, low_confidence_dynamic remasking (0.85)")
    sampling.add_argument("--cache", default=None, choices=("prefix", "dual"),
                          help="LLaDA only, Fast-dLLM: reuse the keys/values of the positions before the block "
                               "(prefix) or before and after it (dual) from the block's first step; dense, "
                               "--method sparsed or pulsecol")
    sampling.add_argument("--threshold", type=probability, default=None, metavar="X",
                          help="LLaDA only, Fast-dLLM: commit every masked position of the block whose confidence "
                               "is >= X (at least the most confident one) per step")
    sampling.add_argument("--factor", type=positive_float, default=None, metavar="F",
                          help="LLaDA only, Fast-dLLM's factor rule instead of --threshold: the i-th most confident "
                               "masked position is committed while it reaches 1 - F / (i + 1)")
    sampling.add_argument("--cache-refresh", type=positive_int, default=None, metavar="K",
                          help="LLaDA only, with --cache: also recompute the cache every K-th step of a block")
    sampling.add_argument("--top-k", type=non_negative_int, default=None, metavar="N",
                          help="SDAR and Dream: top-k (0: off)")
    sampling.add_argument("--top-p", type=fraction, default=None, metavar="X", help="SDAR and Dream: top-p (1: off)")
    sampling.add_argument("--alg-temp", type=non_negative_float, default=None, metavar="T",
                          help="Dream only: draw the committed positions from softmax(confidence / T) (0: the most "
                               "confident)")
    sampling.add_argument("--seed", type=seed_int, default=0, metavar="N", help="random seed, 32-bit (0)")

    methods = argparse.ArgumentParser(add_help=False)
    group = methods.add_argument_group("sparse attention (unset parameters keep the method's defaults)")
    group.add_argument("--method", default="dense", choices=["dense", *METHODS],
                       help="sparsed, pulsecol, sparge: LLaDA and Dream; mage, flashblock, flashblock+mage: SDAR "
                            "(default dense)")
    for param, (flag, kind, text) in METHOD_FLAGS.items():
        metavar = {"int": "N", "float": "X", "str": "FILE"}[kind.__name__.split()[0]]
        metavar += "|none" if kind.__name__.endswith("'none'") else ""
        group.add_argument(flag, dest=param, type=kind, default=argparse.SUPPRESS, metavar=metavar, help=text)

    convert = sub.add_parser("convert", help="convert an HF safetensors checkpoint to Orbax",
                             description="Validates every tensor of an HF checkpoint against its config.json, then "
                                         "streams it into an Orbax checkpoint (tokenizer files travel along).")
    convert.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                         help="stored parameter dtype (default: the source checkpoint's)")
    convert.add_argument("hf_dir", help="directory with config.json and *.safetensors")
    convert.add_argument("out_dir", help="output directory (created; must not exist)")
    convert.add_argument("--overwrite", action="store_true", help="replace an existing out_dir")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(fn=cmd_convert)

    gen = sub.add_parser("generate", parents=[sampling, dtype, methods],
                         help="generate answers with a checkpoint's model and tokenizer",
                         description="Encodes each prompt (--prompt, repeatable, or --prompts-file, streamed) with "
                                     "the checkpoint's chat template and generates them in batches (--batch-size), "
                                     "each left-padded to its longest prompt and run with the official sampler of "
                                     "its family (one compiled loop); prints each batch's answers, numbered when "
                                     "there are several, and a timing line before reading the next.")
    gen.add_argument("--batch-size", type=positive_int, default=None, metavar="N",
                     help="prompts generated together, a batch printed before the next is read (default: as many "
                          "as an estimate of a step's memory fits in half the device's free memory after the "
                          f"weights, or in {budget.CPU_BUDGET // 2**30} GiB where jax reports no memory (CPU), at most "
                          f"{budget.MAX_ROWS}; dllm_jax.generate.budget); greedy answers do not depend on it")
    gen.add_argument("--progress", action="store_true", help="progress bar from inside the compiled loop")
    gen.add_argument("--mesh", type=mesh_spec, default=None, metavar="tp=N[,sp=S][,dp=M]",
                     help="shard the model over N devices (tensor parallelism) and the prompts over M")
    gen.set_defaults(fn=cmd_generate)

    analyze = sub.add_parser("analyze", parents=[sampling, dtype, methods],
                             help="pattern diagnostics of a sparse method for a prompt (PNG plots)",
                             description="Generates with --method under a probe that also computes dense attention "
                                         "and writes to --out: recall.png (kept pattern vs the per-step top-k "
                                         "oracle), error.png (relative L1 vs dense), for LLaDA and Dream "
                                         "jaccard.png (oracle stability over steps) and head_patterns.png (per-head "
                                         "heat maps), and "
                                         "summary.json. Builds [B, H, N, N] arrays: for short prompts.")
    analyze.add_argument("--out", default="analysis", help="output directory (default ./analysis)")
    analyze.add_argument("--layer", type=non_negative_int, default=None, metavar="N",
                         help="LLaDA, Dream: layer of the per-head heat maps (default the last)")
    analyze.set_defaults(fn=cmd_analyze)

    evaluation = sub.add_parser("eval", parents=[dtype, methods], help="accuracy on a synthetic long-context task",
                                description="Makes --samples seeded samples of --task (dllm_jax.eval.tasks) at --context "
                                            "tokens with the checkpoint's tokenizer.json (the task vocabulary), "
                                            "generates greedily (dllm_jax.eval.evaluate) and prints the accuracy.")
    evaluation.add_argument("--model", required=True, help="converted or HF checkpoint directory (with tokenizer.json)")
    evaluation.add_argument("--task", required=True, choices=list(TASKS))
    evaluation.add_argument("--context", type=positive_int, default=4096, metavar="N",
                            help="prompt tokens (4096; sanity prompts stop at 64); with the answer it must fit "
                                 "the model's max_position_embeddings")
    evaluation.add_argument("--samples", type=positive_int, default=100, metavar="N",
                            help=f"number of samples (100; at most {MAX_EVAL_SAMPLES:,}, and {MAX_EVAL_TOKENS:,} "
                                 "prompt tokens in all)")
    evaluation.add_argument("--seed", type=seed_int, default=0, metavar="N", help="seed of the samples (0)")
    evaluation.add_argument("--batch-size", type=positive_int, default=1, metavar="N",
                            help="samples generated together (1; greedy answers do not depend on it)")
    evaluation.add_argument("--json", default=None, metavar="FILE",
                            help="also write the result and every record here (checked before the run)")
    evaluation.add_argument("--quiet", action="store_true", help="no progress bar")
    evaluation.add_argument("--mesh", type=mesh_spec, default=None, metavar="tp=N[,sp=S][,dp=M]",
                            help="shard the model over N devices (tensor parallelism) and the samples over M")
    evaluation.set_defaults(fn=cmd_eval)

    # The flags of `python -m dllm_jax.train`, from its `arguments()` parent parser (one definition)
    train = sub.add_parser("train", parents=[train_main.arguments()],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                           help="train a tiny LLaDA or SDAR model on the synthetic tasks (python -m dllm_jax.train)",
                           description="What `python -m dllm_jax.train` runs, with the same flags. "
                                       + train_main.__doc__.strip().split("\n\n")[-1])
    train.set_defaults(fn=cmd_train)

    bench = sub.add_parser("bench", parents=[dtype], help="time attention kernels and generation on this device",
                           description="Attention kernels (dense cuDNN/XLA vs our flash, block- and column-sparse "
                                       "kernels) and the generate loop per method with random weights; writes "
                                       "bench_<device>_<date>.json and .md to --out (_2, _3, ... for later runs of the "
                                       "day: none is replaced). Defaults fit the device: "
                                       "LLaDA-8B / SDAR-8B dims on a GPU, tiny models on a CPU.")
    bench.add_argument("--sections", nargs="+", default=["attention", "generate"], choices=["attention", "generate"])
    bench.add_argument("--lengths", type=positive_int, nargs="+", default=None,
                       help="attention sequence lengths (GPU 4096 16384; CPU 256 512)")
    bench.add_argument("--densities", type=fraction, nargs="+", default=[0.5, 0.3, 0.1],
                       help="fractions of key blocks / columns kept by the sparse kernels")
    bench.add_argument("--heads", type=positive_int, default=32, help="attention heads (head_dim 128; at most 4 on a CPU)")
    bench.add_argument("--models", nargs="+", default=None,
                       help="shipped config names (e.g. dream-v0-instruct-7b) or tiny-llada / tiny-sdar / tiny-dream / "
                            "tiny-llada2 (GPU llada-8b-instruct sdar-8b-chat; CPU tiny-llada tiny-sdar)")
    bench.add_argument("--context", type=positive_int, default=None, help="prompt + new tokens (GPU 8192; CPU 256)")
    bench.add_argument("--new-tokens", type=positive_int, default=None, help="generated tokens (GPU 128; CPU 32)")
    bench.add_argument("--layers", type=positive_int, default=None, help="use only this many layers (faster, same per-layer shapes)")
    bench.add_argument("--repeats", type=positive_int, default=5, help="timing repeats of the attention section")
    bench.add_argument("--out", default="bench_results", help="output directory (default ./bench_results)")
    bench.add_argument("--progress", action="store_true", help="progress bars of the generate loops")
    bench.set_defaults(fn=cmd_bench)

    demo = sub.add_parser("demo", parents=[dtype], help="trained checkpoints answer a fresh passkey question",
                          description="The main job (make demo): each trained checkpoint of checkpoints/ "
                                      "(tiny-sdar-tasks, tiny-llada-tasks; a missing one is skipped with a note) "
                                      "is converted to Orbax and loaded; it answers a passkey question it never "
                                      "saw (dllm_jax.eval.make_samples, greedy dllm_jax.generate), timed; then "
                                      "--samples fresh samples of each task it was trained on give its accuracy.")
    demo.add_argument("--checkpoints", default=str(REPOSITORY_CHECKPOINTS), metavar="DIR",
                      help="directory of the trained checkpoints (default: the repository's checkpoints/)")
    demo.add_argument("--context", type=positive_int, default=1024, metavar="N",
                      help="prompt tokens (1024, the longest context trained)")
    demo.add_argument("--samples", type=positive_int, default=8, metavar="N", help="samples per task (8)")
    demo.add_argument("--seed", type=fresh_seed, default=None, metavar="N",
                      help="seed of the samples, in [0, 2**31): evaluation seeds never used in training "
                           "(default: from the clock)")
    demo.set_defaults(fn=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs a subcommand; 0 on success, 2 on a bad flag (argparse: usage line + message, by SystemExit) or a
    refused input or unusable path (ValueError, OSError: one line on stderr, no traceback)."""
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except (ValueError, OSError) as e:
        print(f"dllm-jax {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
