"""Unit tests of the scheduler with the real (pure-Python) KV-cache manager and no model.

Each test drives the scheduler as the engine does: ``schedule()``, then a token "sampled"
by the test for every request whose step reaches its end, then ``update_from_output``.
"""

from __future__ import annotations

import itertools
import random
from typing import NamedTuple

import pytest

from pagedllm.core.config import SchedulerConfig
from pagedllm.core.kv_cache import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sampling.params import SamplingParams
from pagedllm.core.scheduler import RunnerOutput, Scheduler, SchedulerOutput

BS = 4  # block size
EOS = 2
TOK = 7  # the token sampled unless a test says otherwise

_arrival = itertools.count()


def make_scheduler(
    num_blocks=64, max_model_len=256, caching=False, extensions=(), **overrides
) -> Scheduler:
    fields = dict(
        max_num_batched_tokens=32,
        max_num_seqs=8,
        enable_chunked_prefill=True,
        max_num_partial_prefills=1,
        max_long_partial_prefills=1,
        long_prefill_token_threshold=0,
        policy="fcfs",
        preemption_mode="recompute",
        delay_factor=0.0,
        scheduler_cls=None,
    )
    fields.update(overrides)
    kv = KVCacheManager(num_blocks, BS, enable_caching=caching)
    return Scheduler(SchedulerConfig(**fields), kv, max_model_len, extensions=extensions)


def add(sched: Scheduler, rid: str, prompt: int | list[int], priority=0, **params) -> Request:
    """Add request ``rid``; an int prompt is that many tokens unique to the request."""
    if isinstance(prompt, int):
        base = 1000 * (len(sched.requests) + 1) + 100_000 * next(_arrival)
        prompt = list(range(base, base + prompt))
    params.setdefault("max_tokens", 4)
    sampling_params = SamplingParams(**params)
    sampling_params.update_from_tokenizer(eos_token_id=EOS)
    request = Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=sampling_params,
        eos_token_id=EOS,
        arrival_time=float(next(_arrival)),
        priority=priority,
    )
    sched.add_request(request)
    return request


class Step(NamedTuple):
    out: SchedulerOutput
    new: dict[str, int]  # request id -> tokens scheduled
    sampled: dict[str, int]  # request id -> token sampled (the items that reached the end)


def step(sched: Scheduler, token=TOK, finished: list | None = None) -> Step:
    """One engine step; ``token`` is an int or a function of the request. Checks the
    invariants that hold after every ``schedule()``; appends finished requests.
    (``item.reaches_end`` is read before ``update_from_output``, which changes it.)"""
    out = sched.schedule()
    cfg = sched.config
    ids = [item.request.request_id for item in out.scheduled]
    assert len(ids) == len(set(ids))
    assert out.num_scheduled_tokens == sum(item.num_new_tokens for item in out.scheduled)
    assert out.num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    for item in out.scheduled:
        request = item.request
        assert request.status is RequestStatus.RUNNING and request in sched.running
        assert item.num_new_tokens >= 1
        assert item.num_computed_tokens == request.num_computed_tokens
        # The block table travels with the scheduled item: the runner never asks the KV
        # manager.
        assert item.block_ids == sched.kv.get_block_ids(request.request_id)
        assert len(item.block_ids) * BS >= item.num_computed_tokens + item.num_new_tokens
    for rid in out.preempted_request_ids:
        request = sched.requests[rid]
        assert request.status is RequestStatus.PREEMPTED and request.num_computed_tokens == 0
        assert request in list(sched.waiting) and not sched.kv.get_block_ids(rid)
    waiting = list(sched.waiting)
    assert not set(waiting) & set(sched.running)
    assert {r.request_id for r in waiting + sched.running} == set(sched.requests)
    sampled = {
        item.request.request_id: token(item.request) if callable(token) else token
        for item in out.scheduled
        if item.reaches_end
    }
    updated = sched.update_from_output(out, RunnerOutput(sampled))
    assert {r.request_id for r in updated} == set(sampled)
    if finished is not None:
        finished.extend(r for r in updated if r.is_finished)
    return Step(
        out, {item.request.request_id: item.num_new_tokens for item in out.scheduled}, sampled
    )


def run_all(sched: Scheduler, token=TOK, max_steps=500) -> list[Request]:
    finished: list[Request] = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return finished
        step(sched, token, finished)
    raise AssertionError("requests did not finish")


