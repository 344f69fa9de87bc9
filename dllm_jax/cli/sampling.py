"""The sampling flags of generate and analyze (--model, the prompts, generate's options) and which family's
sampler reads each of them."""

from __future__ import annotations

import argparse

from dllm_jax.cli.options import option_default
from dllm_jax.cli.prompts import LINE_BYTES_PER_POSITION
from dllm_jax.flags import fraction, non_negative_float, non_negative_int, positive_float, positive_int, probability, \
    seed_int

# Sampling flags read by one family's sampler only. Their defaults are None, so a flag given for the
# other family is refused by name instead of being ignored (even when its value equals a default).
FAMILY_FLAGS = {"block_length": ("--block-length", "LLaDA"), "cfg_scale": ("--cfg-scale", "LLaDA"),
                "top_k": ("--top-k", "SDAR"), "top_p": ("--top-p", "SDAR"),
                "confidence_threshold": ("--confidence-threshold", "SDAR"), "cache": ("--cache", "LLaDA"),
                "threshold": ("--threshold", "LLaDA"), "factor": ("--factor", "LLaDA"),
                "cache_refresh": ("--cache-refresh", "LLaDA"), "alg_temp": ("--alg-temp", "Dream"),
                "entropy_bound": ("--entropy-bound", "DiffusionGemma"),
                "t_min": ("--t-min", "DiffusionGemma"), "t_max": ("--t-max", "DiffusionGemma"),
                "stability_threshold": ("--stability-threshold", "DiffusionGemma"),
                "kv_cache_dtype": ("--kv-cache-dtype", "SDAR")}
# Flags a second family's sampler reads too (Dream's official sampler has top-k and top-p, as SDAR's).
# LLaDA2's official sampler reads block length, threshold, top-k and top-p; DiffusionGemma's adaptive stopping a
# confidence threshold (a mean entropy).
SHARED_FLAGS = {"top_k": ("Dream", "LLaDA2"), "top_p": ("Dream", "LLaDA2"), "block_length": ("LLaDA2",),
                "threshold": ("LLaDA2",), "confidence_threshold": ("DiffusionGemma",), "kv_cache_dtype": ("LLaDA2",)}
REMASKING_FIELDS = {"LLaDA": "remasking", "SDAR": "remasking", "Dream": "alg"}  # Dream's alg: its remasking


def flag_families(dest: str) -> tuple[str, ...]:
    """The families whose sampler reads the flag of `dest` (FAMILY_FLAGS' owner first)."""
    return (FAMILY_FLAGS[dest][1], *SHARED_FLAGS.get(dest, ()))


def remasking_names() -> dict[str, tuple[str, ...]]:
    """{family: its --remasking values} (LLaDA2 has none)."""
    from dllm_jax.generate import dream, llada, sdar

    return {"LLaDA": llada.REMASKING, "SDAR": sdar.REMASKING, "Dream": dream.ALGS}


def remasking_families() -> dict:
    """{--remasking value: the family whose sampler has it}."""
    return {name: family for family, names in remasking_names().items() for name in names}


def remasking_help() -> str:
    """--remasking's help: each family's values, its Options default marked."""
    def values(family):
        default = option_default(family, REMASKING_FIELDS[family])
        return " | ".join(f"{name} (default)" if name == default else name for name in remasking_names()[family])
    return f"LLaDA: {values('LLaDA')}; SDAR: {values('SDAR')}; Dream (its alg): {values('Dream')}"


def sampling_parent() -> argparse.ArgumentParser:
    """The parent parser of generate's and analyze's --model, prompt and sampling flags."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--model", required=True, help="converted or HF checkpoint directory (with tokenizer.json)")
    add_prompt_flags(parent)
    add_option_flags(parent)
    parent.add_argument("--seed", type=seed_int, default=0, metavar="N", help="random seed, 32-bit (0)")
    return parent


def add_prompt_flags(parser: argparse.ArgumentParser) -> None:
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", metavar="TEXT",
                         help="a prompt; repeat it for several, generated in batches (--batch-size; analyze: one)")
    prompts.add_argument("--prompts-file", metavar="FILE",
                         help="a UTF-8 file of prompts, one per line (\\n or \\r\\n; blank lines skipped; a leading "
                              "byte-order mark dropped; a lone \\r refused; a line at most "
                              f"{LINE_BYTES_PER_POSITION} bytes per position of the model's context), read as it is "
                              "generated, batch by batch")
    parser.add_argument("--raw", action="store_true", help="encode the prompts as they are, without the chat template")


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of generate's options. Family-specific flags default to None ("not given"): given for the
    other family they are refused by name; unset, they take the Options dataclasses' defaults (options.py)."""
    add_length_flags(parser)
    greedy, sdar = option_default("LLaDA", "temperature"), option_default("SDAR", "temperature")
    parser.add_argument("--temperature", type=non_negative_float, default=None, metavar="T",
                        help=f"sampling temperature: LLaDA and Dream default {greedy:g} (greedy); SDAR default "
                             f"{sdar:g}, must be > 0 (--top-k 1 is greedy); not DiffusionGemma (--t-max, --t-min)")
    parser.add_argument("--cfg-scale", type=non_negative_float, default=None, metavar="S",
                        help="LLaDA only: classifier-free guidance (0: off)")
    parser.add_argument("--remasking", default=None, choices=list(remasking_families()), metavar="NAME",
                        help=remasking_help())
    parser.add_argument("--confidence-threshold", type=probability, default=None, metavar="X",
                        help="SDAR: low_confidence_dynamic remasking "
                             f"({option_default('SDAR', 'confidence_threshold'):g}); DiffusionGemma: a row stops "
                             "denoising a canvas once its mean entropy is below X and its argmax stable "
                             f"({option_default('DiffusionGemma', 'confidence_threshold'):g})")
    add_fast_dllm_flags(parser)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=None,
                        help="SDAR and LLaDA2: the KV cache in the model's dtype (auto, the default) or in fp8 (e4m3 "
                             "with a scale per position and KV head: half the bytes read per step; dense attention)")
    parser.add_argument("--top-k", type=non_negative_int, default=None, metavar="N",
                        help="SDAR and Dream: top-k (0: off)")
    parser.add_argument("--top-p", type=fraction, default=None, metavar="X", help="SDAR and Dream: top-p (1: off)")
    parser.add_argument("--alg-temp", type=non_negative_float, default=None, metavar="T",
                        help="Dream only: draw the committed positions from softmax(confidence / T) (0: the most "
                             "confident)")
    add_diffusion_gemma_flags(parser)


