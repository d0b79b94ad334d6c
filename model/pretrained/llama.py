"""Llama-family checkpoints -> the dosa Transformer: hyper-parameters, tensor names, loading.

Both file formats (GGUF, Hugging Face safetensors) are read into the Hugging Face naming and
layout (linear weights [out, in], rotate-half RoPE rows); this module checks every tensor's
shape and writes it into a `Transformer` whose DSA indexers are either fresh (to be warmed
up) or loaded from an indexer checkpoint (model.pretrained.indexer_weights).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from indexer.config import HierarchicalConfig
from model.config import ModelConfig


class PretrainedFormatError(ValueError):
    """A checkpoint file that cannot be read: names the file and, when known, the tensor."""


@dataclasses.dataclass(frozen=True)
class LlamaHParams:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    rope_theta: float
    norm_eps: float
    context_length: int
    tie_embeddings: bool


# The DSA indexer put into a retrofitted Llama (see docs/pretrained.md for the choice):
# 4 heads x 64 dims with RoPE on 32 of them, as in the shipped model; V3.2 uses 64 x 128 for a
# 7168-wide model, which would cost more than this model's own attention.
RETROFIT_INDEXER = dict(index_heads=4, index_dim=64, index_rope_dim=32)


def llama_config(hp, *, dtype="float32", **overrides):
    """The ModelConfig of a Llama checkpoint with a DSA indexer; overrides are run-time
    switches (attention, indexer, top_k, dense_layers, rope_scaling, max_seq_len...)."""
    base = ModelConfig(vocab_size=hp.vocab_size, d_model=hp.d_model, n_layers=hp.n_layers,
                       n_heads=hp.n_heads, n_kv_heads=hp.n_kv_heads, head_dim=hp.head_dim,
                       d_ff=hp.d_ff, max_seq_len=hp.context_length, rope_theta=hp.rope_theta,
                       norm_eps=hp.norm_eps, tie_embeddings=hp.tie_embeddings, dtype=dtype,
                       attention="dense", top_k=1024, **RETROFIT_INDEXER,
                       hierarchical=HierarchicalConfig(candidate_tokens=4096))
    return base.replace(**overrides) if overrides else base


def hf_tensor_shapes(hp):
    """Hugging Face name -> numpy shape of every tensor a Llama checkpoint must hold."""
    D, q_rows, kv_rows = hp.d_model, hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim
    shapes = {"model.embed_tokens.weight": (hp.vocab_size, D), "model.norm.weight": (D,)}
    if not hp.tie_embeddings:
        shapes["lm_head.weight"] = (hp.vocab_size, D)
    for i in range(hp.n_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (q_rows, D),
            p + "self_attn.k_proj.weight": (kv_rows, D),
            p + "self_attn.v_proj.weight": (kv_rows, D),
            p + "self_attn.o_proj.weight": (D, q_rows),
            p + "post_attention_layernorm.weight": (D,),
            p + "mlp.gate_proj.weight": (hp.d_ff, D),
            p + "mlp.up_proj.weight": (hp.d_ff, D),
            p + "mlp.down_proj.weight": (D, hp.d_ff),
        })
    return shapes


def _set(variable, array, dtype):
    variable[...] = jnp.asarray(array, dtype)


def build_transformer(config, read_tensor, *, source, seed=0):
    """A Transformer for `config` with the base weights from read_tensor(hf_name) -> numpy
    float array (HF layout); the indexers are freshly initialised from `seed`.

    Every tensor's shape is checked against the config (PretrainedFormatError naming
    `source` and the tensor)."""
    from model import layer_stack  # local: model/__init__ imports this package
    from model.transformer import Transformer

    hp_shapes = hf_tensor_shapes(config_hparams(config))

    def tensor(name):
        array = np.asarray(read_tensor(name), np.float32)
        if array.shape != hp_shapes[name]:
            raise PretrainedFormatError(f"{source}: tensor {name} has shape {array.shape}, "
                                        f"the config needs {hp_shapes[name]}")
        if not np.all(np.isfinite(array)):
            raise PretrainedFormatError(f"{source}: tensor {name} holds non-finite values")
        return array

    dtype = jnp.dtype(config.dtype)
    model = Transformer(config, rngs=nnx.Rngs(seed))
    _set(model.embed.embedding, tensor("model.embed_tokens.weight"), dtype)
    _set(model.final_norm.scale, tensor("model.norm.weight"), jnp.float32)
    if not config.tie_embeddings:
        _set(model.lm_head.kernel, tensor("lm_head.weight").T, dtype)
    layered = {}  # per-layer parameter path -> host array, stacked once at the end
    for i in range(config.n_layers):
        p = f"model.layers.{i}."

        def put(path, array, dtype, i=i):
            layered[("layers", i, *path)] = np.asarray(array, dtype)

        put(("attn_norm", "scale"), tensor(p + "input_layernorm.weight"), np.float32)
        put(("mlp_norm", "scale"), tensor(p + "post_attention_layernorm.weight"), np.float32)
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"),
                             ("wo", "o_proj")):
            put(("attn", ours, "kernel"), tensor(p + f"self_attn.{theirs}.weight").T, dtype)
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            put(("mlp", ours, "kernel"), tensor(p + f"mlp.{theirs}.weight").T, dtype)
    variables = dict(nnx.to_flat_state(nnx.state(model)))
    for path, value in layer_stack.from_layered(layered, config).items():
        variables[path].set_value(jnp.asarray(value))
    return model


def config_hparams(config):
    """The LlamaHParams a ModelConfig implies (for shape checks)."""
    return LlamaHParams(vocab_size=config.vocab_size, d_model=config.d_model,
                        n_layers=config.n_layers, n_heads=config.n_heads,
                        n_kv_heads=config.n_kv_heads, head_dim=config.head_dim, d_ff=config.d_ff,
                        rope_theta=config.rope_theta, norm_eps=config.norm_eps,
                        context_length=config.max_seq_len, tie_embeddings=config.tie_embeddings)
