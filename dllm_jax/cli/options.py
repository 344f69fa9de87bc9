"""generate's options of each family from the sampling flags. An unset flag (None) takes the default of the
family's Options dataclass (read with dataclasses.fields, never retyped here), except where `cli_defaults`
says the command line departs from it on purpose."""

from __future__ import annotations

import dataclasses
import re

# generate's option field -> the flag (args dest) that sets it, per family, in the order the options are passed
# (and listed in analyze's summary.json). Fields not listed keep the Options class's default inside generate.
OPTION_DESTS = {
    "LLaDA": {"gen_length": "gen_length", "steps": "steps", "block_length": "block_length",
              "temperature": "temperature", "cfg_scale": "cfg_scale", "remasking": "remasking", "cache": "cache",
              "threshold": "threshold", "factor": "factor", "cache_refresh": "cache_refresh"},
    "Dream": {"max_new_tokens": "gen_length", "steps": "steps", "alg": "remasking", "alg_temp": "alg_temp",
              "temperature": "temperature", "top_k": "top_k", "top_p": "top_p"},
    "LLaDA2": {"gen_length": "gen_length", "block_length": "block_length", "steps": "steps",
               "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "threshold": "threshold",
               "kv_cache_dtype": "kv_cache_dtype"},
    "SDAR": {"max_new_tokens": "gen_length", "denoising_steps": "steps", "remasking": "remasking",
             "confidence_threshold": "confidence_threshold", "temperature": "temperature", "top_k": "top_k",
             "top_p": "top_p", "kv_cache_dtype": "kv_cache_dtype"},
    "DiffusionGemma": {"max_new_tokens": "gen_length", "max_denoising_steps": "steps", "entropy_bound": "entropy_bound",
                       "t_min": "t_min", "t_max": "t_max", "stability_threshold": "stability_threshold",
                       "confidence_threshold": "confidence_threshold"},
}
# generate's option fields -> the flags that set them (every family), for its errors' messages
OPTION_FLAGS = {field: "--" + dest.replace("_", "-")
                for dests in OPTION_DESTS.values() for field, dest in dests.items()}
OPTION_FIELD = re.compile(r"(?<![\w.-])(" + "|".join(sorted(OPTION_FLAGS, key=len, reverse=True)) + r")(?:(=)|(?!\w))")


def options_class(family: str):
    """The Options dataclass of generate for `family` (its checks run on the flags before any loading)."""
    from dllm_jax.families import family_named

    return family_named(family).options_class


def option_default(family: str, field: str):
    """The library's default of generate's option `field` for `family` (for the flags' help)."""
    return {f.name: f.default for f in dataclasses.fields(options_class(family))}[field]


def cli_defaults(family: str, args, config) -> dict:
    """Where an unset flag's value departs from the Options class's default, on purpose: LLaDA's steps and
    block_length and Dream's steps follow --gen-length (one token a step in one block, as the official
    READMEs' examples; the classes keep the official generate functions' fixed 128), and SDAR's
    denoising_steps the checkpoint's block_size (one token a step; the class cannot know the block)."""
    if family == "LLaDA":
        return dict(steps=args.gen_length, block_length=args.gen_length)
    if family == "Dream":
        return dict(steps=args.gen_length)
    if family == "SDAR":
        return dict(denoising_steps=config.block_size)
    return {}


def family_options(family: str, args, config) -> dict:
    """generate's options of `family` from the flags; unset flags take the official sampler's defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(options_class(family))}
    defaults |= cli_defaults(family, args, config)
    given = {field: getattr(args, dest) for field, dest in OPTION_DESTS[family].items()}
    return {field: defaults[field] if value is None else value for field, value in given.items()}


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
