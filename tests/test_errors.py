"""The errors a new user meets first: each a ValueError that names the problem and the way out."""

import shutil

import numpy as np
import pytest

import dllm_jax
from dllm_jax import FlashBlock, MAGE, PulseCol, SpargeAttn, SparseD, generate, load_model
from dllm_jax.attention.methods import describe, make_method, parameters
from dllm_jax.testing import tiny_llada_config, tiny_sdar_config, write_hf_checkpoint


@pytest.fixture(scope="module")
def models(tiny_model):
    return tiny_model(tiny_llada_config()), tiny_model(tiny_sdar_config())


def test_make_method_builds_each_method_and_names_what_is_unknown():
    assert make_method("dense") is None
    assert make_method("sparsed", select=0.5) == SparseD(select=0.5)
    assert make_method("pulsecol") == PulseCol()
    assert make_method("sparge", cdfthreshd=0.9) == SpargeAttn(cdfthreshd=0.9)
    assert make_method("mage", k=64) == MAGE(k=64)
    assert make_method("flashblock+mage", tau=3, k=64) == FlashBlock(tau=3, inner=MAGE(k=64))
    assert describe(make_method("flashblock+mage", tau=3, k=64)) == "flashblock+mage(tau=3, k=64)"
    with pytest.raises(ValueError, match=r"unknown method 'sparse'; known: \['dense'\] \+ \['sparsed'"):
        make_method("sparse")
    with pytest.raises(ValueError, match=r"method 'mage' has no parameter\(s\) \['tau'\]; its parameters .*k=512"):
        make_method("mage", tau=2)
    with pytest.raises(ValueError, match="dense attention takes no parameters"):
        make_method("dense", select=0.3)
    assert set(parameters("sparsed")) == {"skip", "select", "block_size", "scale_quirk", "backend"}


def test_a_method_of_the_other_family_is_refused_up_front(models):
    llada, sdar = models
    prompt = np.arange(1, 9)[None]
    with pytest.raises(ValueError, match=r"MAGE is a method for SDAR models .*for LLaDA use one of "
                                         r"\['sparsed', 'pulsecol', 'sparge'\]"):
        generate(llada, prompt, gen_length=8, steps=8, block_length=8, method=MAGE(k=4))
    with pytest.raises(ValueError, match=r"SparseD is a method for LLaDA models .*for SDAR use one of "
                                         r"\['mage', 'flashblock', 'flashblock\+mage'\]"):
        generate(sdar, prompt, max_new_tokens=8, method=SparseD())
    with pytest.raises(ValueError, match="FlashBlock is a method for SDAR"):
        generate(llada, prompt, gen_length=8, steps=8, block_length=8, method="flashblock")  # by name, too
    with pytest.raises(ValueError, match="unknown method 'magee'"):
        generate(sdar, prompt, max_new_tokens=8, method="magee")


def test_method_by_name_equals_the_config_object(models):
    llada, _ = models
    prompt = np.arange(1, 9)[None]
    options = dict(gen_length=16, steps=8, block_length=16)
    np.testing.assert_array_equal(generate(llada, prompt, method="pulsecol", **options),
                                  generate(llada, prompt, method=PulseCol(), **options))


def test_lengths_and_schedules_are_checked(models):
    llada, sdar = models
    prompt = np.arange(1, 9)[None]
    with pytest.raises(ValueError, match="gen_length=16 must be a multiple of block_length=5"):
        generate(llada, prompt, gen_length=16, steps=16, block_length=5)
    with pytest.raises(ValueError, match=r"steps=5 must be a multiple of the number of blocks \(gen_length / "
                                         r"block_length = 2\)"):
        generate(llada, prompt, gen_length=16, steps=5, block_length=8)
    limit = llada.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"the prompt has {limit + 1} tokens, longer than the model's context of "
                                         f"{limit} positions"):
        generate(llada, np.ones((1, limit + 1), np.int32), gen_length=8, steps=8, block_length=8)
    with pytest.raises(ValueError, match=rf"prompt \(8 tokens\) \+ {limit} new tokens = {limit + 8} exceeds"):
        generate(llada, prompt, gen_length=limit, steps=limit, block_length=limit)
    with pytest.raises(ValueError, match="block_length defaults to 128, as in the official generate"):
        generate(llada, prompt, gen_length=8, steps=8)
    limit = sdar.config.max_position_embeddings
    with pytest.raises(ValueError, match="exceeds the model's context"):
        generate(sdar, prompt, max_new_tokens=limit)
    with pytest.raises(ValueError, match=r"unknown LLaDA generate options \['max_new_tokens'\]"):
        generate(llada, prompt, max_new_tokens=8)


def test_checkpoint_directories_missing_files(tmp_path):
    with pytest.raises(ValueError, match="checkpoint directory .*absent does not exist"):
        load_model(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json not found: a checkpoint directory needs its config.json"):
        load_model(tmp_path / "empty")
    hf = write_hf_checkpoint(tmp_path / "hf", tiny_llada_config(), shards=2)
    (hf / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="names shard files that do not exist"):
        load_model(hf)
    hf = write_hf_checkpoint(tmp_path / "hf2", tiny_llada_config())
    dllm_jax.convert_hf_checkpoint(hf, tmp_path / "converted", progress=False)
    for victim in ("_METADATA", "ocdbt.process_0"):
        damaged = tmp_path / f"damaged-{victim}"
        shutil.copytree(tmp_path / "converted", damaged)
        path = damaged / "params" / victim
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        with pytest.raises(ValueError, match="is not a complete Orbax checkpoint .*convert the HF checkpoint again"):
            load_model(damaged)
