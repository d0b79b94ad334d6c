"""The scheduler's order of work, against a fake engine (no JAX): a long prefill advances one
chunk per decode step, decode batches every running request, cancelled and timed-out
requests leave at once, and a failing step fails only its requests."""

import threading
import time

import numpy as np

import model
from serving.engine import Prefill
from serving.scheduler import Request, Scheduler

CHUNK = 4


class FakeEngine:
    n_slots = 2
    prefix_cache = None
    config = model.get_config("tiny")

    def __init__(self, fail_prefill_of=None):
        self.calls = []
        self.fail_prefill_of = fail_prefill_of

    def begin_prefill(self, tokens):
        return Prefill(np.asarray(tokens), None, 0, 0)

    def prefill_step(self, state):
        if len(state.tokens) == self.fail_prefill_of:
            raise RuntimeError("boom")
        self.calls.append(("prefill", len(state.tokens)))
        state.position = min(len(state.tokens), state.position + CHUNK)

    def first_token(self, state, sampling):
        return 1

    def cache_prompt(self, state):
        pass

    def insert(self, slot, state):
        self.calls.append(("insert", slot))

    def decode(self, batch):
        time.sleep(0.002)
        self.calls.append(("decode", tuple(sorted(batch))))
        return {slot: 1 for slot in batch}


def collect():
    events, done = [], threading.Event()

    def deliver(event):
        events.append(event)
        if event.kind != "token":
            done.set()

    return events, done, deliver


def run_scheduler(engine):
    scheduler = Scheduler(engine)
    scheduler.start()
    return scheduler


def test_long_prefill_interleaves_with_decode_and_joins_the_batch():
    engine = FakeEngine()
    scheduler = run_scheduler(engine)
    try:
        a_events, a_done, a_deliver = collect()
        scheduler.submit(Request("a", np.arange(3), 200, a_deliver))
        while ("insert", 0) not in engine.calls:
            time.sleep(0.001)
        b_events, b_done, b_deliver = collect()
        scheduler.submit(Request("b", np.arange(12), 5, b_deliver))  # 3 chunks
        assert b_done.wait(10) and a_done.wait(10)
    finally:
        scheduler.stop()
    calls = engine.calls
    b_chunks = [i for i, c in enumerate(calls) if c == ("prefill", 12)]
    assert len(b_chunks) == 3
    for i, j in zip(b_chunks, b_chunks[1:]):  # one decode step of "a" between two chunks
        assert calls[i + 1:j] == [("decode", (0,))]
    assert ("decode", (0, 1)) in calls[b_chunks[-1]:]  # then one step for both
    assert [e.kind for e in b_events] == ["token"] * 5 + ["done"]
    assert b_events[-1].finish_reason == "length" and a_events[-1].finish_reason == "length"
    assert len([e for e in a_events if e.kind == "token"]) == 200


def test_cancel_timeout_and_a_failing_step_end_only_their_requests():
    engine = FakeEngine(fail_prefill_of=7)
    scheduler = run_scheduler(engine)
    try:
        results = {}
        for name, prompt, timeout in (("cancel", 3, 60), ("slow", 3, 0.05), ("fail", 7, 60),
                                      ("ok", 5, 60)):
            events, done, deliver = collect()
            request = Request(name, np.arange(prompt), 10_000 if name != "ok" else 20,
                              deliver, timeout_s=timeout)
            results[name] = (request, events, done)
            scheduler.submit(request)
        time.sleep(0.05)
        scheduler.cancel(results["cancel"][0])
        for _, _, done in results.values():
            assert done.wait(10)
    finally:
        scheduler.stop()
    last = {name: events[-1] for name, (_, events, _) in results.items()}
    assert last["cancel"].finish_reason == "cancelled"
    assert last["slow"].kind == "error" and last["slow"].status == 504
    assert last["fail"].kind == "error" and last["fail"].status == 500
    assert "boom" in last["fail"].message
    assert last["ok"].finish_reason == "length" and len(results["ok"][0].generated) == 20
    assert scheduler.counts() == (0, 0)


def test_stop_token_ends_the_request_without_sending_it():
    engine = FakeEngine()
    scheduler = run_scheduler(engine)
    try:
        events, done, deliver = collect()
        scheduler.submit(Request("s", np.arange(3), 50, deliver, stop_token_ids=frozenset({1})))
        assert done.wait(10)
    finally:
        scheduler.stop()
    assert [e.kind for e in events] == ["done"] and events[0].finish_reason == "stop"


class PagedFakeEngine(FakeEngine):
    """Admits by memory as serving.paged_engine does: a request holds len(prompt) +
    max_tokens units from its start to its end."""

    n_slots = 4

    def __init__(self, units):
        super().__init__()
        self.units, self.held = units, {}

    def fits(self, tokens, max_tokens):
        return len(tokens) + max_tokens <= self.units

    def begin_prefill(self, tokens, max_tokens):
        self.units -= len(tokens) + max_tokens
        self.calls.append(("start", len(tokens)))
        state = super().begin_prefill(tokens)
        state.pages = len(tokens) + max_tokens
        return state

    def insert(self, slot, state):
        super().insert(slot, state)
        self.held[slot] = state.pages

    def discard(self, state):
        self.units += state.pages

    def release(self, slot):
        self.units += self.held.pop(slot)


def test_requests_wait_for_memory_first_come_first_served_and_give_it_back():
    engine = PagedFakeEngine(units=20)
    scheduler = run_scheduler(engine)
    try:
        done = []
        for name, prompt, max_tokens in (("a", 8, 6), ("big", 12, 6), ("small", 2, 2)):
            events, finished, deliver = collect()
            scheduler.submit(Request(name, np.arange(prompt), max_tokens, deliver))
            done.append(finished)
        for finished in done:
            assert finished.wait(10)
    finally:
        scheduler.stop()
    starts = [c for c in engine.calls if c[0] == "start"]
    # "big" (18 units) waits for "a" (14 of 20) to end; "small" (4) would fit beside "a"
    # but does not pass "big"
    assert starts == [("start", 8), ("start", 12), ("start", 2)]
    assert engine.units == 20 and not engine.held
