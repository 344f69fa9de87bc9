"""The sparse-attention flags (--method and its parameters) of generate, analyze and eval, and the policy
they make."""

from __future__ import annotations

import argparse

from dllm_jax.flags import finite_float, fraction, non_negative_int, none_or, positive_int, probability

# method parameter -> (flag, argparse type, help). One table for generate, analyze and eval; which flags a
# method takes comes from dllm_jax.attention.methods.parameters, and so do the defaults: a help's
# {method} is that method's default of the parameter.
METHOD_FLAGS = {
    "skip": ("--skip", probability, "SparseD ({sparsed}) / SpargeAttn ({sparge}): fraction of the steps run dense "
             "first"),
    "select": ("--select", fraction, "SparseD: fraction of key blocks kept per query block ({sparsed})"),
    "block_size": ("--sparse-block", positive_int, "SparseD: pattern block size ({sparsed})"),
    "sparsity": ("--sparsity", finite_float, "PulseCol: fraction of keys dropped per query group ({pulsecol})"),
    "group_size": ("--group-size", positive_int, "PulseCol: queries sharing one column set ({pulsecol})"),
    "eta": ("--eta", finite_float, "PulseCol: refresh-window ratio ({pulsecol})"),
    "refreshes": ("--refreshes", non_negative_int, "PulseCol: refresh budget ({pulsecol})"),
    "k": ("--mage-k", positive_int, "MAGE: prefix keys kept per KV head ({mage})"),
    "exact_layers": ("--exact-layers", non_negative_int, "MAGE: first layers kept exact ({mage})"),
    "tau": ("--tau", none_or(non_negative_int), "FlashBlock: refresh after this many unmasked tokens ({flashblock}); "
            "0 = always refresh, none = only at each block's first step"),
    "simthreshd1": ("--simthreshd1", finite_float, "SpargeAttn: block self-similarity threshold ({sparge})"),
    "cdfthreshd": ("--cdfthreshd", finite_float, "SpargeAttn: TopCdf threshold (instead of --topk)"),
    # SpargeAttn's topk defaults to None: the method then keeps 0.5 unless a cdfthreshd is given
    "topk": ("--topk", finite_float, "SpargeAttn: fraction of key blocks kept (0.5 when no --cdfthreshd)"),
    "pvthreshd": ("--pvthreshd", none_or(finite_float), "SpargeAttn: PV-skip threshold ({sparge}); none = no "
                  "filter"),
    "calibration": ("--calibration", str, "SpargeAttn: per-layer, per-head values (JSON from "
                    "dllm_jax.analysis.calibration.save_calibration)"),
}


def methods_parent() -> argparse.ArgumentParser:
    """The parent parser of --method and the METHOD_FLAGS (unset: argparse.SUPPRESS, so the method's own
    default applies)."""
    from dllm_jax.attention.methods import METHODS

    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("sparse attention (unset parameters keep the method's defaults)")
    group.add_argument("--method", default="dense", choices=["dense", *METHODS],
                       help="sparsed, pulsecol, sparge: LLaDA and Dream; mage, flashblock, flashblock+mage: SDAR "
                            "(default dense)")
    for param, (flag, kind, text) in METHOD_FLAGS.items():
        metavar = {"int": "N", "float": "X", "str": "FILE"}[kind.__name__.split()[0]]
        metavar += "|none" if kind.__name__.endswith("'none'") else ""
        group.add_argument(flag, dest=param, type=kind, default=argparse.SUPPRESS, metavar=metavar,
                           help=text.format_map(method_defaults(param)))
    return parent


def method_defaults(param: str) -> dict[str, str]:
    """{method name: its default of `param`, as a help shows it} over the methods that take `param`."""
    from dllm_jax.attention.methods import METHODS, parameters

    shown = {}
    for name in METHODS:
        params = parameters(name)
        if param in params:
            shown[name] = f"{params[param]:g}" if isinstance(params[param], float) else str(params[param])
    return shown


def method_from_args(args):
    """The --method policy (None = dense); unset method flags keep the method's defaults."""
    from dllm_jax.attention.methods import make_method, parameters

    given = {param: getattr(args, param) for param in METHOD_FLAGS if hasattr(args, param)}
    if args.method == "dense":
        if given:
            flags = sorted(METHOD_FLAGS[p][0] for p in given)
            raise ValueError(f"{', '.join(flags)} {'needs' if len(flags) == 1 else 'need'} a sparse --method "
                             "(dense attention has no parameters)")
        return None
    valid = parameters(args.method)
    stray = sorted(METHOD_FLAGS[p][0] for p in given if p not in valid)
    if stray:
        raise ValueError(f"{', '.join(stray)} {'does' if len(stray) == 1 else 'do'} not apply to --method "
                         f"{args.method}; its flags: "
                         + ", ".join(METHOD_FLAGS[p][0] for p in METHOD_FLAGS if p in valid))
    return make_method(args.method, **given)
