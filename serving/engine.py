"""The JAX side of serving: chunked prefill of one request, a batched decode step over a fixed
number of slots, sampling, the prefix cache's copies in and out, and the warm-up.

Every method runs on the scheduler's worker thread (never on the event loop). Slot caches
hold `capacity` = length_bucket(max_context) positions each, so every request's cache has
one shape: one set of compiled prefill steps and one batched decode step per key-length
bucket, all compiled by `warmup` before the server reports ready.

On a mesh (Engine(..., mesh=...)) the runner is sharded and every cache the engine makes is
placed by the cache's own specs (model.cache): prefill caches and prefix copies by
`cache_specs` / `prefix_specs`, the decode slots by `cache_specs(batched=True)`; what the
host reads (sampled tokens, the prefix cache's copies) comes back replicated, so every
process of a jax.distributed job can read it. Several processes must run the same calls in
the same order: serving.follower.
"""

import dataclasses
import logging
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from model import cache as layer_cache
from model import sharding
from model.buckets import length_bucket, prefill_shapes
from model.cache import init_cache
from model.runner import ModelRunner
from model.sampling import sample_token
from serving.prefix_cache import Block
from serving.shadow import ShadowRecord, compare, flat_rows_program, watched_layers

log = logging.getLogger("serving.engine")


def _sample_batch(logits, seeds, steps, temperatures, top_ps):
    """logits f32[S, V] -> i32[S]; sequence i samples with key fold_in(key(seed_i), step_i),
    so a seeded request draws the same tokens whatever else shares its batch."""
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seeds, steps)
    return jax.vmap(sample_token)(logits, keys, temperatures, top_ps)


sample_batch = jax.jit(_sample_batch)


def _sample_first(logits, seeds, steps, temperatures, top_ps):
    """sample_batch of one sequence's logits f32[V] -> i32[1]."""
    return _sample_batch(logits[None], seeds, steps, temperatures, top_ps)


def _put_slot(slots, cache, index):
    return jax.tree.map(lambda s, c: s.at[index].set(c), slots, cache)


@dataclasses.dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclasses.dataclass
class Prefill:
    """A prompt being prefilled: `position` tokens of it are in `cache` so far."""

    tokens: np.ndarray
    cache: list
    position: int
    cache_hit_tokens: int
    logits: jax.Array | None = None
    step_seconds: float = 0.0  # wall time of the prefill steps so far (device work included)
    shadow: list = dataclasses.field(default_factory=list)  # ShadowRecords of watched chunks
    # a stateful model's state (model.cache.take_state, host) at its last full block's end
    snapshot: list | None = None
    pages: list | None = None  # a paged engine's: the pages this request holds,
    shared_pages: int = 0  # the first of them held by reference (a cached prefix)

    @property
    def done(self):
        return self.position >= len(self.tokens)


def check_block_tokens(config, block_tokens):
    """ValueError naming cache_block_tokens unless a prefix block holds whole rows of every
    cache field (the indexer's key blocks; DeepSeek-V4's entries, one per 4 or 128
    positions, and blocks of them)."""
    strides = {layer_cache.field(name).stride(config)
               for layer in range(config.n_layers)
               for name in layer_cache.layer_fields(config, layer)
               if not layer_cache.field(name).is_state}
    need = math.lcm(*strides)
    if block_tokens % need:
        raise ValueError(f"serving config: cache_block_tokens ({block_tokens}) must be a "
                         f"multiple of {need}, the positions per row of this model's cache "
                         f"fields (the indexer's block size and compressed entries)")


