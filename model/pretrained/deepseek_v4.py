"""DeepSeek-V4 (model_type "deepseek_v4", DeepseekV4ForCausalLM) in transformers' form: what
its save_pretrained writes (transformers 5.23; the tensors under the released names
attn.wkv, attn.compressor.ape, hc_attn_fn, ffn.gate.tid2eid, head.weight...), config.json
with layer_types, compress_rates, mlp_layer_types and rope_parameters {main, compress}.
The released folders' own config keys and FP8 / FP4 weights are issue #55's.
"""

from model.architecture import V4_HF_LAYER_TYPES, DeepseekV4Config, MoEConfig
from model.config import ModelConfig
from model.pretrained.llama import PretrainedFormatError
from model.pretrained.mla_moe import DSAFamily, _get, check_swiglu_without_bias, yarn_config

MLP_TYPES = {"hash_moe": "hash", "moe": "sparse", "dense": "dense", "mlp": "dense"}


# The released config.json's per-layer compress_ratios -> transformers' layer_types.
RATIO_LAYER_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention",
                     128: "heavily_compressed_attention"}
HASH_LAYERS = 3  # transformers' default num_hash_layers


def _layer_types(g, n_layers, source):
    """transformers' layer_types, or the released compress_ratios (0 / 4 / 128 per layer), or
    transformers' default (2 HCA layers, then CSA and HCA in turn)."""
    types = g("layer_types", None)
    ratios = g("compress_ratios", None)
    if types is None and ratios is not None:
        unknown = sorted({r for r in ratios if r not in RATIO_LAYER_TYPES})
        if unknown:
            raise PretrainedFormatError(f"{source}: compress_ratios {unknown}: dosa reads "
                                        f"{sorted(RATIO_LAYER_TYPES)} (sliding, CSA, HCA)")
        types = [RATIO_LAYER_TYPES[r] for r in ratios]
    if types is None:
        types = (["heavily_compressed_attention"] * min(n_layers, 2)
                 + ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                    for i in range(max(n_layers - 2, 0))])
    # The released configs list the multi-token-prediction layer too: past the model.
    types = list(types)[:n_layers]
    unknown = sorted({t for t in types if t not in V4_HF_LAYER_TYPES})
    if unknown or len(types) != n_layers:
        raise PretrainedFormatError(f"{source}: layer_types must name {n_layers} layers from "
                                    f"{sorted(V4_HF_LAYER_TYPES)}, got {types}")
    return types


def _rope_tables(g, source):
    """(main theta, compress theta, compress YarnConfig or None) from transformers' nested
    rope_parameters {main, compress} or the released flat one (YaRN for the compress table,
    theta compress_rope_theta; cos / sin unscaled: attention_factor 1)."""
    rope = dict(g("rope_parameters", None) or g("rope_scaling", None) or {})
    if isinstance(rope.get("main"), dict) and isinstance(rope.get("compress"), dict):
        main, compress = rope["main"], rope["compress"]
    else:
        main = {"rope_type": "default", "rope_theta": g("rope_theta", 10000.0)}
        compress = {**{k: v for k, v in rope.items() if k not in ("main", "compress")},
                    "rope_theta": g("compress_rope_theta", 160000.0)}
        if compress.get("rope_type", compress.get("type", "default")) == "yarn":
            compress.setdefault("attention_factor", 1.0)
    main_theta, main_yarn = yarn_config({"rope_parameters": main}, source)
    if main_yarn is not None:
        raise PretrainedFormatError(f"{source}: rope_parameters.main must be rope_type "
                                    "'default' (dosa reads V4's main table unscaled)")
    compress_theta, compress_yarn = yarn_config(
        {"rope_parameters": compress,
         "max_position_embeddings": g("max_position_embeddings")}, source)
    return main_theta, compress_theta, compress_yarn, main.get("partial_rotary_factor")


