"""`dllm-jax serve`: an OpenAI-compatible HTTP server over the continuous-batching engine (SDAR, LLaDA2)."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import socket
import sys
from pathlib import Path

from dllm_jax.cli.common import add_quantize_flag, dtype_parent
from dllm_jax.cli.methods import methods_parent
from dllm_jax.cli.sampling import add_fast_dllm_flags
from dllm_jax.flags import fraction, non_negative_int, number, positive_int

API_KEY_VARIABLE = "DLLM_JAX_API_KEY"  # the environment variable --api-key defaults to (kept out of `ps` listings)
MAX_REQUEST_BYTES = 4 * 2**20  # dllm_jax.serve.app's default, repeated here so that --help needs no FastAPI
temperature_flag = number(float, "a number in [0, 2]", lambda v: 0 <= v <= 2)
# the sampling flags (-> the generate option each sets) and those that apply to each sampler (`Family.sampler`;
# "--gen-length" sets the family's answer option: the lockstep families decode one answer length for every request)
FLAGS = {"--denoising-steps": "denoising_steps", "--remasking": "remasking", "--gen-length": "gen_length",
         "--steps": "steps", "--block-length": "block_length", "--cache": "cache", "--threshold": "threshold",
         "--factor": "factor", "--kv-cache-dtype": "kv_cache_dtype"}
FAMILY_FLAGS = {"SDAR": ("--denoising-steps", "--remasking", "--kv-cache-dtype"),
                "LLaDA2": ("--steps", "--block-length", "--kv-cache-dtype"),
                "LLaDA": ("--gen-length", "--steps", "--block-length", "--cache", "--threshold", "--factor"),
                "Dream": ("--gen-length", "--steps"), "DiffusionGemma": ("--gen-length", "--steps")}
# where a flag sets an option of another name for a sampler: DiffusionGemma's steps are transformers'
# max_denoising_steps
OPTION_NAMES = {("DiffusionGemma", "--steps"): "max_denoising_steps"}
# where the server departs from the Options' default on purpose: LLaDA serves with Fast-dLLM's dual cache (its
# accuracy kept in the paper's and docs/benchmarks.md's measurements, several times faster at long contexts)
SERVE_DEFAULTS = {"LLaDA": dict(cache="dual")}


def add_parser(subparsers) -> None:
    serve = subparsers.add_parser(
        "serve", parents=[dtype_parent(), methods_parent()],
        help="serve a checkpoint over an OpenAI-compatible HTTP API (continuous batching for SDAR and LLaDA2)",
        description="Loads a checkpoint and serves POST /v1/completions and /v1/chat/completions (stream: true "
                    "sends each decoded block), GET /v1/models, /health and /metrics (Prometheus). SDAR and LLaDA2 "
                    "requests share --slots rows of one compiled block step (continuous batching); LLaDA, Dream and "
                    "DiffusionGemma requests are generated in lockstep batches of up to --slots (a sampled request "
                    "alone: every DiffusionGemma request samples), with the answer length fixed by --gen-length. Each request gets what `dllm_jax.generate` gives its prompt alone. "
                    "Sampling options are the server's (a request may repeat them). SIGTERM or Ctrl-C stops taking "
                    "requests, finishes the running ones, then exits. Needs the serve extra: pip install "
                    "'dllm-jax[serve]'.")
    serve.add_argument("--model", type=Path, required=True, help="checkpoint directory (HF or converted)")
    serve.add_argument("--model-name", default=None, help="the model id clients send (default: the directory's name)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=number(int, "a port in [0, 65535]", lambda v: 0 <= v <= 65535), default=8000,
                       help="port (default 8000; 0: any free port, printed at start-up)")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help=f"requests to /v1 must send 'Authorization: Bearer KEY' (else 401); /health and /metrics "
                            f"stay open. Default: the {API_KEY_VARIABLE} environment variable, else no key (a warning "
                            "when --host is not a loopback address)")
    serve.add_argument("--max-request-bytes", type=positive_int, default=MAX_REQUEST_BYTES, metavar="N",
                       help=f"a request body past N bytes gets 413 before the rest is read (default {MAX_REQUEST_BYTES:,})")
    serve.add_argument("--slots", type=positive_int, default=8, help="requests decoded together (default 8)")
    serve.add_argument("--max-context", type=positive_int, default=None, metavar="L",
                       help="prompt + answer tokens a slot holds (default: the model's context)")
    serve.add_argument("--max-queue", type=positive_int, default=256, metavar="N",
                       help="requests waiting for a slot before new ones get 429 (default 256)")
    serve.add_argument("--temperature", type=temperature_flag, default=0.0,
                       help="the temperature of a request that sends none: 0 = greedy (default); a request's own "
                            "temperature wins")
    serve.add_argument("--top-p", type=fraction, default=1.0,
                       help="the nucleus filter of a request that sends no top_p (default 1: off)")
    serve.add_argument("--top-k", type=non_negative_int, default=0, metavar="K",
                       help="the top-k filter of a request that sends no top_k (default 0: off; SDAR, LLaDA2)")
    serve.add_argument("--max-top-k", type=non_negative_int, default=None, metavar="K",
                       help="the largest top_k a request may send (SDAR, LLaDA2: the compiled step selects that "
                            "many candidates when a request asks; default 64, or --top-k if larger)")
    serve.add_argument("--denoising-steps", type=positive_int, default=None, metavar="N",
                       help="forwards per block (default: SDAR's, 4)")
    serve.add_argument("--remasking", choices=["low_confidence_dynamic", "low_confidence_static", "sequential"],
                       default=None, help="which tokens a step commits (default: SDAR's, low_confidence_dynamic)")
    serve.add_argument("--gen-length", type=positive_int, default=None, metavar="N",
                       help="LLaDA, Dream, DiffusionGemma (lockstep): the answer region every request decodes (the "
                            "family's default); a request's max_tokens may not exceed it")
    serve.add_argument("--steps", type=positive_int, default=None, metavar="N",
                       help="LLaDA, Dream: denoising steps; LLaDA2: steps per block; DiffusionGemma: "
                            "max_denoising_steps per canvas (the family's default)")
    serve.add_argument("--block-length", type=positive_int, default=None, metavar="N",
                       help="LLaDA, LLaDA2: block length (the family's default)")
    add_fast_dllm_flags(serve, served=True)
    serve.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=None,
                       help="SDAR, LLaDA2: the slots' KV cache in the model's dtype (auto, the default) or in fp8 "
                            "(e4m3 with a scale per position and KV head: half the bytes; dense attention only)")
    serve.add_argument("--prefix-cache-mb", type=non_negative_int, default=0, metavar="MB",
                       help="SDAR, LLaDA2: device memory for the prefix cache, which keeps requests' complete prompt "
                            "blocks' keys and values so that a later prompt starting with the same blocks prefills "
                            "only the rest (default 0: off)")
    serve.add_argument("--schedule", choices=["forward", "block"], default=None,
                       help="SDAR, LLaDA2: how a step advances the slots: forward (the default: a block's worth of "
                            "forwards, each slot moving to its next block as soon as its own is done) or block (each "
                            "slot decodes one block per step; the step waits for the slowest)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's log level (default info)")
    add_quantize_flag(serve)
    serve.set_defaults(fn=run)


def family_options(args: argparse.Namespace, family) -> dict:
    """The generate options the sampling flags set for `family`'s server (SERVE_DEFAULTS where a flag is unset);
    ValueError naming the flags that do not apply to it."""
    mine = FAMILY_FLAGS[family.sampler]
    given = [flag for flag in FLAGS if getattr(args, FLAGS[flag]) is not None]
    stray = [flag for flag in given if flag not in mine]
    if stray:
        verb = "does" if len(stray) == 1 else "do"
        raise ValueError(f"{', '.join(stray)} {verb} not apply to {family.label} (its flags: {', '.join(mine)})")
    names = {flag: OPTION_NAMES.get((family.sampler, flag), FLAGS[flag]) for flag in given} | (
        {"--gen-length": family.answer_option} if "--gen-length" in given else {})
    options = SERVE_DEFAULTS.get(family.sampler, {}) | {names[flag]: getattr(args, FLAGS[flag]) for flag in given}
    if options.get("cache") == "none":
        options["cache"] = None
    return options


def memory_line(engine) -> str:
    """The slot engine's memory plan in words (`Engine.memory_plan`)."""
    plan = engine.memory_plan()
    gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    line = (f"weights {gb(plan['weights'])}, KV cache {gb(plan['kv_cache'])} ({engine.slots} slots x {engine.width} "
            f"positions), slot state {gb(plan['slot_state'])}, prefix cache up to {gb(plan['prefix_cache'])}, a "
            f"staged long prompt {gb(plan['staged_prompt'])}, inserts up to {gb(plan['insert'])}")
    if plan["device"] is None:
        return line + "; the device reports no memory limit"
    return line + f"; device {gb(plan['device'])}, headroom {gb(plan['headroom'])}"


