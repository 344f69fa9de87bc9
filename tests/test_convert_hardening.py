"""The converter reads only its checkpoint's own regular files and vouches for every file it writes
(issue 37): index shard names stay inside the folder, a malformed index is one ValueError, FIFOs are
refused instead of read forever, side files keep their source's mode and may not link outside the
checkpoint (a Hugging Face cache still converts), and config.json and the side files are checksummed."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from dllm_jax import convert_hf_checkpoint, load_model
from dllm_jax.testing import write_hf_checkpoint

MANIFEST = "dllm_jax_manifest.json"
INDEX = "model.safetensors.index.json"


@pytest.fixture
def sharded(tmp_path, config):
    return write_hf_checkpoint(tmp_path / "sharded", config, seed=3, shards=2)


def edit_index(hf: Path, edit) -> Path:
    index = json.loads((hf / INDEX).read_text())
    edit(index)
    (hf / INDEX).write_text(json.dumps(index))
    return hf / INDEX


def first_shard(hf: Path) -> tuple[str, str]:
    """(a tensor name, its shard file) from the index."""
    return next(iter(json.loads((hf / INDEX).read_text())["weight_map"].items()))


def params_of(model) -> dict:
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(model.params())[0]}


# --- 1. shard names stay inside the checkpoint folder --------------------------------------------

@pytest.mark.parametrize("where", ["parent", "absolute", "down and out"])
def test_index_naming_a_shard_outside_the_folder_is_refused(tmp_path, sharded, where):
    tensor, shard = first_shard(sharded)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.replace(sharded / shard, elsewhere / shard)
    named = {"parent": f"../elsewhere/{shard}", "absolute": str(elsewhere / shard),
             "down and out": f"sub/../../elsewhere/{shard}"}[where]
    (sharded / "sub").mkdir()
    index = edit_index(sharded, lambda i: i["weight_map"].update({n: named for n, f in i["weight_map"].items()
                                                                   if f == shard}))
    message = rf"{re.escape(str(index))}: weight_map entry '{re.escape(tensor)}' names the shard '{re.escape(named)}'"
    with pytest.raises(ValueError, match=message):
        convert_hf_checkpoint(sharded, elsewhere / "out", progress=False)  # out_dir beside the foreign shard
    with pytest.raises(ValueError, match=message):
        load_model(sharded, progress=False)
    assert sorted(p.name for p in elsewhere.iterdir()) == [shard]


def test_shards_in_a_subfolder_of_the_checkpoint_still_convert(tmp_path, sharded):
    _, shard = first_shard(sharded)
    (sharded / "shards").mkdir()
    os.replace(sharded / shard, sharded / "shards" / shard)
    edit_index(sharded, lambda i: i["weight_map"].update({n: f"./shards/{shard}" for n, f in i["weight_map"].items()
                                                          if f == shard}))
    convert_hf_checkpoint(sharded, tmp_path / "out", progress=False)
    load_model(tmp_path / "out")


# --- 2. a malformed index is one ValueError naming it --------------------------------------------

@pytest.mark.parametrize("weight_map", [["model-00001-of-00002.safetensors"], {"embed": 1}, {"embed": None},
                                        "model.safetensors", {"embed": ""}])
def test_malformed_index_names_the_index_file(tmp_path, sharded, weight_map):
    index = edit_index(sharded, lambda i: i.update(weight_map=weight_map))
    with pytest.raises(ValueError, match=rf"{re.escape(str(index))}(:| is not a valid safetensors index).*weight_map"):
        convert_hf_checkpoint(sharded, tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match=re.escape(str(index))):
        load_model(sharded, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sharded"]


# --- 3. only regular files are read ---------------------------------------------------------------

def test_fifo_named_safetensors_is_refused_not_read_forever(tmp_path, hf):
    """A reader opening a FIFO waits for a writer that never comes: in a subprocess, with a timeout."""
    os.mkfifo(hf / "extra.safetensors")
    run = subprocess.run([sys.executable, "-m", "dllm_jax.cli", "convert", str(hf), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=60, env=os.environ | {"JAX_PLATFORMS": "cpu"})
    assert run.returncode == 2, run.stderr
    assert f"{hf / 'extra.safetensors'} is a FIFO (named pipe), not a regular file" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["model-00002-of-00002.safetensors", "tokenizer_config.json", "config.json"])
def test_fifo_in_place_of_a_file_is_refused_by_name(tmp_path, sharded, name):
    (sharded / name).unlink(missing_ok=True)
    os.mkfifo(sharded / name)
    with pytest.raises(ValueError, match=rf"{re.escape(str(sharded / name))} is a FIFO \(named pipe\), not a regular "
                                         "file: only regular files are read"):
        convert_hf_checkpoint(sharded, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# --- 4. side files: copied as regular files with their mode, never from outside -------------------

def test_side_file_linking_outside_the_checkpoint_is_refused(tmp_path, hf):
    secret = tmp_path / "private" / "secret.json"
    secret.parent.mkdir()
    secret.write_text('{"token": "hunter2"}')
    secret.chmod(0o600)
    (hf / "tokenizer_config.json").symlink_to(secret)
    with pytest.raises(ValueError, match=rf"side file {re.escape(str(hf / 'tokenizer_config.json'))} is a symbolic "
                                         rf"link to {re.escape(str(secret))}, outside the checkpoint"):
        convert_hf_checkpoint(hf, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "private"]


@pytest.mark.parametrize("how", ["plain file", "link inside the checkpoint"])
def test_side_file_is_copied_as_a_regular_file_with_its_mode(tmp_path, hf, how):
    source = hf / ("tokenizer.json" if how == "plain file" else "real/tokenizer.json")
    source.parent.mkdir(exist_ok=True)
    source.write_text('{"private": true}')
    source.chmod(0o600)
    if how != "plain file":
        (hf / "tokenizer.json").symlink_to("real/tokenizer.json")
    previous = os.umask(0o022)
    try:
        convert_hf_checkpoint(hf, tmp_path / "out", progress=False)
    finally:
        os.umask(previous)
    copied = tmp_path / "out" / "tokenizer.json"
    assert not copied.is_symlink() and copied.read_text() == '{"private": true}'
    assert copied.stat().st_mode & 0o777 == 0o600  # not widened to the umask's 0644


def test_hugging_face_cache_layout_still_converts(tmp_path, config):
    """A cache snapshot's files (shards, index, side files) are links to ../../blobs/<hash>: allowed."""
    source = write_hf_checkpoint(tmp_path / "download", config, seed=5, shards=2)
    (source / "tokenizer.json").write_text('{"vocab": 1}')
    blobs, snapshot = tmp_path / "models--org--tiny" / "blobs", tmp_path / "models--org--tiny" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(source.iterdir())):
        os.replace(file, blobs / f"{i:040x}")
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", f"{i:040x}"))
    convert_hf_checkpoint(snapshot, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"vocab": 1}'
    loaded, direct = (params_of(load_model(d, dtype="float32", progress=False)) for d in (tmp_path / "out", snapshot))
    for key in direct:
        np.testing.assert_array_equal(loaded[key], direct[key])


