"""`dllm-jax serve`: the OpenAI-compatible HTTP server over the engine, through real HTTP (uvicorn on a local
socket). Greedy requests from 16 concurrent clients each get exactly what `generate` gives their prompt alone
(and a request with its own temperature, top-p and seed what `generate` gives it with them);
streamed deltas concatenate to the full text; the official `openai` client works; bad input gets 400 with
OpenAI's error object; a full queue 429; a client that disconnects frees its slot; SIGTERM finishes the running
requests, then the process exits. And what a hostile client tries: disconnects racing arrivals never stop the
engine, an API key is enforced, an oversized body gets 413 before it is read, text that is not Unicode gets 400,
and no error body carries a traceback or a server path."""

import asyncio
import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jax
import numpy as np
import openai
import pytest

import dllm_jax
from dllm_jax.serve.app import build_app, running
from dllm_jax.serve.engine import Engine
from dllm_jax.serve.lockstep import LockstepEngine
from dllm_jax.serve.worker import Job, Worker
from dllm_jax.testing import compile_events, tiny_llada2_config, write_hf_checkpoint, write_tiny_tokenizer
from dllm_jax.tokenizer import ChatTokenizer

NAME = "tiny"
MAX_CONTEXT = 96


@pytest.fixture(scope="module")
def sdar(checkpoints):
    path = checkpoints[1]
    return path, dllm_jax.load_model(path, dtype="float32", progress=False), ChatTokenizer(path)


@pytest.fixture(scope="module")
def url(sdar):
    """The SDAR server most tests share. One request per prefill: the tests that count compilations need the same
    insert programs whatever the arrival timing (a batched prefill's rows, 1, 2 or 4, depend on which requests
    one step admits; tests/test_serve_engine.py covers batched prefill)."""
    _, model, tokenizer = sdar
    with running(build_app(model, tokenizer, model_name=NAME, slots=4, max_context=MAX_CONTEXT,
                           prefill_batch=1)) as base:
        yield base


def alone(model, tokenizer, ids, max_tokens: int) -> tuple[str, int, str]:
    """(text, completion tokens, finish reason) of greedy `generate` on the prompt alone, as the server
    reports them: cut at max_tokens and after the first stop token."""
    out = np.asarray(dllm_jax.generate(model, np.asarray(ids)[None], max_new_tokens=max_tokens, top_k=1))[0]
    new = out[len(ids):][:max_tokens]
    stops = np.flatnonzero(np.isin(new, model.config.stop_ids))
    kept = new[:stops[0] + 1] if stops.size else new
    text = tokenizer.decode(kept, skip=(model.config.mask_token_id,))
    return text, len(kept), "stop" if stops.size else "length"


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, timeout=60, **kw)


