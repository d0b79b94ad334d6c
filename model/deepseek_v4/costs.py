"""DeepSeek-V4's attention kinds counted: the sizes model.costs needs of a sliding, CSA or HCA
layer (its ATTENTION_COSTS entries build an AttentionShape from `v4_shape`) and the work of
its attention step (`v4_attention_ops`), as model/deepseek_v4/modules.py runs it. Pure
arithmetic over a ModelConfig, no arrays.

Per query at position p, every layer reads its window, min(W, p + 1) keys; a CSA layer
also the top_k entries its indexer chose among the (p + 1) // 4 whole ones, an HCA layer
every whole entry, (p + 1) // 128. The selection itself (the CSA indexer over entries,
indexer.costs with key_ratio = 4) is model.costs' selection op, over kv_len // ratio keys.
One K = V head per layer: a key row is read once for both products.
"""

from indexer.costs import F32, Op, entry_pairs, visible_keys


def v4_shape(config, kind):
    """dict of AttentionShape fields of a V4 layer of `kind` ("sliding", "csa", "hca")."""
    c, v4 = config, config.v4
    D, H, hd = c.d_model, c.n_heads, c.head_dim
    ratio = {"sliding": 0, "csa": v4.csa_ratio, "hca": v4.hca_ratio}[kind]
    compressor = 2 * D * hd * (2 if kind == "csa" else 1) if ratio else 0  # wkv + wgate
    params = (D * v4.q_lora_rank + v4.q_lora_rank * H * hd + D * hd
              + v4.o_groups * v4.o_lora_rank * (H * hd // v4.o_groups)
              + v4.o_groups * v4.o_lora_rank * D + compressor)
    width = hd * (2 if kind == "csa" else 1)
    # q / kv norms, sinks, and each compressor's slot bias (ape) and norm
    small = v4.q_lora_rank + hd + H + ((ratio * width + hd) if ratio else 0)
    index = 0
    if kind == "csa":  # its indexer: wq_b from the q-LoRA residual, head weights, compressor
        index = (v4.q_lora_rank * c.index_heads * c.index_dim + D * c.index_heads
                 + 2 * D * 2 * c.index_dim)
        small += ratio * 2 * c.index_dim + c.index_dim
    return dict(heads=H, kv_heads=1, qk_dim=hd, v_dim=hd, kv_row=hd, params=params,
                label=f"DeepSeek-V4 {kind}, {H} heads x {hd}, window {v4.sliding_window}"
                      + (f", entries of {ratio}" if ratio else ""),
                cache_row=hd + (hd // ratio if ratio else 0),
                rope=2 * (H + 1) * v4.qk_rope_head_dim + 2 * v4.q_lora_rank,
                norm_params=small,
                window=v4.sliding_window, entry_ratio=ratio,
                reads_entries={"sliding": "", "csa": "selected", "hca": "all"}[kind],
                own_index_params=index)


def v4_attention_ops(a, T, p0, kv_len, top_k, b, skip):
    """One V4 layer's attention over a chunk of T queries at p0.. (cache of kv_len positions):
    the window and the entries read, softmax over both (the sinks aside), and, for
    comparison ("dense_attention"), the same layer reading every whole entry."""
    H, hd, r = a.heads, a.qk_dim, a.entry_ratio
    window = visible_keys(p0, T, a.window)
    n_entries = kv_len // r if r else 0
    every = entry_pairs(p0, T, n_entries, r) if r else 0
    if not skip:
        every = T * n_entries
    read = {"": 0, "all": every,
            "selected": (entry_pairs(p0, T, top_k, r) if skip else T * top_k) if r else 0}
    qo = T * H * 2 * hd * b
    ops = []
    for stage, entries in (("attention", read[a.reads_entries]), ("dense_attention", every)):
        ops.append(Op(stage, "V4 attention", "dense_attention" if stage != "attention"
                      or a.reads_entries != "selected" else "sparse_attention",
                      flops=2 * H * 2 * hd * (window + entries),
                      bytes=qo + T * (a.window + 1) * hd * b
                      + (n_entries * hd * b if stage == "dense_attention"
                         or a.reads_entries == "all" else 0),
                      gather_bytes=(entries * hd * b if stage == "attention"
                                    and a.reads_entries == "selected" else 0),
                      gather_source=n_entries * hd * b))
    if r:  # the compressors' pooling over their windows (a softmax of ratio slots)
        width = hd * (2 if a.reads_entries == "selected" else 1)
        ops.append(Op("other", "compressor pooling", "memory",
                      bytes=T * width * (2 * b + 2 * F32)))
    return ops
