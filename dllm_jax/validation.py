"""Host-side argument checks shared by the model configs and the generate options.

Each check raises a ValueError naming the argument and the bad value, and returns the value in its
canonical Python type (numpy scalars become int / float), so that frozen dataclasses used as static
jit arguments compare and hash the same whichever number type they were built from. Nothing here
touches JAX: a refused argument costs no tracing or compilation.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def is_int(value) -> bool:
    """True for Python and numpy integers and 0-d integer arrays (numpy or JAX: a seed may come from
    jnp.arange); False for bools (True is not the integer 1 here)."""
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, numbers.Integral):
        return True
    dtype = getattr(value, "dtype", None)
    return getattr(value, "shape", None) == () and dtype is not None and np.issubdtype(dtype, np.integer)


def integer(name: str, value, *, minimum: int | None = 1, maximum: int | None = None, hint: str = "") -> int:
    """`value` as an int in [minimum, maximum] (either bound may be None); `hint` ends the message."""
    if not is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if maximum is None:
            need = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        else:
            need = f"an integer <= {maximum}" if minimum is None else f"an integer in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {need}, got {value}{hint}")
    return value


def real(name: str, value, *, low: float | None = None, high: float | None = None, low_open: bool = False,
         high_open: bool = False, hint: str = "") -> float:
    """`value` as a finite float from `low` to `high` (open ends where asked); `hint` ends the message."""
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    interval = (("(" if low_open or low is None else "[") + ("-inf" if low is None else f"{low:g}") + ", "
                + ("inf" if high is None else f"{high:g}") + (")" if high_open or high is None else "]"))
    if not math.isfinite(value):
        where = "" if low is None and high is None else f" in {interval}"
        raise ValueError(f"{name} must be a finite number{where}, got {value}{hint}")
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
        raise ValueError(f"{name} must lie in {interval}, got {value:g}{hint}")
    return value


def flag(name: str, value) -> bool:
    """`value` as a bool; 0/1 or strings are refused ("false" would be truthy)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def choice(name: str, value, choices: tuple) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def seed(value) -> np.int32:
    """The PRNG seed as the int32 the compiled loops take (a traced argument: no recompilation).

    Seeds outside int32 are refused rather than folded: folding (e.g. modulo 2**32) would give two
    different seeds the same random stream without a word, and the loops take the seed as a 32-bit
    traced scalar (64-bit integers are off in JAX by default).
    """
    return np.int32(integer("seed", value, minimum=INT32_MIN, maximum=INT32_MAX))


def real_array(name: str, value, *, low: float | None = None, high: float | None = None,
               max_ndim: int | None = None) -> np.ndarray:
    """`value` (a real number, or nested lists / tuples / arrays of them) as a float64 array whose
    entries are finite and lie in [low, high] (either bound may be None).

    Every entry is checked on its own: numpy would read the string "0.5" as 0.5 and True as 1.0,
    and a ragged nesting or an empty one has no shape that a per-head value could mean.
    """
    def leaves(x):
        if isinstance(x, (list, tuple)):
            return [leaves(item) for item in x]
        if hasattr(x, "__array__") and hasattr(x, "dtype"):  # numpy and JAX arrays and scalars
            try:
                x = np.asarray(x)
            except TypeError as e:  # a traced value: the check needs the numbers
                raise ValueError(f"{name} must be concrete numbers, got {type(x).__name__}") from e
            if x.dtype.kind not in "iuf":
                raise ValueError(f"{name} must hold real numbers, got an array of {x.dtype}")
            return x.astype(np.float64)
        if not isinstance(x, numbers.Real) or isinstance(x, (bool, np.bool_)):
            raise ValueError(f"{name} must hold real numbers, got {x!r} ({type(x).__name__})")
        return float(x)

    try:
        nested = leaves(value)
    except RecursionError as e:
        raise ValueError(f"{name} is nested too deeply") from e
    try:
        arr = np.array(nested, np.float64)
    except ValueError as e:  # numpy's "inhomogeneous shape"
        raise ValueError(f"{name} must be a number or a rectangular nesting of numbers, got ragged rows") from e
    if arr.size == 0:
        raise ValueError(f"{name} must not be empty, got shape {arr.shape}")
    if max_ndim is not None and arr.ndim > max_ndim:
        raise ValueError(f"{name} must have at most {max_ndim} dimensions, got shape {arr.shape}")
    bad = ~np.isfinite(arr) | (arr < (-math.inf if low is None else low)) | (arr > (math.inf if high is None else high))
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        need = "finite" if low is None and high is None else (
            f"finite and lie in [{'-inf' if low is None else f'{low:g}'}, {'inf' if high is None else f'{high:g}'}]")
        at = f" at index {list(where)}" if where else ""
        raise ValueError(f"{name} must be {need}, got {arr[where]:g}{at}")
    return arr
