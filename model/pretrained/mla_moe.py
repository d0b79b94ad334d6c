"""DeepSeek-style checkpoints (MLA + DeepSeekMoE + the lightning indexer, as DeepSeek-V3.2
and GLM-5 release them on Hugging Face) -> the dosa Transformer.

What differs between the families is in their own files (model/pretrained/deepseek_v32.py,
glm_moe_dsa.py: a DSAFamily each); this module reads their common config.json keys and
maps the released tensor names onto dosa's parameters, checking every shape. Released
checkpoints carry one multi-token-prediction layer past num_hidden_layers
(model.layers.{N}.*): it is not part of the model and is never read.
"""

import dataclasses
from collections.abc import Callable

import numpy as np
from flax import nnx

from indexer.config import YarnConfig
from indexer.module import CoarseScreen
from model.architecture import MLAConfig, MoEConfig
from model.attention_kinds import attention_kind
from model.config import ModelConfig
from model.layer_stack import LayerwiseFill
from model.pretrained.llama import PretrainedFormatError
from model.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class DSAFamily:
    """model_type: config.json's; architecture: its class name; index_rope_interleaved:
    the indexer's rotary dims hold interleaved pairs (GLM-5) or halves (V3.2);
    reads_indexer_types: config.json's indexer_types (GLM-5's shared layers).
    chat_format: how chat prompts are rendered (model.pretrained.chat; None: completions
    only).
    make_config, tensor_map: the family's own config.json reading and tensor names (None:
    this module's dsa_config and tensor_map, MLA + DeepSeekMoE)."""

    model_type: str
    architecture: str
    index_rope_interleaved: bool
    reads_indexer_types: bool
    chat_format: str | None  # model.pretrained.chat.CHAT_FORMATS entry; None: no chat
    make_config: Callable | None = None
    tensor_map: Callable | None = None

    def config(self, config, *, source, **kwargs):
        """The ModelConfig of a config.json of this family."""
        return (self.make_config or dsa_config)(config, self, source=source, **kwargs)

    def tensors(self, config, names=()):
        """Tensor name -> (dosa path, transposed?, expert or None, shape): what it reads
        (names: the folder's tensors, for a family whose files name them two ways)."""
        if self.tensor_map is None:
            return tensor_map(config)
        return self.tensor_map(config, names)


def _get(config, key, source, default=KeyError):
    if key not in config or config[key] is None:
        if default is KeyError:
            raise PretrainedFormatError(f"{source}: config.json key {key!r} is missing")
        return default
    return config[key]


def yarn_config(config, source):
    """The YarnConfig of config.json's rope_parameters (or the older rope_scaling +
    rope_theta), None for plain RoPE -> (rope_theta, YarnConfig or None)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise PretrainedFormatError(f"{source}: rope type {kind!r} is not supported (dosa reads "
                                    "default and yarn)")
    factor = rope.get("factor")
    original = int(_get(rope, "original_max_position_embeddings", source))
    if factor is None:  # as transformers: the ratio of the context lengths
        factor = _get(config, "max_position_embeddings", source) / original
    return theta, YarnConfig(
        factor=float(factor), original_max_position_embeddings=original,
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0), mscale=rope.get("mscale"),
        mscale_all_dim=rope.get("mscale_all_dim"),
        attention_factor=rope.get("attention_factor"),
        truncate=bool(rope.get("truncate", True)))


def check_swiglu_without_bias(g, source):
    """PretrainedFormatError unless the config.json (read through g) has SwiGLU (silu)
    feed-forwards and no projection biases, as dosa builds them."""
    if g("hidden_act", "silu") != "silu":
        raise PretrainedFormatError(f"{source}: hidden_act {g('hidden_act')!r}; dosa's MLP is "
                                    "SwiGLU (silu)")
    if g("attention_bias", False) or g("mlp_bias", False):
        raise PretrainedFormatError(f"{source}: attention_bias / mlp_bias: dosa's projections "
                                    "have no bias")


def dsa_config(config, family, *, source, dtype="float32", **overrides):
    """ModelConfig of a DeepSeek-style config.json (family: a DSAFamily): every layer
    sparse with its indexer's flat top index_topk, as the checkpoints run."""
    g = lambda key, default=KeyError: _get(config, key, source, default)  # noqa: E731
    check_swiglu_without_bias(g, source)
    if g("scoring_func", "sigmoid") != "sigmoid":
        raise PretrainedFormatError(f"{source}: scoring_func {g('scoring_func')!r}; dosa's "
                                    "router is DeepSeek-V3's sigmoid")
    n_layers = int(g("num_hidden_layers"))
    types = g("mlp_layer_types", None)
    if types is None:
        dense = min(int(g("first_k_dense_replace", 0)), n_layers)
        types = ["dense"] * dense + ["sparse"] * (n_layers - dense)
    theta, yarn = yarn_config(config, source)
    mla = MLAConfig(q_lora_rank=int(g("q_lora_rank")), kv_lora_rank=int(g("kv_lora_rank")),
                    qk_nope_head_dim=int(g("qk_nope_head_dim")),
                    qk_rope_head_dim=int(g("qk_rope_head_dim")),
                    v_head_dim=int(g("v_head_dim")))
    moe = MoEConfig(n_routed_experts=int(g("n_routed_experts")),
                    num_experts_per_tok=int(g("num_experts_per_tok")),
                    moe_intermediate_size=int(g("moe_intermediate_size")),
                    n_shared_experts=int(g("n_shared_experts", 1)), n_group=int(g("n_group", 1)),
                    topk_group=int(g("topk_group", 1)),
                    routed_scaling_factor=float(g("routed_scaling_factor", 1.0)),
                    norm_topk_prob=bool(g("norm_topk_prob", True)), mlp_layer_types=tuple(types))
    heads = int(g("num_attention_heads"))
    values = dict(
        vocab_size=int(g("vocab_size")), d_model=int(g("hidden_size")), n_layers=n_layers,
        n_heads=heads, n_kv_heads=heads, head_dim=mla.qk_head_dim,
        d_ff=int(g("intermediate_size")), max_seq_len=int(g("max_position_embeddings")),
        rope_theta=theta, norm_eps=float(g("rms_norm_eps", 1e-6)),
        index_heads=int(g("index_n_heads")), index_dim=int(g("index_head_dim")),
        index_rope_dim=mla.qk_rope_head_dim, top_k=int(g("index_topk")), attention="sparse",
        indexer="flat", tie_embeddings=bool(g("tie_word_embeddings", False)), dtype=dtype,
        # inference weights stored as the checkpoint's dtype (bf16: half of float32's bytes)
        param_dtype=dtype, mla=mla, moe=moe, yarn=yarn,
        index_rope_interleaved=family.index_rope_interleaved)
    if family.reads_indexer_types:
        values["indexer_types"] = tuple(g("indexer_types", ()))
    try:
        return ModelConfig(**{**values, **overrides})
    except ValueError as e:
        raise PretrainedFormatError(f"{source}: {e}") from e


