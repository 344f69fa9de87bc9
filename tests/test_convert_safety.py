"""The converter cannot lose data and the loader cannot load a damaged or foreign tree (issue 16):
source/target overlap, atomic overwrite, kills at every phase (in subprocesses), stale temp trees,
the commit manifest, checksums (fault injection), dtype defaults, non-finite weights, permissions."""

import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

from dllm_jax import convert_hf_checkpoint, load_model
from dllm_jax.checkpoint.atomic import make_temp_tree, process_start, replace_tree
from dllm_jax.checkpoint.manifest import tensor_checksum
from dllm_jax.testing import random_hf_tensors, tiny_llada_config, write_hf_checkpoint

MANIFEST = "dllm_jax_manifest.json"
Q0 = "model.transformer.blocks.0.q_proj.weight"


def digest_tree(root: Path) -> dict:
    """{relative path: sha256 of the bytes, or the target of a symlink} of everything under root."""
    out = {}
    for path in sorted(Path(root).rglob("*")):
        key = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[key] = "-> " + os.readlink(path)
        elif path.is_file():
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def leftovers(parent: Path) -> list[str]:
    """Hidden temp or aside trees of a conversion in `parent` (`.<name>.tmp-*`, `.<name>.old-*`)."""
    return sorted(p.name for p in parent.iterdir()
                  if p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name))


def params_of(model) -> dict:
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(model.params())[0]}


# --- where a conversion may write ---------------------------------------------------------------

@pytest.mark.parametrize("where", ["same", "parent", "child", "symlink to the source", "blobs of a cache"])
def test_out_dir_overlapping_the_source_is_refused(tmp_path, config, where):
    if where == "blobs of a cache":  # a Hugging Face cache: the snapshot holds symlinks into blobs/
        blobs = write_hf_checkpoint(tmp_path / "repo" / "blobs", config)
        hf = tmp_path / "repo" / "snapshots" / "abc"
        hf.mkdir(parents=True)
        for file in blobs.iterdir():
            (hf / file.name).symlink_to(file)
        out = blobs
    else:
        hf = write_hf_checkpoint(tmp_path / "repo" / "hf", config)
        out = {"same": hf, "parent": hf.parent, "child": hf / "converted"}.get(where)
        if where == "symlink to the source":
            out = tmp_path / "link"
            out.symlink_to(hf)
    before = digest_tree(tmp_path)
    with pytest.raises(ValueError, match="out_dir .* the source checkpoint"):
        convert_hf_checkpoint(hf, out, overwrite=True, progress=False)
    assert digest_tree(tmp_path) == before
    load_model(hf, dtype="float32", progress=False)  # still a loadable checkpoint


def test_overwrite_never_deletes_files_it_did_not_write(tmp_path, hf):
    out = tmp_path / "out"
    convert_hf_checkpoint(hf, out, progress=False)
    (out / "notes.txt").write_text("mine")
    (out / "params" / "extra.bin").write_bytes(b"x")
    before = digest_tree(out)
    with pytest.raises(ValueError, match=r"refusing to overwrite .*2 files the conversion did not write: "
                                         r"\['notes.txt', 'params/extra.bin'\]"):
        convert_hf_checkpoint(hf, out, overwrite=True, progress=False)
    assert digest_tree(out) == before

    plain = tmp_path / "plain"  # a directory that is not a conversion at all
    plain.mkdir()
    (plain / "data.txt").write_text("mine")
    with pytest.raises(ValueError, match="refusing to overwrite .*plain: it is not a committed dllm_jax conversion"):
        convert_hf_checkpoint(hf, plain, overwrite=True, progress=False)
    assert (plain / "data.txt").read_text() == "mine"

    link = tmp_path / "link"
    link.symlink_to(out)
    with pytest.raises(ValueError, match="link is a symbolic link"):
        convert_hf_checkpoint(hf, link, overwrite=True, progress=False)
    assert digest_tree(out) == before and not leftovers(tmp_path)


