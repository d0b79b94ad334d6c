"""What a model needs on each device, from its config alone (no weights read): parameters
as model.sharding's rules split them over a mesh, the cache at a context length (the KV
part split over the sequence axis, the index part on every device), and a prefill chunk's
working set. `check_fits` refuses a checkpoint before it is loaded, with the figures."""

import math

import jax
import numpy as np
from flax import nnx

from model.cache import bytes_per_token, layer_state_bytes
from model.sharding import MESH_AXES, mesh_axis_sizes, param_specs
from model.transformer import Transformer


def param_bytes_per_device(config, mesh_shape):
    """(bytes on the most loaded device, bytes in all) of the model's parameters in
    config.dtype (norms and the router in float32), split as the sharding rules say."""
    state = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    specs = param_specs(state)
    sizes = {a: int(mesh_shape.get(a, 1)) for a in MESH_AXES}
    per_device = total = 0
    for x, spec in zip(jax.tree.leaves(state), jax.tree.leaves(
            specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))):
        n = int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
        split = math.prod(mesh_axis_sizes(a, sizes) for a in spec)
        total += n
        per_device += n / split
    return per_device, total


def working_set_bytes(config):
    """A prefill chunk's largest transient, roughly: the flat indexer's scores of a query
    chunk of 512 against max_seq_len keys (f32), plus 16 activations of the chunk."""
    return 512 * config.max_seq_len * 4 + 16 * config.prefill_chunk * config.d_model * 4


def memory_per_device(config, mesh_shape, capacity):
    """{"weights", "kv_cache", "index_cache", "state", "working_set", "total"} bytes per
    device for a cache of `capacity` positions on a mesh of these axis sizes ("state": the
    layers' fixed-size rings, DeepSeek-V4's windows and compressor tails; "weights_all":
    the parameters' bytes in all)."""
    weights, weights_all = param_bytes_per_device(config, mesh_shape)
    per = bytes_per_token(config)
    seq = int(mesh_shape.get("sequence", 1))
    out = {"weights": weights, "kv_cache": capacity * per["kv"] / seq,
           "index_cache": capacity * (per["index_keys"] + per["block_summaries"]),
           "state": sum(layer_state_bytes(config, i) for i in range(config.n_layers)),
           "working_set": working_set_bytes(config)}
    out["total"] = sum(out.values())
    out["weights_all"] = weights_all
    return out


def check_fits(config, mesh_shape, capacity, device_bytes, *, source="the model"):
    """ValueError with the figures when `config` on this mesh, with a cache of `capacity`
    positions, needs more than device_bytes per device."""
    need = memory_per_device(config, mesh_shape, capacity)
    if need["total"] <= device_bytes:
        return need
    total = need["weights_all"]
    devices = math.prod(int(mesh_shape.get(a, 1)) for a in MESH_AXES)
    gb = lambda b: f"{b / 1e9:.1f} GB" if b >= 1e8 else f"{b / 1e6:.2f} MB"  # noqa: E731
    fp8 = (" with the routed experts in FP8 e4m3" if config.moe is not None
           and config.moe.fp8_block else "")
    raise ValueError(
        f"{source} does not fit: it needs {gb(need['total'])} per device on mesh "
        f"{dict(mesh_shape)} (weights {gb(need['weights'])} of {gb(total)} in "
        f"{config.dtype}{fp8}, KV cache {gb(need['kv_cache'])} and index cache "
        f"{gb(need['index_cache'])} at {capacity} tokens, working set "
        f"{gb(need['working_set'])}); each device has {gb(device_bytes)} and the "
        f"{devices} devices {gb(devices * device_bytes)} in all")


def device_memory_bytes():
    """Memory of one local device as JAX reports it (GPUs), or None (the CPU reports none)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")
