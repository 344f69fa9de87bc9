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
from dllm_jax.sharding import make_mesh  # noqa: E402
from dllm_jax.testing import tiny_llada_config, tiny_sdar_config, write_hf_checkpoint  # noqa: E402

METHODS = {  # tiny-size parameters, as the methods' own tests use them
    "llada": {"sparsed": dict(block_size=16), "pulsecol": dict(group_size=16, refreshes=2),
              "sparge": dict(block_q=16, block_kv=16)},
    "sdar": {"mage": dict(k=16, exact_layers=1), "flashblock": {}, "flashblock+mage": dict(k=16, exact_layers=1)},
}
OPTIONS = {"llada": dict(gen_length=16, steps=8, block_length=8), "sdar": dict(max_new_tokens=8)}


def cases():
    """(family, mesh spec, method name) of every comparison: dense on both meshes, each method on tp x dp."""
    for family in ("llada", "sdar"):
        yield family, "tp=2", "dense"
        yield family, "tp=2,dp=2", "dense"
        for name in METHODS[family]:
            yield family, "tp=2,dp=2", name


def main(root: Path, out: Path) -> None:
    configs = {"llada": tiny_llada_config(num_heads=4, num_kv_heads=2), "sdar": tiny_sdar_config()}
    rng = np.random.default_rng(0)
    prompts = {"llada": rng.integers(3, 100, (4, 24)).astype(np.int32),  # no mask id: the methods' prompts
               "sdar": rng.integers(3, 100, (4, 24)).astype(np.int32)}
    rows = []
    for family, config in configs.items():
        write_hf_checkpoint(root / family, config, seed=1)
    for family, spec, name in cases():
        method = None if name == "dense" else make_method(name, **METHODS[family][name])
        plain = load_model(root / family, dtype="float32", progress=False)
        sharded = load_model(root / family, dtype="float32", progress=False, mesh=make_mesh(spec))
        want = generate(plain, prompts[family], method=method, **OPTIONS[family])
        got = generate(sharded, prompts[family], method=method, **OPTIONS[family])
        qkv = sharded.params()["layers"][0]["qkv_proj"]
        row = dict(family=family, mesh=spec, method=name, equal=bool(np.array_equal(got, want)),
                   generated=int((got[:, prompts[family].shape[1]:] != config.mask_token_id).sum()),
                   qkv_shape=list(qkv.shape), qkv_shard_shapes=sorted({tuple(s.data.shape) for s in qkv.addressable_shards}),
                   qkv_spec=str(qkv.sharding.spec))
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
    out.write_text(json.dumps(dict(devices=len(jax.devices()), rows=rows, refused_tp4=refused)))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
