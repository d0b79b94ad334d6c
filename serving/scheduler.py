"""The scheduler: one worker thread that owns the engine and runs every request.

Each turn of its loop: take new requests; drop the cancelled and the timed-out (their work
stops there, their slots free up); start the next waiting request's prefill when a decode
slot is free and no other prefill runs; prefill one chunk of it; run one batched decode
step for every running request. A long prefill therefore advances one chunk per decode
step, and running requests keep streaming while it does.

Requests talk to their caller only through `deliver(event)`, called on this thread (the
API turns it into a hand-off to the event loop), or once from another thread by `fail_all`
(a lost host: the worker may be blocked in a collective that never returns). Each request
gets exactly one terminal event ("done" or "error"); nothing is delivered after it.
"""

import collections
import dataclasses
import logging
import threading
import time
import traceback

import numpy as np

from serving import program_maps
from serving.engine import Sampling
from serving.hosts import HostLostError
from serving.metrics import indexer_prefill_share

log = logging.getLogger("serving.scheduler")


@dataclasses.dataclass(frozen=True)
class Event:
    """kind: "token" (token), "done" (finish_reason: stop | length | cancelled) or "error"
    (status, message, error_type). time: time.perf_counter() when it happened."""

    kind: str
    time: float
    token: int | None = None
    finish_reason: str | None = None
    status: int | None = None
    message: str | None = None
    error_type: str | None = None


@dataclasses.dataclass(eq=False)
class Request:
    id: str
    prompt: np.ndarray
    max_tokens: int
    deliver: object  # callable(Event), called on the worker thread
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    stop_token_ids: frozenset = frozenset()
    timeout_s: float = 600.0
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    variant: int = 0  # which engine (selection configuration) runs it: serving.rollout
    # Worker-thread state
    generated: list = dataclasses.field(default_factory=list)
    cache_hit_tokens: int = 0
    prefill_start: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason: str | None = None
    _cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    _closed: bool = False  # its terminal event went out (under Scheduler._deliver_lock)

    @property
    def deadline(self):
        return self.arrival + self.timeout_s

    @property
    def cancelled(self):
        return self._cancelled.is_set()


