"""`dllm-jax` command line: convert | generate | analyze | eval | train | bench | serve | demo (`--help` on each).

One module per subcommand, each with its `add_parser(subparsers)` and `run(args)`; what several share lives
in common.py (--dtype, --mesh, output paths), methods.py (--method and its flags), sampling.py (generate's
and analyze's flags), options.py (generate's options from them), request.py (their checks against the
checkpoint) and prompts.py (prompts read, encoded and batched). The modules import only what they use
at parse time; models, jax work and checkpoints are imported inside `run`.
"""

from __future__ import annotations

import argparse
import sys

from dllm_jax.cli import analyze, bench, convert, demo, eval as evaluate, generate, serve, train
from dllm_jax.flags import one_line

SUBCOMMANDS = (convert, generate, analyze, evaluate, train, bench, serve, demo)  # in the order `--help` lists them


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dllm-jax", description="Diffusion-LLM inference in JAX: LLaDA and SDAR "
                                     "with sparse-attention methods.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in SUBCOMMANDS:
        command.add_parser(sub)
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # also what a missing subcommand's error names
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