def test_overwrite_replaces_a_committed_conversion_completely(tmp_path, config):
    old = write_hf_checkpoint(tmp_path / "old", config, seed=1)
    new = write_hf_checkpoint(tmp_path / "new", config, seed=2)
    (new / "tokenizer.json").write_text("{}")
    out = tmp_path / "out"
    convert_hf_checkpoint(old, out, progress=False)
    convert_hf_checkpoint(new, out, overwrite=True, progress=False)
    loaded, direct = (params_of(load_model(d, dtype="float32", progress=False)) for d in (out, new))
    for key in direct:
        np.testing.assert_array_equal(loaded[key], direct[key])
    manifest = json.loads((out / MANIFEST).read_text())
    assert sorted(manifest["files"]) == sorted(p for p in digest_tree(out) if p != MANIFEST)
    assert "tokenizer.json" in manifest["files"] and not leftovers(tmp_path)


def test_unwritable_out_dir_is_refused_before_reading(tmp_path, config):
    tensors = random_hf_tensors(config)
    tensors[Q0][0, 0] = np.nan  # only the long read would find this
    hf = write_hf_checkpoint(tmp_path / "hf", config, tensors=tensors)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="cannot create .*afile, the parent of out_dir .*afile/out"):
        convert_hf_checkpoint(hf, tmp_path / "afile" / "out", progress=False)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only directory")
def test_read_only_parent_is_refused(tmp_path, hf):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    with pytest.raises(ValueError, match="cannot write out_dir .*locked/out"):
        convert_hf_checkpoint(hf, locked / "out", progress=False)


def test_converted_tree_follows_the_umask(tmp_path, hf):
    (hf / "tokenizer.json").write_text("{}")
    os.chmod(hf / "tokenizer.json", 0o600)  # a side file keeps its source's mode, within the umask
    previous = os.umask(0o027)
    try:
        convert_hf_checkpoint(hf, tmp_path / "out", progress=False)
    finally:
        os.umask(previous)
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777 for p in (tmp_path / "out").rglob("*")}
    modes["out"] = (tmp_path / "out").stat().st_mode & 0o777
    dirs = {p for p in modes if (tmp_path / p).is_dir()}
    assert {p: m for p, m in modes.items() if p in dirs and m != 0o750} == {}
    assert {p: m for p, m in modes.items() if p not in dirs and m != 0o640} == {"out/tokenizer.json": 0o600}


# --- the commit manifest and checksums -----------------------------------------------------------

@pytest.fixture
def converted(tmp_path, hf):
    convert_hf_checkpoint(hf, tmp_path / "out", progress=False)
    return tmp_path / "out"


def edited_copy(converted: Path, name: str, file: str, edit) -> Path:
    copy = converted.parent / name
    shutil.copytree(converted, copy)
    data = json.loads((copy / file).read_text())
    edit(data)
    (copy / file).write_text(json.dumps(data))
    return copy


@pytest.mark.parametrize("file", ["config.json", MANIFEST])
def test_unknown_format_version_or_param_dtype_is_refused(converted, file):
    def entry(data):
        return data["dllm_jax"] if file == "config.json" else data

    version = edited_copy(converted, "v99", file, lambda d: entry(d).update(format_version=99))
    with pytest.raises(ValueError, match=f"{file}: format_version 99 is not one this version of dllm_jax reads"):
        load_model(version)
    int8 = edited_copy(converted, "int8", file, lambda d: entry(d).update(param_dtype="int8"))
    with pytest.raises(ValueError, match=rf"{file}: param_dtype 'int8' is not one of \['bfloat16', 'float32'\]"):
        load_model(int8)
    load_model(converted)


