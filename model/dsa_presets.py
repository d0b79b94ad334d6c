"""Full-size DeepSeek-V3.2 and GLM-5 architectures without a checkpoint: their config.json
values, turned into ModelConfigs by the same mapping that reads a checkpoint folder
(model.pretrained.mla_moe.dsa_config), for shape checks, cost estimates and random-weight
timing runs. The dicts are JAX-free; `dsa_preset` imports the loader (and with it JAX) on
first use only, so model.presets stays importable before JAX starts.

Where the values come from:
- DeepSeek-V3.2 (the published config.json values as issue #23 lists them, also
  transformers 5.23's DeepseekV32Config defaults and tests/model/test_memory.py's): hidden
  7168, 61 layers (3 dense), 128 heads, q_lora 1536, kv_lora 512, rope 64, nope 128, v 128,
  vocab 129280, intermediate 18432, 256 experts of 2048 (8 routed + 1 shared per token, 8
  groups, 4 kept), routed_scaling_factor 2.5, indexer 64 heads x 128, top 2048, YaRN factor
  40 over 4096.
- GLM-5 (zai-org/GLM-5, model_type glm_moe_dsa): transformers 5.23's GlmMoeDsaConfig
  defaults, whose docstring says they match zai-org/GLM-5, and the GLM-5 technical
  report's table (744B parameters, 40B active; 3 dense + 75 MoE layers, hidden 6144, dense
  intermediate 12288, MoE intermediate 2048, q_lora 2048, kv_lora 512, QK nope 192, V 256,
  64 heads, indexer 32 heads x 128, 256 experts, 8 routed + 1 shared, vocab 154880):
  the two agree. Not confirmed from the released config.json itself: rope_theta (1e6 here;
  costs do not depend on it), rms_norm_eps (transformers' default 1e-5) and indexer_types
  (none here: every layer runs its indexer, as transformers' config does without the key;
  the 1-in-4 IndexCache schedule {index_topk_freq: 4, index_skip_topk_offset: 3} seen in
  later GLM-5.x configs is GLM5_SHARED_SCHEDULE, an override).
- DeepSeek-V4-Flash (model_type deepseek_v4): transformers 5.23's DeepseekV4Config
  defaults, which its docstring ties to deepseek-ai/DeepSeek-V4-Flash-Base: hidden 4096,
  43 layers, 64 heads of 512 with one shared K = V head (RoPE on 64 dims), q_lora 1024,
  output in 8 groups of rank 1024, 256 experts of 2048 (6 routed + 1 shared per token,
  sqrtsoftplus, routed_scaling_factor 1.5, the first 3 layers hash-routed), vocab 129280,
  window 128, CSA ratio 4 and HCA ratio 128, indexer 64 heads x 128, top 512, hc_mult 4.
  The layer order, `compress_ratios` 0, 0, 4, 128, 4, ..., 128, 4 (2 sliding, 21 CSA, 20
  HCA; the released list has a 44th entry, 0, for the MTP layer dosa skips), and YaRN
  factor 16 over 65536, as the released config.json reads where public code quotes it
  (several independent copies agree).
- DeepSeek-V4-Pro: the released config.json as public code quotes it (two independent
  copies agree): hidden 7168, 61 layers, 128 heads of 512 (one K = V head, RoPE on 64),
  q_lora 1536, output in 16 groups of rank 1024, 384 experts of 3072 (6 routed + 1 shared,
  sqrtsoftplus, routed_scaling_factor 2.5, the first 3 layers hash-routed), indexer 64
  heads x 128, top 1024, window 128, `compress_ratios` 128, 128, 4, 128, 4, ..., 128, 4 (30
  CSA, 31 HCA, no sliding-only layer; a 62nd entry, 0, for the MTP layer).
"""

V32_CONFIG = dict(
    architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", vocab_size=129280,
    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
    n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
    q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
    topk_group=4, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=163840,
    rms_norm_eps=1e-6, first_k_dense_replace=3, index_topk=2048, index_head_dim=128,
    index_n_heads=64, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                         original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                         mscale=1.0, mscale_all_dim=1.0))

GLM5_CONFIG = dict(
    architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", vocab_size=154880,
    hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
    num_hidden_layers=78, num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1,
    n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=2048,
    qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256, n_group=1, topk_group=1,
    num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=202752,
    rms_norm_eps=1e-5, first_k_dense_replace=3, index_topk=2048, index_head_dim=128,
    index_n_heads=32, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=1000000.0))

V4_FLASH_CONFIG = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=129280,
    hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
    num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024,
    qk_rope_head_dim=64, num_experts_per_tok=6, n_routed_experts=256, n_shared_experts=1,
    scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5,
    max_position_embeddings=1048576, rope_theta=10000.0, compress_rope_theta=160000.0,
    compress_ratios=[0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)],
    num_hash_layers=3, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0,
    sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128,
    index_topk=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=65536,
                         beta_fast=32, beta_slow=1))

V4_PRO_CONFIG = dict(
    V4_FLASH_CONFIG, hidden_size=7168, moe_intermediate_size=3072, num_hidden_layers=61,
    num_attention_heads=128, q_lora_rank=1536, n_routed_experts=384,
    routed_scaling_factor=2.5, compress_ratios=[128, 128] + [4 if i % 2 == 0 else 128
                                                             for i in range(59)],
    o_groups=16, index_topk=1024)

# GLM-5.x's IndexCache schedule (ModelConfig.indexer_types): layers 0-2 full, then one full
# layer in four (3, 7, 11, ...): 21 of 78 layers run an indexer.
GLM5_SHARED_SCHEDULE = {"index_topk_freq": 4, "index_skip_topk_offset": 3}

# What dosa runs on top of the checkpoint's values: bf16, chunks of 4096 queries, the
# hierarchical indexer's budget at 4 x top_k tokens (docs/findings.md).
RUN_FIELDS = dict(dtype="bfloat16", prefill_chunk=4096,
                  hierarchical=dict(candidate_tokens=8192, fine_batch_size=4096))

# DeepSeek-V4's selection runs over compressed entries, so its budget counts entries: 4 x
# top_k in blocks of 4, one table per query (what experiments.benchmarks.v4_entries
# measured: docs/models.md).
V4_RUN_FIELDS = dict(dtype="bfloat16", prefill_chunk=4096,
                     hierarchical=dict(block_size=4, candidate_tokens=2048, query_tile=1,
                                       fine_batch_size=4096))
V4_PRO_RUN_FIELDS = dict(V4_RUN_FIELDS, hierarchical=dict(V4_RUN_FIELDS["hierarchical"],
                                                          candidate_tokens=4096))

DSA_PRESETS = {"deepseek-v3.2": ("deepseek_v32", V32_CONFIG, RUN_FIELDS),
               "glm-5": ("glm_moe_dsa", GLM5_CONFIG, RUN_FIELDS),
               "deepseek-v4-flash": ("deepseek_v4", V4_FLASH_CONFIG, V4_RUN_FIELDS),
               "deepseek-v4-pro": ("deepseek_v4", V4_PRO_CONFIG, V4_PRO_RUN_FIELDS)}


def dsa_preset(name):
    """The ModelConfig of a full-size DSA preset (DSA_PRESETS), built by the checkpoint
    loader's own mapping from the config.json values above."""
    from model.pretrained.safetensors_dir import DSA_FAMILIES

    family, values, run = DSA_PRESETS[name]
    return DSA_FAMILIES[family].config(values, source=f"preset {name}", **run)
