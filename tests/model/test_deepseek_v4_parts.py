"""DeepSeek-V4's hyper-connections, compressors and CSA indexer, as functions over arrays,
against transformers 5.23's own pass on the tiny fixture (tests/fixtures/deepseek_v4: its
weights, and the streams entering every layer, the compressed entries and the indexer's
keys of every compressed layer). The model built of them: test_deepseek_v4_model.py."""

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from indexer.config import YarnConfig
from indexer.rope import rope_angles
from model.deepseek_v4 import compressor, hyper_connections
from model.layers import rms_norm

FIXTURE = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "deepseek_v4" / "tiny"
# The default tier checks the longest prompt (90 tokens, the most indexer rows choosing); the
# other two run in the slow tier (default-tier time budget: each prompt length compiles anew).
PROMPTS = [0, *(pytest.param(j, marks=pytest.mark.slow) for j in (1, 2))]


@pytest.fixture(scope="module")
def tiny():
    config = json.loads((FIXTURE / "config.json").read_text())
    reference = np.load(FIXTURE / "reference.npz")
    return config, load_file(FIXTURE / "model.safetensors"), reference


def _compress_rope(config):
    p = config["rope_parameters"]["compress"]
    yarn = YarnConfig(factor=p["factor"], beta_fast=p["beta_fast"], beta_slow=p["beta_slow"],
                      original_max_position_embeddings=p["original_max_position_embeddings"],
                      attention_factor=p["attention_factor"])
    return functools.partial(rope_angles, dim=config["qk_rope_head_dim"],
                             theta=p["rope_theta"], yarn=yarn), yarn


def test_the_compress_rope_table_is_transformers_yarn(tiny):
    config, _, reference = tiny
    p = config["rope_parameters"]
    _, yarn = _compress_rope(config)
    dim = config["qk_rope_head_dim"]
    np.testing.assert_allclose(yarn.inverse_frequencies(dim, p["compress"]["rope_theta"]),
                               reference["inv_freq_compress"], rtol=1e-6)
    main = 1.0 / p["main"]["rope_theta"] ** (np.arange(0, dim, 2) / dim)
    np.testing.assert_allclose(main, reference["inv_freq_main"], rtol=1e-6)


def _layer_input(config, weights, streams, layer):
    """The attention's input of `layer` from the streams entering it: the collapse by the
    layer's attention hyper-connection, then its RMSNorm."""
    w = lambda name: jnp.asarray(weights[f"model.layers.{layer}.{name}"])  # noqa: E731
    pre, _, _ = hyper_connections.mix_weights(
        jnp.asarray(streams), w("hc_attn_fn"), w("hc_attn_base"), w("hc_attn_scale"),
        hc_eps=config["hc_eps"], norm_eps=config["rms_norm_eps"],
        sinkhorn_iters=config["hc_sinkhorn_iters"])
    x = hyper_connections.collapse(jnp.asarray(streams), pre)
    return rms_norm(x, w("attn_norm.weight"), config["rms_norm_eps"])


def _entries(config, weights, h, prefix, ratio, overlap, *, start=0, prior=None):
    w = lambda name: jnp.asarray(weights[f"{prefix}.{name}"])  # noqa: E731
    rope, _ = _compress_rope(config)
    kv, gate = h @ w("wkv.weight").T, h @ w("wgate.weight").T
    return compressor.compress(kv, gate, w("ape"), w("norm.weight"),
                               lambda positions: rope(positions), ratio=ratio,
                               overlap=overlap, norm_eps=config["rms_norm_eps"],
                               first_position=start, prior=prior), (kv, gate, w("ape"))


def _compressed_layers(config):
    rates = config["compress_rates"]
    return [(i, rates[kind], kind == "compressed_sparse_attention")
            for i, kind in enumerate(config["layer_types"]) if kind in rates]


