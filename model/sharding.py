"""Device meshes and logical-axis sharding rules for parameters, caches and activations.

A mesh has four named axes (MESH_AXES): "data" (independent sequences: serving slots),
"sequence" (positions of one long sequence: its KV cache and a prefill chunk's queries),
"expert" (a DeepSeekMoE's routed experts, together with "tensor") and "tensor" (attention
heads and the MLP's hidden dimension; whole routed experts). Every array dimension gets
a *logical* name (LOGICAL_AXES); LOGICAL_RULES maps each name to a mesh axis or None
(replicated). Tensor parallelism is GSPMD: the jitted step of model.runner with
NamedSharding'd parameters and caches. Sequence parallelism adds one hook inside the
sparse layers (model.sequence_parallel).

Replicated on purpose: the indexer's weights, keys and block summaries (every query scores
every earlier token, and a selection computed identically on every device needs no
exchange; d_I values per token are a small fraction of the KV rows), norms, embedding
and lm_head.
"""

import re

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model.attention_kinds import ATTENTION_KINDS
from model.parallel_flags import MESH_AXES, distributed_settings, parse_mesh

# Logical dimension name -> mesh axis (None: replicated).
LOGICAL_RULES = {
    "batch": "data",            # serving slots
    "layers": None,             # a stack's layers (model.layer_stack): whole on every device
    "cache_seq": "sequence",    # positions of the KV cache
    "act_seq": "sequence",      # the queries (tokens) of a prefill chunk
    "heads": "tensor",          # query heads (flattened heads x head_dim in kernels)
    "kv_heads": "tensor",       # key/value heads
    "mlp": "tensor",            # the MLP's hidden dimension d_ff
    # Routed experts split whole over the expert-parallel group, expert x tensor (the
    # tensor group that splits attention heads holds different experts: model.moe); an
    # expert's hidden dimension stays whole.
    "experts": ("expert", "tensor"),
    "expert_mlp": None,
    "embed": None,              # d_model
    "vocab": None,
    "head_dim": None,
    "latent": None,             # MLA's cached latent: one head, whole on every tensor shard
    "index_heads": None,        # the indexer stays whole on every device (see above)
    "index_dim": None,
    "index_cache_seq": None,    # indexer keys: replicated, all-gathered as written
    "blocks": None,             # block summaries: replicated
    "window": None,             # DeepSeek-V4's rings of a layer's last tokens: replicated
    "entries": None,            # DeepSeek-V4's compressed entries: replicated
}

# Parameter path (regex over "a/b/c") -> logical axes of the array (None: replicated,
# any rank); first match wins.
PARAM_RULES = (
    # DeepSeekMoE (model/moe.py): the router whole; the routed experts split whole over
    # expert x tensor, the shared experts as a dense MLP.
    (r"mlp/(router|bias|tid2eid)$", None),
    # DeepSeek-V4's hyper-connections: small, whole on every device.
    (r"(attn_hc|mlp_hc|hc_head)/", None),
    (r"mlp/(gate|up)$", ("experts", "embed", "expert_mlp")),
    (r"mlp/down$", ("experts", "expert_mlp", "embed")),
    (r"mlp/(gate|up|down)_scale$", ("experts", None, None)),  # FP8 experts' block scales
    (r"mlp/shared/(gate|up)/kernel$", ("embed", "mlp")),
    (r"mlp/shared/down/kernel$", ("mlp", "embed")),
    (r"mlp/(gate|up)/kernel$", ("embed", "mlp")),
    (r"mlp/down/kernel$", ("mlp", "embed")),
    (r"indexer/wq/kernel$", ("embed", "index_heads")),
    (r"indexer/wk/kernel$", ("embed", "index_dim")),
    (r"indexer/ww/kernel$", ("embed", "index_heads")),
    (r"indexer/k_norm/(scale|bias)$", ("index_dim",)),
    (r"(attn_norm|mlp_norm|final_norm)/scale$", ("embed",)),
    (r"embed/embedding$", ("vocab", "embed")),
    (r"lm_head/kernel$", ("embed", "vocab")),
    # The hierarchical indexer's learned coarse screen: small, whole on every device, of
    # whatever rank (None: replicated).
    (r"coarse_screen/", None),
)

