import functools
import sys
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest

from dllm_jax import load_model
from dllm_jax.testing import tiny_llada_config, tiny_sdar_config, write_hf_checkpoint, write_tiny_tokenizer

sys.path.insert(0, str(Path(__file__).parent))  # torch_reference.py


# The files that take longest (seconds of one worker on 2 cores, `make test`, 2026-11-27): scheduled first, so
# that the two workers (`--dist loadfile --no-loadscope-reorder`, Makefile) end together instead of one starting
# a two-minute file while the other runs out of work. The rest follow by number of tests, xdist's own order.
LONGEST_FIRST = ("test_trained_checkpoints.py",  # 155 s: four evaluation processes at 1k-4k tokens
                 "test_flashblock.py",  # 116 s: FlashBlock/MAGE programs and probes
                 "test_sharding.py",  # 103 s: generation on a 4-device CPU mesh in a process of its own
                 "test_notebooks.py",  # 93 s: four Jupyter kernels
                 "test_generate_sdar_batch.py",  # 91 s
                 "test_train.py")  # 85 s


def pytest_collection_modifyitems(items):
    counts = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1

    def rank(item):
        name = item.path.name
        return (LONGEST_FIRST.index(name), 0) if name in LONGEST_FIRST else (len(LONGEST_FIRST), -counts[name])

    items.sort(key=rank)  # stable: a file's tests keep their order


@pytest.fixture(scope="module", autouse=True)
def release_compiled_code():
    """Drops JAX's compiled executables after each test file. Each XLA:CPU executable keeps memory
    mappings of its own, and the suite compiles thousands: kept for the whole session they pass the
    kernel's vm.max_map_count (65530 by default) about three quarters of the way through, and XLA then
    segfaults inside a compilation."""
    yield
    jax.clear_caches()


@pytest.fixture(autouse=True)
def require_gpu(request):
    """A `gpu`-marked test fails (rather than passes vacuously) where JAX has no GPU."""
    if request.node.get_closest_marker("gpu") and jax.default_backend() != "gpu":
        pytest.fail("gpu-marked tests need a GPU; deselect them with -m 'not gpu' on CPU machines")


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's name (reproducible across runs, not shared)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# Tiny models shared by the test files. Each file asks for its own config and seed (the ones it always
# used, so what its assertions see is unchanged); a (config, seed) pair is written and loaded once per
# session, whichever files ask for it.

@pytest.fixture
def config():
    """A tiny LLaDA config (the converter tests' model)."""
    return tiny_llada_config()


@pytest.fixture
def hf(tmp_path, config):
    """An HF-format checkpoint of `config` with seeded random weights, in tmp_path/hf."""
    return write_hf_checkpoint(tmp_path / "hf", config, seed=3)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """checkpoint(config, seed=0) -> the directory of a tiny random HF-format checkpoint of `config`
    (`write_hf_checkpoint`, float32), written once per session. Read it, do not write into it."""

    @functools.cache
    def checkpoint(config, seed: int = 0) -> Path:
        return write_hf_checkpoint(tmp_path_factory.mktemp(f"{config.family}_seed{seed}"), config, seed=seed)

    return checkpoint


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint):
    """model(config, seed=0) -> the float32 model of `tiny_checkpoint(config, seed)`, loaded once per session."""

    @functools.cache
    def model(config, seed: int = 0):
        return load_model(tiny_checkpoint(config, seed), dtype="float32", progress=False)

    return model


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Tiny LLaDA and SDAR checkpoints in HF format with a word-level tokenizer (160 ids: mask 150,
    EOS 141), for the command line."""
    root = tmp_path_factory.mktemp("cli")
    llada = write_hf_checkpoint(root / "llada", tiny_llada_config(mask_token_id=150, eos_token_id=141,
                                                                  pad_token_id=141))
    write_tiny_tokenizer(llada, 160, mask_token_id=150, eos_token_id=141)
    sdar = write_hf_checkpoint(root / "sdar", tiny_sdar_config(vocab_size=160, mask_token_id=150,
                                                               eos_token_ids=(141,), pad_token_id=141))
    write_tiny_tokenizer(sdar, 160, mask_token_id=150, eos_token_id=141)
    return llada, sdar
