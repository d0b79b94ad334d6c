"""DeepSeek-V3.2 (model_type "deepseek_v32", DeepseekV32ForCausalLM): MLA, DeepSeekMoE with
group-limited routing, and a lightning indexer in every layer whose RoPE rotates the first
qk_rope_head_dim dims in halves (unlike its attention's interleaved pairs). The release ships
a Python chat encoder, not a Jinja template: dosa serves it completions-only."""

from model.pretrained.mla_moe import DSAFamily

FAMILY = DSAFamily(model_type="deepseek_v32", architecture="DeepseekV32ForCausalLM",
                   index_rope_interleaved=False, reads_indexer_types=False,
                   chat_format=None)
