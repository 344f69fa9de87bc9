"""Serving under load: the OpenAI server (`dllm_jax.serve`, continuous batching over slots) against
lockstep `generate` batches, on the same trace of requests.

    PYTHONPATH=. python -m benchmarks.serving --model sdar-8b-chat --rates 2,8 --requests 64 --slots 16 \
        --prompt-lengths 128:4096 --output-lengths 32:512 --out benchmarks/results [--tag NAME]
    PYTHONPATH=. python -m benchmarks.serving --model tiny-sdar --rates 50 --requests 16 --slots 4 \
        --prompt-lengths 8:64 --output-lengths 4:32 --out /tmp/serving   # a CPU smoke run

The model has random weights (`dllm_jax.bench.model_for`: a shipped config name or tiny-sdar) with its stop
tokens off, so every request decodes exactly its output length; a word-level tokenizer covers its vocabulary.
A trace (seeded) draws, per arrival rate, `--requests` requests: Poisson arrivals (exponential gaps at the
rate, requests per second), prompt lengths log-uniform and output lengths uniform over their ranges.

- **server**: the app on a local port (`dllm_jax.serve.app.running`), one streaming client per request sent
  at its arrival time (httpx, asyncio); time to first block = arrival to the first streamed text, latency =
  arrival to the last. The clients run in a process of their own (`--clients process`, the default), as a
  deployment's clients do: in the server's process (`--clients thread`) their
  parsing of every streamed block shares the server's interpreter lock with its engine thread.
- **lockstep**: the trace through `generate` batches of up to `--slots` prompts, taken in arrival order when
  the previous batch ends (or at the next arrival); a batch is left-padded to the next of a few widths and
  decodes its longest output (`--output-lengths`' maximum, so one program per width), as a lockstep server
  must; every request of a batch gets its answer when the batch ends (first block = latency).

`--long-prompts N` makes a long-context trace: N requests of each trace, evenly spaced, carry prompts of
`--long-lengths` tokens, and the server serves the trace a second time without them; each row reports the other
requests' inter-block gaps (seconds between a request's streamed blocks, p50 / p99), so the two rows show what the
long prefills cost the requests decoding beside them (lockstep is not run). `--methods dense,mage` serves each
trace once per attention method (`Engine(method=...)`).

Both decode greedily with SDAR's defaults (4 denoising steps per block, dynamic remasking). Compilation is
done before the clock starts: the server's inserts (every prefill length the trace needs) and block step,
lockstep's program per width. Throughput = output tokens of the trace / (last answer - first arrival).
Results: <out>/serving[_tag]_<device>_<date>.{json,md}, with the percentiles per rate and mode.

    python -m benchmarks.serving --plot benchmarks/results/serving_8b_<device>_<date>.json --out docs/images

draws a results file (no model, no device): request latency p50 / p99 and time to first block against tokens/s,
one point per arrival rate, server and lockstep (<out>/<results name>.png).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax import generate
from dllm_jax.bench import markdown_table, model_for, write_results
from dllm_jax.serve.app import build_app, running
from dllm_jax.serve.engine import EngineTiming
from dllm_jax.serve.slots import SCHEDULES
from dllm_jax.testing import write_tiny_tokenizer
from dllm_jax.tokenizer import ChatTokenizer, left_pad


@dataclasses.dataclass(frozen=True)
class Request:
    arrival: float  # seconds after the trace starts
    prompt: tuple[int, ...]
    output: int


@dataclasses.dataclass(frozen=True)
class Served:
    arrival: float
    first: float  # first block's text, seconds after the trace starts
    end: float
    tokens: int
    prompt_tokens: int = 0
    gaps: tuple[float, ...] = ()  # seconds between the request's streamed blocks


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: want LOW:HIGH with 1 <= LOW <= HIGH")
    return lo, hi


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-sdar", help="a shipped SDAR config name or tiny-sdar")
    parser.add_argument("--rates", default="4", help="arrival rates, requests per second (comma-separated)")
    parser.add_argument("--requests", type=int, default=32, help="requests per rate")
    parser.add_argument("--slots", type=int, default=8, help="server slots = lockstep batch size")
    parser.add_argument("--prompt-lengths", type=span, default=(128, 4096), metavar="LOW:HIGH")
    parser.add_argument("--output-lengths", type=span, default=(32, 512), metavar="LOW:HIGH")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=300, help="longest a mode may take on one rate's trace")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tag", default="")
    parser.add_argument("--overlap", choices=("off", "on", "both"), default="on",
                        help="on (the server's default): the engine runs each step on its dispatch thread and reads "
                             "the previous one meanwhile (Engine(overlap=True), mode 'server overlapped'); off: each "
                             "step read before the next (mode 'server'); both: time the server both ways")
    parser.add_argument("--schedules", default="forward",
                        help="the engine's step schedules to serve the trace with, comma-separated: forward (the "
                             "default: a block's worth of forwards, each slot at its own pace) and/or block (each "
                             "step decodes one block per slot); Engine(schedule=...)")
    parser.add_argument("--shared-prefixes", type=int, default=0, metavar="N",
                        help="shared-prefix traffic: N system prompts (lengths drawn from --prefix-lengths), one of "
                             "which starts a --shared-fraction of the requests (its own prompt after it); 0: none")
    parser.add_argument("--prefix-lengths", type=span, default=(1024, 4096), metavar="LOW:HIGH")
    parser.add_argument("--shared-fraction", type=float, default=0.7)
    parser.add_argument("--prefix-cache-mb", default="0",
                        help="the server's prefix-cache budgets to serve the trace with, comma-separated MB (0: none)")
    parser.add_argument("--long-prompts", type=int, default=0, metavar="N",
                        help="a long-context trace: N requests of each rate's trace, evenly spaced, with prompts of "
                             "--long-lengths tokens; the server also serves the trace without them (the short "
                             "requests' inter-block gaps with and without the long prefills); lockstep is off")
    parser.add_argument("--long-lengths", type=span, default=(32768, 131072), metavar="LOW:HIGH")
    parser.add_argument("--prefill-batch", default="0",
                        help="the most requests of one prompt bucket prefilled in one program, comma-separated: each "
                             "value serves the trace once (Engine(prefill_batch=...); 0: every slot, the default)")
    parser.add_argument("--methods", default="dense",
                        help="attention methods the server runs, comma-separated (dense, mage, flashblock, "
                             "flashblock+mage): each serves the trace once (Engine(method=...))")
    parser.add_argument("--no-lockstep", action="store_true",
                        help="time the server only (a diagnosis run: no lockstep rows, no speedups)")
    parser.add_argument("--clients", choices=("process", "thread"), default="process",
                        help="where the server's load-generating clients run: a process of their own (default), or "
                             "threads of the server's process")
    parser.add_argument("--plot", type=Path, metavar="RESULTS_JSON",
                        help="draw this results file to <out>/<its name>.png instead of running")
    # the client process (`--clients process`): this module run against a server's URL with a trace file
    parser.add_argument("--drive", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--trace", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--served", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    if min(args.rates) <= 0 or args.requests < 1 or args.slots < 1:
        parser.error("--rates must be > 0, --requests and --slots >= 1")
    args.schedules = args.schedules.split(",")
    args.prefix_cache_mb = [int(v) for v in args.prefix_cache_mb.split(",")]
    args.prefill_batch = [int(v) for v in args.prefill_batch.split(",")]
    args.methods = [v.strip() for v in args.methods.split(",")]
    if unknown := sorted(set(args.schedules) - set(SCHEDULES)):
        parser.error(f"--schedules: {', '.join(unknown)} is not one of {', '.join(SCHEDULES)}")
    return args


def make_trace(rate: float, n: int, prompts: tuple[int, int], outputs: tuple[int, int], vocab: int, avoid: int,
               seed: int, shared: tuple[np.ndarray, ...] = (), fraction: float = 0.0, long: int = 0,
               long_lengths: tuple[int, int] = (0, 0)) -> list[Request]:
    """Poisson arrivals at `rate`, prompt lengths log-uniform in `prompts`, outputs uniform in `outputs`; a
    `fraction` of the requests start with one of the `shared` prefixes (uniformly), their own prompt after it;
    `long` requests, evenly spaced through the trace, have prompts of lengths log-uniform in `long_lengths`
    instead."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    arrivals -= arrivals[0]
    lengths = np.exp(rng.uniform(np.log(prompts[0]), np.log(prompts[1] + 1), n)).astype(int).clip(*prompts)
    trace = []
    for t, p, o in zip(arrivals, lengths, rng.integers(outputs[0], outputs[1] + 1, n)):
        ids = rng.integers(3, vocab, p)
        if shared and rng.random() < fraction:
            ids = np.concatenate([shared[rng.integers(len(shared))], ids])
        trace.append(Request(float(t), tuple(int(i) for i in np.where(ids == avoid, 3, ids)), int(o)))
    for i in range(long):
        at = (i + 1) * n // (long + 1)
        length = int(np.exp(rng.uniform(np.log(long_lengths[0]), np.log(long_lengths[1] + 1))).clip(*long_lengths))
        ids = rng.integers(3, vocab, length)
        trace[at] = dataclasses.replace(trace[at], prompt=tuple(int(i) for i in np.where(ids == avoid, 3, ids)))
    return trace