def test_uncommitted_tree_is_refused(converted, hf):
    (converted / MANIFEST).unlink()
    with pytest.raises(ValueError, match=r"out is not committed .*an interrupted conversion.*convert the HF"):
        load_model(converted)
    shutil.rmtree(converted / "params")  # what a kill in the middle of the old overwrite left
    with pytest.raises(ValueError, match="out is not committed"):
        load_model(converted)
    with pytest.raises(ValueError, match="refusing to overwrite .*not a committed dllm_jax conversion"):
        convert_hf_checkpoint(hf, converted, overwrite=True, progress=False)


def test_inverted_bytes_in_a_data_file_are_caught(converted):
    clean = params_of(load_model(converted, dtype="float32"))
    largest = max((p for p in (converted / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    start = len(data) // 2
    data[start:start + 64] = bytes(b ^ 0xFF for b in data[start:start + 64])
    largest.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"converted checkpoint {converted} is damaged: .*do not match the checksums"):
        load_model(converted, dtype="float32")
    damaged = params_of(load_model(converted, dtype="float32", verify=False))  # what the checksum stops
    assert any(not np.array_equal(damaged[k], clean[k], equal_nan=True) for k in clean)


def test_checksums_verified_in_either_load_dtype(tmp_path, config):
    for source in ("float32", "bfloat16"):
        hf = write_hf_checkpoint(tmp_path / f"hf-{source}", config, dtype=source)
        convert_hf_checkpoint(hf, tmp_path / source, progress=False)
        for dtype in ("float32", "bfloat16"):
            direct = params_of(load_model(hf, dtype=dtype, progress=False))
            for verify in (True, False):  # a cast after verification, or Orbax's own cast: the same values
                loaded = params_of(load_model(tmp_path / source, dtype=dtype, verify=verify))
                assert {k: v.dtype.name for k, v in loaded.items()} == {k: dtype for k in direct}
                for key in direct:
                    np.testing.assert_array_equal(loaded[key], direct[key])


# --- stored dtype, non-finite weights, the dtype argument ---------------------------------------

def test_fp32_source_round_trips_at_default_settings(tmp_path, hf, config, rng):
    convert_hf_checkpoint(hf, tmp_path / "out", progress=False)
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["param_dtype"] == "float32"
    ids = rng.integers(0, config.tokenizer_vocab_size, (2, 17))
    source = np.asarray(load_model(hf, dtype="float32", progress=False)(ids))
    converted = np.asarray(load_model(tmp_path / "out", dtype="float32")(ids))
    np.testing.assert_allclose(converted, source, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind, stored", [("F16", "float32"), ("BF16", "bfloat16"), ("F16 + BF16", "float32"),
                                          ("F32 + BF16", "float32")])
def test_default_stored_dtype_holds_the_source_exactly(tmp_path, config, kind, stored):
    tensors = random_hf_tensors(config, seed=4)
    first, second = (kind.split(" + ") * 2)[:2]
    cast = {"F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32}
    tensors = {name: t.astype(cast[first if i % 2 else second]) for i, (name, t) in enumerate(tensors.items())}
    hf = write_hf_checkpoint(tmp_path / "hf", config, tensors=tensors)
    convert_hf_checkpoint(hf, tmp_path / "out", progress=False)
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["param_dtype"] == stored
    embed = params_of(load_model(tmp_path / "out", dtype="float32"))["['embed']"]
    np.testing.assert_array_equal(embed, tensors["model.transformer.wte.weight"].astype(np.float32))


def test_explicit_dtype_may_round_down(tmp_path, hf):
    convert_hf_checkpoint(hf, tmp_path / "out", dtype="bfloat16", progress=False)
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["param_dtype"] == "bfloat16"


def test_non_finite_weights_are_refused(tmp_path, config):
    tensors = random_hf_tensors(config)
    tensors[Q0][1, :3] = np.nan
    tensors["model.transformer.ln_f.weight"][0] = -np.inf
    hf = write_hf_checkpoint(tmp_path / "hf", config, tensors=tensors)
    message = rf"(?s)non-finite weights .* in 2 tensors.*{Q0}: 3 NaN, 0 Inf.*ln_f.weight: 0 NaN, 1 Inf"
    with pytest.raises(ValueError, match=message):
        convert_hf_checkpoint(hf, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    with pytest.raises(ValueError, match=message):
        load_model(hf, progress=False)


def test_values_that_overflow_the_stored_dtype_are_refused(tmp_path, config):
    tensors = random_hf_tensors(config)
    tensors[Q0][0, 0] = np.finfo(np.float32).max  # finite in float32, Inf once rounded to bfloat16
    hf = write_hf_checkpoint(tmp_path / "hf", config, tensors=tensors)
    convert_hf_checkpoint(hf, tmp_path / "f32", progress=False)
    with pytest.raises(ValueError, match=rf"(?s)as bfloat16.*{Q0}: 0 NaN, 1 Inf"):
        convert_hf_checkpoint(hf, tmp_path / "bf16", dtype="bfloat16", progress=False)


@pytest.mark.parametrize("dtype", ["fp16", "float16", "int8", 3])
def test_bad_dtype_names_the_argument(tmp_path, hf, dtype):
    with pytest.raises(ValueError, match=rf"load_model: dtype must be one of \['bfloat16', 'float32'\] or None, "
                                         rf"got {dtype!r}"):
        load_model(hf, dtype=dtype)
    with pytest.raises(ValueError, match=r"convert_hf_checkpoint: dtype must be one of"):
        convert_hf_checkpoint(hf, tmp_path / "out", dtype=dtype)


# --- stale temp trees ----------------------------------------------------------------------------

def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def sibling(parent: Path, kind: str, pid: int, host: str, token: str) -> Path:
    path = parent / f".out.{kind}-{pid}@{host}-{token}"
    path.mkdir()
    return path


def test_stale_temp_trees_are_removed_or_reported(tmp_path, hf):
    parent, host, dead = tmp_path / "parent", socket.gethostname(), dead_pid()
    parent.mkdir()
    partial = sibling(parent, "tmp", dead, host, "0000000a")  # killed while writing
    (partial / ".dllm_jax_writer.json").write_text(json.dumps({"pid": dead, "host": host, "files": None}))
    (partial / "params").mkdir()
    (partial / "params" / "chunk").write_bytes(b"x" * 100)
    empty = sibling(parent, "tmp", dead, host, "0000000b")  # killed right after creating it
    cut = sibling(parent, "tmp", dead, host, "0000000f")  # killed while writing its writer file
    (cut / ".dllm_jax_writer.json").write_text('{"pid": ')
    aside = sibling(parent, "old", dead, host, "0000000c")  # an old tree moved aside, then killed
    (aside / "config.json").write_text("{}")
    (aside / "foreign.txt").write_text("not the converter's")
    manifest = dict(format_version=2, param_dtype="float32", chunk_bytes=1 << 26, files=["config.json"], checksums={})
    (aside / MANIFEST).write_text(json.dumps(manifest))
    hollow = sibling(parent, "old", dead, host, "00000012")  # killed while removing its emptied directories
    (hollow / "params" / "0").mkdir(parents=True)
    live = sibling(parent, "tmp", os.getppid(), host, "0000000d")  # a conversion still running
    started = process_start(os.getppid())
    live_started = sibling(parent, "tmp", f"{os.getppid()}.{started}", host, "00000010")  # named as writers name
    # the pid runs another process than the writer that named the tree: the writer is gone (the kernel reuses pids)
    reused = sibling(parent, "tmp", f"{os.getppid()}.{started + 1}", host, "00000011")
    (reused / ".dllm_jax_writer.json").write_text(json.dumps({"pid": os.getppid(), "host": host, "files": None}))
    foreign_host = sibling(parent, "tmp", dead, "elsewhere", "0000000e")
    with pytest.warns(UserWarning) as caught:
        convert_hf_checkpoint(hf, parent / "out", progress=False)
    messages = "\n".join(str(w.message) for w in caught)
    assert not partial.exists() and not empty.exists() and not cut.exists() and not hollow.exists()
    assert sorted(p.name for p in aside.iterdir()) == sorted(["foreign.txt", ".dllm_jax_writer.json"])
    assert live.is_dir() and live_started.is_dir() and foreign_host.is_dir() and not reused.exists()
    assert f"removed {partial}" in messages and f"removed {empty}" in messages and f"removed {reused}" in messages
    assert f"removed {hollow}" in messages
    assert f"{aside}, but not ['foreign.txt']" in messages
    assert f"leaving {live}" in messages and f"leaving {live_started}" in messages
    assert f"leaving {foreign_host}" in messages
    load_model(parent / "out")


# --- kills at every phase, in subprocesses -------------------------------------------------------

KILL_CONFIG = dict(hidden_size=256, num_layers=8, num_heads=4, num_kv_heads=4, intermediate_size=1024,
                   vocab_size=4096, tokenizer_vocab_size=4000)  # 42 MB in fp32: about half a second to convert


def temp_trees(parent: Path, kind: str) -> list[Path]:
    try:
        return [p for p in parent.iterdir() if p.name.startswith(f".out.{kind}-")]
    except FileNotFoundError:
        return []


KILL_POINTS = {  # phase of the child -> test of the filesystem that says it has begun
    "temp tree made": lambda parent: bool(temp_trees(parent, "tmp")),
    "params being written": lambda parent: any((t / "params").exists() for t in temp_trees(parent, "tmp")),
    "params written": lambda parent: any((t / "config.json").exists() for t in temp_trees(parent, "tmp")),
    "committed, not yet renamed": lambda parent: any((t / MANIFEST).exists() for t in temp_trees(parent, "tmp")),
    "old tree moved aside": lambda parent: bool(temp_trees(parent, "old")),
}


@pytest.fixture(scope="module")
def kill_setup(tmp_path_factory):
    """Old and new source checkpoints, their conversions (the expected trees), and a forkserver that
    has imported dllm_jax once, so that each killed child starts in milliseconds."""
    root = tmp_path_factory.mktemp("kill")
    config = tiny_llada_config(**KILL_CONFIG)
    sources = {age: write_hf_checkpoint(root / f"hf-{age}", config, seed=seed)
               for age, seed in (("old", 1), ("new", 2))}
    expected = {}
    for age, source in sources.items():
        convert_hf_checkpoint(source, root / f"ref-{age}", progress=False)
        expected[age] = json.loads((root / f"ref-{age}" / MANIFEST).read_text())["checksums"]
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["dllm_jax.checkpoint.api"])
    small = write_hf_checkpoint(root / "hf-small", tiny_llada_config())
    return dict(root=root, sources=sources, expected=expected, context=context, small=small)


def kill_when(process, reached, timeout=30.0) -> bool:
    """SIGKILLs `process` as soon as `reached()` (polled every ~0.5 ms); whether the kill ended it
    (False if it ended first: on a loaded machine it can exit between the poll and the signal)."""
    deadline = time.monotonic() + timeout
    while process.is_alive() and time.monotonic() < deadline:
        if reached():
            os.kill(process.pid, signal.SIGKILL)
            process.join()
            return process.exitcode == -signal.SIGKILL
        time.sleep(0.0005)
    process.join()
    return False


@pytest.mark.parametrize("overwrite, point", [(False, p) for p in list(KILL_POINTS)[:4]]
                         + [(True, p) for p in ("temp tree made", "params written", "committed, not yet renamed",
                                                "old tree moved aside")])
def test_kill_during_conversion_leaves_old_or_new_tree(kill_setup, overwrite, point):
    """SIGKILL a converting child as soon as the filesystem shows `point`; then out_dir is absent, the
    old complete tree or the new complete tree, the source is intact, and the next conversion into the
    same parent removes every temp tree (a phase too short for the poll ends in the finished state,
    which is checked the same way)."""
    setup = kill_setup
    parent = setup["root"] / f"run-{overwrite}-{point.replace(' ', '_').replace(',', '')}"
    parent.mkdir()
    out = parent / "out"
    if overwrite:
        shutil.copytree(setup["root"] / "ref-old", out)
    source = setup["sources"]["new"]
    source_before = digest_tree(source)
    child = setup["context"].Process(target=convert_hf_checkpoint, args=(source, out),
                                     kwargs=dict(overwrite=overwrite, progress=False))
    child.start()
    killed = kill_when(child, lambda: KILL_POINTS[point](parent))
    assert child.exitcode == (-signal.SIGKILL if killed else 0)
    assert digest_tree(source) == source_before
    if out.exists():  # else killed between moving the old tree aside and renaming the new one in
        checksums = json.loads((out / MANIFEST).read_text())["checksums"]
        assert checksums in ([setup["expected"]["old"], setup["expected"]["new"]] if overwrite
                             else [setup["expected"]["new"]])
        load_model(out, progress=False)  # complete: every checksum verified
    stale = leftovers(parent)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_hf_checkpoint(setup["small"], parent / "next", progress=False)
    assert leftovers(parent) == []
    removed = [str(w.message) for w in caught if str(w.message).startswith("removed")]
    assert len(removed) == len(stale)
    assert sorted(p.name for p in parent.iterdir()) == sorted({"next"} | ({"out"} if out.exists() else set()))


FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), int(sys.argv[3])))
from dllm_jax.cli import main
sys.exit(main(["convert", sys.argv[1], sys.argv[2], "--overwrite", "--quiet"]))
"""


def test_a_conversion_that_runs_out_of_disk_leaves_the_old_tree_and_nothing_hidden(kill_setup, tmp_path):
    """`convert --overwrite` whose very first write fails (the writer file of its temp tree; no file may grow: a
    full disk as the process sees it) exits 2 with one line, out_dir keeps the old tree, and no hidden temp tree
    is left behind."""
    limit = 0
    out = tmp_path / "out"
    shutil.copytree(kill_setup["root"] / "ref-old", out)
    before = digest_tree(out)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    child = subprocess.run([sys.executable, "-c", FULL_DISK, str(kill_setup["sources"]["new"]), str(out), str(limit)],
                           env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 2, child.stderr
    lines = child.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dllm-jax convert: error:"), lines
    assert digest_tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_out_dir_that_appears_during_a_conversion_is_not_replaced(tmp_path, hf):
    """Two conversions racing for one out_dir: the later rename must fail, not replace the winner."""
    out = tmp_path / "out"
    new = make_temp_tree(out)
    (new / "config.json").write_text("{}")
    with pytest.warns(UserWarning, match=f"leaving {new}: a conversion by process {os.getpid()}"):
        convert_hf_checkpoint(hf, out, progress=False)  # the other conversion wins the race (and leaves ours be)
    before = digest_tree(out)
    with pytest.raises(ValueError, match="out appeared while converting"):
        replace_tree(new, out, overwrite=False)
    assert digest_tree(out) == before and (new / "config.json").is_file()


def test_checksum_pieces_are_crc32_of_the_c_order_bytes(rng):
    array = rng.standard_normal((5, 7)).astype(ml_dtypes.bfloat16).T  # not C-contiguous
    data = np.ascontiguousarray(array).tobytes()
    expected = [zlib.crc32(data[i:i + 16]) for i in range(0, len(data), 16)]
    assert tensor_checksum(array, chunk_bytes=16) == expected
    with ThreadPoolExecutor(2) as pool:
        assert tensor_checksum(array, chunk_bytes=16, pool=pool) == expected
    assert tensor_checksum(array) == [zlib.crc32(data)]