def completions(url, prompts, max_tokens: int) -> list:
    """The replies of one concurrent client per prompt (POST /v1/completions, not streamed)."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: post(url, "/v1/completions", dict(model=NAME, prompt=p, max_tokens=max_tokens)),
                             prompts))


def events(response) -> list:
    """The JSON objects of a server-sent event stream, [DONE] checked and dropped."""
    lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


def test_concurrent_clients_each_get_what_generate_gives_their_prompt_alone(url, sdar, rng):
    _, model, tokenizer = sdar
    # 16 clients, 4 slots: requests queue, enter freed slots at different steps, leave at different blocks
    prompts = [rng.integers(3, 140, 6 if i % 2 else 9).tolist() for i in range(16)]
    replies = completions(url, prompts, 12)
    finishes = set()
    for prompt, reply in zip(prompts, replies):
        assert reply.status_code == 200, reply.text
        body = reply.json()
        text, tokens, finish = alone(model, tokenizer, prompt, 12)
        choice = body["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (text, finish), prompt
        assert body["usage"] == dict(prompt_tokens=len(prompt), completion_tokens=tokens,
                                     total_tokens=len(prompt) + tokens)
        assert body["object"] == "text_completion" and body["model"] == NAME
        finishes.add(finish)
    metrics = httpx.get(url + "/metrics").text
    assert "dllm_request_latency_seconds_count" in metrics and "dllm_time_to_first_block_seconds_bucket" in metrics


def test_with_overlapped_steps_clients_get_generate_alone_and_a_disconnect_frees_its_slot(sdar, rng):
    """build_app(overlap=True): steps run on the engine's dispatch thread while the worker streams the previous
    one; 8 clients over 4 slots each get what generate gives them alone, and a client that goes away mid-stream
    frees its slot (cancelled while a step runs)."""
    _, model, tokenizer = sdar
    with running(build_app(model, tokenizer, model_name=NAME, slots=4, max_context=512, overlap=True)) as url:
        prompts = [rng.integers(3, 140, 6 if i % 2 else 9).tolist() for i in range(8)]
        replies = completions(url, prompts, 12)
        for prompt, reply in zip(prompts, replies):
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == alone(model, tokenizer, prompt, 12)[::2], prompt
        long = dict(model=NAME, prompt=[5, 6, 7, 8], max_tokens=400, stream=True)
        with httpx.stream("POST", url + "/v1/completions", json=long, timeout=60) as streaming:
            next(streaming.iter_lines())
        wait_for(lambda: httpx.get(url + "/health").json()["active"] == 0, "the slot to be free")
        assert 'dllm_requests_total{outcome="cancelled"} 1.0' in httpx.get(url + "/metrics").text


def test_streamed_deltas_concatenate_to_the_full_text(url):
    for path, body in (("/v1/completions", dict(prompt="w5 w6 w7 w8 w9")),
                       ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "w5 w6 w7"}]))):
        body = dict(body, model=NAME, max_tokens=20)
        full = post(url, path, body).json()["choices"][0]
        with httpx.stream("POST", url + path, json=dict(body, stream=True, stream_options={"include_usage": True}),
                          timeout=60) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
            chunks = events(response)
        usage = chunks.pop()
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
        pieces = [c["choices"][0]["delta"]["content"] if "chat" in path else c["choices"][0]["text"] for c in chunks]
        whole = full["message"]["content"] if "chat" in path else full["text"]
        assert "".join(pieces) == whole
        assert sum(bool(p) for p in pieces) >= 2, pieces  # one delta per decoded block, not one at the end
        assert chunks[-1]["choices"][0]["finish_reason"] == full["finish_reason"]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_the_official_openai_client_works(url, sdar):
    _, model, tokenizer = sdar
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [NAME]
    # prompts of 6 and 9 tokens, 12 new ones: the programs the concurrency test compiled
    text = "w10 w11 w12 w13 w14 w15"
    reply = client.completions.create(model=NAME, prompt=text, max_tokens=12, temperature=0)
    ids = tokenizer.tokenizer.encode(text, add_special_tokens=True).ids
    assert reply.choices[0].text == alone(model, tokenizer, ids, 12)[0]
    messages = [{"role": "user", "content": "w20 w21 w22 w23"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12)
    ids = tokenizer.encode_messages(messages)
    assert chat.choices[0].message.content == alone(model, tokenizer, ids, 12)[0]
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
    # a request's own temperature, top-p, top-k (vLLM's extension, sent as extra_body) and seed: what generate
    # gives the prompt alone with them
    ids = tokenizer.tokenizer.encode(text, add_special_tokens=True).ids
    for own in (dict(temperature=0.7, top_p=0.9), dict(temperature=0.9, top_k=3)):
        extra = {"top_k": own["top_k"]} if "top_k" in own else None
        sampled = client.completions.create(model=NAME, prompt=text, max_tokens=12, seed=5,
                                            temperature=own["temperature"], top_p=own.get("top_p", 1.0),
                                            extra_body=extra)
        out = np.asarray(dllm_jax.generate(model, np.asarray(ids)[None], max_new_tokens=12, seed=5, **own))
        out = out[0][len(ids):][:12]
        stops = np.flatnonzero(np.isin(out, model.config.stop_ids))
        kept = out[:stops[0] + 1] if stops.size else out
        assert sampled.choices[0].text == tokenizer.decode(kept, skip=(model.config.mask_token_id,)), own
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=NAME, prompt="w1", max_tokens=4, temperature=2.5)


@pytest.mark.parametrize("body, status, message", [
    ("{not json", 400, "JSON"),
    (dict(prompt="w1", max_tokens=4, logit_bias={}), 400, "logit_bias"),  # an unknown field
    (dict(prompt="w1", max_tokens="4"), 400, "max_tokens"),  # mistyped: no string-to-int coercion
    (dict(prompt="w1", max_tokens=0), 400, "max_tokens"),
    (dict(prompt="w1", max_tokens=4, stream="yes"), 400, "stream"),
    (dict(prompt="w1", max_tokens=4, n=2), 400, "n"),
    (dict(prompt="w1", max_tokens=4, temperature=-0.5), 400, "temperature"),
    (dict(prompt="w1", max_tokens=4, top_p=-1), 400, "top_p"),
    (dict(prompt="w1", max_tokens=4, top_k=-1), 400, "top_k"),
    (dict(prompt="w1", max_tokens=4, top_k=2.5), 400, "top_k"),
    (dict(prompt="w1", max_tokens=4, top_k=65), 400, "top_k=65 exceeds the 64"),  # the engine's max_top_k
    (dict(prompt="w1", max_tokens=4, stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (dict(prompt="w1", max_tokens=4, seed=-3), 400, "seed"),
    (dict(prompt=["w1", "w2"], max_tokens=4), 400, "one prompt per request"),
    (dict(prompt=list(range(3, 93)), max_tokens=10), 400, "max_context=96"),  # prompt + answer > the context
    (dict(prompt=[3, 4, 150, 5, 6, 7], max_tokens=4), 400, "mask token id 150"),
    (dict(prompt=[3, 4, 999], max_tokens=4), 400, "vocab"),
    (dict(prompt="w1", max_tokens=4, model="gpt-4"), 404, "does not exist"),
])
def test_bad_requests_get_an_openai_error_object(url, body, status, message):
    if isinstance(body, str):
        reply = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    else:
        reply = post(url, "/v1/completions", dict(model=NAME) | body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert httpx.get(url + "/health").json()["status"] == "ok"  # the engine goes on


def test_bad_chat_requests_are_refused(url):
    for body, message in ((dict(messages=[]), "messages"),
                          (dict(messages=[{"role": "robot", "content": "x"}]), "role"),
                          (dict(messages=[{"role": "user", "content": "x"}], max_completion_tokens=0),
                           "max_completion")):
        reply = post(url, "/v1/chat/completions", dict(model=NAME) | body)
        assert reply.status_code == 400 and message in reply.json()["error"]["message"], reply.text


def wait_for(condition, what: str, seconds: float = 30):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_full_queue_answers_429_and_a_disconnected_client_frees_its_slot(sdar):
    _, model, tokenizer = sdar
    with running(build_app(model, tokenizer, model_name=NAME, slots=1, max_context=512, max_queue=1)) as url:
        # a burst of 8 ten-block requests for one slot and one place in the queue: the first finds the queue
        # empty and is answered; a request that finds a request waiting (not yet in the slot, or queued behind
        # it) gets 429, and with one slot the 8 of a burst of local requests cannot all arrive to an empty queue
        # (that would take 7 requests' ten block steps each)
        body = dict(model=NAME, prompt=[5, 6, 7, 8], max_tokens=40)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda _: post(url, "/v1/completions", body), range(8)))
        codes = sorted(r.status_code for r in replies)
        assert set(codes) == {200, 429}, codes
        assert all(r.json()["error"]["type"] == "rate_limit_error" for r in replies if r.status_code == 429)
        # a streaming client goes away after its first block of 125: its slot is freed, not decoded to the end
        long = dict(model=NAME, prompt=[5, 6, 7, 8], max_tokens=500, stream=True)
        with httpx.stream("POST", url + "/v1/completions", json=long, timeout=60) as streaming:
            next(streaming.iter_lines())
        wait_for(lambda: httpx.get(url + "/health").json()["active"] == 0, "the slot to be free")
        metrics = httpx.get(url + "/metrics").text
        assert 'dllm_requests_total{outcome="cancelled"} 1.0' in metrics
        assert 'dllm_requests_total{outcome="429"}' in metrics
        assert post(url, "/v1/completions", body).status_code == 200


def test_sigterm_finishes_the_running_requests_then_exits(checkpoints):
    """Also what it prints as it starts on every address (--host 0.0.0.0) and a port the kernel picks (--port 0):
    a warning that no API key guards it, then the port it really listens on."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    env.pop("DLLM_JAX_API_KEY", None)
    server = subprocess.Popen([sys.executable, "-m", "dllm_jax.cli", "serve", "--model", str(checkpoints[1]),
                               "--host", "0.0.0.0", "--port", "0", "--dtype", "float32", "--slots", "2",
                               "--max-context", "96", "--log-level", "warning"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        printed = []
        while not printed or not printed[-1].startswith("[dllm-jax serve:"):
            printed.append(server.stdout.readline())
            assert printed[-1], printed  # the server ended before its start-up line
        assert any("warning: listening on 0.0.0.0 (not a loopback address) with no API key" in line
                   for line in printed), printed
        assert any(re.search(r"memory: weights [\d.]+ GB, KV cache [\d.]+ GB \(2 slots x 96 positions\)", line)
                   for line in printed), printed
        port = int(re.search(r"on http://0\.0\.0\.0:(\d+)/v1", printed[-1]).group(1))
        assert port != 0
        url = f"http://127.0.0.1:{port}"

        def up():
            assert server.poll() is None, server.stdout.read()
            try:
                return httpx.get(url + "/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, "the server to start", 120)
        long = dict(model=checkpoints[1].name, prompt=[5, 6, 7, 8], max_tokens=80, stream=True)
        with httpx.stream("POST", url + "/v1/completions", json=long, timeout=120) as streaming:
            lines = streaming.iter_lines()
            next(lines)
            server.send_signal(signal.SIGTERM)
            chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")  # finished, not cut off
        # uvicorn raises the signal again once it has shut down, so the exit status says SIGTERM ended it
        assert server.wait(timeout=60) == -signal.SIGTERM
        assert "Traceback" not in server.stdout.read()
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health")
    finally:
        server.kill()
        server.wait()


@pytest.fixture(scope="module")
def llada2_checkpoint(tmp_path_factory):
    """A tiny random LLaDA2 with the word-level tokenizer (160 ids: mask 150, EOS 141, as the CLI's checkpoints)."""
    config = tiny_llada2_config(vocab_size=160, mask_token_id=150, eos_token_id=141, pad_token_id=141)
    path = write_hf_checkpoint(tmp_path_factory.mktemp("llada2"), config, seed=2)
    return write_tiny_tokenizer(path, 160, mask_token_id=150, eos_token_id=141)


LOCKSTEP = dict(gen_length=16, steps=16, block_length=16)  # LLaDA's answer region, fixed by the server


def test_llada_is_served_in_lockstep_and_each_request_gets_generate_alone(checkpoints, rng):
    """LLaDA is served in lockstep batches (the answer length fixed by the server): 6 concurrent greedy clients
    over batches of 3, prompts of two lengths (the batches mix them, left-padded with hidden pad keys), each
    equal to generate on its prompt alone; sampled requests (their own temperature and seed) generated alone."""
    path = checkpoints[0]
    model, tokenizer = dllm_jax.load_model(path, dtype="float32", progress=False), ChatTokenizer(path)
    with running(build_app(model, tokenizer, model_name=NAME, slots=3, max_context=96, **LOCKSTEP)) as url:
        prompts = [rng.integers(3, 140, 6 if i % 2 else 9).tolist() for i in range(6)]
        replies = completions(url, prompts, 12)
        for prompt, reply in zip(prompts, replies):
            assert reply.status_code == 200, reply.text
            out = np.asarray(dllm_jax.generate(model, np.asarray(prompt)[None], **LOCKSTEP))[0][len(prompt):][:12]
            stops = np.flatnonzero(np.isin(out, model.config.stop_ids))
            kept = out[:stops[0] + 1] if stops.size else out
            assert reply.json()["choices"][0]["text"] == tokenizer.decode(kept, skip=(model.config.mask_token_id,))
        too_long = post(url, "/v1/completions", dict(model=NAME, prompt=[5, 6], max_tokens=LOCKSTEP["gen_length"] + 1))
        assert too_long.status_code == 400 and "fixed by the server" in too_long.json()["error"]["message"]
        # requests with their own temperatures and seeds, concurrent with greedy ones: each is generated alone and
        # gets what generate gives it, with its own remasking rule too; LLaDA has no top_p
        own = [dict(temperature=0.5, seed=4), dict(temperature=1.2, seed=9), dict(temperature=0.0),
               dict(temperature=0.0, remasking="random", seed=5), dict(temperature=0.7, remasking="random", seed=2)]
        with concurrent.futures.ThreadPoolExecutor(len(own)) as pool:
            replies = list(pool.map(lambda o: post(url, "/v1/completions", dict(model=NAME, prompt=prompts[0],
                                                                               max_tokens=12, **o)), own))
        for values, reply in zip(own, replies):
            assert reply.status_code == 200, reply.text
            out = np.asarray(dllm_jax.generate(model, np.asarray(prompts[0])[None], **LOCKSTEP | values))
            out = out[0][len(prompts[0]):][:12]
            stops = np.flatnonzero(np.isin(out, model.config.stop_ids))
            kept = out[:stops[0] + 1] if stops.size else out
            assert reply.json()["choices"][0]["text"] == tokenizer.decode(kept, skip=(model.config.mask_token_id,))
        nucleus = post(url, "/v1/completions", dict(model=NAME, prompt=[5, 6], max_tokens=4, top_p=0.5))
        assert nucleus.status_code == 400 and "samples with temperature only" in nucleus.json()["error"]["message"]
        for wrong, says in ((dict(remasking="sequential"), "remasking must be one of"),
                            (dict(threshold=0.5), "decodes without a confidence threshold")):
            refused = post(url, "/v1/completions", dict(model=NAME, prompt=[5, 6], max_tokens=4, **wrong))
            assert refused.status_code == 400 and says in refused.json()["error"]["message"], refused.text


def test_llada2_requests_share_the_slots_and_each_gets_generate_alone(llada2_checkpoint, rng):
    """LLaDA2 runs in the slot engine (continuous batching, as SDAR): 6 concurrent clients over 3 slots, prompts
    and answers of several lengths, each equal to greedy generate on its prompt alone with that answer length; a
    length that would change LLaDA2's forwards per block is refused with 400."""
    path = llada2_checkpoint
    model, tokenizer = dllm_jax.load_model(path, dtype="float32", progress=False), ChatTokenizer(path)
    options = dict(block_length=8, steps=4)
    with running(build_app(model, tokenizer, model_name=NAME, slots=3, max_context=96, **options)) as url:
        # six (prompt, answer) length pairs over three answer lengths: generate compiles one program per answer
        # length (prompts share one bucket), ~3 s each here
        requests = [(rng.integers(3, 140, 6 if i % 2 else 9).tolist(), 8 + 4 * (i % 3)) for i in range(6)]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda r: post(url, "/v1/completions", dict(model=NAME, prompt=r[0],
                                                                                max_tokens=r[1])), requests))
        for (prompt, k), reply in zip(requests, replies):
            assert reply.status_code == 200, reply.text
            out = np.asarray(dllm_jax.generate(model, np.asarray(prompt)[None], gen_length=k, **options))[0]
            out = out[len(prompt):]
            assert reply.json()["choices"][0]["text"] == tokenizer.decode(out, skip=(model.config.mask_token_id,))
        short = post(url, "/v1/completions", dict(model=NAME, prompt=[5, 6], max_tokens=2))
        assert short.status_code == 400 and "forwards per block" in short.json()["error"]["message"]
        rule = post(url, "/v1/completions", dict(model=NAME, prompt=[5, 6], max_tokens=8, remasking="sequential"))
        assert rule.status_code == 400 and "no remasking rule" in rule.json()["error"]["message"]


def test_the_step_schedule_reaches_the_engine_and_defaults_to_forward(sdar):
    _, model, tokenizer = sdar
    built = {schedule: build_app(model, tokenizer, model_name=NAME, slots=2, max_context=64, schedule=schedule)
             for schedule in ("block", None)}
    assert {schedule: app.state.engine.schedule for schedule, app in built.items()} == {"block": "block",
                                                                                        None: "forward"}


FAST = dict(gen_length=16, steps=16, block_length=8, cache="dual", threshold=0.9)  # Fast-dLLM, as served


def test_llada_is_served_with_fast_dllm_and_each_request_gets_generate_alone(checkpoints, rng):
    """LLaDA served with the dual cache and a confidence threshold: greedy requests (the server's threshold, their
    own), a sampled one with its seed, each equal to generate with the server's options and the request's values;
    a request's factor needs a server decoding with the factor rule."""
    path = checkpoints[0]
    model, tokenizer = dllm_jax.load_model(path, dtype="float32", progress=False), ChatTokenizer(path)
    with running(build_app(model, tokenizer, model_name=NAME, slots=3, max_context=96, **FAST)) as url:
        prompts = [rng.integers(3, 140, 7 + i).tolist() for i in range(3)]
        own = [{}, dict(threshold=0.5), dict(temperature=0.6, seed=11)]
        with concurrent.futures.ThreadPoolExecutor(len(own)) as pool:
            replies = list(pool.map(lambda po: post(url, "/v1/completions", dict(model=NAME, prompt=po[0],
                                                                                max_tokens=16, **po[1])),
                                    zip(prompts, own)))
        for prompt, values, reply in zip(prompts, own, replies):
            assert reply.status_code == 200, reply.text
            out = np.asarray(dllm_jax.generate(model, np.asarray(prompt)[None], **FAST | values))[0][len(prompt):]
            stops = np.flatnonzero(np.isin(out, model.config.stop_ids))
            kept = out[:stops[0] + 1] if stops.size else out
            assert reply.json()["choices"][0]["text"] == tokenizer.decode(kept, skip=(model.config.mask_token_id,))
        refused = post(url, "/v1/completions", dict(model=NAME, prompt=[5, 6], max_tokens=4, factor=1.0))
        assert refused.status_code == 400
        assert "decodes without Fast-dLLM's factor rule" in refused.json()["error"]["message"]


@pytest.mark.parametrize("prefix_cache_bytes", [0, 1000])
def test_the_memory_plan_adds_up(sdar, prefix_cache_bytes):
    """Weights, the slots' rows, the staged long prompt's row, an insert's rows (prefill_batch of the bucket of a
    chunk and a block: the longest prompt an insert takes; a slot wide where the prefix cache keeps them)."""
    _, model, _ = sdar
    engine = Engine(model, slots=3, max_context=64, prefill_chunk=16, prefill_batch=2,
                    prefix_cache_bytes=prefix_cache_bytes)
    plan = engine.memory_plan()
    per_row = sum(leaf.nbytes for leaf in jax.tree.leaves(engine.state.carry.cache)) // 3
    assert plan["kv_cache"] == 3 * per_row and plan["prefix_cache"] == prefix_cache_bytes and plan["slot_state"] > 0
    assert plan["weights"] == sum(leaf.nbytes for leaf in jax.tree.leaves(model.params()))
    assert plan["staged_prompt"] == per_row and engine.width == 64
    assert plan["insert"] == 2 * per_row * (64 if prefix_cache_bytes else 16 + engine.block_length) // 64
    if plan["device"] is not None:
        assert plan["headroom"] == plan["device"] - sum(plan[k] for k in ("weights", "kv_cache", "slot_state",
                                                                          "prefix_cache", "staged_prompt", "insert"))


def test_a_prefix_cache_for_a_lockstep_family_is_refused_before_loading(checkpoints, capsys):
    from dllm_jax.cli import main

    assert main(["serve", "--model", str(checkpoints[0]), "--prefix-cache-mb", "16"]) == 2
    assert "--prefix-cache-mb applies to the slot engine's families; LLaDA is served in lockstep" in \
        capsys.readouterr().err


def test_the_serve_flags_set_the_familys_options():
    from dllm_jax.cli import build_parser
    from dllm_jax.cli.serve import family_options
    from dllm_jax.families import family_named

    def options(name, *argv):
        return family_options(build_parser().parse_args(["serve", "--model", "m", *argv]), family_named(name))

    assert options("llada") == dict(cache="dual")  # LLaDA serves with Fast-dLLM's dual cache unless told
    assert options("llada", "--cache", "none", "--gen-length", "32") == dict(cache=None, gen_length=32)
    assert options("llada", "--cache", "prefix", "--factor", "1.5") == dict(cache="prefix", factor=1.5)
    assert options("llada", "--threshold", "0.8") == dict(cache="dual", threshold=0.8)
    assert options("sdar", "--denoising-steps", "2") == dict(denoising_steps=2)
    with pytest.raises(ValueError, match=r"--cache, --threshold do not apply to SDAR \(its flags: --denoising-steps"):
        options("sdar", "--cache", "dual", "--threshold", "0.9")


def test_requests_sharing_a_system_prompt_reuse_its_blocks_through_the_prefix_cache(sdar, rng):
    """A server with a prefix cache: a first request fills it, then 4 concurrent clients whose prompts start with
    the same 16-token system prompt each get what generate gives their prompt alone; /metrics counts the prompt
    positions looked up and found."""
    _, model, tokenizer = sdar
    system = rng.integers(3, 140, 16).tolist()
    with running(build_app(model, tokenizer, model_name=NAME, slots=2, max_context=MAX_CONTEXT,
                           prefix_cache_bytes=2**28)) as base:
        prompts = [system + rng.integers(3, 140, 3 + i).tolist() for i in range(5)]
        replies = completions(base, prompts[:1], 8) + completions(base, prompts[1:], 8)
        for prompt, reply in zip(prompts, replies):
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == alone(model, tokenizer, prompt, 8)[0]
        metrics = httpx.get(base + "/metrics").text
    block = model.config.block_size
    looked_up = sum(len(p) - len(p) % block for p in prompts)
    assert f"dllm_prefix_cache_query_tokens_total {float(looked_up)}" in metrics
    found = float(re.search(r"^dllm_prefix_cache_hit_tokens_total (\S+)$", metrics, re.MULTILINE).group(1))
    assert found >= 4 * len(system)  # each later request found at least the system prompt's blocks


def test_every_family_has_its_serve_flags():
    from dllm_jax.cli.serve import FAMILY_FLAGS
    from dllm_jax.families import FAMILIES

    assert set(FAMILY_FLAGS) == {family.sampler for family in FAMILIES.values()}
    for family in FAMILIES.values():  # a slot engine's answer length is per request, never the server's
        assert ("--gen-length" in FAMILY_FLAGS[family.sampler]) == (family.slots is None)


def test_lockstep_serving_refuses_the_slot_engines_settings(checkpoints):
    model = dllm_jax.load_model(checkpoints[0], dtype="float32", progress=False)
    with pytest.raises(ValueError, match="unknown LLaDA generate options \\['top_p'\\]"):
        build_app(model, ChatTokenizer(checkpoints[0]), model_name=NAME, top_p=0.7, gen_length=16)
    for given in (dict(max_top_k=8), dict(schedule="block"), dict(prefix_cache_bytes=2**20), dict(prefill_batch=2)):
        with pytest.raises(ValueError, match="max_top_k, overlap, schedule, prefix_cache_bytes and prefill_batch are "):
            build_app(model, ChatTokenizer(checkpoints[0]), model_name=NAME, gen_length=16, **given)


# --- what a hostile client tries ---

@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_a_cancellation_in_the_turn_a_new_job_arrives_ends_only_that_request(family, checkpoints):
    """A client goes away in the moment another request arrives: the worker's next turn takes the new job and the
    running request's cancellation together. Tickets are told apart by identity (two jobs' numpy prompts have no truth value to
    compare by), so the cancelled request leaves, the new one is answered and the engine goes on; on the slot
    engine and on the lockstep engine alike."""
    model = dllm_jax.load_model(checkpoints[0 if family == "llada" else 1], dtype="float32", progress=False)
    engine = (LockstepEngine(model, slots=3, max_context=96, **LOCKSTEP) if family == "llada"
              else Engine(model, slots=4, max_context=96))
    worker = Worker(engine, lambda ids: " ".join(str(int(i)) for i in ids), max_queue=8)

    async def arrive_as_another_leaves():
        leaving = worker.submit(Job(np.array([5, 6, 7], np.int32), 8, 0))
        worker.turn()  # in the engine now
        arriving = worker.submit(Job(np.array([8, 9, 10, 11], np.int32), 8, 0))
        worker.cancel(leaving)
        while worker.turn() and (worker.tickets or worker.inbox):
            pass
        await asyncio.sleep(0)  # the events the engine thread (here: this one) handed to the loop
        return leaving.queue, arriving.queue

    leaving, arriving = asyncio.run(arrive_as_another_leaves())
    left = [leaving.get_nowait() for _ in range(leaving.qsize())]  # a lockstep batch answered it whole at once
    assert all(e.error is None for e in left) and sum(e.final for e in left) <= 1, left
    events = [arriving.get_nowait() for _ in range(arriving.qsize())]
    assert events[-1].finish_reason in ("stop", "length") and events[-1].error is None, events
    assert not engine.queue and engine.busy == 0


def test_disconnects_racing_arrivals_never_stop_the_engine(url):
    """50 rounds of a streaming client that leaves after its first event while two requests arrive: every
    arrival is answered and /health stays 200 after each round."""
    body = dict(model=NAME, prompt=[5, 6, 7, 8], max_tokens=12)

    def leave_early():
        with httpx.stream("POST", url + "/v1/completions", json=dict(body, max_tokens=60, stream=True),
                          timeout=60) as streaming:
            next(streaming.iter_lines())

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        for round_ in range(50):
            leaving = pool.submit(leave_early)
            arriving = [pool.submit(post, url, "/v1/completions", dict(body, prompt=[5, 6, 7, 8 + i]))
                        for i in range(2)]
            leaving.result()
            assert [a.result().status_code for a in arriving] == [200, 200], round_
            assert httpx.get(url + "/health").status_code == 200, round_


def test_a_non_streaming_client_that_hangs_up_is_cancelled_not_served(sdar):
    """A client that closes its connection while its (non-streamed) answer is decoded frees its slot and is
    counted as cancelled: no 200, no generated tokens. The engine sends an event every block, so the handler
    must look for the disconnect between events too, not only when none comes."""
    _, model, tokenizer = sdar
    with running(build_app(model, tokenizer, model_name=NAME, slots=1, max_context=512)) as url:
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps(dict(model=NAME, prompt=[5, 6, 7, 8], max_tokens=480)).encode()
        client = socket.create_connection((host, int(port)))
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                       b"content-length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: httpx.get(url + "/health").json()["active"] == 1, "the request to take the slot")
        client.close()
        wait_for(lambda: httpx.get(url + "/health").json()["active"] == 0, "the slot to be free")
        metrics = httpx.get(url + "/metrics").text
        assert 'dllm_requests_total{outcome="cancelled"} 1.0' in metrics, metrics
        assert 'outcome="200"' not in metrics and "dllm_generated_tokens_total 0.0" in metrics


def test_an_api_key_guards_v1_and_a_body_past_the_limit_gets_413_unread(sdar):
    """With api_key set, /v1 requests without `Authorization: Bearer <key>` get 401 in OpenAI's error format
    (the official client with the key works); /health and /metrics stay open. A body past max_request_bytes
    gets 413: by its Content-Length, or, chunked, once the bytes received pass the limit."""
    _, model, tokenizer = sdar
    app = build_app(model, tokenizer, model_name=NAME, slots=4, max_context=96, api_key="s3cret",
                    max_request_bytes=4096)
    with running(app) as url:
        body = dict(model=NAME, prompt=[5, 6, 7, 8, 9, 10], max_tokens=12)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            refused = post(url, "/v1/completions", body, headers=headers)
            assert refused.status_code == 401, (headers, refused.text)
            assert refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models").status_code == 401
        key = {"Authorization": "Bearer s3cret"}
        assert post(url, "/v1/completions", body, headers=key).status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in client.models.list().data] == [NAME]
        assert httpx.get(url + "/health").json()["status"] == "ok"
        big = dict(body, prompt="w5 " * 2000)  # 6,000 bytes of prompt
        sized = post(url, "/v1/completions", big, headers=key)
        assert sized.status_code == 413 and "limit of 4,096 bytes" in sized.json()["error"]["message"]
        chunked = httpx.post(url + "/v1/completions", content=iter([json.dumps(big).encode()[i:i + 1000]
                                                                   for i in range(0, 7000, 1000)]),
                             headers=key | {"content-type": "application/json"}, timeout=60)
        assert chunked.status_code == 413 and "limit of 4,096 bytes" in chunked.json()["error"]["message"]
        metrics = httpx.get(url + "/metrics").text
        assert 'dllm_requests_total{outcome="401"} 4.0' in metrics and 'outcome="413"} 2.0' in metrics
        assert post(url, "/v1/completions", body, headers=key).status_code == 200  # the engine goes on


