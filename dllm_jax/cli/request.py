"""The generate / analyze request: the flags checked against the checkpoint's config.json before any weights
load, each refusal naming the flag."""

from __future__ import annotations

import dataclasses

from dllm_jax.cli.methods import method_from_args
from dllm_jax.cli.options import OPTION_DESTS, family_options, flag_names, option_default, options_class
from dllm_jax.cli.sampling import FAMILY_FLAGS, flag_families, remasking_families


@dataclasses.dataclass(frozen=True)
class Request:
    """The generate / analyze flags, checked against the checkpoint's config.json before any weights load."""

    config: object  # the checkpoint's config (LLaDAConfig, SDARConfig, ..., DiffusionGemmaConfig)
    family: str  # the sampler's family (`Family.sampler`): "LLaDA", "SDAR", "Dream", "LLaDA2" or "DiffusionGemma"
    method: object  # the --method attention policy; None for dense
    options: dict  # generate's options of the family


def checked_request(args) -> Request:
    """The request of the generate / analyze flags; ValueError naming the flag for anything the
    checkpoint's family would refuse or ignore (reads config.json only)."""
    from dllm_jax.config import read_hf_config
    from dllm_jax.families import family_of

    method = method_from_args(args)
    _, config = read_hf_config(args.model)
    entry = family_of(config)
    family = entry.sampler
    check_family_flags(args, family)
    if args.temperature is not None and "temperature" not in OPTION_DESTS[family].values():
        raise ValueError(f"--temperature does not apply to {family}: its sampler has no temperature option")
    entry.check_method(method)
    check_steps(args, family, config)
    check_top_k(args, config)
    if family == "SDAR":
        check_sdar_flags(args)
    options = family_options(family, args, config)
    try:
        options_class(family)(**options)  # generate's own checks (e.g. Fast-dLLM's rules), before loading
    except ValueError as e:
        raise ValueError(flag_names(str(e))) from None
    return Request(config=config, family=family, method=method, options=options)


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


def check_sdar_flags(args) -> None:
    """SDAR's flag combinations that its Options would accept but that cannot mean what they say."""
    remasking = args.remasking or option_default("SDAR", "remasking")
    if args.temperature == 0:
        raise ValueError("--temperature 0: SDAR's sampler divides the logits by the temperature (default "
                         f"{option_default('SDAR', 'temperature'):g}); for greedy decoding pass --top-k 1")
    if args.confidence_threshold is not None and remasking != "low_confidence_dynamic":
        raise ValueError(f"--confidence-threshold applies to --remasking low_confidence_dynamic only, not {remasking}")


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
