"""How the decoder layers are stored and run: stacks of parameters and caches, and the
segments a pass scans (MaxText's `scan_layers`: one compiled layer body, whatever the depth).

A *stack* holds every layer of one structure (structure_key: the attention kind, whether
the layer runs its own indexer, dense / MoE / hash-routed MoE feed-forward): its
parameters and its cache fields carry a leading layer axis. DeepSeek-V3.2 has two stacks
(its dense layers and its MoE layers), SmolLM2 one, DeepSeek-V4 one per attention kind and
router. Run-time switches (the selection kind per layer, candidate budgets, dense layers
of a retrofit) never change a stack, so `with_config` shares the arrays.

A *segment* is a run of consecutive layers that repeat a unit of `period` layers
`repeats` times, each position of the unit behaving alike in every repeat
(behaviour_key: the structure plus every per-layer switch the layer's code reads). A
segment runs as one `jax.lax.scan` over its repeats (period 1: a run of equal layers;
DeepSeek-V4's alternating CSA / HCA layers: period 2; GLM-5's "SSSF" reuse: period 4); a
layer that repeats nothing runs alone. Position j of the unit reads layer base_j + k
stride_j of its stack in repeat k, through a traced index: parameters by
dynamic_index, caches read and written in place at that index (model.layer_cache).

A shared layer (indexer_types) attends to the selection its source full layer hands off.
Inside a unit the hand-off is a plain value; when a unit begins with shared layers it is
carried in the scan's carry (from the layer before the segment, then from each repeat's
last full layer); a segment whose next layer is shared hands its last repeat's hand-off
across the boundary.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.attention_kinds import attention_kind

MAX_PERIOD = 8  # the longest unit a segment scans


def structure_key(config, layer):
    """What fixes layer `layer`'s parameters and cache fields (their names and shapes)."""
    kind = attention_kind(config, layer)
    own_indexer = not (config.layer_is_shared(layer) or kind.self_indexed)
    mlp = ("hash_moe" if config.layer_is_hashed(layer) else "moe") \
        if config.layer_is_moe(layer) else "dense"
    return kind.name, own_indexer, mlp


