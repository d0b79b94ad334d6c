"""The walk over the decoder layers: each segment of model.layer_stack's plan as one
`jax.lax.scan` over its repeats (the unit of layers compiled once), a layer that repeats
nothing called as it is.

In the scan, position j of the unit reads its parameters at a traced index of its stack
(dynamic_index: the layer's weights, sliced as XLA slices a scan's inputs; a MoE's routed
experts stay the whole stack, read in place at the index: model.moe) and its cache
through a model.layer_cache.LayerView at the same index: the stacks of the caches are the
scan's carry, written in place. The hand-off of a selection to shared layers
(indexer_types) rides in the carry when the unit begins with shared layers; then the first
repeat runs outside the scan (its hand-off comes from the layer before the segment, whose
structure may differ from the unit's own), and a segment whose next layer is shared runs
its last repeat outside the scan to hand off (module docstring of model.layer_stack).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from model.layer_cache import LayerView
from model.layer_stack import layer_plan, layer_slice
from model.moe import MoE


def run_layers(config, stacks, x, cache, args, *, remat=False):
    """Runs every layer of `config` -> (x, cache, captured).

    stacks: [(graphdef, state)] of the Transformer's stacked DecoderBlocks; cache: the list
    over stacks of LayerCache (model.cache.init_cache); args: the blocks' call arguments
    (start, kv_len, n_valid, capture, parallel, capture_rows, tokens); remat: each unit
    rematerialised in the backward pass. captured: {kind: [value of each layer]}."""
    kinds = args["capture"]
    captured = {kind: [None] * config.n_layers for kind in kinds}
    handoff = None
    cache = list(cache)
    for seg in layer_plan(config).segments:
        x, caches, handoff = _run_segment(seg, stacks, x, {s: cache[s] for s, _, _ in seg.units},
                                          handoff, args, captured, remat)
        for s, stack in caches.items():
            cache[s] = stack
    return x, cache, captured


def _layer_state(state, index):
    """A stack's variables at layer `index`, but for a MoE's routed experts, which stay the
    whole stack (the MoE reads them in place at the block's stack_index: sliced, XLA would
    copy the layer's experts before the grouped matmul)."""
    flat = []
    for path, variable in nnx.to_flat_state(state):
        value = variable.get_value()
        if not (len(path) == 2 and path[0] == "mlp" and path[1] in MoE.ROUTED_EXPERTS):
            value = layer_slice(value, index)
        flat.append((path, variable.replace(value)))
    return nnx.from_flat_state(flat)


def _run_segment(seg, stacks, x, caches, handoff, args, captured, remat):
    kinds = args["capture"]

    def unit(carry, k, keep):
        """Repeat k of the unit -> (carry, [captured of each position]); keep: the carry
        holds the unit's last hand-off (else None: the scanned units that read none)."""
        x, caches, handoff = carry
        outs = []
        for j, (s, base, stride) in enumerate(seg.units):
            graphdef, state = stacks[s]
            index = base + k * stride
            block = nnx.merge(graphdef, _layer_state(state, index))
            x, view, got, handoff = block(
                x, LayerView(caches[s], index), args["start"], args["kv_len"],
                args["n_valid"], kinds, args["parallel"], handoff, args["capture_rows"],
                args["tokens"], layer=seg.layer(0, j), stack_index=index)
            caches = {**caches, s: view.stack}
            outs.append(got)
        return (x, caches, handoff if keep else None), outs

    def call(carry, k, keep):
        fn = lambda c, kk: unit(c, kk, keep)  # noqa: E731
        return (jax.checkpoint(fn) if remat else fn)(carry, k)

    def record(k, outs, pick=None):
        for j, got in enumerate(outs):
            for kind in kinds:
                value = got[kind] if pick is None else jax.tree.map(lambda a: a[pick], got[kind])
                captured[kind][seg.layer(k, j)] = value

    repeats = seg.repeats
    head = [0] if seg.reads_handoff else []
    tail = [repeats - 1] if seg.hands_off and not seg.reads_handoff and repeats > 1 else []
    middle = [k for k in range(repeats) if k not in head and k not in tail]
    carry = (x, caches, handoff)
    for k in head:
        carry, outs = call(carry, k, True)
        record(k, outs)
    if len(middle) == 1:  # called as it is: the hand-off passes through
        carry, outs = call(carry, middle[0], True)
        record(middle[0], outs)
    elif middle:
        keep = seg.reads_handoff
        if not keep:  # the scan's carry holds no hand-off: its units make their own
            carry = (carry[0], carry[1], None)
        carry, ys = jax.lax.scan(lambda c, k: call(c, k, keep), carry,
                                 jnp.arange(middle[0], middle[-1] + 1, dtype=jnp.int32))
        for t, k in enumerate(middle):
            record(k, ys, t)
    for k in tail:
        carry, outs = call(carry, k, True)
        record(k, outs)
    return carry
