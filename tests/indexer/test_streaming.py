"""Streaming flat selection (indexer.streaming) equals flat_topk index for index: lengths
that are not tile multiples, late query chunks, top_k past the visible keys, ties, and
the Pallas index-scores kernel (interpreted) under its tiles."""

import jax.numpy as jnp
import numpy as np
import pytest

from indexer.scoring import flat_topk
from indexer.streaming import FEW_IMPROVEMENTS, streaming_topk
from tests.helpers import random_indexer_inputs


@pytest.mark.parametrize("T,L,top_k,q_offset,chunk,tile", [
    (50, 50, 8, 0, 16, 7),        # neither T nor L a multiple of chunk / tile
    (33, 300, 32, 267, 7, 64),    # a late query chunk; the last tile is padded
    (20, 64, 64, 10, 512, 16),    # top_k >= visible everywhere: -1 padding
    (3, 10, 16, 0, 2, 4),         # top_k > L
    (64, 700, 40, 600, 32, 100),  # tiles past the chunk's last query skipped
])
def test_streaming_topk_equals_flat(T, L, top_k, q_offset, chunk, tile):
    q, w, k = random_indexer_inputs(3 * T + L + top_k, T, L)
    want = np.asarray(flat_topk(q, w, k, top_k, q_offset=q_offset, query_chunk=chunk))
    got = np.asarray(streaming_topk(q, w, k, top_k, q_offset=q_offset, query_chunk=chunk,
                                    key_tile=tile))
    assert got.dtype == np.int32 and got.shape == (T, top_k)
    np.testing.assert_array_equal(got, want)


def test_ties_go_to_the_earlier_token_as_in_flat():
    # Keys repeat every 24 tokens: every score appears several times across tiles of 16.
    T, L, top_k = 12, 200, 20
    q, w, _ = random_indexer_inputs(5, T, L)
    k = jnp.tile(random_indexer_inputs(6, 1, 24)[2], (L // 24 + 1, 1))[:L]
    want = np.asarray(flat_topk(q, w, k, top_k, q_offset=L - T))
    got = np.asarray(streaming_topk(q, w, k, top_k, q_offset=L - T, key_tile=16))
    np.testing.assert_array_equal(got, want)
    assert len(set(want[0].tolist())) == top_k  # the tie rule was exercised, not avoided


def test_every_merge_branch_and_a_traced_offset():
    # top_k above FEW_IMPROVEMENTS: early tiles take the full merge, middle ones the few
    # branch, late ones (a full running set) mostly skip.
    T, L, top_k = 16, 2000, FEW_IMPROVEMENTS + 8
    q, w, k = random_indexer_inputs(11, T, L)
    offset = jnp.int32(L - T)
    want = np.asarray(flat_topk(q, w, k, top_k, q_offset=offset))
    got = np.asarray(streaming_topk(q, w, k, top_k, q_offset=offset, key_tile=64))
    np.testing.assert_array_equal(got, want)


def test_with_the_pallas_index_scores_kernel():
    T, L, top_k = 20, 150, 12  # negative per-tile offsets for the tiles past a query
    q, w, k = random_indexer_inputs(13, T, L)
    want = np.asarray(flat_topk(q, w, k, top_k, q_offset=L - T - 5))
    got = np.asarray(streaming_topk(q, w, k, top_k, q_offset=L - T - 5, key_tile=48,
                                    backend="interpret"))
    np.testing.assert_array_equal(got, want)


def test_bad_arguments_name_the_parameter():
    q, w, k = random_indexer_inputs(1, 4, 16)
    with pytest.raises(ValueError, match="top_k"):
        streaming_topk(q, w, k, 0)
    with pytest.raises(ValueError, match="key_tile"):
        streaming_topk(q, w, k, 4, key_tile=0)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_a_model_on_streaming_selection_is_the_flat_model():
    from flax import nnx

    from model import ModelRunner, Transformer, get_config, with_config

    model = Transformer(get_config("tiny", top_k=16), rngs=nnx.Rngs(5))
    tokens = np.asarray(np.random.default_rng(6).integers(0, 256, 150), np.int32)
    runs = {}
    for kind in ("flat", "streaming"):
        net = with_config(model, model.config.replace(attention="sparse", indexer=kind))
        logits, _, captured = ModelRunner(net).prefill(tokens, capture=("indices",), chunk=64)
        runs[kind] = np.asarray(logits), captured["indices"]
    np.testing.assert_array_equal(runs["streaming"][0], runs["flat"][0])
    for got, want in zip(runs["streaming"][1], runs["flat"][1]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