def make_mesh(shape, devices=None):
    """A Mesh with axes MESH_AXES (Auto axis types: GSPMD propagates shardings).

    shape: a dict {axis: size} (missing axes 1) or a parse_mesh string. devices: default
    jax.devices() (every process's devices under jax.distributed). ValueError when the
    sizes' product is not the number of devices."""
    sizes = parse_mesh(shape) if isinstance(shape, str) else {**dict.fromkeys(MESH_AXES, 1),
                                                               **shape}
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh: unknown axes {sorted(unknown)}; allowed: {MESH_AXES}")
    devices = list(jax.devices() if devices is None else devices)
    dims = tuple(int(sizes[a]) for a in MESH_AXES)
    if int(np.prod(dims)) != len(devices):
        raise ValueError(f"--mesh: {dict(zip(MESH_AXES, dims))} needs {int(np.prod(dims))} "
                         f"devices, there are {len(devices)}")
    return Mesh(np.asarray(devices).reshape(dims), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(MESH_AXES))


def axis_size(mesh, axis):
    """Size of `axis` in a Mesh or a {axis: size} dict (1 when absent)."""
    sizes = mesh if isinstance(mesh, dict) else mesh.shape
    return int(sizes.get(axis, 1))


def check_mesh(config, mesh):
    """ValueError unless the tensor axis divides n_heads, n_kv_heads, d_ff and the shared
    experts' hidden size, and expert x tensor divides the routed experts (mesh: a Mesh or
    a {axis: size} dict); an expert axis needs a model with routed experts."""
    tp, ep = axis_size(mesh, "tensor"), axis_size(mesh, "expert")
    names = ["n_heads", "n_kv_heads", "d_ff"]
    if config.moe is not None and config.moe.n_shared_experts:
        names.append("moe.moe_intermediate_size")
    for name in names:
        value = config
        for part in name.split("."):
            value = getattr(value, part)
        if value % tp:
            allowed = [d for d in range(1, value + 1) if value % d == 0]
            raise ValueError(f"mesh: tensor={tp} must divide ModelConfig.{name}={value}; "
                             f"allowed tensor sizes: {allowed}")
    if config.moe is None:
        if ep > 1:
            raise ValueError(f"mesh: expert={ep} splits routed experts, and this model has "
                             "none (ModelConfig.moe is None); use expert=1")
        return
    experts = config.moe.n_routed_experts
    if experts % (ep * tp):
        allowed = [d for d in range(1, experts + 1) if experts % d == 0]
        raise ValueError(f"mesh: expert x tensor = {ep} x {tp} must divide "
                         f"ModelConfig.moe.n_routed_experts={experts} (the routed experts "
                         f"split whole over both); allowed products: {allowed}")


def check_capacity(mesh, capacity):
    """ValueError unless the sequence axis divides the cache capacity."""
    sp = axis_size(mesh, "sequence")
    if capacity % sp:
        raise ValueError(f"cache capacity ({capacity} positions) must be a multiple of the "
                         f"mesh's sequence={sp}")


def logical_to_spec(axes, rules=None):
    """Logical names (None: replicated) -> PartitionSpec through LOGICAL_RULES."""
    rules = LOGICAL_RULES if rules is None else rules
    for a in axes:
        if a is not None and a not in rules:
            raise ValueError(f"unknown logical axis {a!r}; known: {sorted(rules)}")
    return P(*(None if a is None else rules[a] for a in axes))


def _path_str(path):
    # GetAttrKey entries (an nnx Variable's ".value") name no module: skipped.
    return "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path
                    if not isinstance(p, jax.tree_util.GetAttrKey))


