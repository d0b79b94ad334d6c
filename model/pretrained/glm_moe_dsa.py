"""GLM-5 (model_type "glm_moe_dsa", GlmMoeDsaForCausalLM): DeepSeek-V3.2's blocks with
interleaved RoPE in the indexer too, indexer_types marking layers that reuse the previous
full layer's selection ("shared": no indexer weights), one expert group by default, and a
Jinja chat template in the tokenizer files."""

from model.pretrained.mla_moe import DSAFamily

FAMILY = DSAFamily(model_type="glm_moe_dsa", architecture="GlmMoeDsaForCausalLM",
                   index_rope_interleaved=True, reads_indexer_types=True,
                   chat_format="template")
