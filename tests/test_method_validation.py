"""Method configs, SpargeAttn calibration files and the kernels' softmax `scale` are checked on the host.

A bad value is a ValueError naming the class and field (`MAGE.k`), the argument (`scale`) or the
calibration file and its key, raised at construction or before anything is traced or compiled:
never a TypeError inside tracing, an all-NaN output or a silently different schedule. Nothing here
runs a model.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from dllm_jax import Dense, FlashBlock, MAGE, PulseCol, SpargeAttn, SparseD
from dllm_jax.analysis.calibration import Calibration, save_calibration
from dllm_jax.attention.dense import dense_attention
from dllm_jax.attention.methods import make_method, method_names
from dllm_jax.attention.pulsecol import refresh_steps
from dllm_jax.testing import no_compilation

NAN, INF = float("nan"), float("inf")


# ---- policy fields ----

# (build, the field the message must name, the value it must show)
BAD_CONFIGS = {
    "MAGE exact_layers nan": (lambda: MAGE(exact_layers=NAN), "MAGE.exact_layers", "nan"),
    "MAGE exact_layers 0.5": (lambda: MAGE(exact_layers=0.5), "MAGE.exact_layers", "0.5"),
    "MAGE exact_layers bool": (lambda: MAGE(exact_layers=True), "MAGE.exact_layers", "True"),
    "MAGE k 1.5": (lambda: MAGE(k=1.5), "MAGE.k", "1.5"),
    "MAGE k nan": (lambda: MAGE(k=NAN), "MAGE.k", "nan"),
    "MAGE k bool": (lambda: MAGE(k=True), "MAGE.k", "True"),
    "MAGE k string": (lambda: MAGE(k="512"), "MAGE.k", "'512'"),
    "MAGE k beyond int32": (lambda: MAGE(k=2**40), "MAGE.k", str(2**40)),
    "MAGE softmax_over list": (lambda: MAGE(softmax_over=["prefix"]), "MAGE.softmax_over", "['prefix']"),
    "MAGE select_by": (lambda: MAGE(select_by="heap"), "MAGE.select_by", "'heap'"),
    "MAGE backend": (lambda: MAGE(backend="gpu"), "MAGE.backend", "'gpu'"),
    "PulseCol refreshes 1.5": (lambda: PulseCol(refreshes=1.5), "PulseCol.refreshes", "1.5"),
    "PulseCol refreshes bool": (lambda: PulseCol(refreshes=True), "PulseCol.refreshes", "True"),
    "PulseCol sparsity nan": (lambda: PulseCol(sparsity=NAN), "PulseCol.sparsity", "nan"),
    "PulseCol eta string": (lambda: PulseCol(eta="0.3"), "PulseCol.eta", "'0.3'"),
    "PulseCol eta inf": (lambda: PulseCol(eta=INF), "PulseCol.eta", "inf"),
    "PulseCol group_size float": (lambda: PulseCol(group_size=32.0), "PulseCol.group_size", "32.0"),
    "PulseCol total_steps 2.5": (lambda: PulseCol().bind(total_steps=2.5), "PulseCol.total_steps", "2.5"),
    "FlashBlock inner MAGE k 1.5": (lambda: FlashBlock(inner=MAGE(k=1.5)), "MAGE.k", "1.5"),
    "FlashBlock tau bool": (lambda: FlashBlock(tau=True), "FlashBlock.tau", "True"),
    "FlashBlock tau beyond int32": (lambda: FlashBlock(tau=2**40), "FlashBlock.tau", str(2**40)),
    "FlashBlock inner Dense": (lambda: FlashBlock(inner=Dense()), "FlashBlock.inner", "Dense"),
    "FlashBlock backend": (lambda: FlashBlock(backend=None), "FlashBlock.backend", "None"),
    "SparseD skip nan": (lambda: SparseD(skip=NAN), "SparseD.skip", "nan"),
    "SparseD select string": (lambda: SparseD(select="0.3"), "SparseD.select", "'0.3'"),
    "SparseD block_size float": (lambda: SparseD(block_size=64.0), "SparseD.block_size", "64.0"),
    "SparseD scale_quirk string": (lambda: SparseD(scale_quirk="no"), "SparseD.scale_quirk", "'no'"),
    "SparseD prefill_len negative": (lambda: SparseD().bind(total_steps=8, prompt_length=-3), "SparseD.prefill_len",
                                     "-3"),
    "SpargeAttn simthreshd1 string": (lambda: SpargeAttn(simthreshd1="0.5"), "SpargeAttn.simthreshd1", "'0.5'"),
    "SpargeAttn topk bool": (lambda: SpargeAttn(topk=True), "SpargeAttn.topk", "True"),
    "SpargeAttn pvthreshd ragged": (lambda: SpargeAttn(pvthreshd=[[1.0, 2.0], [3.0]]), "SpargeAttn.pvthreshd",
                                    "ragged"),
    "SpargeAttn simthreshd1 3-D": (lambda: SpargeAttn(simthreshd1=[[[0.1]]]), "SpargeAttn.simthreshd1", "(1, 1, 1)"),
    "SpargeAttn cdfthreshd empty": (lambda: SpargeAttn(cdfthreshd=[]), "SpargeAttn.cdfthreshd", "(0,)"),
    "SpargeAttn heads disagree": (lambda: SpargeAttn(simthreshd1=[0.1] * 4, cdfthreshd=[0.5] * 3), "heads",
                                  "cdfthreshd has shape [3]"),
    "SpargeAttn smooth_k string": (lambda: SpargeAttn(smooth_k="no"), "SpargeAttn.smooth_k", "'no'"),
    "SpargeAttn attention_sink int": (lambda: SpargeAttn(attention_sink=1), "SpargeAttn.attention_sink", "1"),
    "SpargeAttn block_kv float": (lambda: SpargeAttn(block_kv=128.0), "SpargeAttn.block_kv", "128.0"),
    "SpargeAttn skip nan": (lambda: SpargeAttn(skip=NAN), "SpargeAttn.skip", "nan"),
    "Dense backend list": (lambda: Dense(["xla"]), "Dense.backend", "['xla']"),
    "SparseD backend cudnn": (lambda: SparseD(backend="cudnn"), "SparseD.backend", "'cudnn'"),
}


@pytest.mark.parametrize("build, field, shown", BAD_CONFIGS.values(), ids=BAD_CONFIGS)
def test_bad_config_is_refused_at_construction(build, field, shown):
    with pytest.raises(ValueError) as refused:
        build()
    assert field in str(refused.value) and shown in str(refused.value), str(refused.value)


def test_valid_configs_construct_with_canonical_types():
    boundary = [MAGE(k=1, exact_layers=0, softmax_over="prefix+block", backend="reference"),
                PulseCol(sparsity=0.0, group_size=16, eta=1.0, refreshes=1).bind(total_steps=1),
                SparseD(skip=0.0, select=1.0, block_size=16, scale_quirk=True).bind(total_steps=1, prompt_length=0),
                FlashBlock(tau=None), FlashBlock(tau=0, inner=MAGE(k=4)), Dense("xla"),
                SpargeAttn(simthreshd1=[[-1.0] * 4] * 2, cdfthreshd=[0.0, 0.5, 1.0, 1.0], pvthreshd=None, skip=0.5,
                           block_q=16, block_kv=16, smooth_k=False, attention_sink=True)]
    for policy in boundary:
        assert dataclasses.replace(policy) == policy and hash(policy) == hash(dataclasses.replace(policy))
    for name in method_names():
        make_method(name)
    # numpy numbers are stored as Python ones: equal policies are one static argument of the loops
    mage = MAGE(k=np.int64(4), exact_layers=np.int32(1))
    assert type(mage.k) is int and type(mage.exact_layers) is int and mage == MAGE(k=4, exact_layers=1)
    sparsed = SparseD(select=np.float32(0.5), block_size=np.int64(32))
    assert type(sparsed.select) is float and type(sparsed.block_size) is int
    assert SpargeAttn(cdfthreshd=np.array([0.25, 0.5], np.float32)).cdfthreshd == (0.25, 0.5)
    assert SpargeAttn(simthreshd1=jnp.float32(0.5)).simthreshd1 == 0.5


def test_refresh_schedule_with_more_refreshes_than_steps_needs_no_loop_over_them():
    def formula(total, eta, refreshes):  # the paper's rule, as docs/methods.md states it
        window = max(1, int(eta * total))
        return tuple(sorted({1 + (r - 1) * (window - 1) // (refreshes - 1) for r in range(1, refreshes + 1)}))

    for total in (1, 2, 7, 16, 50):
        for eta in (0.1, 0.3, 1.0):
            for refreshes in (2, 3, 5, 16, 60):
                assert refresh_steps(total, eta, refreshes) == formula(total, eta, refreshes)
    assert refresh_steps(100, 0.3, 10**6) == tuple(range(1, 31))


# ---- the kernels' scale ----

def kernel_calls():
    """Every public kernel entry point with a `scale`, and its reference, on small valid inputs."""
    def array(x):  # a transfer, not a computation: nothing compiled before the call under test
        return jnp.asarray(np.asarray(x))

    q, q4 = array(np.ones((1, 32, 2, 16), np.float32)), array(np.ones((1, 4, 2, 16), np.float32))
    lse, lse4 = array(np.zeros((1, 2, 32), np.float32)), array(np.zeros((1, 2, 4), np.float32))
    blocks = (array(np.zeros((1, 2, 2, 1), np.int32)), array(np.ones((1, 2, 2), np.int32)))
    columns = blocks  # two query groups of 16, one listed column each
    rows = (array(np.zeros((1, 2, 1), np.int32)), array(np.ones((1, 2), np.int32)))
    sparge = dict(simthreshd1=0.0, topk=1.0, pvthreshd=None, block_q=16, block_kv=16)
    pairs = {
        "flash_attention": lambda f, s: f(q, q, q, scale=s),
        "flash_block_mass": lambda f, s: f(q, q, q, block_kv=16, scale=s),
        "block_sparse_attention": lambda f, s: f(q, q, q, *blocks, block_q=16, block_kv=16, scale=s),
        "block_scores": lambda f, s: f(q, q, lse, block_q=16, block_kv=16, scale=s),
        "column_scores": lambda f, s: f(q, q, lse, group_size=16, scale=s),
        "column_sparse_attention": lambda f, s: f(q, q, q, *columns, group_size=16, scale=s),
        "kv_scores": lambda f, s: f(q4, q, lse4, scale=s),
        "split_kv_attention": lambda f, s: f(q4, q, q, kv_len=8, scale=s),
        "split_kv_gather_attention": lambda f, s: f(q4, q, q, *rows, scale=s),
        "pv_skip_attention": lambda f, s: f(q, q, q, *blocks, pvthreshd=None, block_q=16, block_kv=16, scale=s),
        "sparge_attention": lambda f, s: f(q, q, q, scale=s, **sparge),
    }
    calls = {}
    for name, call in pairs.items():
        kernel, reference = getattr(pk, name), getattr(pk, f"{name}_reference")
        calls[name] = lambda s, call=call, kernel=kernel: call(lambda *a, **k: kernel(*a, interpret=True, **k), s)
        calls[f"{name}_reference"] = lambda s, call=call, reference=reference: call(reference, s)
    calls["predict_block_map"] = lambda s: pk.predict_block_map(q, q, scale=s, simthreshd1=0.0, topk=1.0, block_q=16,
                                                                block_kv=16)
    calls["dense_attention"] = lambda s: dense_attention(q, q, q, scale=s)
    return calls


KERNELS = kernel_calls()
BAD_SCALES = {"nan": NAN, "inf": INF, "-inf": -INF, "zero": 0.0, "negative": -1.0, "string": "0.25", "bool": True,
              "complex": 0.5j, "array": np.array([0.5])}


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS)
@pytest.mark.parametrize("scale", BAD_SCALES.values(), ids=BAD_SCALES)
def test_bad_scale_is_refused_before_compiling(kernel, scale):
    with no_compilation(), pytest.raises(ValueError) as refused:
        kernel(scale)
    message = str(refused.value)
    assert message.startswith("scale must be") and repr(scale) in message, message


def test_a_traced_scale_is_refused_and_a_concrete_one_runs():
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 8, 2, 16)), jnp.float32)
    with pytest.raises(ValueError, match="scale must be a concrete number"):
        jax.jit(lambda s: pk.flash_attention_reference(q, q, q, scale=s))(jnp.float32(0.25))
    default = np.asarray(pk.flash_attention_reference(q, q, q))  # 1/sqrt(16) = 0.25
    for scale in (0.25, np.float32(0.25), jnp.float32(0.25), np.array(0.25), 1 / 4):
        np.testing.assert_allclose(np.asarray(pk.flash_attention_reference(q, q, q, scale=scale)), default, rtol=1e-6)
    assert not np.allclose(np.asarray(pk.flash_attention_reference(q, q, q, scale=2.0)), default)


# ---- SpargeAttn calibration files ----

GOOD = {"simthreshd1": [[0.1, 0.2], [0.3, 0.4]], "cdfthreshd": [[0.5, 0.6], [0.7, 0.8]],
        "pvthreshd": [[10.0, 20.0], [30.0, 40.0]], "block_q": 32, "block_kv": 64, "smooth_k": True}

# (file contents: bytes, or an object written as JSON; the key the message must name, None for the file alone)
BAD_FILES = {
    "not UTF-8": (b"\xff\xfe\x00garbage", "JSON"),
    "not JSON": (b"{simthreshd1: 1", "JSON"),
    "JSON nested too deeply": (b"[" * 100_000 + b"]" * 100_000, "JSON"),
    "a list": ([GOOD], "JSON object"),
    "null": (None, "JSON object"),
    "a number": (5, "JSON object"),
    "missing key": ({k: v for k, v in GOOD.items() if k != "pvthreshd"}, "pvthreshd"),
    "string values": (GOOD | {"simthreshd1": [["0.1", "0.2"], ["0.3", "0.4"]]}, "simthreshd1"),
    "string value": (GOOD | {"pvthreshd": "50"}, "pvthreshd"),
    "object value": (GOOD | {"cdfthreshd": {"0": 0.5}}, "cdfthreshd"),
    "null cdfthreshd": (GOOD | {"cdfthreshd": None}, "cdfthreshd"),
    "smooth_k 'no'": (GOOD | {"smooth_k": "no"}, "smooth_k"),
    "smooth_k 0": (GOOD | {"smooth_k": 0}, "smooth_k"),
    "ragged rows": (GOOD | {"simthreshd1": [[0.1, 0.2], [0.3]]}, "simthreshd1"),
    "3-D values": (GOOD | {"pvthreshd": [[[10.0, 20.0]], [[30.0, 40.0]]]}, "pvthreshd"),
    "NaN": (GOOD | {"cdfthreshd": [[NAN, 0.6], [0.7, 0.8]]}, "cdfthreshd"),
    "Infinity": (GOOD | {"pvthreshd": [[INF, 20.0], [30.0, 40.0]]}, "pvthreshd"),
    "out of range": (GOOD | {"cdfthreshd": [[1.5, 0.6], [0.7, 0.8]]}, "cdfthreshd"),
    "heads disagree": (GOOD | {"cdfthreshd": [[0.5, 0.6, 0.7], [0.7, 0.8, 0.9]]}, "cdfthreshd"),
    "layers disagree": (GOOD | {"pvthreshd": [[10.0, 20.0]] * 3}, "pvthreshd"),
    "block_q string": (GOOD | {"block_q": "64"}, "block_q"),
    "block_kv not a power of two": (GOOD | {"block_kv": 48}, "block_kv"),
}


@pytest.mark.parametrize("contents, key", BAD_FILES.values(), ids=BAD_FILES)
def test_bad_calibration_file_is_refused_naming_it(tmp_path, contents, key):
    path = tmp_path / "calibration.json"
    if isinstance(contents, bytes):
        path.write_bytes(contents)
    else:
        path.write_text(json.dumps(contents))  # NaN and Infinity are written as Python's json allows
    with pytest.raises(ValueError) as refused:
        SpargeAttn.from_calibration(path)
    assert str(path) in str(refused.value) and key in str(refused.value), str(refused.value)


@pytest.mark.parametrize("path", ["missing.json", "."], ids=["missing", "a directory"])
def test_calibration_path_that_is_not_a_file_is_refused(tmp_path, path):
    with pytest.raises(ValueError, match="no SpargeAttn calibration file at"):
        SpargeAttn.from_calibration(tmp_path / path)
    with pytest.raises(ValueError, match="calibration file is a path, got None"):
        SpargeAttn.from_calibration(None)


def test_calibration_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    values = {name: rng.uniform(low, high, (3, 4)).astype(np.float32)
              for name, low, high in (("simthreshd1", -1, 1), ("cdfthreshd", 0, 1), ("pvthreshd", 0, 50))}
    path = tmp_path / "cal.json"
    save_calibration(path, Calibration(**values, sparsity=values["cdfthreshd"], l1=values["cdfthreshd"],
                                       settings=dict(block_q=32, block_kv=64, smooth_k=False, l1=0.05, pv_l1=0.06)))
    policy = SpargeAttn.from_calibration(path)
    for name, value in values.items():
        np.testing.assert_array_equal(np.asarray(getattr(policy, name), np.float32), value)
    assert (policy.block_q, policy.block_kv, policy.smooth_k, policy.topk) == (32, 64, False, None)
    assert hash(policy) == hash(SpargeAttn.from_calibration(path))
    overridden = make_method("sparge", calibration=str(path), pvthreshd=None, skip=0.25)
    assert overridden == dataclasses.replace(policy, pvthreshd=None, skip=0.25)
    with pytest.raises(ValueError, match="SpargeAttn.skip=1.0"):  # an override is named as itself
        SpargeAttn.from_calibration(path, skip=1.0)
