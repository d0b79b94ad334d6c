"""Serving on several processes (jax.distributed): process 0 leads, the others follow.

A jitted step on a mesh that spans several processes is a collective: every process must
run it, in the same order, with the same inputs. Process 0 serves HTTP and runs the
scheduler against a `Leader`, which wraps its Engine: each engine call first broadcasts a
small description of itself (an op and a few numbers) to every process, then runs. The
other processes run `follow`: receive a description, replay the same engine call on their
own Engine, repeat until the "shutdown" op.

A message is two broadcasts (jax.experimental.multihost_utils.broadcast_one_to_all, a psum
from process 0 over one device per process): a header i32[4] = (op, n_ints, n_floats,
variant) - variant: which engine runs the call (0: the main config's, 1: the canary's;
serving.rollout) -,
then, when the op has a payload, (ints i32[N], floats f32[F]) padded to powers of two >= 16
(few shapes: each new shape compiles its psum once). Payloads:

    begin_prefill  ints = the prompt's tokens [n]
    prefill_step   ints = the positions of the rows its shadow recall watches (none: not
                   watched; the leader's sampler decides, serving.shadow)
    cache_prompt, reset_slots, shutdown   (no payload)
    first_token    ints = [seed], floats = [temperature, top_p]
    insert         ints = [slot]
    decode         ints = [slots; tokens; positions; steps; seeds] (5 x running),
                   floats = [temperatures; top_ps] (2 x running)

The prefix cache lives on every process and sees the same lookups and inserts in the same
order, so it holds the same blocks everywhere and a hit runs the same copy on every process.
The scheduler keeps at most one prefill in flight, so a follower keeps the latest begun
Prefill only (the Leader refuses a call on any other).
"""

import logging
import threading

import numpy as np

from model.buckets import length_bucket
from serving import program_maps
from serving.engine import Sampling
from serving.hosts import HostLostError

log = logging.getLogger("serving.follower")

LOSS_CONFIRM_S = 2.0  # a failed call waits this long for the heartbeat to confirm a lost host
OPS = ("shutdown", "begin_prefill", "prefill_step", "first_token", "cache_prompt", "insert",
       "decode", "reset_slots")
OP_CODES = {name: code for code, name in enumerate(OPS)}
HEADER = 4
MIN_PAYLOAD = 16


def _padded(n):
    """Payload length for n values: a power of two >= MIN_PAYLOAD (few compiled psums)."""
    return length_bucket(n, minimum=MIN_PAYLOAD)


def _broadcast(tree, is_source):
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree, is_source=is_source)


def send(op, ints=(), floats=(), variant=0):
    """Process 0: broadcasts one message (op name, ints, floats, variant) to every
    process."""
    ints = np.asarray(ints, np.int32).reshape(-1)
    floats = np.asarray(floats, np.float32).reshape(-1)
    header = np.array([OP_CODES[op], ints.size, floats.size, variant], np.int32)
    _broadcast(header, True)
    if ints.size or floats.size:
        _broadcast(_payload(ints, floats), True)


def receive():
    """Processes > 0: the next message from process 0 -> (op name, ints i32[n], floats
    f32[m], variant)."""
    header = np.asarray(_broadcast(np.zeros(HEADER, np.int32), False))
    op, n_ints, n_floats = OPS[int(header[0])], int(header[1]), int(header[2])
    variant = int(header[3])
    if not (n_ints or n_floats):
        return op, np.zeros(0, np.int32), np.zeros(0, np.float32), variant
    ints, floats = _broadcast(_payload(np.zeros(n_ints, np.int32),
                                       np.zeros(n_floats, np.float32)), False)
    return op, np.asarray(ints)[:n_ints], np.asarray(floats)[:n_floats], variant


def _payload(ints, floats):
    """(ints, floats) zero-padded to _padded lengths."""
    return (np.pad(ints, (0, _padded(ints.size) - ints.size)),
            np.pad(floats, (0, _padded(floats.size) - floats.size)))


def _sampling_message(sampling):
    """Sampling -> (ints [seed], floats [temperature, top_p]); the seed as the engine uses it
    (mod 2^31), the floats as float32 (what the engine samples with)."""
    return [sampling.seed % (1 << 31)], [float(sampling.temperature), float(sampling.top_p)]


def _decode_message(batch):
    """{slot: (token, position, Sampling, step)} -> (ints [5 * k], floats [2 * k])."""
    slots = sorted(batch)
    rows = [[slot, batch[slot][0], batch[slot][1], batch[slot][3],
             batch[slot][2].seed % (1 << 31)] for slot in slots]
    ints = np.asarray(rows, np.int64).reshape(len(slots), 5).T.reshape(-1)
    floats = np.asarray([[float(batch[s][2].temperature) for s in slots],
                         [float(batch[s][2].top_p) for s in slots]], np.float32).reshape(-1)
    return ints, floats


def _decode_batch(ints, floats):
    """The inverse of _decode_message."""
    slots, tokens, positions, steps, seeds = ints.reshape(5, -1)
    temperatures, top_ps = floats.reshape(2, -1)
    return {int(slot): (int(tokens[i]), int(positions[i]),
                        Sampling(float(temperatures[i]), float(top_ps[i]), int(seeds[i])),
                        int(steps[i]))
            for i, slot in enumerate(slots)}


class _Channel:
    """What the Leaders of one group share: the lock, the latest begun Prefill (followers
    hold only that one, whichever variant began it) and whether the group is shut down."""

    def __init__(self):
        self.lock = threading.Lock()
        self.current = None
        self.closed = False


