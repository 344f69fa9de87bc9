"""The sparse-attention methods by name: which kind of model each serves and how to build one.

`make_method("sparsed", select=0.3)` is what the CLI and the notebooks use. A method serves one kind
of decoding, named by the family it was published for: `BIDIRECTIONAL` ("LLaDA": full-sequence steps,
LLaDA and Dream) or `BLOCK` ("SDAR": block steps over a KV cache, SDAR and LLaDA2); MAGE serves `CANVAS` too
("DiffusionGemma": canvases denoised against an encoder's KV cache, a block of 256 queries over a long prefix). A
model family's kind is its `method_kind` in `dllm_jax.families`. `check_method` is what `generate` calls (through
the family's entry), so that a method meant for the other kind fails with a sentence that names the
methods which do apply, instead of deep inside the compiled loop.
"""

from __future__ import annotations

import dataclasses

from dllm_jax.attention.flashblock import FlashBlock
from dllm_jax.attention.mage import MAGE
from dllm_jax.attention.pulsecol import PulseCol
from dllm_jax.attention.sparge import SpargeAttn
from dllm_jax.attention.sparsed import SparseD

BIDIRECTIONAL = "LLaDA"  # methods that estimate their pattern from a full bidirectional sequence step
BLOCK = "SDAR"  # methods that attend a query block against a KV cache
CANVAS = "DiffusionGemma"  # canvases denoised against an encoder's KV cache
KINDS = (BIDIRECTIONAL, BLOCK, CANVAS)

# name -> (the kinds it serves, class). "flashblock+mage" is FlashBlock(inner=MAGE(...)), the paper's residual reuse.
METHODS = {
    "sparsed": ((BIDIRECTIONAL,), SparseD),
    "pulsecol": ((BIDIRECTIONAL,), PulseCol),
    "sparge": ((BIDIRECTIONAL,), SpargeAttn),
    "mage": ((BLOCK, CANVAS), MAGE),
    "flashblock": ((BLOCK,), FlashBlock),
    "flashblock+mage": ((BLOCK,), FlashBlock),
}
KINDS_OF_CLASS = {cls: kinds for kinds, cls in METHODS.values()}

# Fields set by generate (bind) or nested configs: not user parameters.
_INTERNAL = {"total_steps", "prefill_len", "inner", "layer_is_exact"}


def parameters(name: str) -> dict:
    """The user parameters of method `name` and their defaults."""
    _, cls = _lookup(name)
    params = {f.name: f.default for f in dataclasses.fields(cls) if f.init and f.name not in _INTERNAL}
    if name == "flashblock+mage":
        params.update({f.name: f.default for f in dataclasses.fields(MAGE) if f.name != "backend"})
    if name == "sparge":
        params["calibration"] = None  # a JSON file from save_calibration (SpargeAttn.from_calibration)
    return params


def make_method(name: str, **params):
    """The attention policy `name` ("dense" gives None) with `params` over its defaults.

    Raises ValueError naming the valid methods or parameters when one is unknown; the method's
    own checks (ranges, types) raise ValueError as well.
    """
    if name == "dense":
        if params:
            raise ValueError(f"dense attention takes no parameters, got {sorted(params)}")
        return None
    valid = parameters(name)
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(f"method {name!r} has no parameter(s) {unknown}; its parameters (defaults): "
                         + ", ".join(f"{k}={v!r}" for k, v in valid.items()))
    if name == "flashblock+mage":
        mage_names = {f.name for f in dataclasses.fields(MAGE)} - {"backend"}
        inner = MAGE(**{k: v for k, v in params.items() if k in mage_names},
                     **({"backend": params["backend"]} if "backend" in params else {}))
        return FlashBlock(inner=inner, **{k: v for k, v in params.items() if k not in mage_names})
    if name == "sparge" and params.get("calibration") is not None:
        path = params.pop("calibration")
        return SpargeAttn.from_calibration(path, **params)
    params.pop("calibration", None)
    return METHODS[name][1](**params)


def describe(method) -> str:
    """A short label: the method's name and the parameters that differ from its defaults."""
    if method is None:
        return "dense"
    names = {cls: n for n, (_, cls) in METHODS.items() if n != "flashblock+mage"}
    name = names.get(type(method), type(method).__name__)
    if isinstance(method, FlashBlock) and method.inner is not None:
        name = "flashblock+mage"
    changed = [f"{f.name}={getattr(method, f.name)!r}" for f in dataclasses.fields(method)
               if f.init and f.name not in _INTERNAL and getattr(method, f.name) != f.default]
    if isinstance(method, FlashBlock) and method.inner is not None:
        changed += [f"{f.name}={getattr(method.inner, f.name)!r}" for f in dataclasses.fields(MAGE)
                    if getattr(method.inner, f.name) != f.default]
    return f"{name}({', '.join(changed)})"


def method_names(kind: str | None = None) -> list[str]:
    """The methods that serve `kind` (one of KINDS; None: all)."""
    return [name for name, (kinds, _) in METHODS.items() if kind is None or kind in kinds]


def check_method(method, kind: str, family: str) -> None:
    """Raises ValueError if `method` is one of the published methods and does not serve `kind` (the model's;
    `family`: its family's label, for the message)."""
    served = KINDS_OF_CLASS.get(type(method))
    if served is not None and kind not in served:
        expected = served[0]
        why = {BLOCK: "it attends a query block against SDAR's KV cache",
               BIDIRECTIONAL: "it estimates its pattern from the full bidirectional sequence of a LLaDA step"}[expected]
        use = (f"use one of {method_names(kind)} (or method=None for dense attention)" if method_names(kind) else
               "no sparse attention method applies to it yet: use method=None (dense attention)")
        raise ValueError(f"{type(method).__name__} is a method for {expected} models ({why}); for {family} {use}")


def _lookup(name: str):
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: ['dense'] + {list(METHODS)} "
                         f"(LLaDA: {method_names(BIDIRECTIONAL)}; SDAR: {method_names(BLOCK)}; "
                         f"DiffusionGemma: {method_names(CANVAS)})")
    return METHODS[name]