# --- 5. config.json and the side files are covered by the manifest -------------------------------

def flip_last_digit(text: str, key: str) -> str:
    """`text` with one bit flipped in the last digit of `key`'s number (500000.0 -> 500000.1)."""
    match = re.search(rf'"{key}": [-+.0-9e]*([0-9])', text)
    assert match, key
    digit = match.start(1)
    return text[:digit] + chr(ord(text[digit]) ^ 1) + text[digit + 1:]


@pytest.mark.parametrize("file, key", [("config.json", "rope_theta"), ("config.json", "rms_norm_eps"),
                                       ("tokenizer.json", "vocab")])
def test_a_changed_config_or_side_file_is_refused(tmp_path, hf, file, key):
    (hf / "tokenizer.json").write_text('{"vocab": 150}')
    out = tmp_path / "out"
    convert_hf_checkpoint(hf, out, progress=False)
    (out / file).write_text(flip_last_digit((out / file).read_text(), key))
    with pytest.raises(ValueError, match=rf"converted checkpoint {re.escape(str(out))} is damaged: {file} changed "
                                         "after conversion"):
        load_model(out)
    load_model(out, verify=False)  # verify=False trusts the tree


def test_trees_converted_before_file_checksums_still_load(tmp_path, hf):
    out = tmp_path / "out"
    convert_hf_checkpoint(hf, out, progress=False)
    manifest = json.loads((out / MANIFEST).read_text())
    assert set(manifest.pop("file_checksums")) == {"config.json"}
    (out / MANIFEST).write_text(json.dumps(manifest))
    (out / "config.json").write_text(flip_last_digit((out / "config.json").read_text(), "rope_theta"))
    load_model(out)  # nothing recorded, nothing to check