@pytest.mark.slow  # default-tier time budget: the layer test below covers the entries too
@pytest.mark.parametrize("prompt", [0, 1, 2])
def test_compressed_entries_and_index_keys_equal_transformers(tiny, prompt):
    """Every compressed layer (CSA ratio 4, overlapping; HCA ratio 16): the entries its
    compressor pools from the collapsed, normed streams, and on CSA layers its indexer's
    keys, equal those of transformers' pass (float32)."""
    config, weights, reference = tiny
    hidden = reference[f"hidden_{prompt}"]
    checked = 0
    for layer, ratio, csa in _compressed_layers(config):
        h = _layer_input(config, weights, hidden[layer], layer)
        whole = h.shape[0] // ratio * ratio
        got, _ = _entries(config, weights, h[:whole], f"model.layers.{layer}.attn.compressor",
                          ratio, csa)
        want = reference[f"compressed_{prompt}_{layer}"]
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5,
                                   atol=1e-5 * np.abs(want).max())
        checked += 1
        if csa:
            keys, _ = _entries(config, weights, h[:whole],
                               f"model.layers.{layer}.attn.indexer.compressor", ratio, True)
            want = reference[f"index_keys_{prompt}_{layer}"]
            np.testing.assert_allclose(np.asarray(keys), want, rtol=1e-5,
                                       atol=1e-5 * np.abs(want).max())
    assert checked == 3


