"""Prefill, decode and generation over a cache: jitted steps, length buckets, chunked prefill.

ModelRunner is the one loop that runs a model over a sequence: serving, the main job,
evaluation and benchmarks all prefill and decode through it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import paged_cache, sharding
from model.buckets import cache_positions, chunk_plan, length_bucket
from model.cache import cache_capacity, cache_shapes, init_cache, init_sharded_cache
from model.sampling import sample_token, validate_sampling
from model.sequence_parallel import SequenceParallel
from model.transformer import Transformer, check_capture


def _constrain_tokens(mesh, tokens):
    """A chunk's tokens split over the sequence axis (so are its activations, by
    propagation: projections and MLP run on T / S rows per device)."""
    if mesh is None or tokens.shape[0] % sharding.axis_size(mesh, "sequence"):
        return tokens
    return jax.lax.with_sharding_constraint(
        tokens, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("sequence")))


def _last_row(mesh, logits, n_valid):
    """logits[n_valid - 1]; under a mesh as a masked sum (exact: one non-zero term), so the
    sequence-split rows reduce to one [V] row instead of being gathered whole."""
    if mesh is None:
        return logits[n_valid - 1]
    rows = jnp.arange(logits.shape[0])[:, None]
    return jnp.sum(jnp.where(rows == n_valid - 1, logits, 0.0), axis=0)


def _replicated(mesh, tree):
    """Outputs every process can read (jax.distributed: np.asarray needs them whole)."""
    if mesh is None:
        return tree
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, whole), tree)


def _model_step(state, tokens, cache, start, kv_len, n_valid, all_logits, capture, *, graphdef,
                mesh, parallel):
    """One prefill chunk or decode step of the model (graphdef, state); jitted as _step."""
    model = nnx.merge(graphdef, state)
    tokens = _constrain_tokens(mesh, tokens)
    # Rows past n_valid are padding: kept out of the block summaries. The mesh is the
    # step's static argument; modules that split work themselves (model.moe's experts)
    # read it while this traces.
    with sharding.use_mesh(mesh):
        out = model(tokens, cache, start, kv_len, n_valid=n_valid, capture=capture,
                    parallel=parallel)
    logits, cache = out[0], out[1]
    # Per-layer lists -> arrays with a leading layer axis.
    captured = {kind: jax.tree.map(lambda *xs: jnp.stack(xs), *values)
                for kind, values in out[2].items()} if capture else {}
    if not all_logits:
        logits = _last_row(mesh, logits, n_valid)
    return _replicated(mesh, logits), cache, _replicated(mesh, captured)


_step = jax.jit(_model_step, static_argnames=("kv_len", "all_logits", "capture", "graphdef",
                                              "mesh", "parallel"),
                donate_argnames=("cache",))


@functools.partial(jax.jit, static_argnames=("kv_len", "graphdef", "mesh", "parallel"),
                   donate_argnames=("caches",))
def _batch_step(state, tokens, caches, positions, *, kv_len, graphdef, mesh, parallel):
    """One decode step for a batch of sequences (vmap of _step over the batch)."""
    def one(token, cache, position):
        logits, cache, _ = _step(state, token[None], cache, position, kv_len, 1, False, (),
                                 graphdef=graphdef, mesh=mesh, parallel=parallel)
        return logits, cache

    return jax.vmap(one)(tokens, caches, positions)


@functools.partial(jax.jit, static_argnames=("kv_len", "page_tokens", "config", "graphdef",
                                             "mesh", "parallel"),
                   donate_argnames=("pool",))
def _paged_batch_step(state, tokens, pool, tables, positions, slots, *, kv_len, page_tokens,
                      config, graphdef, mesh, parallel):
    """One decode step for a batch of sequences whose caches are pages of one pool
    (model.paged_cache): each reads its pages through its block table, runs the step, and
    only the rows it wrote go back to the pool."""
    def one(token, table, position, own):
        view = paged_cache.gather_view(pool, table, own, position, kv_len, page_tokens, config)
        logits, view, _ = _model_step(state, token[None], view, position, kv_len, 1, False,
                                      (), graphdef=graphdef, mesh=mesh, parallel=parallel)
        return logits, paged_cache.touched_rows(view, position, config)

    logits, rows = jax.vmap(one)(tokens, tables, positions,
                                 paged_cache.slot_state(pool, slots))
    # The rows go back once every read of the pool is done (the barrier ties them to the
    # logits), so the pool is updated in place, not copied for the step's reads.
    logits, rows = jax.lax.optimization_barrier((logits, rows))
    return logits, paged_cache.scatter_rows(pool, rows, tables, positions, slots, page_tokens,
                                            config)


@functools.partial(jax.jit, static_argnames=("size",))
def _rows(x, start, size):
    """x[start:start + size]: the prefill's logits rows of a chunk, one program per shape
    (compiled by compile_prefill, so a timed prefill compiles nothing)."""
    return jax.lax.dynamic_slice_in_dim(x, start, size)


@jax.jit
def _concat(pieces):
    return jnp.concatenate(pieces)


def step_key(step):
    """What makes a step (lower_step's arguments) its own program: (rows, keys read,
    all_logits, capture kinds). Runners of one config share the programs of equal keys."""
    tokens, _, _, kv_len, _, all_logits, capture = step
    return tokens.shape[0], kv_len, all_logits, tuple(capture)


class ModelRunner:

    """Runs one sequence at a time through a Transformer with a KV + indexer-key cache.

    Prefill is chunked: chunk c of `prefill_chunk` tokens reads keys up to
    length_bucket(end of chunk), so compute grows with the real context, not a padded
    maximum; the last chunk is padded up to a power-of-two bucket, never past one chunk.
    The cache passed to prefill/decode is donated (consumed): copy it first
    (`jax.tree.map(jnp.copy, cache)`) to reuse it.
    """

    def __init__(self, model, *, mesh=None):
        """mesh: None (one device, or the mesh of an enclosing model.sharding.use_mesh), or
        a model.sharding mesh: parameters and caches are placed by model.sharding's rules
        (tensor parallel: the same step, partitioned by XLA) and, when its "sequence" axis
        is > 1, sparse layers attend through model.sequence_parallel (the cache split over
        positions). ValueError when the tensor axis does not divide the heads or the MLP."""
        self.config = model.config
        self.graphdef, self.state = nnx.split(model)
        mesh = sharding.current_mesh() if mesh is None else mesh
        self.mesh, self.parallel = mesh, None
        if mesh is not None:
            sharding.check_mesh(self.config, mesh)
            self.state = sharding.shard_state(self.state, mesh)
            if sharding.axis_size(mesh, "sequence") > 1:
                self.parallel = SequenceParallel(mesh)

        # The jitted steps are module-level, keyed on the model's structure (graphdef) and
        # placement: runners over models of one config share their compiled programs.
        self._static = dict(graphdef=self.graphdef, mesh=self.mesh, parallel=self.parallel)

    @classmethod
    def abstract(cls, config, *, mesh=None):
        """A runner over a model of `config` whose parameters are shape structs (placed by
        the sharding rules under `mesh`): its steps lower and compile without weights."""
        return cls(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))), mesh=mesh)

    def _run_step(self, state, tokens, cache, start, kv_len, n_valid, all_logits, capture):
        return _step(state, tokens, cache, start, kv_len, n_valid, all_logits, capture,
                     **self._static)

    def lower_step(self, tokens, cache, start, kv_len, n_valid, all_logits=False, capture=(),
                   *, place=None):
        """The jitted step of one chunk, lowered for these (abstract) arguments (to compile it
        ahead of use, or read its HLO). place: maps the step's array arguments (state,
        tokens, cache, start, n_valid) to placed shape structs (compiling for another
        device: experiments.gpu_targets)."""
        state = self.state
        if place is not None:
            state, tokens, cache, start, n_valid = place((state, tokens, cache, start, n_valid))
        return _step.lower(state, tokens, cache, start, kv_len, n_valid, all_logits, capture,
                           **self._static)

    def _plan(self, n, *, capacity=None, chunk=None, start=0, logits_from=None, capture=(),
              capture_from=None, exact=False, cache_capacity=None):
        """(cache capacity, [(chunk, all_logits, capture kinds, logits rows (first, count) or
        None, captured rows (a slice) or None)]) of a prefill of n tokens with these
        arguments (cache_capacity: an existing cache's)."""
        chunk, capture, capture_from, logits_from = self._check(n, chunk, start, capture,
                                                                capture_from, logits_from)
        cap = cache_capacity or cache_positions(capacity or (start + n), exact=exact)
        plan = []
        for c in chunk_plan(n, start=start, capacity=cap, chunk=chunk):
            all_logits, kinds = self._chunk_outputs(c, logits_from, capture, capture_from)
            first = max(0, logits_from - c.position) if all_logits else 0
            plan.append((c, all_logits, kinds,
                         (first, c.length - first) if all_logits else None,
                         slice(max(0, capture_from - c.position), c.length) if kinds else None))
        return cap, plan

    def _steps(self, cap, plan):
        """{step_key: lower_step's arguments} of a plan's distinct steps."""
        cache = self.abstract_cache(cap)
        steps = {}
        for c, all_logits, kinds, _, _ in plan:
            step = (jax.ShapeDtypeStruct((c.padded,), jnp.int32), cache, c.position, c.kv_len,
                    c.length, all_logits, kinds)
            steps.setdefault(step_key(step), step)
        return steps

    def prefill_steps(self, n, **kwargs):
        """The distinct steps a prefill of n tokens with these arguments (prefill's) runs,
        each as lower_step's arguments (tokens and cache as shape structs)."""
        return list(self._steps(*self._plan(n, **kwargs)).values())

    def compile_prefill(self, n, **kwargs):
        """Compiles, without running, every program a prefill of n tokens with these
        arguments (prefill's) runs: its distinct steps (prefill_steps) and the programs that
        gather its logits rows (a warm-up that costs compile time only) -> number of distinct
        steps."""
        cap, plan = self._plan(n, **kwargs)
        steps = self._steps(cap, plan)
        logits = {}
        for step in steps.values():
            compiled = self.lower_step(*step).compile()
            if step[5]:  # all_logits: the step's logits, as its output gives them
                out = compiled.out_info[0]
                logits[step[0].shape[0]] = self.stand_ins(out.shape, out.dtype,
                                                          compiled.output_shardings[0])
        # The row gathers run on stand-ins rather than compile ahead: a call fills jit's
        # dispatch cache, which an ahead-of-time compile of these small programs does not
        # (the prefill's first call would compile them, while timed).
        pieces = {}  # placement -> the row pieces of every chunk with logits
        for c, _, _, rows, _ in plan:
            for placement, stand_in in enumerate(logits.get(c.padded, ()) if rows else ()):
                pieces.setdefault(placement, []).append(_rows(stand_in, *rows))
        for placed in pieces.values():
            jax.block_until_ready(_concat(placed))
        return len(steps)

    def stand_ins(self, shape, dtype, sharding=None):
        """Zeros placed as this runner's step outputs may be (uncommitted and committed to
        the device; on a mesh by `sharding`, default replicated): what a warm-up call of a
        program that takes a step's output runs on, so that jit's dispatch cache holds the
        program the real call looks up (its key tells the two apart, and whether a step's
        output is committed depends on how the loader placed the parameters)."""
        zeros = jnp.zeros(shape, dtype)
        if self.mesh is not None:
            return [jax.device_put(zeros, sharding or jax.sharding.NamedSharding(
                self.mesh, jax.sharding.PartitionSpec()))]
        return [zeros, jax.device_put(zeros, jax.devices()[0])]

    def decode_steps(self, positions, capacity, *, exact=False):
        """The distinct steps of decoding at `positions` in a cache made for `capacity`
        (new_cache's), as lower_step's arguments."""
        cap = cache_positions(capacity, exact=exact)
        cache = self.abstract_cache(cap)
        first = {}  # kv_len -> the first position that reads it
        for p in positions:
            first.setdefault(min(cap, length_bucket(p + 1)), p)
        return [(jax.ShapeDtypeStruct((1,), jnp.int32), cache, p, kv, 1, False, ())
                for kv, p in sorted(first.items())]

    def abstract_cache(self, capacity):
        """Shape structs of a cache of `capacity` positions (placed, under a mesh)."""
        if self.mesh is not None:
            return cache_shapes(self.config, capacity, self.mesh)
        return jax.eval_shape(lambda: init_cache(self.config, capacity))

    def compile_decode(self, positions, capacity, *, exact=False):
        """Compiles the decode steps at `positions` (decode_steps') -> their number."""
        steps = self.decode_steps(positions, capacity, exact=exact)
        for step in steps:
            self.lower_step(*step).compile()
        return len(steps)

    def _check(self, n, chunk, start, capture, capture_from, logits_from):
        if n < 1:
            raise ValueError("prefill needs at least one token")
        chunk = chunk or self.config.prefill_chunk
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        capture = check_capture(self.config, capture)
        capture_from = start if capture_from is None else int(capture_from)
        if capture and not start <= capture_from < start + n:
            raise ValueError(f"capture_from must be in [{start}, {start + n - 1}] (the "
                             f"prefilled positions), got {capture_from}")
        if logits_from is not None and not start <= logits_from < start + n:
            raise ValueError(f"logits_from must be None or in [{start}, {start + n - 1}] "
                             f"(the prefilled positions), got {logits_from}")
        return chunk, capture, capture_from, logits_from

    @staticmethod
    def _chunk_outputs(c, logits_from, capture, capture_from):
        """(all_logits, capture kinds) of chunk c."""
        end = c.position + c.length
        all_logits = logits_from is not None and end > logits_from
        return all_logits, capture if capture and end > capture_from else ()

    def _host(self, tokens):
        """Token ids as the step takes them: a device array on one device; a host (numpy)
        array under a mesh, which jit places on the mesh (the same on every process)."""
        return np.asarray(tokens) if self.mesh is not None else jax.device_put(tokens)

    def new_cache(self, capacity, *, exact=False):
        """An empty cache for `capacity` positions: model.buckets.cache_positions(capacity,
        exact=exact) long."""
        if capacity > self.config.max_seq_len:
            raise ValueError(f"context of {capacity} tokens exceeds max_seq_len="
                             f"{self.config.max_seq_len}")
        positions = cache_positions(capacity, exact=exact)
        if self.mesh is not None:
            return init_sharded_cache(self.config, positions, self.mesh)
        return init_cache(self.config, positions)

    def prefill(self, tokens, *, cache=None, capacity=None, chunk=None, start=0,
                logits_from=None, capture=(), capture_from=None, exact=False):
        """tokens: ints [N] at positions start..start+N-1 -> (logits, cache), or
        (logits, cache, captured) when `capture` names kinds (model.CAPTURE_KINDS).

        logits: f32[V] for the last position, or f32[M, V] for the M positions >=
        logits_from (logits_from=start: every position, for evaluation).
        capacity: positions the cache must hold (default N + start; generation adds room
        for decoding), made new_cache(capacity, exact=exact). A given cache is extended in
        place (prefix reuse: start > 0).
        captured: each kind as numpy arrays [n_layers, Q, ...] for the Q queries at
        positions >= capture_from (default start); chunks before it run without capture.
        ValueError on an empty prompt, a cache too small, or positions out of range.
        """
        tokens = np.asarray(tokens, dtype=np.int32)
        n = int(tokens.shape[0])
        self._check(n, chunk, start, capture, capture_from, logits_from)
        if cache is None:
            cache = self.new_cache(capacity or (start + n), exact=exact)
        cap = cache_capacity(cache, self.config)
        if start + n > cap:
            raise ValueError(f"cache holds {cap} positions, prefill needs {start + n}")
        _, plan = self._plan(n, chunk=chunk, start=start, logits_from=logits_from,
                             capture=capture, capture_from=capture_from, cache_capacity=cap)
        logits, captured = [], []
        for c, all_logits, kinds, rows, kept in plan:
            padded = np.zeros(c.padded, np.int32)
            padded[:c.length] = tokens[c.offset:c.offset + c.length]
            out, cache, got = self._run_step(self.state, self._host(padded), cache, c.position,
                                             c.kv_len, c.length, all_logits, kinds)
            if all_logits:
                logits.append(_rows(out, *rows))
            elif logits_from is None:
                logits = [out]
            if kinds:
                captured.append(jax.tree.map(lambda a, kept=kept: np.asarray(a)[:, kept], got))
        logits = _concat(logits) if logits_from is not None else logits[0]
        if capture:
            return logits, cache, jax.tree.map(lambda *xs: np.concatenate(xs, axis=1),
                                               *captured)
        return logits, cache

    def decode(self, token, cache, position):
        """Appends `token` at `position`; returns (logits f32[V] for the next token, cache)."""
        cap = cache_capacity(cache, self.config)
        if position >= cap:
            raise ValueError(f"cache holds {cap} positions, decode at position {position}")
        kv_len = min(cap, length_bucket(position + 1))
        logits, cache, _ = self._run_step(self.state, self._host(np.asarray([token], np.int32)),
                                      cache, position, kv_len, 1, False, ())
        return logits, cache

    def generate(self, prompt, max_new_tokens, *, temperature=0.0, top_p=1.0, seed=0,
                 stop_tokens=(), cache=None, start=0):
        """Yields generated token ids one at a time (prefill of `prompt` at position
        `start`, then decode). temperature 0 is greedy. cache: an existing cache holding
        positions before `start` (donated), with room for the prompt and the new tokens."""
        validate_sampling(temperature, top_p)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        n = len(prompt)
        logits, cache = self.prefill(prompt, cache=cache, start=start,
                                     capacity=start + n + max_new_tokens)
        key = jax.random.key(seed)
        for i in range(max_new_tokens):
            key, sub = jax.random.split(key)
            token = int(sample_token(logits, sub, temperature, top_p))
            yield token
            if token in stop_tokens or i == max_new_tokens - 1:
                return
            logits, cache = self.decode(token, cache, start + n + i)

    # ------------------------------------------------------------ batched decode (serving)

    def new_batch_cache(self, batch, capacity):
        """A cache for `batch` sequences: every array gains a leading batch axis [batch, ...]
        (serving's decode slots; one sequence's cache is `jax.tree.map(lambda a: a[i], c)`)."""
        one = self.new_cache(capacity)
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (batch, *a.shape)).copy(), one)

    def decode_paged(self, tokens, pool, tables, positions, slots, *, page_tokens):
        """One decode step for a batch of sequences whose caches are pages of `pool`
        (model.paged_cache; donated): tokens i32[B], block tables i32[B, max_pages],
        positions i32[B], state rows slots i32[B]. -> (logits f32[B, V], pool). Keys are
        read up to length_bucket(max(positions) + 1), as decode_batch."""
        if self.mesh is not None:
            raise ValueError("a paged cache runs on one device (serving's cache_layout: "
                             "slots on a mesh)")
        positions = np.asarray(positions, dtype=np.int32)
        tables = np.asarray(tables, dtype=np.int32)
        cap = tables.shape[1] * page_tokens
        if positions.max(initial=0) >= cap or positions.min(initial=0) < 0:
            raise ValueError(f"block tables hold {cap} positions, decode at positions "
                             f"{positions.tolist()}")
        kv_len = min(cap, length_bucket(int(positions.max(initial=0)) + 1))
        return _paged_batch_step(self.state, jnp.asarray(tokens, jnp.int32), pool,
                                 jnp.asarray(tables), jnp.asarray(positions),
                                 jnp.asarray(slots, jnp.int32), kv_len=kv_len,
                                 page_tokens=page_tokens, config=self.config, **self._static)

    def decode_batch(self, tokens, caches, positions):
        """One decode step for a batch of sequences in one jitted call (vmap over the batch).

        tokens: i32[S], one token per sequence; caches: a batched cache (new_batch_cache,
        donated); positions: i32[S], where each token goes (sequences at different lengths).
        -> (logits f32[S, V] for each sequence's next token, caches). Keys are read up to
        length_bucket(max(positions) + 1): compute follows the longest sequence of the
        batch, and the causal mask hides each shorter sequence's stale positions.
        """
        positions = np.asarray(positions, dtype=np.int32)
        cap = cache_capacity(caches, self.config, batched=True)
        if positions.max(initial=0) >= cap or positions.min(initial=0) < 0:
            raise ValueError(f"cache holds {cap} positions, decode at positions "
                             f"{positions.tolist()}")
        kv_len = min(cap, length_bucket(int(positions.max(initial=0)) + 1))
        return _batch_step(self.state, jnp.asarray(tokens, jnp.int32), caches,
                           jnp.asarray(positions), kv_len=kv_len, **self._static)