def add_diffusion_gemma_flags(parser: argparse.ArgumentParser) -> None:
    """DiffusionGemma's sampler flags (transformers' option names; --steps is its max_denoising_steps)."""
    def default(field):
        return f"{option_default('DiffusionGemma', field):g}"

    parser.add_argument("--entropy-bound", type=positive_float, default=None, metavar="X",
                        help="DiffusionGemma only: a step accepts the lowest-entropy positions while their entropies, "
                             f"summed without the largest, stay within X ({default('entropy_bound')})")
    parser.add_argument("--t-min", type=non_negative_float, default=None, metavar="T",
                        help=f"DiffusionGemma only: the last step's temperature ({default('t_min')})")
    parser.add_argument("--t-max", type=non_negative_float, default=None, metavar="T",
                        help=f"DiffusionGemma only: the first step's temperature ({default('t_max')}; linear to "
                             "--t-min)")
    parser.add_argument("--stability-threshold", type=non_negative_int, default=None, metavar="N",
                        help="DiffusionGemma only: steps a canvas's argmax must stay unchanged before a row stops "
                             f"({default('stability_threshold')})")


def add_length_flags(parser: argparse.ArgumentParser) -> None:
    """--gen-length, --steps and --block-length."""
    # One --gen-length for every family, with LLaDA's default (LLaDA2Options' own 2048 is the official
    # generate's; the command line keeps one default for all)
    gen_length = option_default("LLaDA", "gen_length")
    parser.add_argument("--gen-length", type=positive_int, default=gen_length, metavar="N",
                        help=f"new tokens ({gen_length}). LLaDA: gen_length, exactly this many (Dream: max_new_tokens, "
                             "too). SDAR: max_new_tokens; SDAR decodes whole blocks of its block_size, DiffusionGemma "
                             "whole canvases of its canvas_length, and at most this many are printed (fewer after a "
                             "stop token)")
    parser.add_argument("--steps", type=positive_int, default=None, metavar="N",
                        help="LLaDA and Dream steps in all (default gen-length) / SDAR denoising_steps per block "
                             "(default block_size) / LLaDA2 steps per block / DiffusionGemma max_denoising_steps per "
                             f"canvas ({option_default('DiffusionGemma', 'max_denoising_steps')})")
    parser.add_argument("--block-length", type=positive_int, default=None, metavar="N",
                        help="LLaDA only: block_length (default gen-length)")


def add_fast_dllm_flags(parser: argparse.ArgumentParser, *, served: bool = False) -> None:
    """LLaDA's Fast-dLLM flags: the block-wise cache and parallel decoding (`served`: `dllm-jax serve`'s, whose
    cache is dual unless told, none included, and whose threshold or factor a request may replace)."""
    cache = ("dual", "prefix", "none") if served else ("prefix", "dual")
    own = " (a request may send its own)" if served else ""
    llada = "LLaDA" if served else "LLaDA only"
    parser.add_argument("--cache", default=None, choices=cache,
                        help=f"{llada}, Fast-dLLM: reuse the keys/values of the positions before the block (prefix) or "
                             "before and after it (dual) from the block's first step" +
                             ("; dual unless told, none recomputes every step" if served else
                              "; dense, --method sparsed or pulsecol"))
    parser.add_argument("--threshold", type=probability, default=None, metavar="X",
                        help=f"{llada}, Fast-dLLM: commit every masked position of the block whose confidence is >= X "
                             "(at least the most confident one) per step" + own)
    parser.add_argument("--factor", type=positive_float, default=None, metavar="F",
                        help=f"{llada}, Fast-dLLM's factor rule instead of --threshold: the i-th most confident masked "
                             "position is committed while it reaches 1 - F / (i + 1)" + own)
    if served:
        return
    parser.add_argument("--cache-refresh", type=positive_int, default=None, metavar="K",
                        help="LLaDA only, with --cache: also recompute the cache every K-th step of a block")
