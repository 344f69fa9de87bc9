"""dllm_jax.serve.Engine: continuous batching over the slots of a block-diffusion model (SDAR; LLaDA2). Every
request gets exactly what `generate` returns for its prompt alone, whatever shares the slots and whenever it
arrives; slots are reused as requests finish; bad requests are refused before they are queued."""

import functools

import jax
import numpy as np
import pytest

import dllm_jax
from dllm_jax.serve import Engine
from dllm_jax.serve.slots import insert, stop_table
from dllm_jax.testing import tiny_llada2_config, tiny_llada_config, tiny_sdar_config


@pytest.fixture(scope="module")
def model(tiny_model):
    # a small vocabulary makes stop tokens (41, 42) likely on random weights: rows stop at different blocks
    config = tiny_sdar_config(vocab_size=48, mask_token_id=40, eos_token_ids=(41, 42), pad_token_id=42)
    return tiny_model(config, seed=21)


# (prompt length, max_new_tokens, seed): prompts that end mid-block, on a block boundary, inside the first
# block; answers of one to four blocks, ends that are not block boundaries
REQUESTS = [(5, 8, 1), (9, 13, 2), (2, 4, 3), (12, 10, 4), (8, 16, 5)]
# each request's own (temperature, top_p, top_k): sampled at two temperatures, with and without a nucleus, with
# and without a top-k of its own, and greedy (temperature 0: SDAR's top-k 1), side by side in the slots
SAMPLING = [(0.8, 1.0, 0), (0.8, 0.9, 3), (0.0, 1.0, 0), (0.5, 1.0, 5), (0.8, 1.0, 2)]


def own_options(options: dict, temperature, top_p, top_k, greedy: dict) -> dict:
    """The generate options a request with its own temperature, top-p and top-k (None: the engine's) decodes with;
    temperature 0 is the family's `greedy` options (SDAR: top-k 1; LLaDA2: temperature 0, its filters kept)."""
    own = {} if temperature is None else dict(temperature=temperature, top_p=top_p)
    own |= {} if top_k is None else dict(top_k=top_k)
    if temperature == 0:
        return options | {k: v for k, v in own.items() if k != "temperature"} | greedy
    return options | own


@pytest.mark.parametrize("options, sampling, engine_args", [
    (dict(remasking="sequential", top_k=1, denoising_steps=4), None, {}),  # greedy by the engine's options
    # prompts of 2 and 3 complete blocks prefilled in chunks of 2 blocks (the last overlapping the first)
    (dict(remasking="sequential", top_k=1, denoising_steps=4), None, dict(prefill_chunk=8)),
    (dict(remasking="low_confidence_dynamic", denoising_steps=4), SAMPLING, {}),  # each request its own
    # each step read before the next is dispatched (the default dispatches on a thread and reads behind)
    (dict(remasking="low_confidence_dynamic", denoising_steps=4), SAMPLING, dict(overlap=False)),
    # steps of one whole block per slot (the default steps a block's worth of forwards, each slot moving to its
    # next block when its own is done)
    (dict(remasking="sequential", top_k=1, denoising_steps=4), None, dict(schedule="block")),
    (dict(remasking="low_confidence_dynamic", denoising_steps=4), SAMPLING, dict(schedule="block")),
], ids=["greedy", "greedy, chunked inserts", "per-request sampling", "per-request sampling, overlap off",
        "greedy, by block", "per-request sampling, by block"])