def v4_config(config, family, *, source, dtype="float32", **overrides):
    """ModelConfig of a DeepSeek-V4 config.json, in transformers' form (layer_types,
    compress_rates, mlp_layer_types, rope_parameters {main, compress}) or the released one
    (compress_ratios per layer, num_hash_layers, qk_rope_head_dim, a flat YaRN
    rope_parameters, compress_rope_theta), as transformers' DeepseekV4Config folds them;
    absent keys take its defaults. Every CSA layer selects its indexer's flat top
    index_topk compressed entries, as the model runs."""
    g = lambda key, default=KeyError: _get(config, key, source, default)  # noqa: E731
    check_swiglu_without_bias(g, source)
    n_layers = int(g("num_hidden_layers"))
    types = _layer_types(g, n_layers, source)
    rates = dict(g("compress_rates", None) or {})
    for key, legacy in (("compressed_sparse_attention", "compress_rate_csa"),
                        ("heavily_compressed_attention", "compress_rate_hca")):
        if g(legacy, None) is not None:
            rates[key] = g(legacy)
    mlp_types = g("mlp_layer_types", None)
    if mlp_types is None:
        n_hash = min(n_layers, int(g("num_hash_layers", HASH_LAYERS)))
        mlp_types = ["hash_moe"] * n_hash + ["moe"] * (n_layers - n_hash)
    mlp_types = list(mlp_types)[:n_layers]
    if len(mlp_types) != n_layers or any(t not in MLP_TYPES for t in mlp_types):
        raise PretrainedFormatError(f"{source}: mlp_layer_types must name {n_layers} layers "
                                    f"from {sorted(MLP_TYPES)}, got {mlp_types}")
    main_theta, compress_theta, compress_yarn, rotary = _rope_tables(g, source)
    head_dim = int(g("head_dim", 512))
    # as transformers: partial_rotary_factor first, else the released qk_rope_head_dim
    rotary = g("partial_rotary_factor", None) or rotary
    rope_dim = (round(head_dim * float(rotary)) if rotary
                else int(g("qk_rope_head_dim", 64)))
    try:
        v4 = DeepseekV4Config(
            layer_types=tuple(V4_HF_LAYER_TYPES[t] for t in types),
            q_lora_rank=int(g("q_lora_rank")), qk_rope_head_dim=rope_dim,
            o_groups=int(g("o_groups", 8)), o_lora_rank=int(g("o_lora_rank", 1024)),
            sliding_window=int(g("sliding_window", 128)),
            csa_ratio=int(rates.get("compressed_sparse_attention", 4)),
            hca_ratio=int(rates.get("heavily_compressed_attention", 128)),
            hc_mult=int(g("hc_mult", 4)), hc_eps=float(g("hc_eps", 1e-6)),
            hc_sinkhorn_iters=int(g("hc_sinkhorn_iters", 20)),
            compress_rope_theta=compress_theta, compress_yarn=compress_yarn)
        # V4 normalises the routed weights and runs one shared expert whatever
        # norm_topk_prob and n_shared_experts say (transformers 5.23 reads neither).
        moe = MoEConfig(n_routed_experts=int(g("n_routed_experts")),
                        num_experts_per_tok=int(g("num_experts_per_tok")),
                        moe_intermediate_size=int(g("moe_intermediate_size")),
                        n_shared_experts=1,
                        routed_scaling_factor=float(g("routed_scaling_factor", 1.0)),
                        norm_topk_prob=True,
                        mlp_layer_types=tuple(MLP_TYPES[t] for t in mlp_types),
                        scoring_func=g("scoring_func", "sqrtsoftplus"),
                        swiglu_limit=g("swiglu_limit", 10.0))
        values = dict(
            vocab_size=int(g("vocab_size")), d_model=int(g("hidden_size")), n_layers=n_layers,
            n_heads=int(g("num_attention_heads")), n_kv_heads=1, head_dim=head_dim,
            d_ff=int(g("intermediate_size", None) or moe.moe_intermediate_size),
            max_seq_len=int(g("max_position_embeddings")), rope_theta=main_theta,
            norm_eps=float(g("rms_norm_eps", 1e-6)), index_heads=int(g("index_n_heads", 64)),
            index_dim=int(g("index_head_dim", 128)), index_rope_dim=rope_dim,
            top_k=int(g("index_topk", 512)), attention="sparse", indexer="flat",
            tie_embeddings=bool(g("tie_word_embeddings", False)), dtype=dtype,
            param_dtype=dtype, moe=moe, v4=v4)
        return ModelConfig(**{**values, **overrides})
    except ValueError as e:
        raise PretrainedFormatError(f"{source}: {e}") from e


# transformers' save_pretrained keeps these leaves' module names; the released files do not
RELEASED_TOP_LEVEL = {"model.embed_tokens.weight": "embed.weight",
                      "model.norm.weight": "norm.weight",
                      "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
                      "model.hc_head.hc_scale": "hc_head_scale"}


def v4_tensor_map(config, names=()):
    """Tensor name in the folder -> (path of the dosa parameter, transposed?, expert index or
    None, numpy shape in the file), as model.pretrained.mla_moe.tensor_map. The names are
    transformers' (model.layers.{i}.attn.wkv, model.embed_tokens, model.hc_head.hc_fn), or,
    when the folder's `names` hold the released ones (embed.weight), those: no `model.`
    prefix, embed / norm / hc_head_fn at the top."""
    wanted = _transformers_names(config)
    if "embed.weight" not in names:
        return wanted
    return {RELEASED_TOP_LEVEL.get(name, name.removeprefix("model.")): value
            for name, value in wanted.items()}