def shared_prefixes(n: int, lengths: tuple[int, int], vocab: int, seed: int) -> tuple[np.ndarray, ...]:
    """`n` system prompts, lengths uniform in `lengths`."""
    rng = np.random.default_rng(seed + 1_000_003)
    return tuple(rng.integers(3, vocab, rng.integers(lengths[0], lengths[1] + 1)) for _ in range(n))


def widths(prompts: tuple[int, int]) -> list[int]:
    """Lockstep's padded prompt widths: powers of two from the shortest prompt's up to one >= the longest."""
    w = 1 << max(prompts[0] - 1, 1).bit_length()
    out = [w]
    while out[-1] < prompts[1]:
        out.append(out[-1] * 2)
    return out


async def serve_trace(url: str, name: str, trace: list[Request], seconds: float) -> list[Served]:
    start = time.perf_counter()

    async def one(client: httpx.AsyncClient, r: Request) -> Served:
        await asyncio.sleep(max(0.0, r.arrival - (time.perf_counter() - start)))
        arrival, first, tokens, times = time.perf_counter() - start, None, 0, []
        body = dict(model=name, prompt=list(r.prompt), max_tokens=r.output, stream=True,
                    stream_options={"include_usage": True})
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()}")
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"][0]["text"]:
                    times.append(time.perf_counter() - start)
                    first = times[0]
        end = time.perf_counter() - start
        return Served(arrival, end if first is None else first, end, tokens, len(r.prompt),
                      tuple(float(g) for g in np.diff(times)))

    limits = httpx.Limits(max_connections=len(trace) + 8)
    async with httpx.AsyncClient(timeout=seconds, limits=limits) as client:
        return await asyncio.wait_for(asyncio.gather(*(one(client, r) for r in trace)), seconds)


