"""Tensor, sequence and data parallelism with `jax.sharding`: which device holds which slice of every
weight and activation.

A mesh names its axes "dp" (batch rows), "sp" (sequence: LLaDA's queries) and "tp" (tensor
parallelism); an axis not asked for has size 1 (`canonical_mesh` turns any Mesh with a "tp" axis into
one over exactly these three). Parameters are placed once, at load, from one table of logical axes per
family (its `dllm_jax.families` entry's `param_axes`; the shared decoder's is `DECODER_AXES`): Megatron-style, the attention
heads and the MLP's hidden dimension are split over "tp" (qkv_proj and gate_up_proj by columns,
o_proj and down_proj by rows, so each sub-layer ends in one all-reduce), the LM head by vocabulary
columns, everything else replicated. The fused inference layout is grouped so that contiguous
column splits are whole KV-head groups and whole gate/up pairs (`dllm_jax.models.layers`). The
jitted loops then run unchanged: XLA's SPMD partitioner propagates the shardings and inserts the
collectives, and `generate` places the prompt rows over "dp". Attention runs per device
(`dllm_jax.attention.sharded.Sharded`, a `shard_map`): each device attends its rows, heads and
query slice, so the Pallas kernels see only their shard; over "sp" each device all-gathers the keys
and values of the whole sequence (replicated weights, sharded activations).

    mesh = dllm_jax.sharding.make_mesh("tp=2,dp=2")
    model = dllm_jax.load_model(path, mesh=mesh)

Across hosts, every process runs the same program after `jax.distributed.initialize` (one process
per host, or per GPU): the mesh then spans every process's devices, each process places its own
shards of the weights and prompts (all processes read the same checkpoint and prompts), and
`generate` returns the whole result on every process.

    jax.distributed.initialize(coordinator_address="host0:1234", num_processes=2, process_id=i)
    mesh = dllm_jax.sharding.make_mesh("tp=2,dp=2")  # over jax.devices(): all processes'
"""

from __future__ import annotations

import contextlib
import math

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dllm_jax.quantize import SCALE, is_scale, scale_name

AXES = ("dp", "sp", "tp")

# logical axes of every parameter of the shared decoder's inference layout (one layer's names; the scan
# layout adds a leading layer axis, replicated): each family's table is this one or extends it.
DECODER_AXES = {
    "embed": (None, None),
    "final_norm": (None,),
    "lm_head": (None, "tp"),
    "attn_norm": (None,),
    "mlp_norm": (None,),
    "q_norm": (None,),
    "k_norm": (None,),
    "qkv_proj": (None, "tp"),
    "o_proj": ("tp", None),
    "gate_up_proj": (None, "tp"),
    "down_proj": ("tp", None),
}

