"""The command line's value types and error line, shared by `dllm-jax` and `python -m dllm_jax.train`.

Each type is an argparse `type=`: a bad value becomes argparse's usage and one `error: argument --flag:
...` line, exit status 2, before any work. `one_line` is how every other refused input is printed.
"""

from __future__ import annotations

import argparse
import math


def number(kind, requirement: str, ok):
    """argparse type: a `kind` (int or float) value for which `ok(value)` holds. A float must also be
    finite: nan passes no comparison and would slip through a range check as "not refused"."""
    def parse(text: str):
        value = kind(text)  # a ValueError here reads "invalid int value: 'x'" (argparse) or none_or's message
        if not ((kind is int or math.isfinite(value)) and ok(value)):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


positive_int = number(int, "a positive integer", lambda v: v > 0)
non_negative_int = number(int, "a non-negative integer", lambda v: v >= 0)
seed_int = number(int, "a 32-bit integer", lambda v: -2**31 <= v < 2**31)
fresh_seed = number(int, "an integer in [0, 2**31) (training samples use seeds >= 2**31)", lambda v: 0 <= v < 2**31)
finite_float = number(float, "a finite number", lambda v: True)
positive_float = number(float, "a positive number", lambda v: v > 0)
non_negative_float = number(float, "a finite number >= 0", lambda v: v >= 0)
probability = number(float, "a number in [0, 1]", lambda v: 0 <= v <= 1)
fraction = number(float, "a number in (0, 1]", lambda v: 0 < v <= 1)


def none_or(kind):
    """argparse type: `kind`, or the word 'none' for None."""
    def parse(text: str):
        if text.lower() == "none":
            return None
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__} or 'none', got {text!r}") from None
    parse.__name__ = f"{kind.__name__} or 'none'"
    return parse


def one_line(error: Exception) -> str:
    """The error's message on one line (a multi-line list of problems joined by '; ')."""
    if isinstance(error, OSError) and error.strerror and error.filename:
        text = f"{error.strerror}: {error.filename}"  # without the "[Errno 13]" prefix
    else:
        text = str(error) or type(error).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()] or [type(error).__name__]
    joined = lines[0]
    for line in lines[1:]:
        joined += (" " if joined.endswith(":") else "; ") + line
    return joined
