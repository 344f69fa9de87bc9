"""The one benchmark timer: seconds per call of a jitted function, back to back or synchronised per call."""

from __future__ import annotations

import time

import jax
import numpy as np


def call_times(fn, *args, repeats: int = 5, warmup: int = 1, burst_s: float = 0.05) -> list[float]:
    """Seconds per call of fn(*args), one value per timed burst, after `warmup` untimed calls (the
    first compiles).

    burst_s > 0: each of the `repeats` bursts holds about `burst_s` of back-to-back calls (1 to 50,
    sized by one more untimed call), synchronising only after the burst, so that dispatch overlaps
    the previous call (fair to sub-ms kernels). burst_s = 0: one call per burst, synchronised after
    it (the latency of a call: whole loops, or calls that thread state, see `time_carried`).
    """
    if repeats < 1 or warmup < 0 or not burst_s >= 0:
        raise ValueError(f"call_times needs repeats >= 1, warmup >= 0 and burst_s >= 0, got {repeats=}, {warmup=}, "
                         f"{burst_s=}")
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    calls = 1
    if burst_s > 0:
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        calls = int(min(50, max(1, burst_s / (time.perf_counter() - start))))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return times


def time_calls(fn, *args, repeats: int = 5, warmup: int = 1, burst_s: float = 0.05) -> float:
    """Median seconds per call of `call_times` (same arguments)."""
    return float(np.median(call_times(fn, *args, repeats=repeats, warmup=warmup, burst_s=burst_s)))


def median_min_max(times: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of `call_times`' values."""
    return float(np.median(times)), min(times), max(times)


def time_carried(step, carry, *, repeats: int = 5, warmup: int = 1):
    """(median seconds, last carry) of step(carry) -> (out, carry), each call taking the carry the
    previous one returned (a donated cache or policy state) and synchronised on both outputs."""
    held = [carry]

    def call():
        out, held[0] = step(held[0])
        return out, held[0]

    return time_calls(call, repeats=repeats, warmup=warmup, burst_s=0), held[0]