@pytest.mark.slow  # the model's chunked prefill and decode tests cover carrying in the default tier
def test_entries_continue_across_calls_from_the_carried_window():
    """Compressing in two calls, the second given the first's last Ca slots (prior) and its
    first position, equals one call over both: CSA's overlap and the rope positions carry."""
    rng = np.random.default_rng(3)
    ratio, d, windows = 4, 8, 7
    kv = jnp.asarray(rng.standard_normal((ratio * windows, 2 * d)), jnp.float32)
    gate = jnp.asarray(rng.standard_normal((ratio * windows, 2 * d)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((ratio, 2 * d)), jnp.float32)
    norm = jnp.asarray(rng.uniform(0.5, 1.5, d), jnp.float32)
    rope = functools.partial(rope_angles, dim=4, theta=160000.0)
    run = functools.partial(compressor.compress, position_bias=bias, norm_weight=norm,
                            rope=rope, ratio=ratio, overlap=True, norm_eps=1e-6)
    whole = run(kv, gate)
    cut = 3 * ratio
    first = run(kv[:cut], gate[:cut])
    prior = compressor.last_window_prior(kv[:cut], gate[:cut], bias, ratio=ratio)
    second = run(kv[cut:], gate[cut:], first_position=cut, prior=prior)
    np.testing.assert_allclose(np.concatenate([first, second]), whole, rtol=1e-6, atol=1e-6)
    assert not np.allclose(run(kv[cut:], gate[cut:], first_position=cut), whole[3:])


def test_interleaved_rope_rotates_consecutive_pairs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 2, 12)).astype(np.float32)
    angles = rng.uniform(-3, 3, (5, 2)).astype(np.float32)
    got = np.asarray(compressor.interleaved_rope(jnp.asarray(x), jnp.cos(angles),
                                                 jnp.sin(angles)))
    want = x.copy()
    for i in range(2):
        a, b = x[..., 8 + 2 * i], x[..., 9 + 2 * i]
        c, s = np.cos(angles[:, i])[:, None], np.sin(angles[:, i])[:, None]
        want[..., 8 + 2 * i], want[..., 9 + 2 * i] = a * c - b * s, b * c + a * s
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_compress_names_a_partial_window():
    with pytest.raises(ValueError, match="not whole windows of 4"):
        compressor.compress(jnp.zeros((6, 4)), jnp.zeros((6, 4)), jnp.zeros((4, 4)),
                            jnp.ones(4), None, ratio=4, overlap=False, norm_eps=1e-6)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_csa_index_scores_and_selection_equal_transformers(tiny, prompt):
    """The CSA indexer of every CSA layer, from the layer's input: its scores over the
    compressed entries (-inf on the same entries) and its top index_topk entries, in
    transformers' order, -1 on the same slots."""
    from indexer.scoring import flat_topk
    from model.deepseek_v4 import csa

    config, weights, reference = tiny
    rope, _ = _compress_rope(config)
    eps = config["rms_norm_eps"]
    for layer, ratio, is_csa in _compressed_layers(config):
        if not is_csa:
            continue
        w = lambda name, layer=layer: jnp.asarray(weights[f"model.layers.{layer}.{name}"])  # noqa: E731
        h = _layer_input(config, weights, reference[f"hidden_{prompt}"][layer], layer)
        T = h.shape[0]
        keys, _ = _entries(config, weights, h[:T // ratio * ratio],
                           f"model.layers.{layer}.attn.indexer.compressor", ratio, True)
        q_residual = rms_norm(h @ w("attn.wq_a.weight").T, w("attn.q_norm.weight"),
                                          eps)
        cos, sin = rope(jnp.arange(T))
        q, head_w = csa.index_queries(q_residual, w("attn.indexer.wq_b.weight"),
                                      w("attn.indexer.weights_proj.weight"), h, cos, sin,
                                      n_heads=config["index_n_heads"],
                                      head_dim=config["index_head_dim"])
        scores = np.asarray(csa.entry_scores(q, head_w, keys, start=0, ratio=ratio))
        want = reference[f"scores_{prompt}_{layer}"]
        np.testing.assert_array_equal(np.isfinite(scores), np.isfinite(want))
        finite = np.isfinite(want)
        np.testing.assert_allclose(scores[finite], want[finite], rtol=1e-5,
                                   atol=1e-5 * np.abs(want[finite]).max())
        got = flat_topk(q, head_w, keys, config["index_topk"], q_offset=0, key_ratio=ratio)
        np.testing.assert_array_equal(np.asarray(got), reference[f"indices_{prompt}_{layer}"])


@pytest.mark.parametrize("T, start", [(1, 37), (7, 5), (53, 0), (53, 19)])
def test_the_blocked_window_equals_one_masked_softmax(T, start):
    """attention.window_blocks + attend (the window read in query blocks, T (W + B) work)
    against one softmax over every key with the window mask written out, with a shared and
    a per-query part beside it: random inputs, lengths that are not multiples of W = 16,
    keys before position 0 hidden."""
    from model.deepseek_v4 import attention

    rng = np.random.default_rng(T + start)
    W, H, D, S, k = 16, 3, 8, 5, 4
    q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((W + T, D)), jnp.float32)
    shared = jnp.asarray(rng.standard_normal((S, D)), jnp.float32)
    shared_visible = jnp.asarray(rng.random((T, S)) < 0.6)
    own = jnp.asarray(rng.standard_normal((T, k, D)), jnp.float32)
    own_visible = jnp.asarray(rng.random((T, k)) < 0.6)
    sinks = jnp.asarray(rng.standard_normal(H), jnp.float32)
    got = jax.jit(lambda q, keys, start, *rest: attention.attend(
        q, rest[-1], attention.window_blocks(keys, start, W), rest[0:2], rest[2:4]))(
        q, keys, start, shared, shared_visible, own, own_visible, sinks)
    t = start + np.arange(T)[:, None]
    s = start - W + np.arange(W + T)[None, :]
    window_visible = (s <= t) & (s > t - W) & (s >= 0)
    logits = np.concatenate([np.einsum("thd,ld->thl", q, keys),
                             np.einsum("thd,sd->ths", q, shared),
                             np.einsum("thd,tkd->thk", q, own)], axis=-1) * D ** -0.5
    visible = np.concatenate([window_visible, shared_visible, own_visible], axis=-1)
    logits = np.where(visible[:, None, :], logits, -np.inf)
    logits = np.concatenate([logits, np.broadcast_to(sinks[None, :, None], (T, H, 1))], -1)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True))[..., :-1]
    L = W + T
    want = (np.einsum("thl,ld->thd", probs[..., :L], keys)
            + np.einsum("ths,sd->thd", probs[..., L:L + S], shared)
            + np.einsum("thk,tkd->thd", probs[..., L + S:], own))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