def drive(url: str, name: str, trace: list[Request], seconds: float, clients: str) -> list[Served]:
    """`serve_trace` in this process (clients "thread") or in a process of its own ("process"): this module with
    --drive, the trace and its results passed as JSON files."""
    if clients == "thread":
        return asyncio.run(serve_trace(url, name, trace, seconds))
    with tempfile.TemporaryDirectory() as tmp:
        trace_file, served_file = Path(tmp) / "trace.json", Path(tmp) / "served.json"
        trace_file.write_text(json.dumps([dataclasses.asdict(r) for r in trace]))
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        run = subprocess.run([sys.executable, "-m", "benchmarks.serving", "--drive", url, "--model", name,
                              "--trace", str(trace_file), "--served", str(served_file), "--seconds", str(seconds)],
                             env=env, capture_output=True, text=True, timeout=seconds + 120)
        if run.returncode != 0:
            raise RuntimeError(f"the client process failed:\n{run.stderr[-3000:]}")
        return [Served(**record | dict(gaps=tuple(record["gaps"]))) for record in json.loads(served_file.read_text())]


def drive_main(args: argparse.Namespace) -> Path:
    """The client process: the trace file's requests against --drive's server; their records to --served."""
    trace = [Request(r["arrival"], tuple(r["prompt"]), r["output"]) for r in json.loads(args.trace.read_text())]
    served = asyncio.run(serve_trace(args.drive, args.model, trace, args.seconds))
    args.served.write_text(json.dumps([dataclasses.asdict(s) for s in served]))
    return args.served


def lockstep_trace(model, trace: list[Request], slots: int, pads: list[int], new: int, pad_id: int) -> list[Served]:
    start = time.perf_counter()
    served, waiting, i = [], [], 0
    while i < len(trace) or waiting:
        now = time.perf_counter() - start
        while i < len(trace) and trace[i].arrival <= now:
            waiting.append(trace[i])
            i += 1
        if not waiting:
            time.sleep(max(0.0, trace[i].arrival - now))
            continue
        batch, waiting = waiting[:slots], waiting[slots:]
        ids, mask = padded_batch([r.prompt for r in batch], slots, pads, pad_id)
        jax.block_until_ready(generate(model, ids, attention_mask=mask, max_new_tokens=new, top_k=1))
        end = time.perf_counter() - start
        served += [Served(r.arrival, end, end, r.output, len(r.prompt)) for r in batch]
    return served


