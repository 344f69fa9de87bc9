"""Runs greedy fp32 generation on tiny random models unsharded and on a CPU mesh, in a process of its
own (the host device count must be set before JAX starts), and writes what tests/test_sharding.py
asserts on: python tests/sharded_generation.py CHECKPOINT_DIR OUT.json"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dllm_jax import generate, load_model  # noqa: E402
from dllm_jax.attention.methods import make_method  # noqa: E402
from dllm_jax.attention.policy import Dense  # noqa: E402
from dllm_jax.attention.sharded import Sharded  # noqa: E402
from dllm_jax.models import llada  # noqa: E402
from dllm_jax.models.moe import routed_experts  # noqa: E402
from dllm_jax.sharding import make_mesh  # noqa: E402
from dllm_jax.testing import tiny_llada2_config, tiny_llada_config, tiny_sdar_config, write_hf_checkpoint  # noqa: E402

METHODS = {  # tiny-size parameters, as the methods' own tests use them
    "llada": {"sparsed": dict(block_size=16), "pulsecol": dict(group_size=16, refreshes=2),
              "sparge": dict(block_q=16, block_kv=16)},
    "sdar": {"mage": dict(k=16, exact_layers=1), "flashblock": {}, "flashblock+mage": dict(k=16, exact_layers=1)},
    "llada2": {"mage": dict(k=16, exact_layers=1)},
}
OPTIONS = {"llada": dict(gen_length=16, steps=8, block_length=8), "sdar": dict(max_new_tokens=8),
           "llada2": dict(gen_length=16, block_length=8, steps=4)}
# SDAR on the CPU mesh: FlashBlock around MAGE carries both methods' per-layer state (MAGE's selection, FlashBlock's
# cached parts), so it covers the sharding of each (MAGE and FlashBlock alone took 12 s each of the run's ~130 on
# 2 cores: not run here; the two-GPU test runs MAGE alone)
ON_MESH = {"sdar": ("flashblock+mage",)}
FAST = dict(cache="dual", threshold=0.9)  # the "/dual" cases: Fast-dLLM's cached windows


def cases():
    """(family, mesh spec, method name) of every comparison: dense on each mesh, each method (SDAR: ON_MESH) on tp x dp
    and (LLaDA) on sp x tp; a name ending in "/dual" decodes with Fast-dLLM's dual cache."""
    for family in ("llada", "sdar", "llada2"):  # LLaDA2: experts' hidden dimension over tp
        yield family, "tp=2", "dense"
        yield family, "tp=2,dp=2", "dense"
        for name in ON_MESH.get(family, METHODS[family]):
            yield family, "tp=2,dp=2", name
    yield "llada", "sp=2", "dense"
    yield "llada", "sp=4", "dense"
    for name in ["dense", *METHODS["llada"], "dense/dual", "sparsed/dual"]:
        yield "llada", "sp=2,tp=2", name


def write_checkpoints(root: Path) -> dict:
    """The tiny models' checkpoints under root/<family>; returns {family: config}."""
    configs = {"llada": tiny_llada_config(num_heads=4, num_kv_heads=2), "sdar": tiny_sdar_config(),
               "llada2": tiny_llada2_config()}
    for family, config in configs.items():
        write_hf_checkpoint(root / family, config, seed=1)
    return configs


def make_prompts() -> dict:
    rng = np.random.default_rng(0)
    # LLaDA: 48 + 16 positions, whole 16-query pattern rows on each of 4 "sp" devices
    return {"llada": rng.integers(3, 100, (4, 48)).astype(np.int32),  # no mask id: the methods' prompts
            "sdar": rng.integers(3, 100, (4, 24)).astype(np.int32),
            "llada2": rng.integers(3, 100, (4, 20)).astype(np.int32)}


