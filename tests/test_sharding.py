"""Tensor and data parallelism (dllm_jax.sharding): the mesh grammar and its errors in this process;
sharded greedy generation against unsharded, token for token, on a 4-device CPU mesh in a process of
its own (tests/sharded_generation.py), for LLaDA, SDAR and LLaDA2, dense and every method."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dllm_jax import generate, load_model
from dllm_jax.attention.methods import make_method
from dllm_jax.sharding import make_mesh, parse_mesh
from dllm_jax.testing import tiny_llada_config, tiny_sdar_config, write_hf_checkpoint
from sharded_generation import METHODS, OPTIONS, cases, make_prompts, write_checkpoints

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    out = root / "rows.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), env_path()]))
    run = subprocess.run([sys.executable, str(HERE / "sharded_generation.py"), str(root), str(out)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["devices"] == 4
    rows = {(r["family"], r["mesh"], r["method"]): r for r in data["rows"]}
    return rows | {key: data[key] for key in ("refused", "flops", "tp_short_equal", "moe", "quantized")}


def env_path() -> str:
    return os.environ.get("PYTHONPATH", "")


@pytest.mark.parametrize("family,mesh,method", list(cases()))
def test_sharded_generation_equals_unsharded(sharded, family, mesh, method):
    row = sharded[(family, mesh, method)]
    assert row["equal"], row
    assert row["generated"] > 0


@pytest.mark.parametrize("family", ["llada", "sdar", "llada2"])
def test_weights_and_sdar_cache_are_split_over_tp(sharded, family):
    row = sharded[(family, "tp=2", "dense")]
    d, columns = row["qkv_shape"]
    assert row["qkv_shard_shapes"] == [[d, columns // 2]], row  # each device holds half of the columns
    if family == "llada2":  # each device holds half of every expert's (gate, up) pairs
        e, d, pairs = row["experts_shape"]
        assert row["experts_shard_shapes"] == [[e, d, pairs // 2]], row
    if family == "sdar":
        b, s, heads, dim = row["cache_shape"]
        assert row["cache_shard_shape"] == [b, s, heads // 2, dim]
        row = sharded[(family, "tp=2,dp=2", "dense")]
        assert row["cache_shard_shape"] == [b // 2, s, heads // 2, dim]


def test_routed_experts_run_per_device_on_their_slice(sharded):
    """On a tp=2 x dp=2 mesh each device dispatches its 6 of 12 token rows to its half of every expert's
    hidden dimension, and the halves are summed over tp: equal to one device (XLA cannot partition the
    grouped-matmul kernel, so without the shard_map it would gather every expert to every device)."""
    moe = sharded["moe"]
    assert moe["max_diff"] <= 1e-5 * moe["scale"], moe
    assert moe["local_shapes"] == [[6, 16], [6, 2], [6, 2], [6, 16, 8], [6, 4, 16]], moe
    assert moe["psum"], moe


def test_a_quantized_model_shards_and_generates_what_one_device_does(sharded):
    """int8 weights (stored [out, in]) split over tp as their bf16 form would be: qkv_proj by its output columns
    (now its rows), down_proj by its input rows (now its columns); each scale with its output channels. LLaDA2's
    routed experts ([E, out, in]) likewise, through the shard_map they run in."""
    quantized = sharded["quantized"]["sdar"]
    assert quantized["equal"], quantized
    shards = quantized["shards"]
    (qkv, qkv_shards), (qkv_scale, scale_shards) = shards["qkv_proj"], shards["qkv_proj_scale"]
    assert qkv_shards == [[qkv[0] // 2, qkv[1]]] and scale_shards == [[qkv_scale[0] // 2]]
    (down, down_shards), (down_scale, down_scale_shards) = shards["down_proj"], shards["down_proj_scale"]
    assert down_shards == [[down[0], down[1] // 2]] and down_scale_shards == [down_scale]
    experts = sharded["quantized"]["llada2"]
    assert experts["equal"], experts
    shards = experts["shards"]
    (gate_up, gate_up_shards), (gate_up_scale, scale_shards) = (shards["experts_gate_up"],
                                                                shards["experts_gate_up_scale"])
    assert gate_up_shards == [[gate_up[0], gate_up[1] // 2, gate_up[2]]]
    assert scale_shards == [[gate_up_scale[0], gate_up_scale[1] // 2]]
    (down, down_shards), (down_scale, down_scale_shards) = shards["experts_down"], shards["experts_down_scale"]
    assert down_shards == [[down[0], down[1], down[2] // 2]] and down_scale_shards == [down_scale]


def test_tp_that_does_not_divide_the_kv_heads_is_refused(sharded):
    assert "tp=4 must divide num_kv_heads=2" in (sharded["refused"]["tp4"] or "")


def test_sequence_parallelism_is_refused_where_it_cannot_split(sharded):
    assert "SDAR's block steps take tp and dp only" in (sharded["refused"]["sdar_sp"] or "")
    # 40 + 16 positions do not split into whole 16-query rows of SparseD's pattern on 2 devices
    assert "multiple of 32" in (sharded["refused"]["llada_sp_length"] or "")
    # the same sequence without "sp" is not refused, and generates what one device does
    assert sharded["tp_short_equal"]


@pytest.mark.parametrize("spec, message", [
    ("tp=2,pp=2", "mesh axis 'pp'"), ("tp=0", "must be a positive integer"), ("tp=x", "must be a positive integer"),
    ("tp=2,tp=2", "given twice"), ("", "names no axis"),
])
def test_bad_mesh_specs_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_mesh(spec)


def test_a_mesh_needs_its_devices_and_tp_must_divide_the_heads(tiny_checkpoint):
    assert parse_mesh("tp=2") == {"dp": 1, "sp": 1, "tp": 2}
    assert parse_mesh("sp=2,dp=2") == {"dp": 2, "sp": 2, "tp": 1}
    with pytest.raises(ValueError, match="needs 64 devices"):
        make_mesh("tp=64")
    with pytest.raises(ValueError, match=r"tp=1 must divide|must be a jax.sharding.Mesh"):
        load_model(tiny_checkpoint(tiny_llada_config(), 0), mesh="tp=2")


@pytest.mark.parametrize("mesh, devices", [("sp=2", 2), ("tp=2", 2), ("sp=2,tp=2", 4)])
def test_each_device_does_its_share_of_a_forward(sharded, mesh, devices):
    # XLA's operation count of one device's program: sequence and tensor parallelism divide the work
    whole, share = sharded["flops"][""], sharded["flops"][mesh]
    assert share <= 1.1 * whole / devices, (mesh, share, whole)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_under_jax_distributed_generate_what_one_process_does(tmp_path):
    # tp=2 x dp=2 over two processes' devices (2 each), localhost coordinator
    from multihost_generation import OPTIONS, prompts

    configs = {"llada": tiny_llada_config(num_heads=4, num_kv_heads=2), "sdar": tiny_sdar_config()}
    for family, config in configs.items():
        write_hf_checkpoint(tmp_path / family, config, seed=1)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), env_path()]))
    port = free_port()
    runs = [subprocess.Popen([sys.executable, str(HERE / "multihost_generation.py"), str(port), str(i), str(tmp_path),
                              str(tmp_path / f"out{i}.json")], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        logs = [run.communicate(timeout=600)[0] for run in runs]
    finally:
        for run in runs:
            run.kill()
    assert [run.returncode for run in runs] == [0, 0], [log[-2000:] for log in logs]
    for i in range(2):
        got = json.loads((tmp_path / f"out{i}.json").read_text())
        assert (got["processes"], got["devices"], got["local_devices"]) == (2, 4, 2)
        for family, prompt in prompts().items():
            model = load_model(tmp_path / family, dtype="float32", progress=False)
            assert got[family] == generate(model, prompt, **OPTIONS[family]).tolist(), (i, family)


@pytest.mark.gpu
@pytest.mark.parametrize("family,spec,method", [("llada", "tp=2", "dense"), ("llada", "sp=2", "sparsed"),
                                                ("llada", "tp=2", "pulsecol"), ("sdar", "tp=2", "dense"),
                                                ("sdar", "tp=2", "mage"), ("llada2", "tp=2", "dense")])
def test_gpu_two_devices_generate_what_one_does(tmp_path, family, spec, method):
    """On two GPUs (nvidia-h200-x2): greedy fp32 generation on a mesh equals one GPU's, with the Pallas
    kernels running per device inside the shard_map."""
    import jax

    if jax.device_count() < 2:
        pytest.skip("needs two GPUs")
    write_checkpoints(tmp_path)
    prompt = make_prompts()[family]
    policy = None if method == "dense" else make_method(method, **METHODS[family][method])
    one = load_model(tmp_path / family, dtype="float32", progress=False)
    two = load_model(tmp_path / family, dtype="float32", progress=False, mesh=make_mesh(spec))
    want = generate(one, prompt, method=policy, **OPTIONS[family])
    assert (generate(two, prompt, method=policy, **OPTIONS[family]) == want).all()



def test_any_mesh_with_a_tp_axis_is_taken(tiny_checkpoint):
    """A Mesh names its own axes: "tp", and optionally "dp" and "sp", in any order (an axis it lacks has
    size 1); a foreign axis of size 1 is dropped, one of more devices refused, as is a mesh without "tp"."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from dllm_jax.sharding import AXES, canonical_mesh

    mesh = canonical_mesh(jax.make_mesh((1,), ("tp",)))
    assert tuple(mesh.axis_names) == AXES and dict(mesh.shape) == {"dp": 1, "sp": 1, "tp": 1}
    assert dict(canonical_mesh(jax.make_mesh((1, 1, 1), ("tp", "pp", "dp"))).shape) == {"dp": 1, "sp": 1, "tp": 1}
    device = jax.devices()[0]  # a Mesh may repeat a device: shapes of more than one device on one CPU
    assert dict(canonical_mesh(Mesh(np.array([device] * 2).reshape(2, 1), ("tp", "dp"))).shape) == {
        "dp": 1, "sp": 1, "tp": 2}
    with pytest.raises(ValueError, match=r"mesh axes \{'pp': 2\} are not ones dllm_jax splits over"):
        canonical_mesh(Mesh(np.array([device] * 2).reshape(1, 2), ("tp", "pp")))
    with pytest.raises(ValueError, match=r"mesh axes \('dp',\) have no 'tp' axis"):
        canonical_mesh(jax.make_mesh((1,), ("dp",)))
    path = tiny_checkpoint(tiny_llada_config(), 0)
    model = load_model(path, dtype="float32", progress=False, mesh=jax.make_mesh((1,), ("tp",)))
    assert tuple(model.mesh.axis_names) == AXES
    prompt = np.arange(3, 19, dtype=np.int32)[None]
    options = dict(gen_length=8, steps=4, block_length=8)
    np.testing.assert_array_equal(generate(model, prompt, **options),
                                  generate(load_model(path, dtype="float32", progress=False), prompt, **options))
