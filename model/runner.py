"""Prefill, decode and generation over a cache: jitted steps, length buckets, chunked prefill.

ModelRunner is the one loop that runs a model over a sequence: serving, the main job,
evaluation and benchmarks all prefill and decode through it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import sharding
from model.buckets import chunk_plan, length_bucket
from model.cache import cache_capacity, cache_shapes, init_cache, init_sharded_cache
from model.sampling import sample_token, validate_sampling
from model.sequence_parallel import SequenceParallel
from model.transformer import check_capture


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


@functools.partial(jax.jit, static_argnames=("kv_len", "all_logits", "capture", "graphdef",
                                             "mesh", "parallel"),
                   donate_argnames=("cache",))
def _step(state, tokens, cache, start, kv_len, n_valid, all_logits, capture, *, graphdef,
          mesh, parallel):
    """One prefill chunk or decode step of the model (graphdef, state)."""
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


@functools.partial(jax.jit, static_argnames=("kv_len", "graphdef", "mesh", "parallel"),
                   donate_argnames=("caches",))
def _batch_step(state, tokens, caches, positions, *, kv_len, graphdef, mesh, parallel):
    """One decode step for a batch of sequences (vmap of _step over the batch)."""
    def one(token, cache, position):
        logits, cache, _ = _step(state, token[None], cache, position, kv_len, 1, False, (),
                                 graphdef=graphdef, mesh=mesh, parallel=parallel)
        return logits, cache

    return jax.vmap(one)(tokens, caches, positions)


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

    def _run_step(self, state, tokens, cache, start, kv_len, n_valid, all_logits, capture):
        return _step(state, tokens, cache, start, kv_len, n_valid, all_logits, capture,
                     **self._static)

    def lower_step(self, tokens, cache, start, kv_len, n_valid, all_logits=False, capture=()):
        """The jitted step of one chunk, lowered for these (abstract) arguments (to compile it
        ahead of use, or read its HLO)."""
        return _step.lower(self.state, tokens, cache, start, kv_len, n_valid, all_logits,
                           capture, **self._static)

    def compile_prefill(self, n, *, capacity=None, chunk=None, start=0, logits_from=None,
                        capture=(), capture_from=None):
        """Compiles, without running, every step a prefill of n tokens with these arguments
        would run (a warm-up that costs compile time only) -> number of distinct steps."""
        chunk, capture, capture_from, logits_from = self._check(n, chunk, start, capture,
                                                                capture_from, logits_from)
        cap = length_bucket(capacity or (start + n))
        if self.mesh is not None:
            cache = cache_shapes(self.config, cap, self.mesh)
        else:
            cache = jax.eval_shape(lambda: init_cache(self.config, cap))
        seen = set()
        for c in chunk_plan(n, start=start, capacity=cap, chunk=chunk):
            key = (c.padded, c.kv_len, *self._chunk_outputs(c, logits_from, capture,
                                                            capture_from))
            if key not in seen:
                seen.add(key)
                self.lower_step(jax.ShapeDtypeStruct((c.padded,), jnp.int32), cache,
                                c.position, c.kv_len, c.length, key[2], key[3]).compile()
        return len(seen)

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
        return np.asarray(tokens) if self.mesh is not None else jnp.asarray(tokens)

    def new_cache(self, capacity):
        if capacity > self.config.max_seq_len:
            raise ValueError(f"context of {capacity} tokens exceeds max_seq_len="
                             f"{self.config.max_seq_len}")
        if self.mesh is not None:
            return init_sharded_cache(self.config, length_bucket(capacity), self.mesh)
        return init_cache(self.config, length_bucket(capacity))

    def prefill(self, tokens, *, cache=None, capacity=None, chunk=None, start=0,
                logits_from=None, capture=(), capture_from=None):
        """tokens: ints [N] at positions start..start+N-1 -> (logits, cache), or
        (logits, cache, captured) when `capture` names kinds (model.CAPTURE_KINDS).

        logits: f32[V] for the last position, or f32[M, V] for the M positions >=
        logits_from (logits_from=start: every position, for evaluation).
        capacity: positions the cache must hold (default N + start; generation adds room
        for decoding). A given cache is extended in place (prefix reuse: start > 0).
        captured: each kind as numpy arrays [n_layers, Q, ...] for the Q queries at
        positions >= capture_from (default start); chunks before it run without capture.
        ValueError on an empty prompt, a cache too small, or positions out of range.
        """
        tokens = np.asarray(tokens, dtype=np.int32)
        n = int(tokens.shape[0])
        chunk, capture, capture_from, logits_from = self._check(n, chunk, start, capture,
                                                                capture_from, logits_from)
        if cache is None:
            cache = self.new_cache(capacity or (start + n))
        cap = cache_capacity(cache)
        if start + n > cap:
            raise ValueError(f"cache holds {cap} positions, prefill needs {start + n}")
        logits, captured = [], []
        for c in chunk_plan(n, start=start, capacity=cap, chunk=chunk):
            padded = np.zeros(c.padded, np.int32)
            padded[:c.length] = tokens[c.offset:c.offset + c.length]
            all_logits, kinds = self._chunk_outputs(c, logits_from, capture, capture_from)
            out, cache, got = self._run_step(self.state, self._host(padded), cache, c.position,
                                         c.kv_len, c.length, all_logits, kinds)
            if all_logits:
                logits.append(out[max(0, logits_from - c.position):c.length])
            elif logits_from is None:
                logits = [out]
            if kinds:
                rows = slice(max(0, capture_from - c.position), c.length)
                captured.append(jax.tree.map(lambda a, rows=rows: np.asarray(a)[:, rows], got))
        logits = jnp.concatenate(logits) if logits_from is not None else logits[0]
        if capture:
            return logits, cache, jax.tree.map(lambda *xs: np.concatenate(xs, axis=1),
                                               *captured)
        return logits, cache

    def decode(self, token, cache, position):
        """Appends `token` at `position`; returns (logits f32[V] for the next token, cache)."""
        cap = cache_capacity(cache)
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

    def decode_batch(self, tokens, caches, positions):
        """One decode step for a batch of sequences in one jitted call (vmap over the batch).

        tokens: i32[S], one token per sequence; caches: a batched cache (new_batch_cache,
        donated); positions: i32[S], where each token goes (sequences at different lengths).
        -> (logits f32[S, V] for each sequence's next token, caches). Keys are read up to
        length_bucket(max(positions) + 1): compute follows the longest sequence of the
        batch, and the causal mask hides each shorter sequence's stale positions.
        """
        positions = np.asarray(positions, dtype=np.int32)
        cap = cache_capacity(caches, batched=True)
        if positions.max(initial=0) >= cap or positions.min(initial=0) < 0:
            raise ValueError(f"cache holds {cap} positions, decode at positions "
                             f"{positions.tolist()}")
        kv_len = min(cap, length_bucket(int(positions.max(initial=0)) + 1))
        return _batch_step(self.state, jnp.asarray(tokens, jnp.int32), caches,
                           jnp.asarray(positions), kv_len=kv_len, **self._static)