def main(root: Path, out: Path) -> None:
    configs, prompts = write_checkpoints(root), make_prompts()
    rows = []
    for family, spec, name in cases():
        method_name, _, cache = name.partition("/")
        method = None if method_name == "dense" else make_method(method_name, **METHODS[family][method_name])
        options = OPTIONS[family] | (FAST if cache else {})
        plain = load_model(root / family, dtype="float32", progress=False)
        sharded = load_model(root / family, dtype="float32", progress=False, mesh=make_mesh(spec))
        want = generate(plain, prompts[family], method=method, **options)
        got = generate(sharded, prompts[family], method=method, **options)
        qkv = sharded.params()["layers"][0]["qkv_proj"]
        row = dict(family=family, mesh=spec, method=name, equal=bool(np.array_equal(got, want)),
                   generated=int((got[:, prompts[family].shape[1]:] != configs[family].mask_token_id).sum()),
                   qkv_shape=list(qkv.shape), qkv_shard_shapes=sorted({tuple(s.data.shape) for s in qkv.addressable_shards}),
                   qkv_spec=str(qkv.sharding.spec))
        if family == "llada2":  # layer 1 is the MoE layer
            experts = sharded.params()["layers"][1]["experts_gate_up"]
            row["experts_shape"] = list(experts.shape)
            row["experts_shard_shapes"] = sorted({tuple(s.data.shape) for s in experts.addressable_shards})
        if family == "sdar":
            cache = sharded.init_cache(4, 32)
            row["cache_shard_shape"] = list(cache.k[0].addressable_shards[0].data.shape)
            row["cache_shape"] = list(cache.k[0].shape)
        rows.append(row)
    try:  # 2 KV heads cannot be split 4 ways
        load_model(root / "llada", dtype="float32", progress=False, mesh=make_mesh("tp=4"))
        refused = None
    except ValueError as e:
        refused = str(e)
    refusals = {"tp4": refused}
    # without "sp", a sequence need not split into whole pattern rows: 40 + 16 positions, SparseD at tp=2
    sparsed = make_method("sparsed", **METHODS["llada"]["sparsed"])
    short = prompts["llada"][:, 8:]
    plain = load_model(root / "llada", dtype="float32", progress=False)
    sharded = load_model(root / "llada", dtype="float32", progress=False, mesh=make_mesh("tp=2"))
    tp_short_equal = bool(np.array_equal(generate(sharded, short, method=sparsed, **OPTIONS["llada"]),
                                         generate(plain, short, method=sparsed, **OPTIONS["llada"])))
    flops = {spec: forward_flops(root / "llada", spec, prompts["llada"]) for spec in ("", "sp=2", "tp=2", "sp=2,tp=2")}
    for key, family, spec, prompt in [("sdar_sp", "sdar", "sp=2", prompts["sdar"]),
                                      ("llada_sp_length", "llada", "sp=2", prompts["llada"][:, 8:])]:
        try:
            sharded = load_model(root / family, dtype="float32", progress=False, mesh=make_mesh(spec))
            generate(sharded, prompt, method=make_method("sparsed", **METHODS["llada"]["sparsed"])
                     if family == "llada" else None, **OPTIONS[family])
            refusals[key] = None
        except ValueError as e:
            refusals[key] = str(e)
    out.write_text(json.dumps(dict(devices=len(jax.devices()), rows=rows, refused=refusals, flops=flops,
                               tp_short_equal=tp_short_equal, moe=sharded_experts(),
                               quantized=sharded_quantized(root, prompts))))


# per family: the layer whose quantized weights' split is recorded, and those weights (LLaDA2: a MoE layer's routed
# experts, which run per device in a shard_map that takes their scales too)
QUANTIZED_SPLITS = {"sdar": (0, ("qkv_proj", "qkv_proj_scale", "down_proj", "down_proj_scale")),
                    "llada2": (-1, ("experts_gate_up", "experts_gate_up_scale", "experts_down", "experts_down_scale"))}


def sharded_quantized(root: Path, prompts: dict) -> dict:
    """SDAR and LLaDA2 with int8 weights (`quantize="int8"`, bf16 compute) on a tp=2 x dp=2 mesh against one device:
    greedy generation, and how their quantized weights and scales are split."""
    out = {}
    for family, (index, names) in QUANTIZED_SPLITS.items():
        plain = load_model(root / family, quantize="int8", progress=False)
        sharded = load_model(root / family, quantize="int8", progress=False, mesh=make_mesh("tp=2,dp=2"))
        options = OPTIONS[family] | (dict(top_k=1) if family == "sdar" else {})
        layer = sharded.params()["layers"][index]
        shards = {name: [list(layer[name].shape), sorted({tuple(s.data.shape) for s in layer[name].addressable_shards})]
                  for name in names}
        prompt = prompts[family]
        same = np.array_equal(generate(sharded, prompt, **options), generate(plain, prompt, **options))
        out[family] = dict(equal=bool(same), shards=shards)
    return out


def sharded_experts() -> dict:
    """LLaDA2's routed experts on a tp=2 x dp=2 mesh against one device: the result, and what each device
    computes on (its rows, its slice of every expert: the shapes inside the shard_map)."""
    rng = np.random.default_rng(1)
    t, d, experts, hidden, k = 12, 16, 6, 8, 2
    x = rng.standard_normal((t, d)).astype(np.float32)
    idx = np.stack([rng.choice(experts, k, replace=False) for _ in range(t)]).astype(np.int32)
    weights = rng.random((t, k)).astype(np.float32)
    gate_up = rng.standard_normal((experts, d, 2 * hidden)).astype(np.float32)
    down = rng.standard_normal((experts, hidden, d)).astype(np.float32)
    mesh = make_mesh("tp=2,dp=2")
    want = np.asarray(routed_experts(x, idx, weights, gate_up, down))
    run = jax.jit(lambda *a: routed_experts(*a, mesh=mesh))
    got = np.asarray(run(x, idx, weights, gate_up, down))
    jaxpr = jax.make_jaxpr(lambda *a: routed_experts(*a, mesh=mesh))(x, idx, weights, gate_up, down)
    inner = next(e for e in jaxpr.eqns if e.primitive.name == "shard_map").params["jaxpr"]
    return dict(max_diff=float(np.max(np.abs(got - want))), scale=float(np.max(np.abs(want))),
                local_shapes=[list(v.aval.shape) for v in inner.invars],
                psum=any(e.primitive.name.startswith("psum") for e in inner.eqns))


def forward_flops(checkpoint: Path, spec: str, ids) -> float:
    """XLA's count of one device's floating-point operations in a LLaDA forward on `spec`'s mesh
    ("": one device): whether the work is really divided, not replicated."""
    mesh = make_mesh(spec) if spec else None
    model = load_model(checkpoint, dtype="float32", progress=False, mesh=mesh)
    policy = Dense() if mesh is None else Sharded(Dense(), mesh)
    run = jax.jit(lambda params, ids: llada.forward(params, ids, config=model.config, policy=policy)[0])
    return float(run.lower(model.params(), ids).compile().cost_analysis()["flops"])


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