def padded_batch(prompts, slots: int, pads: list[int], pad_id: int):
    """`slots` rows (missing rows repeat the last prompt), left-padded to the next width of `pads`."""
    rows = list(prompts) + [prompts[-1]] * (slots - len(prompts))
    width = next(w for w in pads if w >= max(len(p) for p in rows))
    ids, mask = left_pad([list(p) for p in rows], pad_id)
    extra = width - ids.shape[1]
    return np.pad(ids, ((0, 0), (extra, 0)), constant_values=pad_id), np.pad(mask, ((0, 0), (extra, 0)))


def engine_breakdown(timing: EngineTiming) -> dict:
    """The engine thread's counters over one trace (`dllm_jax.serve.engine.EngineTiming`), rounded for the results:
    steps, the mean busy slots a step decoded, inserts, and host seconds by phase (wait: on the device)."""
    out = dataclasses.asdict(timing)
    out["mean_busy_slots"] = timing.busy_slot_steps / max(timing.steps, 1)
    # what scheduling by forward rather than by block could save: a step's forwards against a row's own need
    out["forwards_per_step"] = timing.forwards / max(timing.steps, 1)
    out["forwards_per_row_block"] = timing.row_forwards / max(timing.row_blocks, 1)
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def summary(served: list[Served], short: int) -> dict:
    """Throughput and latency percentiles of a trace's requests; inter-block gaps (between a request's streamed
    blocks) over the requests whose prompts have at most `short` tokens."""
    first = np.array([s.first - s.arrival for s in served])
    gaps = np.array([g for s in served if s.prompt_tokens <= short for g in s.gaps])
    latency = np.array([s.end - s.arrival for s in served])
    span_s = max(s.end for s in served) - min(s.arrival for s in served)
    tokens = sum(s.tokens for s in served)
    pct = lambda a, q: round(float(np.percentile(a, q)), 3)  # noqa: E731
    return dict(requests=len(served), tokens=tokens, seconds=round(span_s, 3), tokens_per_s=round(tokens / span_s, 1),
                first_p50=pct(first, 50), first_p99=pct(first, 99), latency_p50=pct(latency, 50),
                latency_p99=pct(latency, 99), gap_p50=pct(gaps, 50) if gaps.size else None,
                gap_p99=pct(gaps, 99) if gaps.size else None)