def test_text_that_is_not_unicode_and_unknown_paths_get_openai_errors(url):
    """A lone surrogate (JSON's "\\ud800") in a prompt or a message: 400, not a plain-text 500 with a traceback;
    an unknown path 404 and a wrong method 405, each as OpenAI's error object."""
    for path, text in (("/v1/completions", '{"model": "tiny", "prompt": "w5 \\ud800", "max_tokens": 4}'),
                       ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": '
                                                '"w5 \\udcff w6"}], "max_tokens": 4}')):
        reply = httpx.post(url + path, content=text, headers={"content-type": "application/json"})
        assert reply.status_code == 400, reply.text
        assert "not valid UTF-8 text" in reply.json()["error"]["message"]
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
        reply = httpx.request(method, url + path)
        assert reply.status_code == status and reply.json()["error"]["message"].endswith(f"{method} {path}")
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_a_failing_chat_template_is_reported_without_the_servers_paths(sdar, tmp_path):
    """The checkpoint's template refuses the conversation (transformers' `raise_exception`): 400 naming the file
    as the checkpoint names it, never the server's directory."""
    path, model, _ = sdar
    served = tmp_path / "served-checkpoint"
    served.mkdir()
    write_tiny_tokenizer(served, 160, mask_token_id=150, eos_token_id=141,
                         chat_template="{{ raise_exception('system messages are not supported') }}")
    with running(build_app(model, ChatTokenizer(served), model_name=NAME, slots=4, max_context=96)) as url:
        reply = post(url, "/v1/chat/completions", dict(model=NAME, messages=[{"role": "user", "content": "w5"}]))
        message = reply.json()["error"]["message"]
        assert reply.status_code == 400 and "system messages are not supported" in message, message
        assert str(tmp_path) not in message and "tokenizer_config.json" in message