def param_axes(path, ndim):
    """Logical axes of the parameter at `path` (a pytree key path); ValueError if no rule
    matches (every parameter must have one). A stacked layer parameter (model.layer_stack:
    "stacks/<s>/...") is its layer's rule after a leading "layers" axis."""
    name = _path_str(path)
    stacked = name.startswith("stacks/")
    if stacked:
        ndim -= 1
    # The attention kinds' own parameters first (model.attention_kinds: each names its
    # axes), then the rest.
    kinds = tuple(rule for kind in ATTENTION_KINDS.values() for rule in kind.param_axes)
    for pattern, axes in kinds + PARAM_RULES:
        if re.search(pattern, name):
            if axes is None:
                axes = (None,) * ndim
            elif len(axes) != ndim:
                raise ValueError(f"sharding rule {pattern!r} has {len(axes)} axes, parameter "
                                 f"{name} has {ndim} dimensions")
            return ("layers", *axes) if stacked else tuple(axes)
    raise ValueError(f"no sharding rule for parameter {name}; add one to PARAM_RULES (or "
                     f"to its attention kind's param_axes)")


def param_specs(state):
    """PartitionSpecs for an nnx.State (or any pytree of arrays) of model parameters."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: logical_to_spec(param_axes(path, np.ndim(x))), state)


def named(mesh, specs):
    """PartitionSpecs -> NamedShardings on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def put(tree, shardings):
    """Places host or single-device arrays on global shardings. Works across processes
    (jax.distributed): each process fills its own shards from its copy, which must be the
    same on every process. Arrays already placed so (a model streamed onto the mesh as it
    loaded) are kept as they are, never gathered. Shape structs (a model made without
    weights, to compile for a mesh) become shape structs with the sharding."""
    def one(x, sharding):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
    return jax.tree.map(one, tree, shardings)


def shard_state(state, mesh):
    """Model parameters (nnx.State) placed by their rules (param_axes) on `mesh`."""
    return put(state, named(mesh, param_specs(state)))


def per_device_bytes(tree):
    """{device id: bytes held} for a pytree of jax.Arrays (addressable shards only)."""
    out = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


try:  # jax >= 0.7 (the 0.11 GPU hosts and 0.12 here) export it at the top level.
    shard_map = jax.shard_map
except AttributeError:  # pragma: no cover - older jax: the experimental one, check_rep
    from jax.experimental.shard_map import shard_map as _old_shard_map

    def shard_map(f, *, mesh, in_specs, out_specs, check_vma=True):
        return _old_shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                              check_rep=check_vma)


def mesh_axis_sizes(spec_entry, sizes):
    """How many shards a PartitionSpec entry (None, an axis, or a tuple of axes) makes."""
    if spec_entry is None:
        return 1
    axes = spec_entry if isinstance(spec_entry, tuple) else (spec_entry,)
    return int(np.prod([sizes.get(a, 1) for a in axes]))


_MESH = []  # the use_mesh stack


class use_mesh:  # noqa: N801 - used as a context manager, like jax's own
    """`with use_mesh(mesh):` every ModelRunner built inside runs on `mesh` unless given
    its own (a run-time setting for code that builds runners itself, e.g. the main job's
    study); mesh None: one device."""

    def __init__(self, mesh):
        self.mesh = mesh

    def __enter__(self):
        _MESH.append(self.mesh)
        return self.mesh

    def __exit__(self, *exc):
        _MESH.pop()


def current_mesh():
    """The innermost use_mesh's mesh, or None."""
    return _MESH[-1] if _MESH else None


# ---------------------------------------------------------------- several processes / hosts

def initialize_distributed(coordinator_address=None, num_processes=None, process_id=None):
    """jax.distributed.initialize from flags or the environment, when more than one process
    is asked for (before any other JAX call). Returns the number of processes."""
    address, count, pid = distributed_settings(coordinator_address, num_processes, process_id)
    if count > 1:
        jax.distributed.initialize(coordinator_address=address, num_processes=count,
                                   process_id=pid)
    return count


def mesh_from_args(args):
    """initialize_distributed + make_mesh from model.parallel_flags' flags -> Mesh or
    None (no --mesh: one device). ValueError on bad flags."""
    initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
    return None if args.mesh is None else make_mesh(args.mesh)