class Scheduler:
    """engine: one Engine, or a list of them (the variants of a canary rollout: the same
    weights under other selection switches, each with its own decode slots and prefix
    cache); a request runs on engines[request.variant] from its prefill to its end.
    metrics: a serving.metrics.Metrics, or one per engine (Metrics.for_version views).
    on_shadow: called (variant, ShadowRecord) for each watched prefill chunk."""

    def __init__(self, engine, metrics=None, *, batching_window_s=0.0, on_shadow=None):
        self.engines = list(engine) if isinstance(engine, (list, tuple)) else [engine]
        self.engine = self.engines[0]
        if not isinstance(metrics, (list, tuple)):
            metrics = [metrics] * len(self.engines)
        self.metrics_of = list(metrics)
        self.metrics = self.metrics_of[0]
        self.on_shadow = on_shadow
        self.batching_window_s = batching_window_s
        self._cond = threading.Condition()
        self._incoming = collections.deque()
        self._stop = False
        self.waiting = collections.deque()
        self.prefilling = None  # (Request, engine.Prefill, (variant, slot))
        self.running = {}  # (variant, slot) -> Request
        self.finished_log = collections.deque(maxlen=1000)  # (id, reason, tokens out)
        self._thread = None
        self._deliver_lock = threading.Lock()
        self._failure = None  # fail_all's (status, message, error_type): the worker stops

    # ------------------------------------------------------------------ any thread

    def start(self):
        self._thread = threading.Thread(target=self._loop, name="dosa-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout=10.0):
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request):
        with self._cond:
            if self._failure is None:
                self._incoming.append(request)
                self._cond.notify_all()
                return
        self._send(request, _error_event(self._failure))

    def fail_all(self, status, message, error_type):
        """Answers every admitted request (waiting, prefilling, running) with this error and
        stops the worker at its next turn; later submits get it too. Safe from any thread:
        worker-owned state is only read here, and the worker's own deliveries to these
        requests are dropped from now on."""
        with self._cond:
            self._failure = (status, message, error_type)
            self._cond.notify_all()
            requests = list(self._incoming) + list(self.waiting) + list(self.running.values())
            if self.prefilling is not None:
                requests.append(self.prefilling[0])
        for request in requests:
            request.finish_reason = "error"
            self._send(request, _error_event(self._failure))
        log.error("failed %d requests: %s", len(requests), message)

    def cancel(self, request):
        """Stops `request`'s work at the worker's next turn (client gone, stop string)."""
        request._cancelled.set()
        with self._cond:
            self._cond.notify_all()

    def counts(self):
        """(running, waiting): prefilling or decoding, and admitted but not started."""
        running = len(self.running) + (self.prefilling is not None)
        return running, len(self.waiting) + len(self._incoming)

    # ------------------------------------------------------------------ worker thread

    def _loop(self):
        while True:
            with self._cond:
                busy = self.running or self.prefilling or self.waiting
                if not busy and not self._incoming and not self._stop:
                    self._cond.wait()
                    # Just woken from idle: give other requests a moment to join the batch.
                    deadline = time.perf_counter() + self.batching_window_s
                    slots = sum(e.n_slots for e in self.engines)
                    while (not self._stop and len(self._incoming) < slots
                           and time.perf_counter() < deadline):
                        self._cond.wait(deadline - time.perf_counter())
                if self._stop or self._failure is not None:
                    return
                self.waiting.extend(self._incoming)
                self._incoming.clear()
            try:
                self._turn()
            except Exception:  # keep serving; the turn's requests got their error
                log.error("engine turn failed:\n%s", traceback.format_exc())
            # Between turns, nothing in flight: the compiled programs may be dropped here
            # when they near the process's memory-map cap (serving.program_maps).
            program_maps.budget().check()
            self._update_gauges()

    def _turn(self):
        self._drop_cancelled()
        if self.prefilling is None:
            # The first waiting request whose engine has a free slot and room for its cache
            # (sides do not block each other; within a side, first come first served: a
            # request that waits for pages is not passed by later, smaller ones).
            blocked = set()
            for request in self.waiting:
                if request.variant in blocked:
                    continue
                free = self._free_slots(request.variant)
                if free and not self._fits(request):
                    blocked.add(request.variant)
                    continue
                if free:
                    self.waiting.remove(request)
                    self._guarded([request], self._begin_prefill, request,
                                  (request.variant, free[0]))
                    break
        if self.prefilling is not None:
            request, state, slot = self.prefilling
            self._guarded([request], self._prefill_chunk, request, state, slot)
        for variant in sorted({v for v, _ in self.running}):
            requests = [r for (v, _), r in self.running.items() if v == variant]
            self._guarded(requests, self._decode, variant)

    def _fits(self, request):
        """Whether the request's engine has the memory to start it now: an engine that
        admits by pages (serving.paged_engine) says so; slot engines always do."""
        fits = getattr(self.engines[request.variant], "fits", None)
        return fits is None or fits(request.prompt, request.max_tokens)

    def _release(self, request, state=None, slot=None):
        """Gives back what a paged engine holds for the request (its pages)."""
        engine = self.engines[request.variant]
        if state is not None and hasattr(engine, "discard"):
            engine.discard(state)
        if slot is not None and hasattr(engine, "release"):
            engine.release(slot[1])

    def _m(self, request):
        return self.metrics_of[request.variant]

    def _guarded(self, requests, fn, *args):
        try:
            fn(*args)
        except HostLostError:  # fail_all has answered every request; the loop ends
            log.error("engine call failed: a host of the group is lost")
        except Exception as e:
            log.error("engine error:\n%s", traceback.format_exc())
            for request in requests:
                self._finish(request, error=(500, f"internal error: {type(e).__name__}: {e}",
                                             "server_error"))
            if fn == self._decode:  # the donated slot caches may be gone: start afresh
                self.engines[args[0]].reset_slots()

    def _free_slots(self, variant=0):
        taken = set(self.running)
        if self.prefilling is not None:
            taken.add(self.prefilling[2])
        return [s for s in range(self.engines[variant].n_slots) if (variant, s) not in taken]

    def _drop_cancelled(self):
        now = time.perf_counter()
        requests = list(self.waiting) + list(self.running.values())
        if self.prefilling is not None:
            requests.append(self.prefilling[0])
        for request in requests:
            if request.cancelled:
                self._finish(request, reason="cancelled")
            elif now > request.deadline:
                self._finish(request, error=(504, f"request timed out after "
                                                  f"{request.timeout_s:g} s", "timeout_error"))

    def _begin_prefill(self, request, slot):
        request.prefill_start = time.perf_counter()
        engine, metrics = self.engines[request.variant], self._m(request)
        if metrics is not None:
            metrics.queue_time.labels(**metrics.labels).observe(
                request.prefill_start - request.arrival)
        if hasattr(engine, "fits"):  # it reserves the pages of prompt + max_tokens
            state = engine.begin_prefill(request.prompt, request.max_tokens)
        else:
            state = engine.begin_prefill(request.prompt)
        request.cache_hit_tokens = state.cache_hit_tokens
        if metrics is not None:
            metrics.observe_cache_lookup(len(request.prompt), state.cache_hit_tokens)
            share = indexer_prefill_share(engine.config, state.position,
                                          len(request.prompt) - state.position)
            if share is not None:  # a model the cost model counts
                metrics.indexer_share.labels(**metrics.labels).set(share)
        self.prefilling = (request, state, slot)

    def _prefill_chunk(self, request, state, slot):
        engine, metrics = self.engines[request.variant], self._m(request)
        seconds = getattr(state, "step_seconds", 0.0)
        try:
            engine.prefill_step(state)
        finally:
            self._record_step(request, state, seconds)
        if not state.done:
            return
        self.prefilling = None
        token = engine.first_token(state, request.sampling)
        if metrics is not None:
            metrics.prefill_time.labels(**metrics.labels).observe(
                time.perf_counter() - request.prefill_start)
        goes_on = self._emit_token(request, token)  # first: caching must not delay TTFT
        engine.cache_prompt(state)
        if metrics is not None and engine.prefix_cache is not None:
            metrics.set_cache_usage(engine.prefix_cache.usage())
        if goes_on:
            engine.insert(slot[1], state)
            self.running[slot] = request
        else:
            self._release(request, state=state)

    def _record_step(self, request, state, seconds_before):
        """The prefill seconds of the step just run, and its shadow records, if any."""
        metrics = self._m(request)
        records = getattr(state, "shadow", None) or []
        if metrics is not None and hasattr(state, "step_seconds"):
            metrics.prefill_seconds.labels(**metrics.labels).inc(
                state.step_seconds - seconds_before)
        for record in records:
            if metrics is not None:
                metrics.observe_shadow(record)
            if self.on_shadow is not None:
                self.on_shadow(request.variant, record)
        if records:
            records.clear()

    def _decode(self, variant):
        running = {slot: r for (v, slot), r in self.running.items() if v == variant}
        batch = {slot: (r.generated[-1], len(r.prompt) + len(r.generated) - 1, r.sampling,
                        len(r.generated)) for slot, r in running.items()}
        for slot, token in self.engines[variant].decode(batch).items():
            self._emit_token(running[slot], token)

    def _emit_token(self, request, token):
        """Delivers `token` (or finishes the request on a stop token or its length limit);
        returns whether the request goes on."""
        now = time.perf_counter()
        metrics = self._m(request)
        if request.first_token_time is None:
            request.first_token_time = now
        elif metrics is not None:
            metrics.inter_token.labels(**metrics.labels).observe(now - request.last_token_time)
        request.last_token_time = now
        if token in request.stop_token_ids:
            self._finish(request, reason="stop")
            return False
        request.generated.append(token)
        if metrics is not None:
            metrics.generated_tokens.labels(**metrics.labels).inc()
        self._send(request, Event("token", now, token=token))
        if len(request.generated) >= request.max_tokens:
            self._finish(request, reason="length")
            return False
        return True

    def _finish(self, request, *, reason=None, error=None):
        """Removes `request` from wherever it is and tells its caller."""
        if request in self.waiting:
            self.waiting.remove(request)
        if self.prefilling is not None and self.prefilling[0] is request:
            self._release(request, state=self.prefilling[1])
            self.prefilling = None  # its cache is dropped with the Prefill
        for slot, r in list(self.running.items()):
            if r is request:
                del self.running[slot]
                self._release(request, slot=slot)
        now = time.perf_counter()
        if error is not None:
            request.finish_reason = "error"
            event = _error_event(error, now)
        else:
            request.finish_reason = reason
            event = Event("done", now, finish_reason=reason)
        self.finished_log.append((request.id, request.finish_reason, len(request.generated)))
        self._send(request, event)

    def _send(self, request, event):
        # Under the lock, so that no token follows fail_all's error (deliver only hands the
        # event to the event loop).
        with self._deliver_lock:
            if request._closed:
                return
            request._closed = event.kind in ("done", "error")
            try:
                request.deliver(event)
            except Exception:  # a caller that is gone (closed loop) must not stop the engine
                log.warning("could not deliver %s to request %s", event.kind, request.id)

    def _update_gauges(self):
        if self.metrics is None:
            return
        maps = program_maps.budget()
        self.metrics.set_memory_maps(*maps.usage(), maps.drops)
        prefilling = self.prefilling[0].variant if self.prefilling is not None else None
        waiting = list(self.waiting) + list(self._incoming)
        for variant, metrics in enumerate(self.metrics_of):
            running = sum(v == variant for v, _ in self.running) + (prefilling == variant)
            metrics.running.labels(**metrics.labels).set(running)
            counts = getattr(self.engines[variant], "page_counts", None)
            if counts is not None:
                metrics.set_page_counts(counts())
            metrics.waiting.labels(**metrics.labels).set(
                sum(r.variant == variant for r in waiting))


def _error_event(error, now=None):
    status, message, error_type = error
    return Event("error", time.perf_counter() if now is None else now, status=status,
                 message=message, error_type=error_type)