def test_each_request_gets_what_generate_gives_its_prompt_alone(model, rng, options, sampling, engine_args):
    engine = Engine(model, slots=3, max_context=64, **engine_args, **options)
    prompts = [rng.integers(0, 40, n) for n, _, _ in REQUESTS]
    sampling = sampling or [(None, None, None)] * len(REQUESTS)
    submit = lambda i: engine.submit(prompts[i], REQUESTS[i][1], REQUESTS[i][2], *sampling[i])  # noqa: E731
    ids = [submit(i) for i in range(4)]
    done = {}
    for _ in range(2):  # four requests for three slots, two blocks decoded, then one more arrives
        done.update((c.request_id, c) for c in engine.step())
    ids += [submit(4)]
    done.update(engine.run())
    assert sorted(done) == sorted(ids) and not engine.busy and not engine.queue
    stopped = 0
    for request_id, prompt, (n, k, seed), (t, p, top_k) in zip(ids, prompts, REQUESTS, sampling):
        alone = np.asarray(dllm_jax.generate(model, prompt[None], max_new_tokens=k, seed=seed,
                                             **own_options(options, t, p, top_k, {"top_k": 1})))[0]
        completion = done[request_id]
        np.testing.assert_array_equal(completion.tokens, alone, err_msg=f"request {request_id}")
        np.testing.assert_array_equal(completion.generated, alone[n:])
        stopped += len(alone) < -(-(n + k) // 4) * 4
    if options.get("top_k") != 1:
        assert stopped, "no request stopped early: per-slot stops were not exercised"


def test_overlapped_steps_report_progress_that_grows_into_each_answer(model, rng):
    """With overlap, what `progress` reports after each step (the previous step's result) is a prefix of the
    request's final answer that never shrinks, and every request completes."""
    engine = Engine(model, slots=3, max_context=64, overlap=True, remasking="low_confidence_dynamic",
                    denoising_steps=4)
    ids = [engine.submit(rng.integers(0, 40, n), k, seed) for n, k, seed in REQUESTS]
    seen = {i: [] for i in ids}
    done = {}
    while not engine.idle:
        done.update((c.request_id, c) for c in engine.step())
        for request_id, tokens in engine.progress().items():
            seen[request_id].append(tokens)
    assert sorted(done) == sorted(ids)
    assert any(seen.values())  # (a request that ends at the first step read of it reports none)
    for request_id, reports in seen.items():
        final = done[request_id].generated
        for earlier, later in zip(reports, reports[1:] + [final]):
            np.testing.assert_array_equal(later[:len(earlier)], earlier)


@pytest.mark.parametrize("schedule", ["block", "forward"])
def test_a_method_in_the_slot_gives_what_generate_gives_with_it(model, rng, schedule):
    """FlashBlock around MAGE (both states: MAGE's selection, FlashBlock's cached parts) in one slot that two
    requests take in turn: the second finds the first's state there, and its first forward must replace it,
    as generate's first step of a block does."""
    method = dllm_jax.FlashBlock(tau=2, inner=dllm_jax.MAGE(k=5, exact_layers=1))
    options = dict(remasking="low_confidence_dynamic", denoising_steps=4, confidence_threshold=0.3)
    engine = Engine(model, slots=1, max_context=64, method=method, schedule=schedule, **options)
    requests = [(rng.integers(0, 40, n), k) for n, k in ((14, 10), (9, 8))]
    ids = [engine.submit(p, k, seed=1) for p, k in requests]
    done = engine.run()
    for request_id, (prompt, k) in zip(ids, requests):
        alone = np.asarray(dllm_jax.generate(model, prompt[None], max_new_tokens=k, seed=1, method=method, **options))
        np.testing.assert_array_equal(done[request_id].tokens, alone[0], err_msg=f"request {request_id}")


def test_a_short_request_leaves_and_a_queued_one_starts_while_a_long_one_runs(model, rng):
    """Without overlap, at the step that finished it (with it, a step later: each step is read behind)."""
    engine = Engine(model, slots=2, max_context=64, overlap=False, remasking="sequential", top_k=1,
                    denoising_steps=4)
    long = engine.submit(rng.integers(0, 40, 8), 40)  # ten blocks (on this prompt, no stop token before)
    short = engine.submit(rng.integers(0, 40, 8), 4)  # one block
    queued = engine.submit(rng.integers(0, 40, 8), 4)  # one block too
    finished_at = {}
    for step in range(1, 20):
        for c in engine.step():
            finished_at[c.request_id] = step
        if long in finished_at:
            break
    assert finished_at[short] == 1  # left after its only block, not when the batch ended
    assert finished_at[queued] == 2 < finished_at[long]  # took the freed slot at once, while the long one ran


def test_a_request_cancelled_while_its_step_runs_frees_the_slot_for_the_next(model, rng):
    """With overlap, a step runs on the engine's dispatch thread while the host cancels a request in it: the slot's
    busy flag changes once that step has returned, the queued request takes the slot, and the others get what
    generate gives them alone."""
    options = dict(remasking="sequential", top_k=1, denoising_steps=4)
    engine = Engine(model, slots=2, max_context=64, overlap=True, **options)
    prompts = [rng.integers(0, 40, 8) for _ in range(3)]
    first, second, queued = (engine.submit(p, 12) for p in prompts)
    engine.step()  # the first two in the slots, their first block dispatched
    assert engine.dispatched is not None and engine.cancel(first)
    done = engine.run()
    assert sorted(done) == [second, queued] and engine.idle
    for request_id, prompt in ((second, prompts[1]), (queued, prompts[2])):
        alone = np.asarray(dllm_jax.generate(model, prompt[None], max_new_tokens=12, seed=0, **options))[0]
        np.testing.assert_array_equal(done[request_id].tokens, alone)


def test_the_engine_counts_its_steps_inserts_and_busy_slots(model, rng):
    engine = Engine(model, slots=2, max_context=64, remasking="sequential", top_k=1, denoising_steps=4)
    for n in (4, 8, 12):  # three requests for two slots
        engine.submit(rng.integers(0, 40, 8), n)
    steps = 0
    while engine.queue or engine.busy:
        steps += 1
        engine.step()
    t = engine.timing
    assert (t.inserts, t.steps) == (3, steps)
    assert t.steps <= t.busy_slot_steps <= 2 * t.steps  # one or both slots busy in every step
    assert t.wait_s > 0 and min(t.admit_s, t.dispatch_s, t.retire_s, t.progress_s) >= 0


@pytest.mark.parametrize("schedule, counts", [("block", (4, 6, 2)), ("forward", (4, 8, 2))])
def test_the_engine_counts_the_forwards_a_step_ran_and_each_row_needed(model, rng, schedule, counts):
    """One forward per masked position here (sequential remasking, 4 steps for a block of 4). A prompt of 6 with
    6 new tokens leaves its row a first block of 2 masks, then one of 4; a prompt of 8 one block of 4. By block,
    the step lasts until the slower row's block is done (4 forwards), the other row waiting after its 2; by
    forward, that row moves on to its next block and unmasks 2 of its masks in the same 4 forwards."""
    engine = Engine(model, slots=2, max_context=64, remasking="sequential", top_k=1, denoising_steps=4, overlap=False,
                    schedule=schedule)
    engine.submit(rng.integers(0, 40, 6), 6)
    engine.submit(rng.integers(0, 40, 8), 4)
    engine.step()
    t = engine.timing
    assert (t.steps, t.forwards, t.row_forwards, t.row_blocks) == (1, *counts)


def test_a_request_stops_on_the_device_at_its_own_stop_id(model, rng):
    """A request's own stop id ends its row in the step that decodes it, as the model's stop ids do: the slot
    decodes no further block (fewer blocks than the same request without it) and its answer is `generate`'s cut
    after that token."""
    prompt = rng.integers(0, 40, 8)
    options = dict(remasking="sequential", top_k=1, denoising_steps=4)
    alone = np.asarray(dllm_jax.generate(model, prompt[None], max_new_tokens=16, **options))[0][8:]
    model_stop = np.flatnonzero(np.isin(alone, model.config.stop_ids))
    assert not model_stop.size or model_stop[0] >= 6, alone  # the model runs past the second block: nothing to cut
    blocks = {}
    for own in ((), (int(alone[5]),)):
        engine = Engine(model, slots=1, max_context=64, overlap=False, **options)
        engine.submit(prompt, 16, stop_ids=own)
        (done,) = engine.run().values()
        blocks[own] = engine.timing.row_blocks
        end = np.flatnonzero(np.isin(alone, (*model.config.stop_ids, *own)))
        np.testing.assert_array_equal(done.generated, alone[:end[0] + 1] if end.size else alone)
    assert blocks[(int(alone[5]),)] < blocks[()], blocks


@pytest.mark.parametrize("call, message", [
    (lambda e: e.submit(np.arange(3, 40), 30), "exceeds the engine's max_context=64"),
    (lambda e: e.submit(np.arange(3, 8), 4, stop_ids=list(range(9))), "at most 8"),
    (lambda e: e.submit(np.arange(3, 8), 4, stop_ids=[48]), "stop_ids"),
    (lambda e: e.submit(np.arange(3, 8), 4, remasking="random"), "remasking must be one of"),
    (lambda e: e.submit(np.zeros((2, 4), np.int32), 4), "one prompt"),
    (lambda e: e.submit(np.array([], np.int32), 4), "prompt_ids must be"),
    (lambda e: e.submit(np.arange(3, 8), 0), "max_new_tokens"),
    (lambda e: e.submit(np.arange(3, 8), 4, seed=-1), "seed"),
    (lambda e: e.submit(np.arange(3, 8), 4, temperature=2.5), "temperature"),
    (lambda e: e.submit(np.arange(3, 8), 4, top_p=0.0), "top_p"),
    (lambda e: e.submit(np.arange(3, 8), 4, top_k=-1), "top_k"),
    (lambda e: e.submit(np.arange(3, 8), 4, top_k=9), "top_k=9 exceeds the 8 this engine was started with"),
    (lambda e: e.submit(np.array([3, 40, 5, 6, 7]), 4), "mask token id 40"),
    (lambda e: e.submit(np.array([3, 99]), 4), "vocab"),
])
def test_bad_requests_are_refused_before_they_are_queued(model, call, message):
    engine = Engine(model, slots=2, max_context=64, top_k=1, max_top_k=8)
    with pytest.raises(ValueError, match=message):
        call(engine)
    assert not engine.queue


def test_bad_engines_are_refused(model, tiny_model):
    with pytest.raises(ValueError, match="per request"):
        Engine(model, max_new_tokens=8)
    with pytest.raises(ValueError, match="max_context=9999 exceeds the model's context"):
        Engine(model, max_context=9999)
    with pytest.raises(ValueError, match="denoising_steps"):
        Engine(model, denoising_steps=8)
    with pytest.raises(ValueError, match="unknown SDAR generate options"):
        Engine(model, steps=4)
    with pytest.raises(ValueError, match="max_top_k"):
        Engine(model, max_top_k=49)  # past the vocabulary of 48
    with pytest.raises(ValueError, match="top_k=9 .* exceeds max_top_k=8"):
        Engine(model, top_k=9, max_top_k=8)
    with pytest.raises(ValueError, match="prefill_chunk=6 is not a multiple of the block length 4"):
        Engine(model, prefill_chunk=6)
    with pytest.raises(ValueError, match="prefill_batch"):
        Engine(model, prefill_batch=0)
    with pytest.raises(ValueError, match="schedule"):
        Engine(model, schedule="token")
    with pytest.raises(ValueError, match="SparseD is a method for LLaDA"):
        Engine(model, method="sparsed")
    with pytest.raises(ValueError, match="the slot engine runs the block-diffusion families"):
        Engine(tiny_model(tiny_llada_config()))


def test_a_sharded_model_is_refused(tiny_checkpoint):
    import jax

    config = tiny_sdar_config(vocab_size=48, mask_token_id=40, eos_token_ids=(41, 42), pad_token_id=42)
    sharded = dllm_jax.load_model(tiny_checkpoint(config, seed=21), dtype="float32", progress=False,
                                  mesh=jax.make_mesh((1,), ("tp",)))
    with pytest.raises(ValueError, match="one device: load it without mesh="):
        Engine(sharded)


@pytest.fixture(scope="module")
def llada2(tiny_model):
    # EOS 39: a token these random weights often pick, so rows stop at different blocks
    config = tiny_llada2_config(vocab_size=48, mask_token_id=40, eos_token_id=39, pad_token_id=39)
    return tiny_model(config, seed=21)


@pytest.mark.parametrize("schedule", ["block", "forward"])
def test_llada2_requests_share_the_slots_and_each_gets_what_generate_gives_it_alone(llada2, rng, schedule):
    """LLaDA2 in the slots (its own model functions, sampler and block length: `Family.slots`): five requests
    (each its own seed) over three slots, three sampled at the engine's temperature, one greedy (temperature 0:
    LLaDA2's argmax), one at its own temperature and top-p, one with its own top-k, one with a top-k at temperature
    0 (which samples at temperature 1, as the official sampler), the answer cut at each one's length as generate's
    (its gen_length) is. More greedy LLaDA2 requests: test_serve_http's six concurrent clients."""
    options = dict(block_length=4, steps=4, temperature=0.8)
    engine = Engine(llada2, slots=3, max_context=64, schedule=schedule, **options)
    prompts = [rng.integers(0, 40, n) for n, _, _ in REQUESTS]
    sampling = [(None, None, None), (0.0, 1.0, 0), (0.6, 0.9, None), (None, None, 3), (0.0, 1.0, 2)]
    ids = [engine.submit(p, k, s, *own) for p, (_, k, s), own in zip(prompts, REQUESTS, sampling)]
    done = engine.run()
    stopped = 0
    for request_id, prompt, (n, k, seed), (t, p, top_k) in zip(ids, prompts, REQUESTS, sampling):
        alone = np.asarray(dllm_jax.generate(llada2, prompt[None], gen_length=k, seed=seed,
                                             **own_options(options, t, p, top_k, {"temperature": 0.0})))[0]
        np.testing.assert_array_equal(done[request_id].tokens, alone, err_msg=f"request {request_id}")
        stopped += len(alone) < n + k
    assert stopped, "no request stopped early: per-slot stops were not exercised"


def test_llada2_requests_whose_schedule_differs_from_the_engines_are_refused(llada2):
    engine = Engine(llada2, slots=1, max_context=64, block_length=4, steps=4)
    with pytest.raises(ValueError, match=r"max_new_tokens=3: LLaDA2 then runs .* = 3 forwards per block, the engine 4"):
        engine.submit(np.arange(3, 8), 3)
    with pytest.raises(ValueError, match="mask id 40"):
        engine.submit(np.array([3, 40, 5]), 8)
    with pytest.raises(ValueError, match="gen_length is per request"):
        Engine(llada2, gen_length=8)
    assert not engine.queue


def one_entry_bytes(engine) -> int:
    """The bytes of one prefix-cache entry of `engine` (a one-row cache of its slots' capacity)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(engine.state.carry.cache)) // engine.slots


@pytest.mark.parametrize("sampling", [None, SAMPLING[:4]], ids=["greedy", "per-request sampling"])
def test_prompts_sharing_a_prefix_reuse_its_blocks_and_each_gets_what_generate_gives_it(model, rng, sampling):
    """Prefix cache: requests whose prompts share 3 and 5 complete blocks with earlier ones (two of them in flight
    together with the one that filled the cache) prefill only the rest, each with what generate gives its prompt
    alone; the counters say how many prompt positions were looked up and found."""
    options = dict(remasking="sequential", top_k=1, denoising_steps=4) if sampling is None else \
        dict(remasking="low_confidence_dynamic", denoising_steps=4)
    engine = Engine(model, slots=2, max_context=64, prefix_cache_bytes=2**30, **options)
    system = rng.integers(0, 40, 20)  # five blocks of 4
    prompts = [np.concatenate([system, rng.integers(0, 40, 6)]), np.concatenate([system, rng.integers(0, 40, 3)]),
               np.concatenate([system[:12], rng.integers(0, 40, 9)]), rng.integers(0, 40, 10)]
    sampling = sampling or [(None, None, None)] * len(prompts)
    ids = [engine.submit(p, 8, i + 1, *s) for i, (p, s) in enumerate(zip(prompts, sampling))]
    done = engine.run()
    for request_id, prompt, seed, (t, p, top_k) in zip(ids, prompts, range(1, 5), sampling):
        alone = np.asarray(dllm_jax.generate(model, prompt[None], max_new_tokens=8, seed=seed,
                                             **own_options(options, t, p, top_k, {"top_k": 1})))[0]
        np.testing.assert_array_equal(done[request_id].tokens, alone, err_msg=f"request {request_id}")
    # complete blocks looked up: 24 + 20 + 20 + 8; found: the second's 20 (the system prompt), the third's 12
    assert (engine.prefix.query_tokens, engine.prefix.hit_tokens) == (72, 32)


def test_the_prefix_cache_drops_the_least_recently_used_entry_past_its_budget(model, rng):
    """A budget of one entry: a second prompt evicts the first's blocks, so a third request sharing the first's
    prefix finds nothing (and is still what generate gives it); an entry that starts a longer one is superseded."""
    options = dict(remasking="sequential", top_k=1, denoising_steps=4)
    engine = Engine(model, slots=1, max_context=64, **options)
    engine = Engine(model, slots=1, max_context=64, prefix_cache_bytes=one_entry_bytes(engine), **options)
    first, other = rng.integers(0, 40, 16), rng.integers(0, 40, 16)
    for prompt in (first, other, first[:12]):
        request_id = engine.submit(prompt, 4, 0)
        alone = np.asarray(dllm_jax.generate(model, prompt[None], max_new_tokens=4, **options))[0]
        np.testing.assert_array_equal(engine.run()[request_id].tokens, alone)
        assert len(engine.prefix.entries) == 1
    assert engine.prefix.hit_tokens == 0 and engine.prefix.query_tokens == 16 + 16 + 12
    longer = engine.submit(np.concatenate([first[:12], rng.integers(0, 40, 8)]), 4, 0)
    engine.run()[longer]
    assert engine.prefix.hit_tokens == 12 and len(engine.prefix.entries) == 1  # the 12-token entry superseded
    assert len(next(iter(engine.prefix.entries.values())).tokens) == 20


@pytest.mark.parametrize("count, prefill_batch, prefills", [(4, None, 1), (3, None, 1), (3, 2, 2), (4, 1, 4)],
                         ids=["a full batch", "a batch padded by repeating a row", "batches of at most 2",
                              "one request per prefill"])
def test_requests_admitted_together_are_prefilled_in_one_program(model, rng, count, prefill_batch, prefills):
    """Batched prefill: requests of one prompt bucket admitted at one step are prefilled together (one insert
    program for up to `prefill_batch` of them, padded to a power of two), each still getting what generate gives
    its prompt alone."""
    options = dict(remasking="low_confidence_dynamic", denoising_steps=4)
    engine = Engine(model, slots=4, max_context=64, prefill_batch=prefill_batch, **options)
    prompts = [rng.integers(0, 40, n) for n in (9, 13, 15, 10)[:count]]  # one bucket: 16 positions
    ids = [engine.submit(p, 8, seed, *sampling) for seed, (p, sampling) in enumerate(zip(prompts, SAMPLING))]
    done = engine.run()
    assert (engine.timing.inserts, engine.timing.prefills) == (count, prefills)
    for request_id, prompt, seed, (t, p, top_k) in zip(ids, prompts, range(count), SAMPLING):
        alone = np.asarray(dllm_jax.generate(model, prompt[None], max_new_tokens=8, seed=seed,
                                             **own_options(options, t, p, top_k, {"top_k": 1})))[0]
        np.testing.assert_array_equal(done[request_id].tokens, alone, err_msg=f"request {request_id}")


@pytest.mark.parametrize("keep", [False, True], ids=["no prefix cache", "for the prefix cache"])
def test_an_insert_prefills_rows_as_wide_as_its_bucket(model, keep):
    """An insert's rows are its prompt bucket's width, not the slots' capacity (a burst of short prompts at a long
    context stays small); kept for the prefix cache, they come back padded to the capacity its entries have."""
    engine = Engine(model, slots=2, max_context=512, remasking="low_confidence_dynamic", denoising_steps=4)
    bucket, prompts = engine.buckets[0], np.ones((2, engine.buckets[0]), np.int32)
    state, rows = jax.eval_shape(
        functools.partial(insert, config=engine.config, loop=engine.loop, block_length=engine.block_length,
                          chunk=engine.prefill_chunk, keep=keep),
        engine.params, engine.state, np.asarray([0, 1], np.int32), prompts, np.asarray([9, 12], np.int32),
        np.asarray([8, 8], np.int32), np.zeros(2, np.int32), engine.state.rows,
        np.stack([stop_table(engine.config, ())] * 2), None, np.int32(0))
    capacity = engine.state.carry.cache.max_length
    assert bucket < capacity and state.carry.cache.k[0].shape == engine.state.carry.cache.k[0].shape
    assert rows.k[0].shape[:2] == (2, capacity if keep else bucket)


def test_a_prompt_of_a_chunk_and_part_of_a_block_prefills_rows_just_past_the_chunk(model, rng):
    """A prompt whose complete blocks fill one prefill chunk exactly, with a partial block after them, is inserted
    (not staged) in rows of a chunk and a block (the bucket the memory plan counts), not as wide as a slot, and gets
    what generate gives it alone."""
    options = dict(remasking="low_confidence_dynamic", denoising_steps=4)
    engine = Engine(model, slots=2, max_context=256, prefill_chunk=16, overlap=False, **options)
    bl = engine.block_length
    prompt = rng.integers(0, 40, 16 + bl - 1)
    request_id = engine.submit(prompt, 8, 3)
    width = engine.bucket(engine.queue[0])
    assert width == 16 + bl < engine.width and engine.buckets[-2] == width
    done = engine.run()
    assert engine.timing.prefill_chunks == 0 and engine.timing.inserts == 1
    alone = np.asarray(dllm_jax.generate(model, prompt[None], max_new_tokens=8, seed=3, **options))[0]
    np.testing.assert_array_equal(done[request_id].tokens, alone)


def test_a_long_prompt_is_prefilled_a_chunk_per_step_while_the_others_decode(tiny_model, rng):
    """Chunked prefill: a prompt of 4 prefill chunks arriving while a request decodes holds its slot for 4 steps,
    one chunk each, while the running request keeps decoding a block per step; both get what generate gives them
    alone."""
    model = tiny_model(tiny_sdar_config(vocab_size=48, mask_token_id=40, eos_token_ids=(), pad_token_id=42), seed=21)
    options = dict(remasking="sequential", top_k=1, denoising_steps=4)
    engine = Engine(model, slots=2, max_context=64, prefill_chunk=8, overlap=False, **options)
    short, long = rng.integers(0, 40, 5), rng.integers(0, 40, 34)  # the long one: 32 complete positions
    first = engine.submit(short, 28, 0)
    done = {c.request_id: c for c in engine.step()}
    second = engine.submit(long, 8, 1)
    decoded = [len(engine.progress()[first])]
    for _ in range(3):  # chunks 1-3: the long prompt stays staged, the short request decodes
        done.update((c.request_id, c) for c in engine.step())
        assert [s.request.request_id for s in engine.staged.values()] == [second]
        decoded.append(len(engine.progress()[first]))
    assert decoded == sorted(set(decoded)) and len(decoded) == 4  # a block more at every step
    done.update(engine.run())
    assert engine.timing.prefill_chunks == 4 and not engine.staged
    for request_id, prompt, k, seed in ((first, short, 28, 0), (second, long, 8, 1)):
        alone = np.asarray(dllm_jax.generate(model, prompt[None], max_new_tokens=k, seed=seed, **options))[0]
        np.testing.assert_array_equal(done[request_id].tokens, alone, err_msg=f"request {request_id}")


@pytest.mark.parametrize("overlap", [True, False])
def test_llada2_prompts_sharing_a_prefix_and_a_long_prompt_get_what_generate_gives_them(llada2, rng, overlap):
    """LLaDA2 in the slots with a prefix cache and chunked prefill (its own cache and prefill): a prompt sharing 3
    blocks with one before it, and a prompt of 2 prefill chunks, each what generate gives it alone."""
    options = dict(block_length=4, steps=4)
    engine = Engine(llada2, slots=2, max_context=64, prefix_cache_bytes=2**30, prefill_chunk=16, overlap=overlap,
                    **options)
    system = rng.integers(0, 40, 12)
    prompts = [np.concatenate([system, rng.integers(0, 40, 3)]), np.concatenate([system, rng.integers(0, 40, 2)]),
               rng.integers(0, 40, 26)]
    ids = [engine.submit(p, 8, i) for i, p in enumerate(prompts)]
    done = engine.run()
    for request_id, prompt in zip(ids, prompts):
        alone = np.asarray(dllm_jax.generate(llada2, prompt[None], gen_length=8, temperature=0.0, **options))[0]
        np.testing.assert_array_equal(done[request_id].tokens, alone, err_msg=f"request {request_id}")
    assert engine.prefix.hit_tokens >= 12 and engine.timing.prefill_chunks == 2


def test_one_long_prompt_is_staged_at_a_time_and_shorter_ones_pass_the_next(model, rng):
    """Two long prompts then a short one, three free slots: the first long prompt is staged, the second waits at the
    head of the queue (one staged cache, a slot wide, at a time), the short one is admitted; the second is staged
    once the first takes its slot."""
    engine = Engine(model, slots=3, max_context=64, prefill_chunk=8, overlap=False, remasking="sequential", top_k=1)
    first, second = (engine.submit(rng.integers(0, 40, 20), 8, seed) for seed in (0, 1))
    short = engine.submit(rng.integers(0, 40, 5), 8, 2)
    engine.step()
    assert [s.request.request_id for s in engine.staged.values()] == [first]
    assert [r.request_id for r in engine.queue] == [second]
    assert short in [r.request_id for r in engine.running if r is not None]
    while first not in [r.request_id for r in engine.running if r is not None]:
        engine.step()
    engine.step()
    assert [s.request.request_id for s in engine.staged.values()] == [second] and not engine.queue
    assert set(engine.run()) >= {second}


def test_a_staged_request_can_be_cancelled(model, rng):
    engine = Engine(model, slots=1, max_context=64, prefill_chunk=8, overlap=False, remasking="sequential", top_k=1)
    request = engine.submit(rng.integers(0, 40, 34), 8, 0)
    engine.step()
    assert engine.staged and engine.cancel(request) and not engine.staged and engine.idle