class Engine:
    def __init__(self, model, *, max_context, slots, prefill_chunk=None, prefix_cache=None,
                 mesh=None, shadow=None):
        """mesh: None (one device) or a model.sharding mesh. ValueError when the mesh does
        not fit the model (tensor axis vs heads), the cache (sequence axis vs capacity) or
        the decode slots (data axis). shadow: a serving.shadow.ShadowSampler (shadow recall
        of sampled prefill chunks against flat) or None."""
        self.config = model.config
        self.watched = watched_layers(model.config)
        self.shadow = shadow if shadow is not None and shadow.enabled and self.watched else None
        self.mesh = mesh
        self.runner = ModelRunner(model, mesh=mesh)
        self.max_context = max_context
        self.capacity = length_bucket(max_context)
        self.n_slots = slots
        self.chunk = prefill_chunk or self.config.prefill_chunk
        self.prefix_cache = prefix_cache
        # A model whose cache keeps state (DeepSeek-V4's window and compressor rings): a
        # prefix is reusable only where that state was saved, at the end of a prompt's last
        # full block (`Prefill.snapshot`, Block.state).
        self.stateful = bool(layer_cache.state_fields(self.config))
        self.block_size = self.config.hierarchical.block_size
        if prefix_cache is not None:
            check_block_tokens(self.config, prefix_cache.block_tokens)
        # Every cache handed to a jitted step is committed to the device, as the steps'
        # outputs are (with committed weights): jit keys its compiled programs on it, and a
        # fresh uncommitted cache would miss the warm-up's programs and compile again.
        if mesh is None:
            self.device = jax.devices()[0]
            self.reset_slots()
            self._put_slot = jax.jit(_put_slot, donate_argnums=0)
            self._take_prefix = jax.jit(layer_cache.take_prefix, static_argnums=(1, 2))
            self._with_prefix = jax.jit(self._cache_with_prefix)
            self._take_state = jax.jit(layer_cache.take_state)
            self._sample, self._sample_one, self._xp = sample_batch, None, jnp
            self._flat_rows = flat_rows_program()
            return
        self._init_mesh(mesh)

    def _init_mesh(self, mesh):
        """The jitted copies with their outputs placed on `mesh`: caches by the rules, what
        the host reads replicated (np.asarray needs every value on every process)."""
        sharding.check_capacity(mesh, self.capacity)
        data = sharding.axis_size(mesh, "data")
        if self.n_slots % data:
            raise ValueError(f"serving config: decode_slots ({self.n_slots}) must be a multiple "
                             f"of the mesh's data={data} (--mesh)")
        self.device = None
        whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        one = jax.eval_shape(lambda: init_cache(self.config, self.capacity))
        batched = jax.eval_shape(lambda: self._empty_slots())
        self._cache_shardings = sharding.named(mesh, layer_cache.cache_specs(one))
        self._slot_shardings = sharding.named(mesh, layer_cache.cache_specs(batched,
                                                                            batched=True))
        self.reset_slots()
        self._put_slot = jax.jit(_put_slot, donate_argnums=0, out_shardings=self._slot_shardings)
        self._take_prefix = jax.jit(layer_cache.take_prefix, static_argnums=(1, 2),
                                    out_shardings=whole)
        self._with_prefix = jax.jit(self._cache_with_prefix, out_shardings=self._cache_shardings)
        self._take_state = jax.jit(layer_cache.take_state, out_shardings=whole)
        # Sampling inputs go in as host arrays (placed by jit, the same on every process).
        self._sample = jax.jit(_sample_batch, out_shardings=whole)
        self._sample_one = jax.jit(_sample_first, out_shardings=whole)
        self._xp = np
        self._flat_rows = flat_rows_program(whole)

    # ------------------------------------------------------------------ prefill

    def begin_prefill(self, tokens):
        """A Prefill of `tokens`, its cache starting with the longest cached prefix (at most
        len - 1 tokens: the last token is always prefilled, for its logits)."""
        tokens = np.asarray(tokens, np.int32)
        held = []
        if self.prefix_cache is not None:
            _, held = self.prefix_cache.lookup(tokens, max_tokens=len(tokens) - 1)
        hit_blocks = held
        if self.stateful:  # up to the deepest block that saved the state at its end
            saved = [i for i, block in enumerate(held) if block.state is not None]
            hit_blocks = held[:saved[-1] + 1] if saved else []
        if not hit_blocks:
            if held:
                self.prefix_cache.release(held)
            return Prefill(tokens, self._fresh_cache(), 0, 0)
        try:
            cache = self._assemble(hit_blocks)
        finally:
            self.prefix_cache.release(held)
        hit = len(hit_blocks) * self.prefix_cache.block_tokens
        return Prefill(tokens, cache, hit, hit)

    def shadow_plan(self, state):
        """The positions of the rows to watch in `state`'s next chunk (i32[<= rows]), or
        None (host only: the leader of several processes decides and broadcasts it)."""
        if self.shadow is None:
            return None
        end = min(len(state.tokens), state.position + self.chunk)
        return self.shadow.plan(state.position, end - state.position)

    def prefill_step(self, state, rows="plan", *, charge=True):
        """Prefills the next chunk (up to self.chunk tokens) of `state`. rows: "plan" (the
        shadow sampler decides), None (not watched) or the positions of the chunk's rows to
        watch: then the step captures the indexer inputs and indices of its own pass and
        appends a ShadowRecord to state.shadow (charge: count its time against the
        sampler's budget; the warm-up does not)."""
        if isinstance(rows, str):
            rows = self.shadow_plan(state)
        start, end = state.position, min(len(state.tokens), state.position + self.chunk)
        saved_at = self._state_boundary(state)
        if saved_at is not None and start < saved_at < end:
            end = saved_at  # the chunk stops where the state is saved
        t0 = time.perf_counter()
        if rows is None or len(rows) == 0:
            state.logits, state.cache = self.runner.prefill(
                state.tokens[start:end], cache=state.cache, start=start,
                chunk=self.config.prefill_chunk)
            state.logits.block_until_ready()
        else:
            state.logits, state.cache, captured = self.runner.prefill(
                state.tokens[start:end], cache=state.cache, start=start,
                chunk=self.config.prefill_chunk, capture=("indexer", "indices"),
                capture_from=start)
        t1 = time.perf_counter()
        state.step_seconds += t1 - t0
        state.position = end
        if end == saved_at:
            state.snapshot = jax.device_get(self._take_state(state.cache))
        if rows is not None and len(rows):
            record = self._watch(state.cache, captured, np.asarray(rows, np.int32), start, end,
                                 t1)
            state.shadow.append(record)
            if charge and self.shadow is not None:
                self.shadow.charge(record.seconds)

    def _watch(self, cache, captured, positions, start, end, t0):
        """The ShadowRecord of a captured chunk: flat top_k of the rows at `positions` over
        the pass's own key cache against the indices the pass attended to."""
        layers = [layer for layer, _ in self.watched]
        rel = positions - start
        if rel.min() < 0 or positions.max() >= end:
            raise ValueError(f"shadow rows {positions.tolist()} are outside the chunk "
                             f"[{start}, {end})")
        # Always R rows (one compiled re-selection per key length): pad with the last row.
        R = max(len(rel), self.shadow.rows if self.shadow is not None else 0)
        padded = np.concatenate([rel, np.full(R - len(rel), rel[-1], rel.dtype)])
        q = np.asarray(captured["indexer"].q)[layers][:, padded]
        w = np.asarray(captured["indexer"].w)[layers][:, padded]
        deployed = np.asarray(captured["indices"])[[u for _, u in self.watched]][:, rel]
        flat = np.asarray(self._flat_rows(
            tuple(layer_cache.layer_of(cache, self.config, layer).k_index for layer in layers),
            q, w, padded + start,
            kv_len=min(self.capacity, length_bucket(end)), top_k=self.config.top_k))
        recall, iou = compare(layers, deployed, flat[:, :len(rel)])
        return ShadowRecord(tuple(positions.tolist()), tuple(layers), tuple(recall), tuple(iou),
                            time.perf_counter() - t0)

    def first_token(self, state, sampling):
        """Samples the first generated token of a finished prefill."""
        arrays = self._sampling_arrays([sampling], [0])
        if self.mesh is None:
            token = sample_batch(state.logits[None], *arrays)
        else:  # no eager op on a global array: the [None] goes inside the jitted step
            token = self._sample_one(state.logits, *arrays)
        return int(np.asarray(token)[0])

    def _state_boundary(self, state):
        """Where a stateful model's prefill saves its state for the prefix cache: the end
        of the prompt's last full block (None: nothing to save)."""
        pc = self.prefix_cache
        if not self.stateful or pc is None or not pc.enabled:
            return None
        end = len(state.tokens) // pc.block_tokens * pc.block_tokens
        return end if end > state.cache_hit_tokens else None

    def cache_prompt(self, state):
        """Stores the prompt's full blocks that the prefix cache lacks (after prefill), and
        a stateful model's state with its last full block."""
        pc = self.prefix_cache
        if pc is None or not pc.enabled:
            return
        missing = pc.missing(state.tokens)
        blocks = {}
        if missing:
            end = (missing[-1] + 1) * pc.block_tokens
            prefix = jax.device_get(self._take_prefix(
                state.cache, min(self.capacity, length_bucket(end)), self.config))
            for i in missing:
                piece = layer_cache.slice_prefix(prefix, i * pc.block_tokens,
                                                 (i + 1) * pc.block_tokens, self.config)
                blocks[i] = Block(piece, layer_cache.prefix_bytes(piece))
        if state.snapshot is not None:
            last = len(state.tokens) // pc.block_tokens - 1
            if last in blocks:
                blocks[last].state = state.snapshot
            else:
                pc.save_state(state.tokens, last, state.snapshot)
        pc.insert(state.tokens, blocks)

    def _assemble(self, blocks):
        """A fresh cache holding the cached blocks' tokens at positions [0, len * P)."""
        n = len(blocks) * self.prefix_cache.block_tokens
        prefix = layer_cache.pad_prefix(layer_cache.join_prefix([b.prefix for b in blocks]),
                                        min(self.capacity, length_bucket(n)), self.config)
        state = blocks[-1].state if self.stateful else None
        return self._with_prefix(self._commit_prefix(prefix),
                                 None if state is None else self._commit_state(state))

    def _commit_state(self, state):
        if self.mesh is None:
            return self._commit(state)
        return sharding.put(state, jax.sharding.NamedSharding(self.mesh,
                                                              jax.sharding.PartitionSpec()))

    def _commit(self, tree):
        return jax.device_put(tree, self.device)

    def _commit_prefix(self, prefix):
        """A host prefix onto the device, or onto the mesh as the cache it goes into holds it
        (each device takes only its slice: model.cache.prefix_specs)."""
        if self.mesh is None:
            return self._commit(prefix)
        specs = layer_cache.prefix_specs(prefix, sharding.axis_size(self.mesh, "sequence"))
        return sharding.put(prefix, sharding.named(self.mesh, specs))

    def _fresh_cache(self):
        if self.mesh is not None:  # created on its shardings (model.cache)
            return self.runner.new_cache(self.max_context)
        return self._commit(self.runner.new_cache(self.max_context))

    def _empty_slots(self):
        """Empty decode-slot caches [n_slots, ...] (runner.new_batch_cache's values)."""
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (self.n_slots, *a.shape)),
                            init_cache(self.config, self.capacity))

    def reset_slots(self):
        """Empty decode slots (at start, and after a failed step consumed them); on a mesh
        created directly on their shardings (no device holds them whole)."""
        if self.mesh is not None:
            self.slots = jax.jit(self._empty_slots, out_shardings=self._slot_shardings)()
            return
        self.slots = self._commit(self.runner.new_batch_cache(self.n_slots, self.max_context))

    def _cache_with_prefix(self, prefix, state=None):
        cache = layer_cache.put_prefix(init_cache(self.config, self.capacity), prefix)
        return cache if state is None else layer_cache.put_state(cache, state)

    # ------------------------------------------------------------------ decode

    def insert(self, slot, state):
        """Moves a finished prefill's cache into decode slot `slot`."""
        self.slots = self._put_slot(self.slots, state.cache, slot)
        state.cache = None

    def decode(self, batch):
        """One batched step. batch: {slot: (token, position, Sampling, step)} for the running
        slots -> {slot: next token}. Idle slots run too (a fixed batch: one compiled step)."""
        tokens = np.zeros(self.n_slots, np.int32)
        positions = np.zeros(self.n_slots, np.int32)
        sampling, steps = [Sampling()] * self.n_slots, [0] * self.n_slots
        for slot, (token, position, params, step) in batch.items():
            tokens[slot], positions[slot] = token, position
            sampling[slot], steps[slot] = params, step
        logits, self.slots = self.runner.decode_batch(tokens, self.slots, positions)
        out = np.asarray(self._sample(logits, *self._sampling_arrays(sampling, steps)))
        return {slot: int(out[slot]) for slot in batch}

    def _sampling_arrays(self, sampling, steps):
        """(seeds u32[S], steps i32[S], temperatures f32[S], top_ps f32[S]): device arrays on
        one device, host arrays on a mesh."""
        xp = self._xp
        return (xp.asarray([s.seed % (1 << 31) for s in sampling], xp.uint32),
                xp.asarray(steps, xp.int32),
                xp.asarray([float(s.temperature) for s in sampling], xp.float32),
                xp.asarray([float(s.top_p) for s in sampling], xp.float32))

    # ------------------------------------------------------------------ warm-up

    def warmup(self, max_len, room=None):
        """Runs once every step shape that requests up to max_len tokens use: each prefill
        chunk shape, the batched decode step of every key-length bucket, sampling, the slot
        insert and the prefix cache's copies. Real calls on scratch data, not
        `jit.lower().compile()`: a first call with concrete arrays traces and lowers again
        (about as long as the compile on CPU), so only a call warms the call path. The
        buckets go shortest first, each with its prefill steps and its decode steps; room:
        None, or a callable that says False once the process must compile no more ahead
        (serving.program_maps): the warm-up stops after the bucket in progress (the first
        always runs), and longer buckets compile on first use.
        Returns the number of key-length buckets warmed."""
        max_len = min(max_len, self.capacity)
        if max_len < 1:
            return 0
        # Every (padded chunk, key length) step a prefill can run (model.buckets' rule).
        shapes = prefill_shapes(max_len, capacity=self.capacity,
                                chunk=self.config.prefill_chunk)
        scratch = Prefill(np.zeros(1, np.int32), self._fresh_cache(), 0, 0)
        kv_buckets = sorted({kv_len for _, kv_len in shapes})
        warmed = []
        for kv_bucket in kv_buckets:
            if warmed and room is not None and not room():
                log.warning("warm-up stopped at %d of %d key-length buckets (up to %d tokens): "
                            "the process nears its memory-map cap (docs/serving.md, "
                            "\"Compiled programs and vm.max_map_count\"); longer prompts "
                            "compile on first use", len(warmed), len(kv_buckets), warmed[-1])
                break
            for padded, kv_len in shapes:
                if kv_len != kv_bucket:
                    continue
                scratch.tokens = np.zeros(kv_len, np.int32)
                scratch.position = kv_len - padded
                self.prefill_step(scratch, None)
                if self.shadow is not None:  # the capturing step and the flat re-selection
                    scratch.position = kv_len - padded
                    rows = min(self.shadow.rows, padded)
                    self.prefill_step(scratch, np.arange(kv_len - rows, kv_len), charge=False)
            self._warm_decode(kv_bucket)
            warmed.append(kv_bucket)
        self.first_token(scratch, Sampling())
        if self.prefix_cache is not None and self.prefix_cache.enabled:
            P = self.prefix_cache.block_tokens
            for padded in sorted({min(self.capacity, length_bucket(n))
                                  for n in range(P, min(max_len, warmed[-1]) + 1, P)}):
                prefix = self._take_prefix(scratch.cache, padded, self.config)
                state = (self._commit_state(jax.device_get(self._take_state(scratch.cache)))
                         if self.stateful else None)
                self._with_prefix(self._commit_prefix(jax.device_get(prefix)), state)
        self.insert(0, scratch)
        return len(warmed)

    def _warm_decode(self, kv_len):
        """The decode steps of key length kv_len (a step of every batch size the engine
        runs)."""
        self.decode({0: (0, kv_len - 1, Sampling(), 0)})  # slot 0 is overwritten on use