def tensor_map(config):
    """Released tensor name -> (path of the dosa parameter, transposed?, expert index or
    None, numpy shape in the file) for every tensor a DeepSeek-style model reads."""
    c, m, moe = config, config.mla, config.moe
    D, H = c.d_model, c.n_heads
    out = {"model.embed_tokens.weight": (("embed", "embedding"), False, None, (c.vocab_size, D)),
           "model.norm.weight": (("final_norm", "scale"), False, None, (D,))}
    if not c.tie_embeddings:
        out["lm_head.weight"] = (("lm_head", "kernel"), True, None, (c.vocab_size, D))
    for i in range(c.n_layers):
        p, L = f"model.layers.{i}.", ("layers", i)

        def linear(name, ours, rows, cols, p=p, L=L):
            out[p + name + ".weight"] = ((*L, *ours, "kernel"), True, None, (rows, cols))

        def vector(name, ours, n, p=p, L=L):
            out[p + name] = ((*L, *ours), False, None, (n,))

        vector("input_layernorm.weight", ("attn_norm", "scale"), D)
        vector("post_attention_layernorm.weight", ("mlp_norm", "scale"), D)
        a = "self_attn."
        linear(a + "q_a_proj", ("attn", "q_a"), m.q_lora_rank, D)
        vector(a + "q_a_layernorm.weight", ("attn", "q_a_norm", "scale"), m.q_lora_rank)
        linear(a + "q_b_proj", ("attn", "q_b"), H * m.qk_head_dim, m.q_lora_rank)
        linear(a + "kv_a_proj_with_mqa", ("attn", "kv_a"), m.latent_dim, D)
        vector(a + "kv_a_layernorm.weight", ("attn", "kv_a_norm", "scale"), m.kv_lora_rank)
        linear(a + "kv_b_proj", ("attn", "kv_b"), H * (m.qk_nope_head_dim + m.v_head_dim),
               m.kv_lora_rank)
        linear(a + "o_proj", ("attn", "wo"), D, H * m.v_head_dim)
        if not c.layer_is_shared(i):
            x = a + "indexer."
            linear(x + "wq_b", ("indexer", "wq"), c.index_heads * c.index_dim, m.q_lora_rank)
            linear(x + "wk", ("indexer", "wk"), c.index_dim, D)
            vector(x + "k_norm.weight", ("indexer", "k_norm", "scale"), c.index_dim)
            vector(x + "k_norm.bias", ("indexer", "k_norm", "bias"), c.index_dim)
            linear(x + "weights_proj", ("indexer", "ww"), c.index_heads, D)
        if not c.layer_is_moe(i):
            for name in ("gate", "up"):
                linear(f"mlp.{name}_proj", ("mlp", name), c.d_ff, D)
            linear("mlp.down_proj", ("mlp", "down"), D, c.d_ff)
            continue
        F = moe.moe_intermediate_size
        out[p + "mlp.gate.weight"] = ((*L, "mlp", "router"), False, None,
                                      (moe.n_routed_experts, D))
        vector("mlp.gate.e_score_correction_bias", ("mlp", "bias"), moe.n_routed_experts)
        for e in range(moe.n_routed_experts):
            for name in ("gate", "up"):
                out[p + f"mlp.experts.{e}.{name}_proj.weight"] = ((*L, "mlp", name), True, e,
                                                                  (F, D))
            out[p + f"mlp.experts.{e}.down_proj.weight"] = ((*L, "mlp", "down"), True, e, (D, F))
        if moe.n_shared_experts:
            S = F * moe.n_shared_experts
            for name in ("gate", "up"):
                linear(f"mlp.shared_experts.{name}_proj", ("mlp", "shared", name), S, D)
            linear("mlp.shared_experts.down_proj", ("mlp", "shared", "down"), D, S)
    return out