def test_completion_tokens_end_with_the_token_that_completes_a_stop_string(url, sdar):
    """`usage.completion_tokens` counts the answer's tokens up to the one that completes the stop string (as
    vLLM counts), not the decoded block's tokens past the cut."""
    _, model, tokenizer = sdar
    prompt = [5, 6, 7, 8, 9, 10]
    out = np.asarray(dllm_jax.generate(model, np.asarray(prompt)[None], max_new_tokens=12, top_k=1))[0][6:]
    words = [tokenizer.decode([t], skip=(model.config.mask_token_id,)) for t in out]
    at = next(i for i in range(3, 12) if words[i] and all(words[i] not in w for w in words[:i]))
    reply = post(url, "/v1/completions", dict(model=NAME, prompt=prompt, max_tokens=12, stop=[words[at]])).json()
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] == at + 1, (words, at, reply)


def test_a_huge_prompt_is_tokenized_off_the_event_loop_and_refused_by_its_length(url):
    """A 3 MB text prompt (under the 4 MiB body limit, far past the context): /health answers while it is
    tokenized (on a thread, not the event loop), and it is refused with 400 for its token count, before any
    engine work."""
    huge = dict(model=NAME, prompt="w5 w6 w7 " * 350_000, max_tokens=4)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, url, "/v1/completions", huge)
        answered_meanwhile = 0
        while not pending.done():
            answered_meanwhile += httpx.get(url + "/health", timeout=60).status_code == 200
        reply = pending.result()
    assert reply.status_code == 400 and "1050000 tokens, longer than" in reply.json()["error"]["message"], reply.text
    assert answered_meanwhile >= 1


