"""The one results writer: <benchmark>_<device>_<date>.json (meta + rows) and .md beside it, each whole or
not at all, and the claim of a free name (_2, _3, ...) for runs that must never replace a result."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_results(out_dir: Path, meta: dict, rows: list[dict], lines: list[str], *,
                  keep_existing: bool = False) -> Path:
    """Writes <benchmark>_<device>_<date>.json (meta + rows) and .md (`lines`), each whole or not at all
    (`dllm_jax.files.write_atomic`), prints the table and returns the Markdown path.

    keep_existing=False replaces a result of that name (the studies of benchmarks/*.py rewrite theirs as
    rows arrive). keep_existing=True (`dllm-jax bench`) never replaces one: the run takes the first free
    stem of <stem>, <stem>_2, <stem>_3, ..., claimed by creating both files exclusively, so two runs on
    one day (even at once) each keep their own."""
    from dllm_jax.files import write_atomic

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = results_stem(meta)
    if keep_existing:
        stem = claim_stem(out_dir, stem)
    write_atomic(out_dir / f"{stem}.json", json.dumps(dict(meta, rows=rows), indent=2) + "\n")
    table = "\n".join(lines) + "\n"
    write_atomic(out_dir / f"{stem}.md", table)
    print(table)
    return out_dir / f"{stem}.md"


def results_stem(meta: dict) -> str:
    """<benchmark>_<device>_<date>: the name of a run's results files (before any _2, _3 of `claim_stem`)."""
    return f"{meta['benchmark']}_{meta['device'].replace(' ', '_')}_{meta['date']}"


def claim_stem(out_dir: Path, stem: str) -> str:
    """The first of stem, stem_2, stem_3, ... whose .json and .md this call creates (empty, exclusively:
    a name another run holds, or takes at the same moment, is skipped)."""
    number = 1
    while True:
        name = stem if number == 1 else f"{stem}_{number}"
        if claim(out_dir / f"{name}.json"):
            if claim(out_dir / f"{name}.md"):
                return name
            (out_dir / f"{name}.json").unlink()  # the .md is another run's: leave the name to it
        number += 1


def claim(path: Path) -> bool:
    """Creates `path` empty unless it exists (O_EXCL: atomic); True if this call created it."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    except FileExistsError:
        return False
    return True