class Leader:
    """Process 0's engine for the scheduler: each call broadcasts its message, then runs on
    the wrapped Engine. Other attributes (config, n_slots, prefix_cache, ...) are the
    engine's. Calls are serialized by a lock: the scheduler thread and `shutdown` (from
    the main thread) never interleave two collectives. hosts: the group's HostMonitor; a
    call that fails while it reports a lost host raises HostLostError (its requests are
    answered by the Service, with 503). variant: the engine's index in the followers' list
    (a canary rollout's second engine is 1); `group` builds the Leaders of several engines
    over one channel."""

    def __init__(self, engine, hosts=None, *, variant=0, channel=None):
        self.engine = engine
        self.hosts = hosts
        self.variant = variant
        self._channel = channel if channel is not None else _Channel()
        self._lock = self._channel.lock

    @classmethod
    def group(cls, engines, hosts=None):
        channel = _Channel()
        return [cls(engine, hosts, variant=i, channel=channel)
                for i, engine in enumerate(engines)]

    @property
    def _current(self):
        return self._channel.current

    @_current.setter
    def _current(self, state):
        self._channel.current = state

    @property
    def _closed(self):
        return self._channel.closed

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _call(self, op, method, *args, ints=(), floats=()):
        with self._lock:
            if self._closed:
                raise RuntimeError(f"engine is shut down: cannot run {op}")
            try:
                send(op, ints, floats, self.variant)
                return method(*args)
            except Exception as e:
                # A collective with a dead peer fails (or hangs) before the heartbeat says
                # so; wait a moment for it, so the client hears "host lost", not a 500.
                if self.hosts is not None and self.hosts.wait_lost(LOSS_CONFIRM_S):
                    raise HostLostError(self.hosts.message()) from e
                raise

    def _check_current(self, state, op):
        if state is not self._current:
            raise RuntimeError(f"{op}: not the latest begun prefill (followers hold only that)")

    def begin_prefill(self, tokens):
        tokens = np.asarray(tokens, np.int32)
        self._current = None
        state = self._call("begin_prefill", self.engine.begin_prefill, tokens, ints=tokens)
        self._current = state
        return state

    def prefill_step(self, state):
        self._check_current(state, "prefill_step")
        plan = getattr(self.engine, "shadow_plan", None)
        rows = plan(state) if plan is not None else None
        if rows is None:
            return self._call("prefill_step", self.engine.prefill_step, state, None)
        return self._call("prefill_step", self.engine.prefill_step, state, rows, ints=rows)

    def first_token(self, state, sampling):
        self._check_current(state, "first_token")
        ints, floats = _sampling_message(sampling)
        return self._call("first_token", self.engine.first_token, state, sampling, ints=ints,
                          floats=floats)

    def cache_prompt(self, state):
        self._check_current(state, "cache_prompt")
        return self._call("cache_prompt", self.engine.cache_prompt, state)

    def insert(self, slot, state):
        self._check_current(state, "insert")
        self._call("insert", self.engine.insert, slot, state, ints=[slot])
        self._current = None

    def decode(self, batch):
        ints, floats = _decode_message(batch)
        return self._call("decode", self.engine.decode, batch, ints=ints, floats=floats)

    def reset_slots(self):
        return self._call("reset_slots", self.engine.reset_slots)

    def shutdown(self):
        """Ends the followers' loops (once; later engine calls raise)."""
        with self._lock:
            if not self._closed:
                self._channel.closed = True
                send("shutdown")


def replay(engine, op, ints, floats, current):
    """Runs message (op, ints, floats) on `engine` (the message's variant's) as process 0
    ran it -> the Prefill the follower holds next."""
    if op == "begin_prefill":
        return engine.begin_prefill(ints)
    if op == "reset_slots":
        engine.reset_slots()
        return current
    if op == "decode":
        engine.decode(_decode_batch(ints, floats))
        return current
    if current is None:
        raise RuntimeError(f"{op}: no prefill begun")
    if op == "prefill_step":
        engine.prefill_step(current, ints if len(ints) else None)
    elif op == "first_token":
        engine.first_token(current, Sampling(float(floats[0]), float(floats[1]), int(ints[0])))
    elif op == "cache_prompt":
        engine.cache_prompt(current)
    elif op == "insert":
        engine.insert(int(ints[0]), current)
        return None
    else:
        raise RuntimeError(f"unknown op {op!r}")
    return current


def follow(engines):
    """A follower's loop: replays process 0's engine calls (each on the engine of its
    message's variant; `engines`: one Engine or the list build_engines made) until
    "shutdown". A failed call is logged and the loop goes on, as process 0's scheduler does
    (its request got the error; the same inputs fail the same way here). Returns the
    number of calls replayed."""
    engines = engines if isinstance(engines, (list, tuple)) else [engines]
    current, count = None, 0
    while True:
        op, ints, floats, variant = receive()
        if op == "shutdown":
            log.info("shutdown from process 0 after %d engine calls", count)
            return count
        count += 1
        try:
            current = replay(engines[variant], op, ints, floats, current)
        except Exception:
            log.exception("replaying %s failed", op)
            if op == "begin_prefill":
                current = None
        program_maps.budget().check()  # as process 0 between turns (serving.program_maps)


def run_follower(config, mesh, *, hosts=None, loader=None):
    """What `python -m serving` runs on processes other than 0: load the model, build and
    warm up the engines exactly as process 0 does (serving.loading.build_engines), then
    follow. hosts: this process's HostMonitor (serving.hosts), stopped with a goodbye after
    process 0's shutdown. Returns the exit code."""
    import jax

    from serving.loading import build_engines

    log.info("process %d of %d: following process 0", jax.process_index(), jax.process_count())
    engines, _, _ = build_engines(config, mesh, loader=loader)
    follow(engines)
    if hosts is not None:
        hosts.stop()
    return 0
