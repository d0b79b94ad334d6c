"""The optional parts of a ModelConfig that make a DeepSeek-style model: multi-head latent
attention (MLAConfig, model/mla.py), the DeepSeekMoE feed-forward (MoEConfig,
model/moe.py) and DeepSeek-V4's compressed attention with hyper-connections
(DeepseekV4Config, model/deepseek_v4/). Frozen, validated, JAX-free (serving reads configs
before JAX starts)."""

import dataclasses

from indexer.config import FrozenConfig, YarnConfig

# A dense MLP, or the MoE ("sparse": learned routing; "hash": DeepSeek-V4's first layers,
# whose experts a frozen table picks by token id)
MLP_LAYER_TYPES = ("dense", "sparse", "hash")
ROUTER_SCORES = ("sigmoid", "sqrtsoftplus")  # V3.2 / GLM-5; DeepSeek-V4


def _positive_int(cls, name, value, lo=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{cls}.{name} must be an int >= {lo}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class MLAConfig(FrozenConfig):
    """Multi-head latent attention (DeepSeek-V2/V3, V3.2, GLM-5).

    q = q_b(RMSNorm(q_a(x))) per head [qk_nope_head_dim | qk_rope_head_dim]; the kv latent
    kv_a(x) = [c (kv_lora_rank) | k_rope (qk_rope_head_dim)], c RMSNorm'd, k_rope one
    head shared by all; kv_b expands c into each head's [k_nope | v]. The cache holds only
    [c | k_rope] per token. absorb: attend in the MQA form over the latent (kv_b folded into
    the queries and the output: the cost of a 576-dim single-head attention for V3.2); False:
    expand K and V for every read token (the reference form, equal up to rounding).
    """

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    absorb: bool = True

    def __post_init__(self):
        for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            _positive_int("MLAConfig", name, getattr(self, name))
        _positive_int("MLAConfig", "qk_rope_head_dim", self.qk_rope_head_dim, 2)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLAConfig.qk_rope_head_dim must be even for RoPE, got "
                             f"{self.qk_rope_head_dim}")
        if not isinstance(self.absorb, bool):
            raise ValueError(f"MLAConfig.absorb must be a bool, got {self.absorb!r}")

    @property
    def qk_head_dim(self):
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self):
        """What the cache holds per token: the latent and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class MoEConfig(FrozenConfig):
    """DeepSeekMoE: n_shared_experts always-on experts plus num_experts_per_tok of
    n_routed_experts routed ones, each a SwiGLU of moe_intermediate_size. The router's
    scores are sigmoid(x W^T) in float32; the choice adds e_score_correction_bias and is
    group-limited (experts in n_group groups, a group's score the sum of its 2 best, the
    topk_group best groups kept); the weights are the chosen experts' unbiased scores,
    normalised to sum 1 when norm_topk_prob, times routed_scaling_factor.
    mlp_layer_types: per layer "dense" (the model's SwiGLU of d_ff), "sparse" (this MoE) or
    "hash" (this MoE, its experts read from a token-id table, `tid2eid`); empty: every layer
    sparse (transformers' first_k_dense_replace = k is k "dense" first).
    fp8_block: () keeps the routed experts in the model's dtype; (rows, cols), a released
    FP8 checkpoint's weight_block_size, keeps them as float8 e4m3 with one float32 scale per
    block of the checkpoint's [out, in] matrices, dequantized where they are used (a
    quarter of float32's bytes, half of bf16's; the products still run in the model's dtype).
    scoring_func: the router's scores, sigmoid (V3.2, GLM-5) or sqrt(softplus) (DeepSeek-V4).
    swiglu_limit: None, or (DeepSeek-V4) the experts' SwiGLU clamps its gate projection at
    most this and its up projection to [-limit, limit].
    """

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    mlp_layer_types: tuple[str, ...] = ()
    fp8_block: tuple[int, ...] = ()
    scoring_func: str = "sigmoid"
    swiglu_limit: float | None = None

    def __post_init__(self):
        for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "n_group", "topk_group"):
            _positive_int("MoEConfig", name, getattr(self, name))
        _positive_int("MoEConfig", "n_shared_experts", self.n_shared_experts, 0)
        E, G = self.n_routed_experts, self.n_group
        if E % G:
            raise ValueError(f"MoEConfig.n_group ({G}) must divide n_routed_experts ({E})")
        if G > 1 and E // G < 2:
            raise ValueError(f"MoEConfig: group-limited routing scores a group by its 2 best "
                             f"experts; n_routed_experts / n_group = {E // G} < 2")
        if self.topk_group > G:
            raise ValueError(f"MoEConfig.topk_group must be in [1, n_group = {G}], got "
                             f"{self.topk_group}")
        reachable = self.topk_group * (E // G)
        if self.num_experts_per_tok > reachable:
            raise ValueError(f"MoEConfig.num_experts_per_tok must be in [1, topk_group x "
                             f"experts per group = {reachable}], got {self.num_experts_per_tok}")
        value = self.routed_scaling_factor
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"MoEConfig.routed_scaling_factor must be a positive number, "
                             f"got {value!r}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"MoEConfig.norm_topk_prob must be a bool, got "
                             f"{self.norm_topk_prob!r}")
        types = self.mlp_layer_types
        if not isinstance(types, (tuple, list)) or any(t not in MLP_LAYER_TYPES for t in types):
            raise ValueError(f"MoEConfig.mlp_layer_types must be a list of {MLP_LAYER_TYPES}, "
                             f"got {types!r}")
        object.__setattr__(self, "mlp_layer_types", tuple(types))
        block = self.fp8_block
        if not isinstance(block, (tuple, list)) or (block and (
                len(block) != 2 or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                                       for b in block))):
            raise ValueError(f"MoEConfig.fp8_block must be () or two ints >= 1 (the "
                             f"checkpoint's weight_block_size), got {block!r}")
        object.__setattr__(self, "fp8_block", tuple(block))
        if self.scoring_func not in ROUTER_SCORES:
            raise ValueError(f"MoEConfig.scoring_func must be one of {ROUTER_SCORES}, got "
                             f"{self.scoring_func!r}")
        limit = self.swiglu_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                                  or limit <= 0):
            raise ValueError(f"MoEConfig.swiglu_limit must be None or a positive number, got "
                             f"{limit!r}")

    def layer_is_moe(self, layer):
        return not self.mlp_layer_types or self.mlp_layer_types[layer] != "dense"

    def layer_is_hashed(self, layer):
        return bool(self.mlp_layer_types) and self.mlp_layer_types[layer] == "hash"


V4_LAYER_TYPES = ("sliding", "csa", "hca")
# transformers' layer_types -> dosa's
V4_HF_LAYER_TYPES = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
                     "heavily_compressed_attention": "hca"}


@dataclasses.dataclass(frozen=True)
class DeepseekV4Config(FrozenConfig):
    """DeepSeek-V4's attention and residual stream (model/deepseek_v4/, docs/models.md).

    layer_types: per layer "sliding" (its last sliding_window tokens only), "csa" (those and
    the indexer's top_k of the entries pooling csa_ratio tokens each, over overlapping
    windows) or "hca" (those and every entry pooling hca_ratio tokens). Attention: q-LoRA
    of q_lora_rank, one shared K = V head of the ModelConfig's head_dim whose last
    qk_rope_head_dim dims rotate (interleaved pairs), a learned sink per head, the output
    through o_groups low-rank groups of o_lora_rank. RoPE: sliding layers the main table
    (ModelConfig.rope_theta), compressed layers and their indexer compress_rope_theta with
    compress_yarn. The residual is hc_mult streams mixed by Sinkhorn-normalised
    hyper-connections (hc_sinkhorn_iters, hc_eps)."""

    layer_types: tuple[str, ...]
    q_lora_rank: int
    qk_rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int = 128
    csa_ratio: int = 4
    hca_ratio: int = 128
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    compress_rope_theta: float = 160000.0
    compress_yarn: YarnConfig | None = None

    def __post_init__(self):
        types = self.layer_types
        if not isinstance(types, (tuple, list)) or not types or any(
                t not in V4_LAYER_TYPES for t in types):
            raise ValueError(f"DeepseekV4Config.layer_types must be a non-empty list of "
                             f"{V4_LAYER_TYPES}, got {types!r}")
        object.__setattr__(self, "layer_types", tuple(types))
        for name in ("q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "csa_ratio",
                     "hca_ratio", "hc_mult", "hc_sinkhorn_iters"):
            _positive_int("DeepseekV4Config", name, getattr(self, name))
        _positive_int("DeepseekV4Config", "qk_rope_head_dim", self.qk_rope_head_dim, 2)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"DeepseekV4Config.qk_rope_head_dim must be even, got "
                             f"{self.qk_rope_head_dim}")
        for name in ("hc_eps", "compress_rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"DeepseekV4Config.{name} must be a positive number, got "
                                 f"{value!r}")
        if isinstance(self.compress_yarn, dict):
            object.__setattr__(self, "compress_yarn", YarnConfig.from_dict(self.compress_yarn))
        if self.compress_yarn is not None and not isinstance(self.compress_yarn, YarnConfig):
            raise ValueError(f"DeepseekV4Config.compress_yarn must be a YarnConfig, a dict or "
                             f"None, got {type(self.compress_yarn).__name__}")

    def ratio(self, layer):
        """Positions per compressed entry of layer `layer` (0: a sliding layer)."""
        kind = self.layer_types[layer]
        return 0 if kind == "sliding" else self.csa_ratio if kind == "csa" else self.hca_ratio
