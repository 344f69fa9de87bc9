"""The wheel is complete: the shipped model configs are package data, so `shipped_config` works from an
installed copy, not only from the clone."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parent.parent


def build_wheel(tmp_path) -> Path:
    """Builds the wheel from a copy of the sources (the build writes build/ and *.egg-info next to them),
    offline, with the setuptools of this environment."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("dllm_jax", "pallas_kernels"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("dllm_jax-*.whl")
    return wheel


def test_the_wheel_ships_the_configs_and_shipped_config_reads_them_there(tmp_path):
    shipped = sorted(p.parent.name for p in (ROOT / "dllm_jax" / "configs").glob("*/config.json"))
    assert "llada-8b-instruct" in shipped and "sdar-8b-chat" in shipped
    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"dllm_jax/configs/{name}/config.json" for name in shipped} <= names
    # a pure-Python wheel installs by unpacking; import it from there, away from the clone
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    script = ("import dllm_jax, sys; from dllm_jax.config import shipped_config; "
              "print(dllm_jax.__file__); [print(type(shipped_config(n)).__name__) for n in sys.argv[1:]]")
    out = subprocess.run([sys.executable, "-c", script, *shipped], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu", "PATH": ""}, check=True).stdout.split()
    assert Path(out[0]).is_relative_to(site)
    assert out[1:] == [expected_class(name) for name in shipped]


def expected_class(name: str) -> str:
    """The config class of a shipped config directory, from its family prefix."""
    for prefix, cls in (("llada2", "LLaDA2Config"), ("llada", "LLaDAConfig"), ("dream", "DreamConfig")):
        if name.startswith(prefix):
            return cls
    return "SDARConfig"
