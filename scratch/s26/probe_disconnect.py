"""Probe: disconnect races and non-streaming hang-ups against the slot server (today's main)."""
import concurrent.futures, sys, time, threading, socket
from pathlib import Path
import httpx, numpy as np
import dllm_jax
from dllm_jax.serve.app import build_app, running
from dllm_jax.testing import tiny_sdar_config, write_hf_checkpoint, write_tiny_tokenizer
from dllm_jax.tokenizer import ChatTokenizer

root = Path("/tmp/s26probe"); root.mkdir(exist_ok=True)
sdar = root / "sdar"
if not (sdar / "config.json").exists():
    write_hf_checkpoint(sdar, tiny_sdar_config(vocab_size=160, mask_token_id=150, eos_token_ids=(141,), pad_token_id=141))
    write_tiny_tokenizer(sdar, 160, mask_token_id=150, eos_token_id=141)
model = dllm_jax.load_model(sdar, dtype="float32", progress=False)
tok = ChatTokenizer(sdar)
with running(build_app(model, tok, model_name="t", slots=4, max_context=512)) as url:
    body = dict(model="t", prompt=[5, 6, 7, 8], max_tokens=12)
    print(httpx.post(url + "/v1/completions", json=body, timeout=60).status_code)  # warm
    t0 = time.time()
    for round in range(int(sys.argv[1]) if len(sys.argv) > 1 else 20):
        def disconnect():
            with httpx.stream("POST", url + "/v1/completions", json=dict(body, max_tokens=200, stream=True), timeout=60) as s:
                next(s.iter_lines())
        def arrive():
            return httpx.post(url + "/v1/completions", json=dict(body, prompt=[5, 6, 7, 9]), timeout=60).status_code
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            fs = [pool.submit(disconnect), pool.submit(arrive), pool.submit(arrive)]
            codes = [f.result() for f in fs[1:]]
        h = httpx.get(url + "/health")
        if h.status_code != 200 or set(codes) != {200}:
            print("round", round, codes, h.status_code, h.text); break
    else:
        print("race ok", time.time() - t0)
    # non-streaming hang-up
    try:
        httpx.post(url + "/v1/completions", json=dict(body, max_tokens=400), timeout=0.5)
    except httpx.TimeoutException:
        pass
    time.sleep(1.5)
    print("after hangup", httpx.get(url + "/health").json())
    time.sleep(3)
    print("after hangup 4.5s", httpx.get(url + "/health").json())
    print([l for l in httpx.get(url + "/metrics").text.splitlines() if l.startswith("dllm_requests_total")])