def parse_mesh(spec: str) -> dict[str, int]:
    """"tp=2,dp=2" -> {"dp": 2, "sp": 1, "tp": 2} (axes in mesh order); ValueError naming a bad item."""
    sizes = {}
    for item in (part.strip() for part in spec.split(",") if part.strip()):
        name, _, value = item.partition("=")
        if name not in AXES:
            raise ValueError(f"mesh axis {name!r} in {spec!r} is not one of {AXES}")
        if name in sizes:
            raise ValueError(f"mesh axis {name!r} is given twice in {spec!r}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"mesh axis {name}={value!r} in {spec!r} must be a positive integer") from None
        if sizes[name] < 1:
            raise ValueError(f"mesh axis {name}={sizes[name]} in {spec!r} must be a positive integer")
    if not sizes:
        raise ValueError(f"mesh {spec!r} names no axis: e.g. 'tp=2', 'sp=2' or 'tp=2,dp=2'")
    return {name: sizes.get(name, 1) for name in AXES}


def make_mesh(spec: str | dict[str, int], devices=None) -> Mesh:
    """A Mesh with axes ("dp", "sp", "tp") from "tp=2,dp=2" or {"tp": 2}, over the first dp * sp * tp
    devices (`jax.devices()` unless given: every process's, under `jax.distributed`)."""
    sizes = parse_mesh(spec) if isinstance(spec, str) else parse_mesh(",".join(f"{k}={v}" for k, v in spec.items()))
    devices = jax.devices() if devices is None else list(devices)
    need = math.prod(sizes.values())
    if need > len(devices):
        raise ValueError(f"mesh {sizes} needs {need} devices, {len(devices)} available "
                         "(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    return Mesh(np.asarray(devices[:need]).reshape(tuple(sizes.values())), AXES)


def canonical_mesh(mesh) -> Mesh:
    """`mesh` as a Mesh over exactly AXES on the same devices: any `jax.sharding.Mesh` with a "tp" axis
    (e.g. `jax.make_mesh((2,), ("tp",))`), its "dp" and "sp" axes if it has them, in any order; an axis it
    lacks has size 1. Another axis of size 1 is dropped; one of more devices is refused (ValueError naming
    it): dllm_jax would not know what to split over it."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh (dllm_jax.sharding.make_mesh), got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    if names == AXES:
        return mesh
    if "tp" not in names:
        raise ValueError(f"mesh axes {names} have no 'tp' axis: dllm_jax splits the weights over 'tp' (and the "
                         "batch over 'dp', the sequence over 'sp'); e.g. jax.make_mesh((2,), ('tp',))")
    foreign = {name: size for name, size in mesh.shape.items() if name not in AXES and size > 1}
    if foreign:
        raise ValueError(f"mesh axes {foreign} are not ones dllm_jax splits over (it knows {AXES}); give them "
                         "size 1 or leave them out")
    order = [names.index(n) for n in AXES if n in names] + [i for i, n in enumerate(names) if n not in AXES]
    devices = np.transpose(mesh.devices, order).reshape(tuple(mesh.shape.get(n, 1) for n in AXES))
    return Mesh(devices, AXES)


def check_mesh(mesh, config, split: tuple[str, ...]) -> Mesh:
    """`canonical_mesh(mesh)`, after checking that its "tp" size divides every `split` size of `config`
    (the family's `tp_split`: what tensor parallelism splits); ValueError otherwise."""
    mesh = canonical_mesh(mesh)
    tp = mesh.shape["tp"]
    bad = [f"{name}={getattr(config, name)}" for name in split if getattr(config, name) % tp]
    if bad:
        raise ValueError(f"tp={tp} must divide {', '.join(bad)}: tensor parallelism splits the KV heads, the MLP "
                         "and the vocabulary over it")
    return mesh


def param_sharding(mesh: Mesh, name: str, ndim: int, axes: dict, *, quantized: bool = False) -> NamedSharding:
    """The NamedSharding of parameter `name` with `ndim` dimensions (a stacked one has a layer axis first)
    by the family's table `axes` ({parameter name: logical axes}). A quantized weight (`quantized`: stored
    [..., out, in], dllm_jax.quantize) is split as its [..., in, out] form would be, and its per-channel
    scale (`<name>_scale`) like that weight's output axis."""
    if is_scale(name) and name not in axes:
        weight = axes[name.removesuffix(SCALE)]
        spec = weight[:-2] + weight[-1:]
    else:
        spec = axes[name]
        if quantized:
            spec = spec[:-2] + (spec[-1], spec[-2])
    return NamedSharding(mesh, PartitionSpec(*((None,) * (ndim - len(spec)) + spec)))


def shard_params(params: dict, axes: dict, mesh: Mesh) -> dict:
    """The inference-layout tree `params` (unrolled or stacked layers) placed on `mesh` (a canonical one)
    by the family's table `axes`."""

    def place(name, x, tree):
        return jax.device_put(x, param_sharding(mesh, name, x.ndim, axes, quantized=scale_name(name) in tree))

    top = {name: place(name, x, params) for name, x in params.items() if name != "layers"}
    layers = params["layers"]
    if isinstance(layers, dict):
        layers = {name: place(name, x, layers) for name, x in layers.items()}
    else:
        layers = tuple({name: place(name, x, layer) for name, x in layer.items()} for layer in layers)
    return dict(top, layers=layers)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Rows over "dp", the rest replicated: where `generate` puts prompts on a sharded model."""
    return NamedSharding(mesh, PartitionSpec("dp", *(None,) * (ndim - 1)))


def shard_kv_cache(cache, mesh: Mesh | None):
    """An SDAR KV cache (its [B, S, Hkv, D] keys and values and [B] lengths) with rows over "dp" and KV
    heads over "tp" (a sharding constraint: inside jit it places the loop's cache, outside it moves a
    cache); unchanged without a mesh."""
    if mesh is None:
        return cache

    def place(x):
        spec = PartitionSpec("dp", None, "tp", None) if x.ndim == 4 else PartitionSpec("dp")
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(place, cache)


def tracing_on(mesh: Mesh | None):
    """The context in which traced model code sees `mesh` as `jax.sharding.get_abstract_mesh()` (inside
    jit: the code that must run per device, LLaDA2's routed experts, reads it there); a no-op without one."""
    return contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def traced_mesh():
    """The mesh `tracing_on` put in the trace context (an AbstractMesh over AXES), else None (a mesh of
    other axes that the caller set is not ours to split by)."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or tuple(mesh.axis_names) != AXES else mesh


def to_host(x) -> np.ndarray:
    """A (possibly sharded) array as one numpy array on this host: under `jax.distributed` the shards
    other processes hold are gathered first."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
