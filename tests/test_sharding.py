"""Tensor and data parallelism (dllm_jax.sharding): the mesh grammar and its errors in this process;
sharded greedy generation against unsharded, token for token, on a 4-device CPU mesh in a process of
its own (tests/sharded_generation.py), for LLaDA and SDAR, dense and every method."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dllm_jax import load_model
from dllm_jax.sharding import make_mesh, parse_mesh
from dllm_jax.testing import tiny_llada_config
from sharded_generation import cases

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
    return {(r["family"], r["mesh"], r["method"]): r for r in data["rows"]} | {"refused_tp4": data["refused_tp4"]}


def env_path() -> str:
    return os.environ.get("PYTHONPATH", "")


@pytest.mark.parametrize("family,mesh,method", list(cases()))
def test_sharded_generation_equals_unsharded(sharded, family, mesh, method):
    row = sharded[(family, mesh, method)]
    assert row["equal"], row
    assert row["generated"] > 0


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_weights_and_sdar_cache_are_split_over_tp(sharded, family):
    row = sharded[(family, "tp=2", "dense")]
    d, columns = row["qkv_shape"]
    assert row["qkv_shard_shapes"] == [[d, columns // 2]], row  # each device holds half of the columns
    if family == "sdar":
        b, s, heads, dim = row["cache_shape"]
        assert row["cache_shard_shape"] == [b, s, heads // 2, dim]
        row = sharded[(family, "tp=2,dp=2", "dense")]
        assert row["cache_shard_shape"] == [b // 2, s, heads // 2, dim]


def test_tp_that_does_not_divide_the_kv_heads_is_refused(sharded):
    assert "tp=4 must divide num_kv_heads=2" in (sharded["refused_tp4"] or "")


@pytest.mark.parametrize("spec, message", [
    ("tp=2,pp=2", "mesh axis 'pp'"), ("tp=0", "must be a positive integer"), ("tp=x", "must be a positive integer"),
    ("tp=2,tp=2", "given twice"), ("", "names no axis"),
])
def test_bad_mesh_specs_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_mesh(spec)


def test_a_mesh_needs_its_devices_and_tp_must_divide_the_heads(tiny_checkpoint):
    assert parse_mesh("tp=2") == {"dp": 1, "tp": 2}
    with pytest.raises(ValueError, match="needs 64 devices"):
        make_mesh("tp=64")
    with pytest.raises(ValueError, match=r"tp=1 must divide|must be a jax.sharding.Mesh"):
        load_model(tiny_checkpoint(tiny_llada_config(), 0), mesh="tp=2")
