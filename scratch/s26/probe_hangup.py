import time, httpx
from pathlib import Path
import dllm_jax
from dllm_jax.serve.app import build_app, running
from dllm_jax.tokenizer import ChatTokenizer
sdar = Path("/tmp/s26probe/sdar")
model = dllm_jax.load_model(sdar, dtype="float32", progress=False); tok = ChatTokenizer(sdar)
with running(build_app(model, tok, model_name="t", slots=1, max_context=512)) as url:
    body = dict(model="t", prompt=[5, 6, 7, 8], max_tokens=500)
    t0 = time.time()
    try:
        httpx.post(url + "/v1/completions", json=body, timeout=1.0)
    except httpx.TimeoutException:
        pass
    for _ in range(30):
        h = httpx.get(url + "/health").json()
        print(round(time.time() - t0, 2), h["active"]); 
        if not h["active"]: break
        time.sleep(0.5)
    print([l for l in httpx.get(url + "/metrics").text.splitlines() if l.startswith("dllm_requests_total")])
