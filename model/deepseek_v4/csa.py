"""The CSA layer's lightning indexer over compressed entries (DeepSeek-V4): DSA's score
sum_h w_h ReLU(q_h . k_s), its keys the indexer compressor's entries (compressor.py, at
index_head_dim), its queries from the attention's q-LoRA residual with the compress RoPE
at the query's position, its head weights from the layer's input times
index_n_heads^-0.5, and the dot products times index_head_dim^-0.5.

Entry s summarises positions [s ratio, (s + 1) ratio): a query at position t sees it once
the window is whole, s ratio + ratio - 1 <= t. That is the lightning indexer's causality
over key blocks (pallas_kernels.index_scores with key_block_size = ratio: key s visible iff
s ratio <= position) for queries placed ratio - 1 positions earlier, so the scores come from
the indexer's own op, whichever backend runs it. The selection over them is any selection
kind's (indexer.selection) with key_ratio = ratio: flat, streaming or hierarchical, whose
blocks are then blocks of entries."""

import jax.numpy as jnp

from indexer.scoring import index_scores
from model.deepseek_v4.compressor import interleaved_rope


def index_queries(q_residual, wq_b, head_weights_proj, x, cos, sin, *, n_heads, head_dim):
    """-> (q [T, n_heads, head_dim] with RoPE, w f32[T, n_heads] with both scales folded
    in). q_residual [T, q_lora_rank]; wq_b [n_heads head_dim, q_lora_rank] and
    head_weights_proj [n_heads, d_model] as the checkpoints store them ([out, in]); x: the
    layer's input [T, d_model]; cos, sin: the compress RoPE at the queries' positions."""
    T = q_residual.shape[0]
    q = (q_residual @ wq_b.T).reshape(T, n_heads, head_dim)
    q = interleaved_rope(q, cos, sin)
    w = (x @ head_weights_proj.T).astype(jnp.float32) * (n_heads ** -0.5 * head_dim ** -0.5)
    return q, w


def entry_scores(q, w, keys, *, start, ratio, backend=None):
    """Index scores f32[T, n] of queries at positions start.. over compressed entries keys
    [n, head_dim]; -inf where the entry's window is not whole yet."""
    return index_scores(q, w, keys, q_offset=start - (ratio - 1), key_block_size=ratio,
                        backend=backend)


