"""One process of a two-process `jax.distributed` run on this machine (localhost coordinator, two CPU
devices each): greedy fp32 generation with LLaDA and SDAR on a tp=2 x dp=2 mesh over both processes'
devices. tests/test_sharding.py starts two of these and compares what they write with one process:
python tests/multihost_generation.py PORT PROCESS_ID CHECKPOINT_ROOT OUT.json"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dllm_jax import generate, load_model  # noqa: E402
from dllm_jax.sharding import make_mesh  # noqa: E402

OPTIONS = {"llada": dict(gen_length=16, steps=8, block_length=8), "sdar": dict(max_new_tokens=8)}


def prompts() -> dict:
    rng = np.random.default_rng(0)
    return {family: rng.integers(3, 100, (4, 16)).astype(np.int32) for family in OPTIONS}


def main(port: int, process_id: int, root: Path, out: Path) -> None:
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id)
    mesh = make_mesh("tp=2,dp=2")
    result = dict(processes=jax.process_count(), devices=jax.device_count(), local_devices=jax.local_device_count())
    for family, prompt in prompts().items():
        model = load_model(root / family, dtype="float32", progress=False, mesh=mesh)
        result[family] = generate(model, prompt, **OPTIONS[family]).tolist()
    out.write_text(json.dumps(result))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