def test_a_port_in_use_is_refused_before_the_weights_load(checkpoints, tmp_path, capsys):
    """One line naming the port, exit 2; the checkpoint here has no weights, so reaching the load would fail on
    them instead."""
    from dllm_jax.cli import main

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((checkpoints[1] / name).read_bytes())
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main(["serve", "--model", str(tmp_path), "--port", str(port)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1 port {port}" in lines[0], lines


def test_the_api_key_comes_from_the_flag_else_the_environment():
    from dllm_jax.cli import build_parser
    from dllm_jax.cli.serve import api_key_of

    def key(argv, environ):
        return api_key_of(build_parser().parse_args(["serve", "--model", "m", *argv]), environ)

    assert key([], {}) is None and key([], {"DLLM_JAX_API_KEY": ""}) is None
    assert key([], {"DLLM_JAX_API_KEY": "from-env"}) == "from-env"
    assert key(["--api-key", "flag"], {"DLLM_JAX_API_KEY": "from-env"}) == "flag"
    with pytest.raises(ValueError, match="printable"):
        key(["--api-key", "bad\nkey"], {})


def test_an_unexpected_failure_is_a_500_error_object_without_details(sdar):
    """A failure nobody anticipated (here the tokenizer raising a RuntimeError that names a server path) gets 500
    as OpenAI's error object, never a plain-text page or the exception's text; the engine goes on."""
    path, model, tokenizer = sdar

    class Failing(ChatTokenizer):
        def encode(self, text, *, chat=True):
            raise RuntimeError("/srv/secret/tokenizer.json exploded")

    with running(build_app(model, Failing(path), model_name=NAME, slots=4, max_context=96)) as url:
        reply = post(url, "/v1/completions", dict(model=NAME, prompt="w5 w6", max_tokens=4))
        assert reply.status_code == 500 and reply.headers["content-type"] == "application/json", reply.text
        assert reply.json()["error"]["type"] == "server_error" and "/srv" not in reply.text
        assert post(url, "/v1/completions", dict(model=NAME, prompt=[5, 6, 7, 8, 9, 10], max_tokens=12)).status_code == 200


def test_requests_with_their_own_temperatures_thresholds_and_rules_share_a_step_without_compiling(url, sdar):
    """After one warm-up request, five requests with different temperatures, confidence thresholds and remasking
    rules (this server's `threshold` and `remasking` extension fields) run in the same steps without a new
    compilation (counted), each getting what `generate` gives its prompt alone with those values (the threshold
    decides how many tokens a step of SDAR's low_confidence_dynamic remasking commits)."""
    _, model, tokenizer = sdar
    prompt = [5, 6, 7, 8, 9, 10]

    def concurrently(values: list[dict]) -> list:
        with concurrent.futures.ThreadPoolExecutor(len(values)) as pool:
            return list(pool.map(lambda o: post(url, "/v1/completions", dict(model=NAME, prompt=prompt, seed=7,
                                                                            max_tokens=12, **o)), values))

    # the warm-up: the same traffic at other values (the host's own small programs compile once here too)
    assert {r.status_code for r in concurrently([dict(temperature=0.6, threshold=0.2)] * 4)} == {200}
    own = [dict(temperature=0.8, threshold=0.3), dict(temperature=0.8, threshold=0.95), dict(temperature=1.1),
           dict(temperature=0.5, threshold=0.6, remasking="sequential"),
           dict(temperature=0.9, remasking="low_confidence_static")]
    with compile_events() as events:
        replies = concurrently(own)
    assert events == [], events
    for values, reply in zip(own, replies):
        assert reply.status_code == 200, reply.text
        options = dict(temperature=values["temperature"], remasking=values.get("remasking", "low_confidence_dynamic"))
        options |= {"confidence_threshold": values["threshold"]} if "threshold" in values else {}
        out = np.asarray(dllm_jax.generate(model, np.asarray(prompt)[None], max_new_tokens=12, seed=7, **options))
        out = out[0][len(prompt):][:12]
        stops = np.flatnonzero(np.isin(out, model.config.stop_ids))
        kept = out[:stops[0] + 1] if stops.size else out
        assert reply.json()["choices"][0]["text"] == tokenizer.decode(kept, skip=(model.config.mask_token_id,)), values
    factor = post(url, "/v1/completions", dict(model=NAME, prompt=prompt, max_tokens=4, factor=1.0))
    assert factor.status_code == 400 and "factor rule is LLaDA's" in factor.json()["error"]["message"]


def test_requests_with_their_own_stop_token_ids_end_there_and_share_a_step(url, sdar):
    """`stop_token_ids` (vLLM's extension field): each of three concurrent requests ends its answer at the first of
    its own stop ids (besides the model's), finish_reason "stop", with the text and usage `generate` gives its
    prompt alone cut there; requests with different stop ids share the step without a new compilation; more ids
    than a request may set, or an id outside the vocabulary, is a 400."""
    _, model, tokenizer = sdar
    prompt = [5, 6, 7, 8, 9, 10]
    out = np.asarray(dllm_jax.generate(model, np.asarray(prompt)[None], max_new_tokens=12, top_k=1))[0][len(prompt):]
    out = out[:12]
    model_stop = np.flatnonzero(np.isin(out, model.config.stop_ids))
    out = out[:model_stop[0] + 1] if model_stop.size else out
    assert len(out) >= 4, out  # the model's own answer runs long enough to cut
    own = [[int(out[1])], [int(out[3]), 7777 % model.config.vocab_size], []]
    post(url, "/v1/completions", dict(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stop_token_ids=[3]))
    with compile_events() as events, concurrent.futures.ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda ids: post(url, "/v1/completions", dict(
            model=NAME, prompt=prompt, max_tokens=12, temperature=0, stop_token_ids=ids)), own))
    assert events == [], events
    for ids, reply in zip(own, replies):
        assert reply.status_code == 200, reply.text
        hits = np.flatnonzero(np.isin(out, ids))
        kept = out[:hits[0] + 1] if hits.size else out
        choice = reply.json()["choices"][0]
        assert choice["text"] == tokenizer.decode(kept, skip=(model.config.mask_token_id,)), ids
        assert reply.json()["usage"]["completion_tokens"] == len(kept)
        assert choice["finish_reason"] == ("stop" if hits.size or model_stop.size else "length")
    for wrong, says in (([1] * 9, "at most 8"), ([model.config.vocab_size], "stop_ids")):
        refused = post(url, "/v1/completions", dict(model=NAME, prompt=prompt, max_tokens=4, stop_token_ids=wrong))
        assert refused.status_code == 400 and says in refused.json()["error"]["message"], refused.text