def run(args: argparse.Namespace) -> None:
    try:
        import uvicorn

        from dllm_jax.serve.app import build_app
    except ImportError as e:
        raise ValueError(f"dllm-jax serve needs the serve extra ({e.name} is missing): pip install "
                         "'dllm-jax[serve]'") from None
    from dllm_jax.checkpoint import load_model
    from dllm_jax.cli.methods import method_from_args
    from dllm_jax.config import read_hf_config
    from dllm_jax.families import family_of
    from dllm_jax.tokenizer import ChatTokenizer

    _, config = read_hf_config(args.model)  # every flag error before the weights load
    family = family_of(config)
    options = family_options(args, family)
    if args.prefix_cache_mb and family.slots is None:
        raise ValueError(f"--prefix-cache-mb applies to the slot engine's families; {family.label} is served in "
                         "lockstep batches")
    method = method_from_args(args)
    api_key = api_key_of(args, os.environ)
    tokenizer = ChatTokenizer(args.model)
    listening = bound_socket(args.host, args.port)  # a port in use is refused now, not after the weights load
    try:
        host, port = listening.getsockname()[:2]
        if api_key is None and not loopback(host):
            print(f"dllm-jax serve: warning: listening on {args.host} (not a loopback address) with no API key: anyone "
                  f"who can reach port {port} can use the server; pass --api-key or set {API_KEY_VARIABLE}",
                  file=sys.stderr, flush=True)
        model = load_model(args.model, dtype=args.dtype, quantize=args.quantize)
        name = args.model_name or args.model.resolve().name
        app = build_app(model, tokenizer, model_name=name, slots=args.slots, max_context=args.max_context,
                        method=method, max_queue=args.max_queue, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, max_top_k=args.max_top_k, schedule=args.schedule,
                        prefix_cache_bytes=args.prefix_cache_mb * 2**20, api_key=api_key,
                        max_request_bytes=args.max_request_bytes, **options)
        shown = f"[{host}]" if ":" in host else host
        if hasattr(app.state.engine, "memory_plan"):  # the slot engine's device memory, allocated at start-up
            print(f"[dllm-jax serve memory: {memory_line(app.state.engine)}]", file=sys.stderr, flush=True)
        print(f"[dllm-jax serve: {name} on http://{shown}:{port}/v1, {args.slots} slots"
              f"{', API key required' if api_key else ''}]", file=sys.stderr, flush=True)
        uvicorn.Server(uvicorn.Config(app, log_level=args.log_level)).run(sockets=[listening])
    finally:
        listening.close()


def api_key_of(args: argparse.Namespace, environ) -> str | None:
    """--api-key, else the environment's DLLM_JAX_API_KEY, else None (no key); a ValueError for an unusable one
    (`dllm_jax.serve.guards.checked_key`, before the weights load)."""
    from dllm_jax.serve.guards import checked_key

    key = args.api_key if args.api_key is not None else environ.get(API_KEY_VARIABLE) or None
    return checked_key(key, f"--api-key (or {API_KEY_VARIABLE})")


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), as uvicorn binds one; ValueError naming the address if it cannot be."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: not an address this machine can listen on ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    listening = socket.socket(family, kind, proto)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listening.bind(address)
    except OSError as e:
        listening.close()
        raise ValueError(f"cannot listen on {host} port {port}: {e.strerror}"
                         + (" (another server holds it? pick another --port, or 0 for any free one)"
                            if e.errno == errno.EADDRINUSE else "")) from None
    return listening


def loopback(host: str) -> bool:
    """Whether a bound address is reachable only from this machine."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