def build_dsa_transformer(config, read_tensor, *, source, names, mesh=None, read_fp8=None,
                          tensors=None):
    """A Transformer for `config` with every weight from read_tensor(name) (float32 numpy,
    released names; `names`: the tensors the files hold), streamed: the model is created
    abstractly (shapes only), then each parameter is read, converted and placed, on one
    device or, with `mesh`, directly with its sharding (model.sharding's rules: each device
    receives its slice), so the host holds about one parameter at a time (a layer's routed
    experts are stacked first: [E, D, F]). PretrainedFormatError naming `source` and the
    tensor for a missing, misshapen or non-finite one. Tensors past the model (the
    multi-token-prediction layer) are never read. With config.moe.fp8_block the routed
    experts are read as stored, read_fp8(name) -> (e4m3, block scales, block), and kept so
    (model.moe: transposed like the weights). tensors: the family's map (DSAFamily.tensors;
    default this module's tensor_map)."""
    from model import sharding

    wanted = tensor_map(config) if tensors is None else tensors
    missing = sorted(set(wanted) - set(names))
    if missing:
        raise PretrainedFormatError(f"{source}: tensors missing from the checkpoint: "
                                    f"{missing[:8]}{' ...' if len(missing) > 8 else ''}")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    # Parameters by per-layer path, each written into its stack (model.layer_stack) as read.
    fill = LayerwiseFill(config, dict(nnx.to_flat_state(state)), mesh=mesh,
                         specs=dict(nnx.to_flat_state(sharding.param_specs(state)))
                         if mesh is not None else None)
    place = fill.place

    by_param = {}  # parameter path -> its tensors (one, or one per expert)
    for name, (path, transpose, expert, shape) in wanted.items():
        by_param.setdefault(tuple(path), []).append((name, transpose, expert, shape))
    fp8_block = config.moe.fp8_block if config.moe is not None else ()
    for path, tensors in by_param.items():
        stacked = None
        if fp8_block and tensors[0][2] is not None:  # routed experts kept in FP8
            place_fp8_experts(path, tensors, read_fp8, fp8_block, fill, source)
            continue
        for name, transpose, expert, shape in tensors:
            array = np.asarray(read_tensor(name), np.float32)
            if array.shape != shape:
                raise PretrainedFormatError(f"{source}: tensor {name} has shape "
                                            f"{array.shape}, the config needs {shape}")
            if not np.all(np.isfinite(array)):
                raise PretrainedFormatError(f"{source}: tensor {name} holds non-finite values")
            array = array.T if transpose else array
            if expert is None:
                stacked = array
            else:
                if stacked is None:
                    stacked = np.empty(fill.shape(path), np.float32)
                stacked[expert] = array
        place(path, stacked)
    # What no checkpoint holds: the hierarchical indexer's coarse screens start untrained.
    screen = nnx.state(CoarseScreen(config.index_heads, config.index_dim))
    for layer in range(config.n_layers):
        if not config.layer_is_shared(layer) and not attention_kind(config, layer).self_indexed:
            for name in ("scales", "log_temperature", "mean_log_temperature"):
                place(("layers", layer, "coarse_screen", name), screen[name].get_value())
    missing = fill.missing()
    if missing:
        raise PretrainedFormatError(f"{source}: no tensor maps to {missing[:4]}")
    return nnx.merge(graphdef, nnx.from_flat_state(list(fill.flat.items())))


def place_fp8_experts(path, tensors, read_fp8, block, fill, source):
    """Stacks one layer's routed experts of one projection as stored (e4m3, and their
    scales beside them at path + "_scale"), transposed into dosa's layout; fill: the
    model's model.layer_stack.LayerwiseFill."""
    scale_path = (*path[:-1], path[-1] + "_scale")
    q_all = np.empty(fill.shape(path), fill.dtype(path))
    s_all = np.empty(fill.shape(scale_path), np.float32)
    for name, _, expert, shape in tensors:
        q, scale, file_block = read_fp8(name)
        if q.shape != shape:
            raise PretrainedFormatError(f"{source}: tensor {name} has shape {q.shape}, the "
                                        f"config needs {shape}")
        if tuple(file_block) != tuple(block):
            raise PretrainedFormatError(f"{source}: tensor {name} has blocks of {file_block}, "
                                        f"the config keeps {block}")
        if not np.all(np.isfinite(scale)):
            raise PretrainedFormatError(f"{source}: tensor {name}'s scales are not finite")
        q_all[expert], s_all[expert] = q.T, scale.T
    fill.place(path, q_all)
    fill.place(scale_path, s_all)
