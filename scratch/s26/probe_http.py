import time, httpx, json
from pathlib import Path
import dllm_jax
from dllm_jax.serve.app import build_app, running
from dllm_jax.tokenizer import ChatTokenizer
sdar = Path("/tmp/s26probe/sdar")
model = dllm_jax.load_model(sdar, dtype="float32", progress=False); tok = ChatTokenizer(sdar)
with running(build_app(model, tok, model_name="t", slots=2, max_context=96, api_key="sekrit", max_request_bytes=1000)) as url:
    H = {"Authorization": "Bearer sekrit"}
    print(httpx.post(url + "/v1/completions", json=dict(model="t", prompt="w5", max_tokens=4)).text)
    print(httpx.post(url + "/v1/completions", json=dict(model="t", prompt="w5", max_tokens=4), headers={"Authorization": "Bearer x"}).status_code)
    print(httpx.post(url + "/v1/completions", json=dict(model="t", prompt="w5", max_tokens=4), headers=H).status_code)
    print(httpx.get(url + "/health").status_code, httpx.get(url + "/metrics").status_code)
    print(httpx.post(url + "/v1/completions", json=dict(model="t", prompt="w5 " * 1000, max_tokens=4), headers=H).text)
    def chunks():
        for _ in range(100): yield b"x" * 100
    print(httpx.post(url + "/v1/completions", content=chunks(), headers=H).text)
    print(httpx.post(url + "/v1/completions", content=b'{"model": "t", "prompt": "w5 \\ud800", "max_tokens": 4}', headers=H | {"content-type": "application/json"}).text)
    print(httpx.post(url + "/v1/chat/completions", content=b'{"model": "t", "messages": [{"role": "user", "content": "w5 \\ud800"}], "max_tokens": 4}', headers=H | {"content-type": "application/json"}).text)
    print(httpx.get(url + "/v1/nothing", headers=H).text, httpx.get(url + "/v1/completions", headers=H).text)
    print(httpx.get(url + "/nothing").text)
    print(httpx.post(url + "/v1/completions", json=dict(model="t", prompt="w5 w6 w7 w8", max_tokens=20, stop=["w"]), headers=H).text)
    print([l for l in httpx.get(url + "/metrics").text.splitlines() if l.startswith("dllm_requests_total")])
