"""`dllm-jax train`: what `python -m dllm_jax.train` runs, with the same flags (one definition, there)."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    # The flags of `python -m dllm_jax.train`, from its `arguments()` parent parser. The import goes this way
    # only: dllm_jax.train never imports the cli (the shared argparse types live in dllm_jax.flags).
    from dllm_jax.train import __main__ as train_main

    train = subparsers.add_parser(
        "train", parents=[train_main.arguments()], formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="train a tiny LLaDA or SDAR model on the synthetic tasks (python -m dllm_jax.train)",
        description="What `python -m dllm_jax.train` runs, with the same flags. "
                    + train_main.__doc__.strip().split("\n\n")[-1])
    train.set_defaults(fn=run)


def run(args) -> None:
    """`python -m dllm_jax.train`: the flags are its `arguments()`, the run is its `run`."""
    from dllm_jax.train.__main__ import run as train

    train(args)
