"""Issue 41: where a slot-engine step's GPU time goes against one block of lockstep generate (SDAR-8B, random bf16,
16 slots / rows, prompts 512-2048, stops off)."""
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax import generate
from dllm_jax.bench import kernel_profile
from dllm_jax.bench.models import model_for
from dllm_jax.serve import Engine

OUT = Path(sys.argv[1])
TRACES = Path(sys.argv[3]) if len(sys.argv) > 3 else OUT
model, config = model_for(sys.argv[2] if len(sys.argv) > 2 else "sdar-8b-chat", layers=None, context=2624, dtype=jnp.bfloat16)
rng = np.random.default_rng(0)
lengths = np.exp(rng.uniform(np.log(512), np.log(2048), 16)).astype(int)
prompts = [rng.integers(3, config.mask_token_id, n).astype(np.int32) for n in lengths]


def table(title, prof):
    if prof is None:
        return print(title, "no GPU kernels")
    print(f"\n{title}: {prof['gpu_ms']:.2f} ms of GPU kernels in {prof['launches']} launches")
    for k in prof["kernels"][:16]:
        print(f"  {k['ms']:8.2f} ms {k['launches']:5d}  {k['name']}")


engine = Engine(model, slots=16, max_context=2560, overlap=False)
for i, p in enumerate(prompts):
    engine.submit(p, max_new_tokens=512, seed=i, temperature=0.0)
t = time.perf_counter(); engine.step(); jax.block_until_ready(engine.state); print(f"engine first step {time.perf_counter() - t:.1f} s")
for _ in range(3):
    engine.step()
jax.block_until_ready(engine.state)
n = 20
t = time.perf_counter()
for _ in range(n):
    engine.step()
jax.block_until_ready(engine.state)
step_ms = (time.perf_counter() - t) / n * 1e3
print(f"engine step: {step_ms:.2f} ms (16 busy slots)")
table("engine step", kernel_profile(lambda: jax.block_until_ready(engine.step() or engine.state), TRACES / "t_engine", top=16))
# the step's own program alone, without the engine's host work
state = engine.state
engine_state = [state]
def raw():
    s, snap = engine.dispatch(engine_state.pop())
    engine_state.append(s)
    return snap
jax.block_until_ready(raw())
t = time.perf_counter()
for _ in range(n):
    snap = raw()
jax.block_until_ready(snap)
print(f"raw step: {(time.perf_counter() - t) / n * 1e3:.2f} ms")
engine.state = engine_state.pop()
del engine, state, engine_state

# lockstep: 16 rows left-padded to 2048, per block from two answer lengths
width = 2048
ids = np.zeros((16, width), np.int32); mask = np.zeros((16, width), np.int32)
for r, p in enumerate(prompts):
    ids[r, width - len(p):] = p; mask[r, width - len(p):] = 1
times = {}
for new in (16, 80):
    run = lambda: jax.block_until_ready(generate(model, ids, attention_mask=mask, max_new_tokens=new, top_k=1))
    t = time.perf_counter(); run(); print(f"lockstep new={new} first call {time.perf_counter() - t:.1f} s")
    ts = []
    for _ in range(3):
        t = time.perf_counter(); run(); ts.append(time.perf_counter() - t)
    times[new] = min(ts)
    print(f"lockstep new={new}: {times[new] * 1e3:.1f} ms")
print(f"lockstep per block: {(times[80] - times[16]) / 16 * 1e3:.2f} ms")
table("lockstep generate new=16 (prefill + 4 blocks)", kernel_profile(
    lambda: jax.block_until_ready(generate(model, ids, attention_mask=mask, max_new_tokens=16, top_k=1)), TRACES / "t_l16", top=16))
table("lockstep generate new=80 (prefill + 20 blocks)", kernel_profile(
    lambda: jax.block_until_ready(generate(model, ids, attention_mask=mask, max_new_tokens=80, top_k=1)), TRACES / "t_l80", top=16))
print(f"\nSUMMARY engine step {step_ms:.2f} ms; lockstep block {(times[80] - times[16]) / 16 * 1e3:.2f} ms")
