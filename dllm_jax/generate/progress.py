"""tqdm progress bars advanced from inside a compiled loop by `jax.debug.callback`.

The compiled loop calls `tick(run_id)` (a fixed module-level function, so enabling progress
compiles once, not once per call); `run_id` is a traced argument naming the bar of this call in a
registry that lives only while `progress_bar` is open.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager

import jax
from tqdm.auto import tqdm

_live_bars: dict[int, tqdm] = {}
_run_ids = itertools.count(1)


def tick(run_id, *_) -> None:
    bar = _live_bars.get(int(run_id))
    if bar is not None:
        bar.update(1)


@contextmanager
def progress_bar(total: int | None, desc: str, enabled: bool):
    """Yields the run id to pass to the compiled loop (0 when disabled)."""
    if not enabled:
        yield 0
        return
    run_id = next(_run_ids)
    _live_bars[run_id] = tqdm(total=total, desc=desc, unit="step")
    try:
        yield run_id
        jax.effects_barrier()  # callbacks are asynchronous: let the last ticks land before closing
    finally:
        _live_bars.pop(run_id).close()
