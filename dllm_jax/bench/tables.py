"""The one Markdown table writer of every results file (`dllm-jax bench` and benchmarks/*.py), and the
cell formats they share.

Standard library only: `benchmarks/throughput.py --baseline` runs its tables from this checkout's file
beside an old copy of the package, which has no such module.
"""

from __future__ import annotations


def markdown_table(header, rows, *, align: str = "") -> list[str]:
    """The lines of a Markdown table: `header`, the rule, then one line per row of cells (str() of each).

    align: one letter per column, "l" (the default for columns it does not reach) or "r" (`---:`).
    A row shorter than the header is padded with empty cells (an error or skip message and the rest
    left blank); an empty cell prints as `| |`."""
    rule = "|" + "".join("---:|" if a == "r" else "---|" for a in align.ljust(len(header), "l"))
    return [line(header), rule] + [line(list(row) + [""] * (len(header) - len(row))) for row in rows]


def line(cells) -> str:
    """One table line: `| a | b |`, an empty cell as `| |`."""
    return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"


def fmt(x):
    """A ratio for a table cell: two decimals, "n/a" for None (no GPU kernels traced)."""
    return "n/a" if x is None else f"{x:.2f}"


def cell(value, spec: str = ".2f", suffix: str = "", missing: str = "-") -> str:
    """A value formatted by `spec` with `suffix`; `missing` for None (not measured)."""
    return missing if value is None else f"{value:{spec}}{suffix}"