# --------------------------------------------------------------------- token budget


def test_long_prompt_is_chunked_across_steps():
    sched = make_scheduler(max_num_batched_tokens=16)
    request = add(sched, "a", 40)
    for computed_before, expected in [(0, 16), (16, 16), (32, 8)]:
        s = step(sched)
        (item,) = s.out.scheduled
        assert (item.num_computed_tokens, item.num_new_tokens) == (computed_before, expected)
        assert request.num_computed_tokens == computed_before + expected
        assert s.sampled == ({"a": TOK} if expected == 8 else {})  # a chunk samples nothing
    assert request.output_token_ids == [TOK]
    assert step(sched).new == {"a": 1} and request.num_computed_tokens == 41


def test_budget_is_shared_and_never_exceeded():
    sched = make_scheduler(max_num_batched_tokens=16, max_num_partial_prefills=4)
    for i in range(6):
        add(sched, f"r{i}", 5 + 3 * i, max_tokens=3)
    s = step(sched)
    assert s.new == {"r0": 5, "r1": 8, "r2": 3}  # the last one is a chunk
    assert set(s.sampled) == {"r0", "r1"} and s.out.num_scheduled_tokens == 16
    assert len(run_all(sched)) == 6


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits():
    sched = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    add(sched, "a", 10)
    add(sched, "b", 10)
    add(sched, "c", 2)  # fits, but stays behind b (first come, first served)
    assert step(sched).new == {"a": 10}
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    s = step(sched)
    assert s.new == {"a": 1, "b": 10, "c": 2}
    assert set(s.sampled) == {"a", "b", "c"}


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(5):
        add(sched, f"r{i}", 3, max_tokens=2)
    assert set(step(sched).new) == {"r0", "r1"} and sched.num_waiting == 3
    finished = run_all(sched)
    assert [r.request_id for r in finished] == ["r0", "r1", "r2", "r3", "r4"]


@pytest.mark.parametrize(
    ("max_partial", "max_long", "first_step"),
    [
        (1, 1, {"a": 8, "c": 6}),
        (2, 1, {"a": 8, "c": 6}),
        (2, 2, {"a": 8, "c": 6, "b": 8}),
        (3, 2, {"a": 8, "c": 6, "b": 8}),
        (3, 3, {"a": 8, "c": 6, "b": 8, "d": 8}),
    ],
)
def test_partial_prefill_limits(max_partial, max_long, first_step):
    sched = make_scheduler(
        max_num_batched_tokens=64,
        max_num_partial_prefills=max_partial,
        max_long_partial_prefills=max_long,
        long_prefill_token_threshold=8,
    )
    for rid, n in [("a", 20), ("b", 20), ("c", 6), ("d", 20)]:
        add(sched, rid, n)
    s = step(sched)
    assert s.new == first_step  # c, short, overtakes the long prompts the limits hold back
    assert [r.request_id for r in sched.waiting] == [r for r in "bd" if r not in first_step]
    while sched.has_unfinished_requests():
        s = step(sched)
        partial = [item for item in s.out.scheduled if item.request.request_id not in s.sampled]
        assert len(partial) <= max_partial
        assert sum(item.request.num_tokens > 8 for item in partial) <= max_long
        assert max(s.new.values()) <= 8  # the threshold caps every request's step


# -------------------------------------------------------------------- stop conditions


