"""The persistent compilation cache a user gets by default: where it lives, how it is turned off or moved, and
that a second process with the same shapes loads its programs instead of compiling them, with two processes
filling one folder at once."""

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from dllm_jax import compile_cache
from dllm_jax.testing import tiny_sdar_config, user_environment

# one generation in a process of its own: how many programs it compiled for the backend, how many it loaded from
# the cache (JAX times a program's backend step whether it compiles or loads it: compiled = timed - loaded)
GENERATE_ONCE = """
import json, sys
import jax, numpy as np
counts = {"compiled": 0, "loaded": 0}

def count(event, *args, **kwargs):
    counts["compiled"] += event == "/jax/core/compile/backend_compile_duration"
    counts["loaded"] += event == "/jax/compilation_cache/cache_hits"
    counts["compiled"] -= event == "/jax/compilation_cache/cache_hits"

jax.monitoring.register_event_listener(count)
jax.monitoring.register_event_duration_secs_listener(count)
import dllm_jax
model = dllm_jax.load_model(sys.argv[1], dtype="float32", progress=False)
out = dllm_jax.generate(model, np.arange(3, 12, dtype=np.int32)[None], max_new_tokens=8, seed=1)
print(json.dumps(dict(counts, cache=jax.config.jax_compilation_cache_dir, tokens=np.asarray(out).tolist(),
                      min_compile=jax.config.jax_persistent_cache_min_compile_time_secs)))
"""


def test_the_folder_follows_the_environment(tmp_path):
    home = Path.home() / ".cache" / "dllm_jax" / "jax"
    assert compile_cache.default_folder({}) == home
    assert compile_cache.default_folder({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "dllm_jax" / "jax"
    assert compile_cache.default_folder({"DLLM_JAX_CACHE_DIR": str(tmp_path / "c")}) == tmp_path / "c"
    for off in ("off", "OFF", "none", "0", "", " "):
        assert compile_cache.default_folder({"DLLM_JAX_CACHE_DIR": off}) is None
    assert compile_cache.size_limit({}) == 8 * 2**30 and compile_cache.size_limit({"DLLM_JAX_CACHE_BYTES": "1000"}) == 1000
    with pytest.raises(ValueError, match="DLLM_JAX_CACHE_BYTES='-5' must be a positive number of bytes"):
        compile_cache.size_limit({"DLLM_JAX_CACHE_BYTES": "-5"})


def test_a_cache_set_already_is_left_alone():
    """This process's cache comes from JAX_COMPILATION_CACHE_DIR (`make test`) or from the default; either way
    enable_default leaves a set folder as it is."""
    before = jax.config.jax_compilation_cache_dir
    assert before and compile_cache.enable_default({"DLLM_JAX_CACHE_DIR": "/nonexistent/elsewhere"}) is None
    assert jax.config.jax_compilation_cache_dir == before


def test_an_unusable_folder_warns_and_the_import_goes_on(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    env = {k: v for k, v in user_environment(os.environ).items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env |= {"DLLM_JAX_CACHE_DIR": str(blocker / "cache"), "PYTHONPATH": str(Path(__file__).parents[1])}
    run = subprocess.run([sys.executable, "-c", "import dllm_jax, jax; print(jax.config.jax_compilation_cache_dir)"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "None", run.stderr
    assert f"no persistent compilation cache (the compilation cache folder {blocker / 'cache'} cannot be created" in \
        run.stderr


def test_a_second_process_loads_what_two_processes_compiled_at_once(tiny_checkpoint, tmp_path):
    """Two processes generate at once into one empty cache folder (both compile; the file lock keeps their writes
    apart), then a third loads every program it needs, the small host-side ones too (the cache keeps programs
    however fast they compiled, `MIN_COMPILE_SECONDS`), and compiles none, with the same tokens."""
    checkpoint = tiny_checkpoint(tiny_sdar_config(), 0)
    env = {k: v for k, v in user_environment(os.environ).items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", compile_cache.MIN_COMPILE_VARIABLE)}  # as a user's process
    env |= {"DLLM_JAX_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(Path(__file__).parents[1])}

    def generate_once():
        run = subprocess.run([sys.executable, "-c", GENERATE_ONCE, str(checkpoint)], env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1])

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = list(pool.map(lambda _: generate_once(), range(2)))
    third = generate_once()
    assert all(r["cache"] == str(tmp_path / "cache") for r in [*first, third])
    assert all(r["compiled"] > 0 for r in first), first
    assert third["compiled"] == 0 and third["loaded"] >= 1 and third["min_compile"] == 0, third
    assert third["tokens"] == first[0]["tokens"] == first[1]["tokens"]
    assert oct((tmp_path / "cache").stat().st_mode & 0o777) == oct(0o700)
