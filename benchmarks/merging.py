"""The one merge and the one compare of results files (benchmarks/results/*.json: the run's meta and its
rows, as `dllm_jax.bench.write_results` writes them).

`merge` makes one table from the files of one study split over several processes or time limits: the
files must agree on the meta that makes them one run (`same`); the first file's meta is kept, with the
caller's `changes` (the union of what varied) and `merged_from`; rows are concatenated, or keyed so that
a row in several files is taken from the last (a rerun of failed rows replaces them).
`compare` puts a baseline run against a new one, point by point.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from dllm_jax.bench import cell, markdown_table, write_results


def read_results(paths, flag: str = "--merge") -> list[dict]:
    """The parsed JSON files; a missing one is named with the flag that gave it."""
    parts = []
    for path in paths:
        if not Path(path).is_file():
            raise ValueError(f"{flag} {path}: no such file")
        parts.append(json.loads(Path(path).read_text()))
    return parts


def check_one_run(parts: list[dict], same, *, flag: str = "--merge", hint: str = "") -> None:
    """Refuses files whose meta differs in any key of `same` (one table needs one value of each)."""
    for key in same:
        values = {json.dumps(p.get(key)) for p in parts}
        if len(values) > 1:
            raise ValueError(f"{flag}: the files differ in {key} ({', '.join(sorted(values))}): one table needs "
                             f"one{hint}")


def union(lists, order=None) -> list:
    """The items of all lists, first seen first (or in the order of `order`), each once."""
    items = list(dict.fromkeys(x for values in lists for x in values))
    return items if order is None else sorted(items, key=list(order).index)


def merge(paths, out: Path, *, report: Callable[[dict, list[dict]], list[str]], same=(), changes=None,
          key: Callable[[dict], object] | None = None, order: Callable[[dict], object] | None = None,
          flag: str = "--merge", hint: str = "") -> Path:
    """Writes one results file from `paths` (see the module docstring); returns its Markdown path.

    changes(parts) -> the meta that replaces the first file's (at least `benchmark`, the new name);
    key(row) -> identity of a row (the last file's wins); order(row) -> sort key of the rows."""
    parts = read_results(paths, flag)
    check_one_run(parts, same, flag=flag, hint=hint)
    meta = {k: v for k, v in parts[0].items() if k != "rows"}
    meta |= (changes(parts) if changes else {}) | dict(merged_from=[Path(p).name for p in paths])
    rows = [r for p in parts for r in p["rows"]]
    if key is not None:
        rows = list({key(r): r for r in rows}.values())
    if order is not None:
        rows = sorted(rows, key=order)
    return write_results(out, meta, rows, report(meta, rows))


def compare(baseline_path: Path, new_path: Path, out: Path, *, compared: dict, benchmark: str, title: str) -> Path:
    """A baseline run against a new one: per point both runs measured, the value before, after, and the
    speed-up (> 1: the new run is faster).

    compared: {section: (the fields naming a point, the value compared, its unit, larger is better)}."""
    before, after = read_results((baseline_path, new_path), "--compare")
    old, new = compared_points(before, compared), compared_points(after, compared)
    rows, cells = [], []
    for key, r in new.items():
        if key not in old:
            continue
        section, point = key
        names, field, unit, larger_better = compared[section]
        a, b = old[key][field], r[field]
        speedup = (b / a if larger_better else a / b) if a and b else None
        rows.append(dict(section=section, point=list(point), field=field, baseline=a, new=b, speedup=speedup))
        cells.append([section, ", ".join(f"{k}={v}" for k, v in zip(names, point)), f"{a:.2f} {unit}",
                      f"{b:.2f} {unit}", cell(speedup, ".2f", "x")])
    lines = [f"# {title} — {after['device']}, jax {after['jax']}, {after['date']}", "",
             f"Baseline `{before['package']}` ({Path(baseline_path).name}); new `{after['package']}` "
             f"({Path(new_path).name}). Speed-up > 1: the new package is faster.", "",
             *markdown_table(["section", "point", "baseline", "new", "speed-up"], cells)]
    meta = dict(benchmark=benchmark, device=after["device"], jax=after["jax"], date=after["date"],
                baseline=Path(baseline_path).name, new=Path(new_path).name)
    return write_results(out, meta, rows, lines)


def compared_points(data: dict, compared: dict) -> dict:
    """{(section, point values as strings): the first row measured there} of one results file."""
    found = {}
    for r in data["rows"]:
        spec = compared.get(r.get("section"))
        if spec and spec[1] in r:
            found.setdefault((r["section"], tuple(str(r.get(k)) for k in spec[0])), r)
    return found