def draw_latency(results: dict, path: Path) -> None:
    """Draws to `path` (PNG) latency (p50 solid, p99 dashed) and time to first block against tokens/s per mode, a
    point per arrival rate (labelled), from a results file's contents."""
    from matplotlib.figure import Figure  # the object API: no pyplot state, no GUI backend

    fig = Figure(figsize=(10, 4))
    panels = fig.subplots(1, 2)
    for ax, key, title in ((panels[0], "latency", "request latency"), (panels[1], "first", "time to first block")):
        served = sorted({r["mode"] for r in results["rows"]} - {"lockstep"})  # the server's modes run
        colors = dict(zip(served, ("tab:blue", "tab:green", "tab:purple", "tab:red"))) | {"lockstep": "tab:orange"}
        for mode, color in colors.items():
            rows = sorted((r for r in results["rows"] if r["mode"] == mode), key=lambda r: r["rate"])
            x = [r["tokens_per_s"] for r in rows]
            ax.plot(x, [r[f"{key}_p50"] for r in rows], "o-", color=color, label=f"{mode} p50")
            ax.plot(x, [r[f"{key}_p99"] for r in rows], "s--", color=color, label=f"{mode} p99")
            for r in rows:
                ax.annotate(f"{r['rate']:g}/s", (r["tokens_per_s"], r[f"{key}_p99"]), textcoords="offset points",
                            xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("seconds")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(f"{results['model']}, {results['slots']} slots, {results['device']} ({results['date']}); "
                 "labels: arrival rate", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)


def plot(results_file: Path, out: Path) -> Path:
    results = json.loads(results_file.read_text())
    if results.get("benchmark", "").split("_")[0] != "serving" or not results.get("rows"):
        raise ValueError(f"{results_file} is not a results file of benchmarks/serving.py (no serving rows)")
    out.mkdir(parents=True, exist_ok=True)
    path = out / (results_file.stem + ".png")
    draw_latency(results, path)
    print(f"wrote {path}")
    return path


def main(argv=None) -> Path:
    args = parse_args(argv)
    if args.plot is not None:
        return plot(args.plot, args.out)
    if args.drive is not None:
        return drive_main(args)
    short = args.prompt_lengths[1] + (args.prefix_lengths[1] if args.shared_prefixes else 0)
    context = max(short, args.long_lengths[1] if args.long_prompts else 0) + args.output_lengths[1]
    model, config = model_for(args.model, layers=None, context=context + 64, dtype=jnp.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_tokenizer(tmp, config.vocab_size, mask_token_id=config.mask_token_id,
                             eos_token_id=config.vocab_size - 1)
        tokenizer = ChatTokenizer(tmp)
    shared = shared_prefixes(args.shared_prefixes, args.prefix_lengths, config.vocab_size - 3, args.seed)
    traces = {rate: make_trace(rate, args.requests, args.prompt_lengths, args.output_lengths, config.vocab_size - 3,
                               config.mask_token_id, args.seed + i, shared, args.shared_fraction, args.long_prompts,
                               args.long_lengths)
              for i, rate in enumerate(args.rates)}
    # with long prompts, each trace is served again without them: the short requests alone
    runs = [(rate, trace, "") for rate, trace in traces.items()] + [
        (rate, [r for r in trace if len(r.prompt) <= short], ", without the long prompts")
        for rate, trace in traces.items() if args.long_prompts]
    lockstep = not (args.no_lockstep or args.long_prompts)
    longest_prompt = max(len(r.prompt) for t in traces.values() for r in t)
    pads = widths((args.prompt_lengths[0], max(args.prompt_lengths[1], longest_prompt)))
    new = args.output_lengths[1]
    rows = []
    start = time.perf_counter()  # compile lockstep's program per width before any clock
    for w in pads if lockstep else []:
        ids, mask = padded_batch([(3,) * w], args.slots, pads, config.pad_token_id)
        jax.block_until_ready(generate(model, ids, attention_mask=mask, max_new_tokens=new, top_k=1))
    print(f"lockstep compiled in {time.perf_counter() - start:.1f} s", flush=True)
    for rate, trace in traces.items() if lockstep else []:
        served = lockstep_trace(model, trace, args.slots, pads, new, config.pad_token_id)
        rows.append(dict(rate=rate, mode="lockstep", **summary(served, short)))
        print(json.dumps(rows[-1]), flush=True)
    overlaps = {"off": [False], "on": [True], "both": [False, True]}[args.overlap]
    for method, overlap, schedule, cache_mb, batch in [(m, o, s, c, b) for m in args.methods for b in args.prefill_batch
                                                       for c in args.prefix_cache_mb for s in args.schedules
                                                       for o in overlaps]:
        mode = (("server overlapped" if overlap else "server") + (", by forward" if schedule == "forward" else "")
                + (f", prefix cache {cache_mb} MB" if cache_mb else "") + (f", prefill batch {batch}" if batch else "")
                + (f", {method}" if method != "dense" else ""))
        app = build_app(model, tokenizer, model_name=args.model, slots=args.slots, max_context=context,
                        method=None if method == "dense" else method,
                        max_queue=args.requests * 2, overlap=overlap, schedule=schedule,
                        prefix_cache_bytes=cache_mb * 2**20, prefill_batch=batch or None)
        with running(app) as url:
            start = time.perf_counter()  # compile: every prefill length the traces use, the step
            # per insert bucket the trace reaches, its longest prompt (the widest bucket is the whole context)
            longest = {}
            for n in sorted({len(r.prompt) for t in traces.values() for r in t}):
                longest[next(b for b in app.state.engine.buckets if b >= n)] = n
            drive(url, args.model, [Request(0.0, tuple([3] * n), 4) for n in longest.values()], args.seconds,
                  args.clients)
            # then bursts of 2, 4, ... requests per batched bucket, which free slots admit together: the batched
            # prefill programs a trace's bursts reach
            burst = 2
            while burst <= min(args.slots, batch or args.slots):
                drive(url, args.model, [Request(0.0, tuple([3] * n), 4) for n in longest.values()
                                        if n <= app.state.engine.prefill_chunk for _ in range(burst)],
                      args.seconds, args.clients)
                burst *= 2
            print(f"{mode} compiled in {time.perf_counter() - start:.1f} s", flush=True)
            engine = app.state.engine
            for rate, trace, variant in runs:
                engine.timing = EngineTiming()
                engine.prefix.clear()  # each trace starts with an empty prefix cache
                served = drive(url, args.model, trace, args.seconds, args.clients)
                rows.append(dict(rate=rate, mode=mode + variant, **summary(served, short),
                                 engine=engine_breakdown(engine.timing),
                                 prefix_hit_tokens=engine.prefix.hit_tokens,
                                 prefix_query_tokens=engine.prefix.query_tokens))
                for lockstep in (r for r in rows if r["rate"] == rate and r["mode"] == "lockstep"):
                    rows[-1]["speedup"] = round(rows[-1]["tokens_per_s"] / lockstep["tokens_per_s"], 2)
                print(json.dumps(rows[-1]), flush=True)
        del app
    rows.sort(key=lambda r: (r["rate"], r["mode"] == "lockstep"))
    meta = dict(benchmark="serving" + (f"_{args.tag}" if args.tag else ""), device=jax.devices()[0].device_kind,
                jax=jax.__version__, date=datetime.date.today().isoformat(), model=args.model, slots=args.slots,
                requests=args.requests, prompt_lengths=args.prompt_lengths, output_lengths=args.output_lengths,
                seed=args.seed, lockstep_widths=pads, lockstep_new_tokens=new, overlap=args.overlap,
                clients=args.clients, methods=args.methods, shared_prefixes=[len(p) for p in shared],
                shared_fraction=args.shared_fraction,
                long_prompts=sorted(len(r.prompt) for t in traces.values() for r in t if len(r.prompt) > short))
    header = ["rate (req/s)", "mode", "tokens/s", "vs lockstep", "first block p50 / p99 (s)", "latency p50 / p99 (s)",
              "inter-block p50 / p99 (s)"]
    table = [[r["rate"], r["mode"], r["tokens_per_s"], f"{r['speedup']}x" if "speedup" in r else "",
              f"{r['first_p50']} / {r['first_p99']}", f"{r['latency_p50']} / {r['latency_p99']}",
              "" if r["mode"] == "lockstep" or r["gap_p50"] is None else f"{r['gap_p50']} / {r['gap_p99']}"]
             for r in rows]
    lines = [f"# Serving: continuous batching against lockstep - {meta['device']}, jax {meta['jax']}, {meta['date']}",
             "", f"{args.model} (random weights, stops off), {args.slots} slots"
             f", {args.requests} requests per rate, "
             f"prompts {args.prompt_lengths[0]}-{args.prompt_lengths[1]}, outputs {args.output_lengths[0]}-"
             f"{args.output_lengths[1]} tokens; lockstep widths {pads}, {new} new tokens per batch; the server's "
             f"clients in {'a process of their own' if args.clients == 'process' else 'its process'}"
             + (f"; long prompts of {meta['long_prompts']} tokens (inter-block gaps: the other requests')"
                if args.long_prompts else "") + ".", "",
             *markdown_table(header, table, align="rlrrrrr"), "",
             "Where the engine thread's time went (host seconds over the trace; `wait`: blocked on the device, "
             "which ran the steps and the inserts meanwhile; the rest of the trace's time is the thread's "
             "text decoding and streaming, and idling; forwards: a step's, which last until its slowest row's "
             "block is unmasked, against the denoising forwards a row's block needed, on average):", "",
             *markdown_table(["rate (req/s)", "mode", "trace s", "steps", "mean busy slots", "inserts (prefills)",
                              "wait s",
                              "admit s", "dispatch s", "retire s", "progress s", "forwards / step",
                              "forwards / row block"],
                             [[r["rate"], r["mode"], r["seconds"], e["steps"], round(e["mean_busy_slots"], 1),
                               f"{e['inserts']} ({e['prefills']})", e["wait_s"], e["admit_s"], e["dispatch_s"], e["retire_s"],
                               e["progress_s"], round(e["forwards_per_step"], 2), round(e["forwards_per_row_block"], 2)]
                              for r in rows if (e := r.get("engine"))], align="rlrrrrrrrrrrr")]
    return write_results(args.out, meta, rows, lines)


if __name__ == "__main__":
    main()