def behaviour_key(config, layer):
    """structure_key and every per-layer switch a layer's code reads through its index:
    layers of equal keys trace to the same program, so one scanned body serves them."""
    return (structure_key(config, layer), config.layer_is_shared(layer),
            config.layer_is_sparse(layer), config.layer_needs_selection(layer),
            config.layer_indexer(layer), config.layer_settings(layer))


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers start .. start + period x repeats - 1: repeat k, position j is layer
    start + k period + j, stored at index units[j][1] + k units[j][2] of stack units[j][0].
    reads_handoff: the unit begins with shared layers (they read the hand-off of the layer
    before them: carried by the scan); hands_off: the layer after the segment is shared (it
    reads this segment's last hand-off)."""

    start: int
    period: int
    repeats: int
    units: tuple
    reads_handoff: bool
    hands_off: bool

    @property
    def stop(self):
        return self.start + self.period * self.repeats

    def layer(self, k, j):
        return self.start + k * self.period + j


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """stacks: the layers of each stack, in order; place: per layer (stack, index in it);
    segments: how a pass runs them."""

    stacks: tuple
    place: tuple
    segments: tuple


def _segment_units(keys, start):
    """(period, repeats) of the segment starting at `start`: the unit that covers most
    layers by repeating (ties: the shortest); a layer that repeats nothing runs alone."""
    best = (1, 1)
    for period in range(1, MAX_PERIOD + 1):
        unit = keys[start:start + period]
        if len(unit) < period:
            break
        repeats = 1
        while keys[start + repeats * period:start + (repeats + 1) * period] == unit:
            repeats += 1
        if repeats > 1 and period * repeats > best[0] * best[1]:
            best = (period, repeats)
    return best


@functools.lru_cache(maxsize=256)
def layer_plan(config):
    """The LayerPlan of a ModelConfig."""
    n = config.n_layers
    structures = [structure_key(config, i) for i in range(n)]
    stack_keys = list(dict.fromkeys(structures))
    stacks = tuple(tuple(i for i in range(n) if structures[i] == key) for key in stack_keys)
    place = [None] * n
    for s, layers in enumerate(stacks):
        for index, layer in enumerate(layers):
            place[layer] = (s, index)
    keys = [behaviour_key(config, i) for i in range(n)]
    segments, start = [], 0
    while start < n:
        period, repeats = _segment_units(keys, start)
        unit_stacks = [place[start + j][0] for j in range(period)]
        units = tuple((s, place[start + j][1], unit_stacks.count(s))
                      for j, s in enumerate(unit_stacks))
        segment_shared = [config.layer_is_shared(start + j) for j in range(period)]
        first_full = segment_shared.index(False) if False in segment_shared else period
        stop = start + period * repeats
        segment = Segment(start, period, repeats, units,
                          reads_handoff=first_full > 0 and repeats > 1,
                          hands_off=stop < n and config.layer_is_shared(stop))
        for k in range(repeats):  # the index rule holds for every layer of the segment
            for j, (s, base, stride) in enumerate(units):
                assert place[segment.layer(k, j)] == (s, base + k * stride)
        segments.append(segment)
        start = stop
    return LayerPlan(stacks, tuple(place), tuple(segments))


def describe_plan(config):
    """The plan in words: each segment's layers, unit and repeats (docs, logs)."""
    plan = layer_plan(config)
    parts = []

    def name(layer):
        kind, _, mlp = structure_key(config, layer)
        return (kind + ("" if mlp == "dense" else f"+{mlp}")
                + (" shared" if config.layer_is_shared(layer) else ""))

    for seg in plan.segments:
        kinds = ", ".join(name(seg.start + j) for j in range(seg.period))
        if seg.repeats == 1 and seg.period == 1:
            parts.append(f"layer {seg.start} ({kinds}) alone")
        else:
            parts.append(f"layers {seg.start}-{seg.stop - 1}: {seg.repeats} x [{kinds}]")
    stacks = len(plan.stacks)
    return f"{stacks} stack{'s' if stacks > 1 else ''}; " + "; ".join(parts)


# ---------------------------------------------------------------- parameters

STACKS = "stacks"  # the Transformer's attribute holding one stacked DecoderBlock per stack
LAYERS = "layers"  # the per-layer name of a block's parameters (files, checkpoints)


def stack_trees(trees):
    """Per-layer pytrees of one structure -> one with a leading layer axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def layer_slice(tree, index):
    """Layer `index` (int or traced) of a stacked pytree (arrays or shape structs)."""
    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
        if isinstance(index, int) and not isinstance(x, jax.core.Tracer):
            return x[index]
        return jax.lax.dynamic_index_in_dim(x, index, keepdims=False)
    return jax.tree.map(one, tree)


def to_layered(flat, config, *, keys_only=False):
    """{path tuple: value} with stacked paths ("stacks", s, ...) -> per-layer paths
    ("layers", i, ...) (values sliced: arrays, numpy or shape structs; keys_only: values
    None); other paths kept."""
    plan = layer_plan(config)
    out = {}
    for path, value in flat.items():
        if path[0] != STACKS:
            out[path] = value
            continue
        for index, layer in enumerate(plan.stacks[int(path[1])]):
            out[(LAYERS, layer, *path[2:])] = None if keys_only else layer_slice(value, index)
    return out


def from_layered(flat, config):
    """to_layered's inverse: per-layer paths ("layers", i, ...) -> stacked paths (values
    stacked with numpy for host arrays, jnp otherwise). Every layer of a stack must hold
    the same paths: ValueError naming the first one missing."""
    plan = layer_plan(config)
    per_stack = {}
    out = {}
    for path, value in flat.items():
        if path[0] != LAYERS:
            out[path] = value
            continue
        s, index = plan.place[int(path[1])]
        per_stack.setdefault((s, path[2:]), {})[index] = value
    for (s, rest), values in per_stack.items():
        layers = plan.stacks[s]
        if len(values) != len(layers):
            missing = [layers[i] for i in range(len(layers)) if i not in values]
            raise ValueError(f"layer {missing[0]} has no parameter {'/'.join(map(str, rest))}, "
                             f"which layer {layers[min(values)]} of the same structure has")
        ordered = [values[i] for i in range(len(layers))]
        if all(isinstance(v, np.ndarray) for v in ordered):
            out[(STACKS, s, *rest)] = np.stack(ordered)
        else:
            out[(STACKS, s, *rest)] = jnp.stack([jnp.asarray(v) for v in ordered])
    return out


def stacked_path(config, path):
    """A per-layer parameter path ("layers", i, ...) -> (its stacked path, index in the
    stack); any other path -> (path, None)."""
    if not path or path[0] != LAYERS:
        return tuple(path), None
    s, index = layer_plan(config).place[int(path[1])]
    return (STACKS, s, *path[2:]), index


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stacked, value, index):
    return jax.lax.dynamic_update_index_in_dim(stacked, value.astype(stacked.dtype), index, 0)


def set_layer(stacked, value, index):
    """stacked with layer `index` replaced by value, in place (the stack is donated: a model
    streamed onto a mesh is filled layer by layer without a second copy)."""
    return _set_layer(stacked, jnp.asarray(value), jnp.int32(index))


def nest(flat):
    """{path tuple: value} -> nested dicts (nnx's pure-dict form)."""
    out = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def flatten(nested, prefix=()):
    """nest's inverse."""
    out = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            out.update(flatten(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


def layered_pure_dict(state, config):
    """An nnx.State of a Transformer's variables (stacked) -> the nested pure dict of the
    same values per layer ("layers" / i / ...): the form files and checkpoints keep, the
    same whatever the stacking."""
    return nest(to_layered(flatten(nnx.to_pure_dict(state)), config))


def stacked_pure_dict(layered, config):
    """layered_pure_dict's inverse: values per layer -> the stacked pure dict."""
    return nest(from_layered(flatten(layered), config))


def named_values(model, kind):
    """{"layers.3.indexer.wq.kernel": value, ...}: a Transformer's variables of `kind` (an
    nnx filter) by their per-layer dotted names (the names files keep), values sliced from
    the stacks."""
    flat = {path: v.get_value() for path, v in nnx.to_flat_state(nnx.state(model, kind))}
    return {".".join(map(str, path)): value
            for path, value in to_layered(flat, model.config).items()}


def assign_named(model, kind, values):
    """Writes values by per-layer dotted name (named_values' form, every name of `kind`
    present) into the model's variables of `kind` (stacked in place)."""
    flat = dict(nnx.to_flat_state(nnx.state(model, kind)))
    layered = to_layered(dict.fromkeys(flat), model.config, keys_only=True)
    by_path = {path: values[".".join(map(str, path))] for path in layered}
    for path, value in from_layered(by_path, model.config).items():
        variable = flat[path]
        variable.set_value(jnp.asarray(value, variable.get_value().dtype))


class LayerwiseFill:
    """An abstract Transformer's variables (the flat state of nnx.eval_shape's model)
    filled one parameter at a time by per-layer path, each placed as it comes: a layer's
    parameter goes into its stack in place (the stack allocated, on its sharding, at its
    first layer), so a model streamed onto a mesh never holds a parameter twice.

    specs: {stacked path: PartitionSpec} (model.sharding.param_specs) with `mesh`."""

    def __init__(self, config, flat, *, mesh=None, specs=None):
        self.config, self.flat, self.mesh, self.specs = config, flat, mesh, specs or {}
        self._written = {}  # stacked path -> indices written

    def _where(self, path):
        return stacked_path(self.config, tuple(path))

    def shape(self, path):
        """The per-layer shape of the parameter at `path`."""
        spath, index = self._where(path)
        shape = self.flat[spath].shape
        return tuple(shape[1:]) if index is not None else tuple(shape)

    def dtype(self, path):
        return self.flat[self._where(path)[0]].dtype

    def _sharding(self, spath, drop_layer_axis):
        if self.mesh is None:
            return None
        spec = self.specs[spath].get_value()
        return jax.sharding.NamedSharding(
            self.mesh, jax.sharding.PartitionSpec(*spec[1:]) if drop_layer_axis else spec)

    def place(self, path, host):
        """Writes host (numpy) as the parameter at per-layer `path`."""
        spath, index = self._where(path)
        variable = self.flat[spath]
        host = np.asarray(host, variable.dtype)
        sharding = self._sharding(spath, index is not None)
        if sharding is None:
            value = jnp.asarray(host)
        else:
            value = jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
        # Transfers are asynchronous: wait for each, so that the host copies of pending ones
        # never pile up (on a busy machine they did, by tens of MB).
        value.block_until_ready()
        if index is None:
            self.flat[spath] = variable.replace(value)
            return
        written = self._written.setdefault(spath, set())
        current = variable.get_value()
        if not written:
            stacked_sharding = self._sharding(spath, False)
            current = (jnp.zeros(variable.shape, variable.dtype) if stacked_sharding is None
                       else jax.jit(lambda: jnp.zeros(variable.shape, variable.dtype),
                                    out_shardings=stacked_sharding)())
        written.add(index)
        self.flat[spath] = variable.replace(set_layer(current, value, index).block_until_ready())

    def missing(self):
        """Per-layer paths of stacked parameters some of whose layers were never written."""
        plan = layer_plan(self.config)
        out = []
        for spath, written in self._written.items():
            layers = plan.stacks[int(spath[1])]
            out += [(LAYERS, layers[i], *spath[2:]) for i in range(len(layers))
                    if i not in written]
        return out