def _transformers_names(config):
    c, v4, moe = config, config.v4, config.moe
    D, H, hd, N = c.d_model, c.n_heads, c.head_dim, v4.hc_mult
    out = {"model.embed_tokens.weight": (("embed", "embedding"), False, None, (c.vocab_size, D)),
           "model.norm.weight": (("final_norm", "scale"), False, None, (D,)),
           "model.hc_head.hc_fn": (("hc_head", "fn"), False, None, (N, N * D)),
           "model.hc_head.hc_base": (("hc_head", "base"), False, None, (N,)),
           "model.hc_head.hc_scale": (("hc_head", "scale"), False, None, (1,))}
    if not c.tie_embeddings:
        out["head.weight"] = (("lm_head", "kernel"), True, None, (c.vocab_size, D))
    for i in range(c.n_layers):
        p, L = f"model.layers.{i}.", ("layers", i)

        def put(name, ours, shape, transpose=False, expert=None, p=p, L=L):
            out[p + name] = ((*L, *ours), transpose, expert, shape)

        put("attn_norm.weight", ("attn_norm", "scale"), (D,))
        put("ffn_norm.weight", ("mlp_norm", "scale"), (D,))
        for hf, ours in (("hc_attn", "attn_hc"), ("hc_ffn", "mlp_hc")):
            put(f"{hf}_fn", (ours, "fn"), ((2 + N) * N, N * D))
            put(f"{hf}_base", (ours, "base"), ((2 + N) * N,))
            put(f"{hf}_scale", (ours, "scale"), (3,))
        a = "attn."
        put(a + "wq_a.weight", ("attn", "wq_a"), (v4.q_lora_rank, D))
        put(a + "q_norm.weight", ("attn", "q_norm"), (v4.q_lora_rank,))
        put(a + "wq_b.weight", ("attn", "wq_b"), (H * hd, v4.q_lora_rank))
        put(a + "wkv.weight", ("attn", "wkv"), (hd, D))
        put(a + "norm.weight", ("attn", "kv_norm"), (hd,))
        put(a + "attn_sink", ("attn", "sinks"), (H,))
        put(a + "wo_a.weight", ("attn", "wo_a"), (v4.o_groups * v4.o_lora_rank,
                                                  H * hd // v4.o_groups))
        put(a + "wo_b.weight", ("attn", "wo_b"), (D, v4.o_groups * v4.o_lora_rank))
        ratio, kind = v4.ratio(i), v4.layer_types[i]

        def compressor(prefix, ours, dim, overlap, ratio=ratio):
            width = dim * (2 if overlap else 1)
            for name, shape in (("wkv.weight", (width, D)), ("wgate.weight", (width, D)),
                                ("ape", (ratio, width)), ("norm.weight", (dim,))):
                put(prefix + name, (*ours, name.split(".")[0]), shape)

        if ratio:
            compressor(a + "compressor.", ("attn", "compressor"), hd, kind == "csa")
        if kind == "csa":
            x = a + "indexer."
            put(x + "wq_b.weight", ("attn", "indexer", "wq_b"),
                (c.index_heads * c.index_dim, v4.q_lora_rank))
            put(x + "weights_proj.weight", ("attn", "indexer", "weights_proj"),
                (c.index_heads, D))
            compressor(x + "compressor.", ("attn", "indexer", "compressor"), c.index_dim, True)
        if not c.layer_is_moe(i):
            raise PretrainedFormatError(f"layer {i}: DeepSeek-V4's feed-forward is the MoE in "
                                        "every layer")
        E, F = moe.n_routed_experts, moe.moe_intermediate_size
        put("ffn.gate.weight", ("mlp", "router"), (E, D))
        if c.layer_is_hashed(i):
            put("ffn.gate.tid2eid", ("mlp", "tid2eid"), (c.vocab_size, moe.num_experts_per_tok))
        else:
            put("ffn.gate.bias", ("mlp", "bias"), (E,))
        for e in range(E):
            for hf, ours, shape in (("w1", "gate", (F, D)), ("w3", "up", (F, D)),
                                    ("w2", "down", (D, F))):
                put(f"ffn.experts.{e}.{hf}.weight", ("mlp", ours), shape, True, e)
        if moe.n_shared_experts:
            S = F * moe.n_shared_experts
            for hf, ours, shape in (("w1", "gate", (S, D)), ("w3", "up", (S, D)),
                                    ("w2", "down", (D, S))):
                put(f"ffn.shared_experts.{hf}.weight", ("mlp", "shared", ours, "kernel"), shape,
                    True)
    return out


FAMILY = DSAFamily(model_type="deepseek_v4", architecture="DeepseekV4ForCausalLM",
                   index_rope_interleaved=True, reads_indexer_types=False,
                   chat_format="deepseek_v4",
                   make_config=v4_config, tensor_map=v4_tensor_map)