@pytest.mark.parametrize(
    ("params", "token", "num_outputs", "status", "stop_reason"),
    [
        ({}, EOS, 1, RequestStatus.FINISHED_STOPPED, None),
        ({"ignore_eos": True, "max_tokens": 5}, EOS, 5, RequestStatus.FINISHED_LENGTH_CAPPED, None),
        ({"stop_token_ids": [9]}, 9, 1, RequestStatus.FINISHED_STOPPED, 9),
        ({"stop_token_ids": [9]}, TOK, 4, RequestStatus.FINISHED_LENGTH_CAPPED, None),
        ({"max_tokens": 3}, TOK, 3, RequestStatus.FINISHED_LENGTH_CAPPED, None),
        ({"min_tokens": 3}, EOS, 3, RequestStatus.FINISHED_STOPPED, None),
        ({"max_tokens": 100}, TOK, 7, RequestStatus.FINISHED_LENGTH_CAPPED, None),  # model len
    ],
)
def test_stop_conditions(params, token, num_outputs, status, stop_reason):
    sched = make_scheduler(max_model_len=13, num_blocks=8, caching=True)
    free_at_start = sched.kv.num_free_blocks
    request = add(sched, "a", 6, **params)
    add(sched, "other", 3, max_tokens=20, ignore_eos=True)
    finished = []
    while request.request_id in sched.requests:
        step(sched, lambda r: token if r is request else TOK, finished)
    assert finished[0] is request
    assert request.num_output_tokens == num_outputs
    assert (request.status, request.stop_reason) == (status, stop_reason)
    stopped = status is RequestStatus.FINISHED_STOPPED
    assert request.status.finish_reason == ("stop" if stopped else "length")
    assert request not in sched.running and not sched.kv.get_block_ids("a")
    sched.finish_requests(["other"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks == free_at_start


# ------------------------------------------------------------ preemption and resumption


def test_preemption_frees_the_last_request_and_resumes_it_first():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=32)
    a = add(sched, "a", 6, max_tokens=10)
    b = add(sched, "b", 6, max_tokens=10)
    assert step(sched).new == {"a": 6, "b": 6} and sched.kv.num_free_blocks == 0
    add(sched, "c", 2, max_tokens=1)  # no free block: it waits behind the running ones
    assert step(sched).new == {"a": 1, "b": 1}
    assert step(sched).new == {"a": 1, "b": 1}
    s = step(sched)  # a's 9th token needs a third block: b, the last one, is preempted
    assert s.new == {"a": 1} and s.out.preempted_request_ids == ["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert b.num_computed_tokens == 0 and b.output_token_ids == [TOK] * 3
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert sched.kv.num_free_blocks == 1 and sched.num_preemptions == 1
    finished = []
    while a.request_id in sched.requests:
        assert step(sched, finished=finished).new == {"a": 1}  # b needs 3 blocks
    s = step(sched, finished=finished)  # b recomputes its prompt and its three outputs
    assert s.new == {"b": 9, "c": 2} and s.sampled == {"b": TOK, "c": TOK}
    assert s.out.scheduled[0].num_computed_tokens == 0
    finished += run_all(sched)
    assert [r.request_id for r in finished] == ["a", "c", "b"]
    assert b.output_token_ids == [TOK] * 10
    assert sched.kv.num_free_blocks == 4 and sched.num_preemptions == 1


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize(("chunked", "caching"), [(True, True), (True, False), (False, True)])
def test_random_workload_with_a_tiny_cache_loses_nothing(policy, chunked, caching):
    rng = random.Random(f"{policy}{chunked}{caching}")
    sched = make_scheduler(
        num_blocks=10,
        max_model_len=40,
        caching=caching,
        max_num_batched_tokens=40 if not chunked else 12,
        enable_chunked_prefill=chunked,
        max_num_partial_prefills=3,
        max_long_partial_prefills=1,
        long_prefill_token_threshold=6 if chunked else 0,
        policy=policy,
    )
    shared = [rng.randrange(10, 500) for _ in range(12)]  # some prompts share a prefix
    expected, finished, preempted = {}, [], set()
    for i in range(40):
        n = rng.randrange(1, 25)
        prompt = shared[: rng.randrange(12)] + [rng.randrange(10, 500) for _ in range(n)]
        max_tokens = rng.randrange(1, 40 - len(prompt))
        rid = f"r{i}"
        add(
            sched,
            rid,
            prompt,
            priority=rng.randrange(3) if policy == "priority" else 0,
            max_tokens=max_tokens,
            ignore_eos=True,
        )
        expected[rid] = [1000 + k for k in range(max_tokens)]
        if rng.random() < 0.5:
            s = step(sched, lambda r: 1000 + r.num_output_tokens, finished)
            preempted.update(s.out.preempted_request_ids)
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        s = step(sched, lambda r: 1000 + r.num_output_tokens, finished)
        preempted.update(s.out.preempted_request_ids)
    ids = [r.request_id for r in finished]
    assert sorted(ids) == sorted(expected)  # every request finished exactly once
    for request in finished:
        assert request.output_token_ids == expected[request.request_id]
        assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert len(preempted) > 3 and not sched.running and not sched.num_waiting
    assert sched.kv.num_free_blocks == 10


# ------------------------------------------------------------------- priority policy


def test_priority_orders_the_waiting_queue_then_arrival():
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    for rid, priority in [("p3", 3), ("p1", 1), ("p2", 2), ("p1-later", 1), ("p0", 0)]:
        add(sched, rid, 3, priority=priority, max_tokens=2)
    assert [r.request_id for r in sched.waiting] == ["p0", "p1", "p1-later", "p2", "p3"]
    finished = run_all(sched)
    assert [r.request_id for r in finished] == ["p0", "p1", "p1-later", "p2", "p3"]


def test_priority_preempts_the_worst_request_even_if_scheduled_earlier():
    sched = make_scheduler(
        num_blocks=4, max_model_len=16, max_num_batched_tokens=4, policy="priority"
    )
    low = add(sched, "low", 3, priority=5, max_tokens=30)
    assert step(sched).new == {"low": 3}
    add(sched, "h1", 3, priority=0, max_tokens=30)
    assert step(sched).new == {"low": 1, "h1": 3}
    add(sched, "h2", 12, priority=0, max_tokens=30)
    assert step(sched).new == {"low": 1, "h1": 1, "h2": 2} and sched.kv.num_free_blocks == 0
    assert [r.request_id for r in sched.running] == ["low", "h1", "h2"]
    # low is scheduled first, then h1 needs a block: low is the victim, and its token of
    # budget goes to h2 (3 tokens, not 2).
    s = step(sched)
    assert s.out.preempted_request_ids == ["low"] and s.new == {"h1": 1, "h2": 3}
    assert s.out.num_scheduled_tokens == 4
    assert low.status is RequestStatus.PREEMPTED and low.output_token_ids == [TOK] * 3
    assert list(sched.waiting) == [low] and not sched.kv.get_block_ids("low")
    assert len(run_all(sched)) == 3 and sched.kv.num_free_blocks == 4


# -------------------------------------------------------------------------- aborting


def test_finish_requests_aborts_waiting_and_running_requests():
    sched = make_scheduler(num_blocks=8, max_num_seqs=2, caching=True)
    running = [add(sched, "r0", 6), add(sched, "r1", 6)]
    waiting = add(sched, "w", 6)
    step(sched)
    assert sched.kv.num_free_blocks == 4 and waiting.status is RequestStatus.WAITING
    aborted = sched.finish_requests(["w", "r1", "nope"], RequestStatus.FINISHED_ABORTED)
    assert aborted == [waiting, running[1]]
    assert sched.finish_requests(["w", "nope"], RequestStatus.FINISHED_ABORTED) == []
    for request in aborted:
        assert request.status is RequestStatus.FINISHED_ABORTED
        assert request.status.finish_reason == "abort"
    assert sched.running == [running[0]] and not sched.num_waiting
    assert set(sched.requests) == {"r0"} and sched.kv.num_free_blocks == 6
    # Aborted while its step runs: update_from_output leaves it alone.
    out = sched.schedule()
    sched.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, RunnerOutput({"r0": TOK})) == []
    assert running[0].output_token_ids == [TOK] and sched.kv.num_free_blocks == 8
    assert not sched.has_unfinished_requests() and sched.schedule().is_empty


# -------------------------------------------------------------------- prefix caching


def test_prefix_cache_hits_through_the_scheduler():
    sched = make_scheduler(caching=True)
    prefix = list(range(100, 110))  # two full blocks and a half
    a = add(sched, "a", [*prefix, 1, 2], max_tokens=20)
    s = step(sched)
    assert s.new == {"a": 12} and a.num_cached_tokens == 0
    b = add(sched, "b", [*prefix, 3, 4, 5])
    c = add(sched, "c", [*prefix, 1, 2])  # the same prompt: all but its last block
    s = step(sched)
    assert s.new == {"a": 1, "b": 5, "c": 4}
    assert [item.num_computed_tokens for item in s.out.scheduled] == [12, 8, 8]
    assert (b.num_cached_tokens, c.num_cached_tokens) == (8, 8)
    assert b.num_computed_tokens == 13 and c.num_computed_tokens == 12
    assert sched.kv.total_prefix_cache_stats.hits == 16 + 0


@pytest.mark.parametrize("caching", [True, False])
def test_requests_one_after_another_reuse_freed_blocks(caching):
    """Freed KV blocks are reused before never-touched ones (whose pages the OS would
    commit at their first write): requests served one after another, each finished
    before the next arrives, keep to a few blocks of the 64 (the prefix cache keeps
    about as many freed blocks as the most held at once). A shared prefix still hits."""
    sched = make_scheduler(num_blocks=64, caching=caching)
    system = list(range(500, 508))  # two full blocks every request starts with
    handed_out: set[int] = set()
    most_held = 0
    for index in range(30):
        start = 10_000 * (index + 1)
        add(sched, f"r{index}", [*system, *range(start, start + 6)])
        while sched.has_unfinished_requests():
            s = step(sched)
            held = {b for item in s.out.scheduled for b in item.block_ids}
            handed_out |= held
            most_held = max(most_held, len(held))
    assert most_held == 5  # 14 prompt tokens and 3 of 4 outputs computed: 17 tokens
    assert len(handed_out) <= 2 * most_held + 1, sorted(handed_out)
    stats = sched.kv.total_prefix_cache_stats
    assert stats.hits == (8 * 29 if caching else 0)
    # The cache still holds the last request's blocks: the same prompt again hits them.
    last = add(sched, "again", [*system, *range(300_000, 300_006)])
    run_all(sched)
    assert last.num_cached_tokens == (12 if caching else 0)


def test_delay_factor_holds_new_prompts_back(monkeypatch):
    import pagedllm.core.scheduler as scheduler_module

    clock = [100.0]
    monkeypatch.setattr(scheduler_module.time, "monotonic", lambda: clock[0])
    sched = make_scheduler(delay_factor=1.0)
    add(sched, "a", 4)
    out = sched.schedule()  # admits "a" at t=100
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    clock[0] = 102.0  # that prompt step took 2 s
    sched.update_from_output(out, RunnerOutput({"a": TOK}))
    add(sched, "b", 4)
    out = sched.schedule()  # t=102: 2 s since the prompt step, latency 2 s: hold "b"
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    sched.update_from_output(out, RunnerOutput({"a": TOK}))
    clock[0] = 104.5  # more than factor x latency since the last prompt step
    out = sched.schedule()
    assert {s.request.request_id for s in out.scheduled} == {"a", "b"}

    no_delay = make_scheduler()
    add(no_delay, "a", 4)
    no_delay.update_from_output(no_delay.schedule(), RunnerOutput({"a": TOK}))
    add(no_delay, "b", 4)
    assert {s.request.request_id for s in no_delay.schedule().scheduled} == {"a", "b"}


def test_waiting_queue_is_one_class_per_policy():
    from pagedllm.core.waiting_queue import FCFSQueue, PriorityQueue, WaitingQueue

    assert type(make_scheduler(policy="fcfs").waiting) is FCFSQueue
    assert type(make_scheduler(policy="priority").waiting) is PriorityQueue
    with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'.*fcfs, priority"):
        WaitingQueue.for_policy("lifo")


def test_a_failed_constraint_compile_aborts_the_request_and_is_never_admitted():
    from concurrent.futures import Future

    from pagedllm.features.guided import GuidedExtension

    guided = GuidedExtension(manager=None)  # (compiles only: no mask, no matcher)
    sched = make_scheduler(extensions=[guided])
    compiling: Future = Future()
    request = add(sched, "guided", 4)
    request.features["guided"] = compiling
    sched.waiting.remove({request})
    del sched.requests["guided"]
    sched.add_request(request)  # with its compile pending
    add(sched, "plain", 4)
    out = sched.schedule()
    assert [i.request.request_id for i in out.scheduled] == ["plain"] and not out.aborted
    compiling.set_exception(ValueError("bad schema"))
    out = sched.schedule()
    assert [(r.request_id, str(e)) for r, e in out.aborted] == [("guided", "bad schema")]
    assert request.status is RequestStatus.FINISHED_ABORTED and "guided" not in sched.requests
    # Failed, but its done-callback has not run yet when the scheduler reaches it.
    late: Future = Future()
    other = add(sched, "late", 4)
    sched.waiting.remove({other})
    del sched.requests["late"]
    other.features["guided"] = late
    sched.add_request(other)
    late.set_exception(ValueError("too big"))
    guided.failures.clear()
    out = sched.schedule()
    assert "late" not in {i.request.request_id for i in out.scheduled}
    assert [(r.request_id, str(e)) for r, e in out.aborted] == [("late", "too big")]
    assert not sched.kv.get_block_ids("late")
