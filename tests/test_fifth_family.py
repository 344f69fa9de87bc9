"""A family added from outside the package: a module of its own holding a config subclass, a model class and one
registry entry (`dllm_jax.families.register`), and nothing else, is converted, loaded, generated from, run on the
command line and served. The module and the run live in a process of their own, so the registry of this one stays
as the package defines it."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from dllm_jax.testing import user_environment

# the new family: LLaDA's architecture and sampler under a name, HF model type and classes of its own
FAMILY_MODULE = '''
import dataclasses

from dllm_jax import families
from dllm_jax.config import LLaDAConfig
from dllm_jax.models.llada import LLaDA


class ToyConfig(LLaDAConfig):
    family = "toy"
    MODEL_TYPES = ("toy_llada",)
    ARCHITECTURES = ("ToyLLaDAModelLM",)


class Toy(LLaDA):
    pass


FAMILY = families.register(dataclasses.replace(families.family_named("llada"), name="toy", config_class=ToyConfig,
                                               model_class=Toy))
'''

RUN = '''
import contextlib, io, json, sys
from pathlib import Path

import httpx
import numpy as np

import toy_family
import dllm_jax
from dllm_jax.cli import main
from dllm_jax.families import family_named, family_of
from dllm_jax.serve.app import build_app, running
from dllm_jax.testing import tiny_llada_config, write_hf_checkpoint, write_tiny_tokenizer
from dllm_jax.tokenizer import ChatTokenizer

root = Path(sys.argv[1])
fields = {k: v for k, v in vars(tiny_llada_config(num_layers=1, mask_token_id=150, eos_token_id=141,
                                                  pad_token_id=141)).items()}
config = toy_family.ToyConfig(**fields)
hf = write_hf_checkpoint(root / "hf", config, seed=3)
write_tiny_tokenizer(hf, 160, mask_token_id=150, eos_token_id=141)
dllm_jax.convert_hf_checkpoint(hf, root / "out", progress=False)
model = dllm_jax.load_model(root / "out", dtype="float32", progress=False)
options = dict(gen_length=16, steps=16, block_length=16)
prompt = np.arange(5, 13, dtype=np.int32)[None]
alone = np.asarray(dllm_jax.generate(model, prompt, **options))[0, 8:]
err = io.StringIO()
with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    cli = main(["generate", "--model", str(root / "out"), "--prompt", "w5 w6 w7", "--gen-length", "16",
                "--steps", "4", "--dtype", "float32"])
serve_err = io.StringIO()
with contextlib.redirect_stderr(serve_err):  # the server's flags follow the family's sampler (refused before loading)
    refused = main(["serve", "--model", str(root / "out"), "--denoising-steps", "2"])
tokenizer = ChatTokenizer(root / "out")
with running(build_app(model, tokenizer, model_name="toy", slots=2, max_context=64, **options)) as url:
    reply = httpx.post(url + "/v1/completions", json=dict(model="toy", prompt=prompt[0].tolist(), max_tokens=16),
                       timeout=120)
stops = np.flatnonzero(np.isin(alone, model.config.stop_ids))
kept = alone[:stops[0] + 1] if stops.size else alone
print(json.dumps(dict(
    hf_model_type=json.loads((hf / "config.json").read_text())["model_type"],
    family=family_of(model).name, label=family_named("toy").label, model=type(model).__name__,
    config_round_trip=model.config == config, cli=cli, cli_label="[Toy: " in err.getvalue(), serve_refused=refused,
    serve_message=serve_err.getvalue(),
    answer=alone.tolist(), status=reply.status_code,
    served=reply.json()["choices"][0]["text"] if reply.status_code == 200 else reply.text,
    expected=tokenizer.decode(kept, skip=(model.config.mask_token_id,)))))
'''


def test_a_family_from_its_own_module_converts_loads_generates_and_is_served(tmp_path):
    (tmp_path / "toy_family.py").write_text(textwrap.dedent(FAMILY_MODULE))
    env = user_environment(__import__("os").environ)
    env["PYTHONPATH"] = f"{tmp_path}:{Path(__file__).resolve().parents[1]}:{env.get('PYTHONPATH', '')}"
    done = subprocess.run([sys.executable, "-c", RUN, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["hf_model_type"] == "toy_llada"  # its own HF name, read back as its own family
    assert (result["family"], result["label"], result["model"]) == ("toy", "Toy", "Toy")
    assert result["config_round_trip"]
    assert len(result["answer"]) == 16 and all(0 <= t < 160 for t in result["answer"])
    assert result["cli"] == 0 and result["cli_label"]
    assert result["serve_refused"] != 0
    assert "--denoising-steps does not apply to Toy (its flags: --gen-length, --steps, --block-length, --cache" in \
        result["serve_message"]
    assert result["status"] == 200 and result["served"] == result["expected"]
