"""DeepSeek-V4 as a dosa model: the transformers-form fixture folder (tests/fixtures/
deepseek_v4/tiny) through load_pretrained, run by the one Transformer and the one runner,
against transformers 5.23's own outputs on it: logits, the CSA selections at every row,
chunked prefill across compressor windows, and greedy decoding with its cache. The cache's
bytes per token are measured from allocated caches."""

import json
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from model import ModelConfig, ModelRunner
from model.attention_kinds import attention_kind
from model.cache import (
    init_cache,
    layer_bytes_per_token,
    layer_fields,
    layer_of,
    layer_state_bytes,
)
from model.layer_cache import LayerCache, LayerView
from model.pretrained.llama import PretrainedFormatError
from model.pretrained.registry import load_pretrained

FIXTURE = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "deepseek_v4" / "tiny"
CSA_LAYERS = (1, 3)


@pytest.fixture(scope="module")
def tiny():
    return load_pretrained(FIXTURE), np.load(FIXTURE / "reference.npz")


def _close(got, want, what):
    scale = np.abs(want).max()
    err = np.abs(np.asarray(got) - want).max() / scale
    assert err < 1e-4, f"{what}: max error {err:.2e} x max |logit|"
    np.testing.assert_array_equal(np.asarray(got).argmax(-1), want.argmax(-1), err_msg=what)


def test_the_folder_loads_as_three_attention_kinds_and_hash_routing(tiny):
    pretrained, _ = tiny
    config = pretrained.model.config
    assert pretrained.info["family"] == "deepseek_v4"
    assert [attention_kind(config, i).name for i in range(4)] == ["sliding", "csa", "hca", "csa"]
    assert config.moe.mlp_layer_types == ("hash", "hash", "sparse", "sparse")
    assert (config.v4.csa_ratio, config.v4.hca_ratio, config.v4.hc_mult) == (4, 16, 4)
    assert config.moe.scoring_func == "sqrtsoftplus" and config.moe.swiglu_limit == 2.0
    assert layer_fields(config, 0) == ("window",)
    assert "csa_index_entries" in layer_fields(config, 1)
    assert "k_index" not in layer_fields(config, 1)  # V4 indexes entries, not tokens
    weights = load_file(FIXTURE / "model.safetensors")
    np.testing.assert_array_equal(
        np.asarray(pretrained.model.layer(0).mlp.tid2eid[...]),
        weights["model.layers.0.ffn.gate.tid2eid"])


@pytest.mark.slow  # default-tier budget: the hierarchical test checks logits and sets
def test_logits_and_every_csa_selection_equal_transformers(tiny):
    """Prompt 0 (90 tokens; the indexer chooses among more than index_topk entries on 71
    rows): logits within 1e-4 x max |logit| at every position, and each CSA layer's chosen
    entries, in the indexer's order, identical on every row."""
    pretrained, reference = tiny
    runner = ModelRunner(pretrained.model)
    tokens = reference["prompt_0"]
    logits, _, captured = runner.prefill(tokens, logits_from=0, capture=("indices",))
    _close(logits, reference["logits_0"], "one pass")
    for layer in CSA_LAYERS:
        np.testing.assert_array_equal(captured["indices"][layer],
                                      reference[f"indices_0_{layer}"], err_msg=f"layer {layer}")
    assert (captured["indices"][0] == -1).all()  # the sliding layer selects nothing


@pytest.mark.slow  # 9 s (hierarchical over entries alone: tests/indexer/test_entry_selection)
def test_hierarchical_selection_over_entries_runs_in_the_model(tiny):
    """The CSA layers' selection through the hierarchical kind over compressed entries, in
    chunks of 30 (not a multiple of the ratio: entries are rewritten across chunks), with
    blocks of 2 entries and a budget of every block: transformers' selected sets on every
    row, so its logits; the entry summaries kept in the cache are those of the whole
    entries, built from scratch. (Streaming over entries: tests/indexer.)"""
    from indexer.block_summaries import block_summaries
    from model import with_config
    from model.deepseek_v4.modules import CSA_SUMMARY_PREFIX

    pretrained, reference = tiny
    model = pretrained.model
    tokens = reference["prompt_0"]
    settings = model.config.hierarchical.replace(block_size=2, candidate_tokens=32,
                                                 query_tile=4, fine_batch_size=32)
    net = with_config(model, model.config.replace(indexer="hierarchical", hierarchical=settings))
    runner = ModelRunner(net)
    logits, cache, captured = runner.prefill(tokens, logits_from=0, chunk=30,
                                             capture=("indices",))
    _close(logits, reference["logits_0"], "hierarchical, every block")
    whole = len(tokens) // 4
    for layer in CSA_LAYERS:
        got = np.asarray(captured["indices"][layer])
        want = reference[f"indices_0_{layer}"]
        assert [set(r) for r in got] == [set(r) for r in want], f"layer {layer}"
        own = layer_of(cache, net.config, layer)
        entries = np.asarray(own.fields["csa_index_entries"][:whole], np.float32)
        summary = block_summaries(entries, 2)
        for name in ("sum", "count", "min", "max"):
            kept = own.fields[CSA_SUMMARY_PREFIX + name][:len(summary.count)]
            np.testing.assert_allclose(np.asarray(kept), np.asarray(getattr(summary, name)),
                                       rtol=1e-5, atol=1e-5, err_msg=f"layer {layer} {name}")


@pytest.mark.slow  # default-tier budget: the prefill test above covers the summaries
def test_hierarchical_decoding_over_entries_equals_transformers_generate(tiny):
    """Decode steps refresh the entry summaries one entry at a time (windows close at 91
    and 95 on prompt 0): with every block in the budget, transformers' 8 greedy tokens."""
    from model import with_config

    pretrained, reference = tiny
    model = pretrained.model
    settings = model.config.hierarchical.replace(block_size=2, candidate_tokens=32)
    net = with_config(model, model.config.replace(indexer="hierarchical", hierarchical=settings))
    tokens = reference["prompt_0"]
    assert list(ModelRunner(net).generate(tokens, 8)) == reference["generate_0"].tolist()


# default-tier budget: chunks of 30 run in the default tier with hierarchical selection
@pytest.mark.slow
@pytest.mark.parametrize("chunk", [7, 20])
def test_chunked_prefill_equals_transformers_across_windows(tiny, chunk):
    """Chunks of 7 (neither a multiple of the CSA ratio 4 nor of the HCA ratio 16: windows
    close inside chunks and continue across them) and 20 (the last chunk padded to 16 rows,
    6 of them padding): every position's logits as transformers' one pass."""
    pretrained, reference = tiny
    runner = ModelRunner(pretrained.model)
    logits, _ = runner.prefill(reference["prompt_0"], logits_from=0, chunk=chunk)
    _close(logits, reference["logits_0"], f"chunks of {chunk}")


@pytest.mark.slow
@pytest.mark.parametrize("prompt", [0, 1, 2])
def test_greedy_decoding_equals_transformers_generate(tiny, prompt):
    """Prefill, then 7 single-token decode steps (windows close at some of them: 91 and 95 on
    prompt 0): the 8 greedy tokens of transformers' generate with its cache, each step's
    logits within 1e-4, and each decode step's CSA selection identical."""
    pretrained, reference = tiny
    runner = ModelRunner(pretrained.model)
    tokens = reference[f"prompt_{prompt}"]
    n = len(tokens)
    logits, cache = runner.prefill(tokens, capacity=n + 8)
    steps, chosen = [np.asarray(logits)], {layer: [] for layer in CSA_LAYERS}
    for i, token in enumerate(reference[f"generate_{prompt}"][:-1]):
        out, cache, captured = runner._run_step(runner.state, jnp.asarray([token], jnp.int32),
                                                cache, n + i, 256, 1, False, ("indices",))
        steps.append(np.asarray(out))
        for layer in CSA_LAYERS:
            chosen[layer].append(np.asarray(captured["indices"][layer, 0]))
    want = reference[f"generate_logits_{prompt}"]
    _close(np.stack(steps), want, f"prompt {prompt} decode")
    np.testing.assert_array_equal(np.stack(steps).argmax(-1), reference[f"generate_{prompt}"])
    for layer in CSA_LAYERS:
        np.testing.assert_array_equal(np.stack(chosen[layer]),
                                      reference[f"decode_indices_{prompt}_{layer}"])
    assert list(runner.generate(tokens, 8)) == reference[f"generate_{prompt}"].tolist()


def _flash_like(dtype="bfloat16"):
    """One sliding, one CSA and one HCA layer at DeepSeek-V4-Flash's attention sizes
    (head 512, indexer 64 x 128, ratios 4 and 128, window 128), a small rest."""
    return ModelConfig(
        vocab_size=256, d_model=256, n_layers=3, n_heads=4, n_kv_heads=1, head_dim=512,
        d_ff=256, index_heads=64, index_dim=128, index_rope_dim=64, top_k=512, dtype=dtype,
        v4=dict(layer_types=("sliding", "csa", "hca"), q_lora_rank=64, qk_rope_head_dim=64,
                o_groups=2, o_lora_rank=32, sliding_window=128, csa_ratio=4, hca_ratio=128))


def _allocated_bytes(config, capacity):
    return [sum(a.nbytes for a in layer.fields.values())
            for layer in init_cache(config, capacity)]


def test_cache_bytes_per_token_are_the_compressed_entries():
    """Measured from allocated caches (the difference between 2048 and 4096 positions): a CSA
    layer holds (head_dim + index_head_dim) / 4 x 2 B = 320 B per token in bf16, plus the
    summaries of its indexer's entries (sum, min, max f32[128], count, radius per block of
    64 entries = 256 positions: 6.03 B), an HCA layer head_dim / 128 x 2 B = 8 B, a sliding
    layer nothing that grows; the window and the compressors' tails are the same bytes at
    both lengths. model.cache's count agrees."""
    config = _flash_like()
    short, long = _allocated_bytes(config, 2048), _allocated_bytes(config, 4096)
    per_token = [(b - a) / 2048 for a, b in zip(short, long)]
    summaries = (3 * 128 * 4 + 4 + 4) / (4 * 64)
    assert per_token == [0.0, (512 + 128) / 4 * 2 + summaries, 512 / 128 * 2] == \
        [0.0, 326.03125, 8.0]
    for layer in range(3):
        counted = layer_bytes_per_token(config, layer)
        assert counted["kv"] + counted["index_keys"] + counted["block_summaries"] == \
            per_token[layer]
    assert layer_bytes_per_token(config, 1)["block_summaries"] == summaries
    window = 128 * 512 * 2
    assert short[0] == window  # the sliding layer: its window ring only
    # kv and gate rings: CSA's last 2 x 4 tokens at twice the width (its overlap), for the
    # entries and the indexer's keys; HCA's last 128 tokens
    tails = (2 * 8 * 2 * (512 + 128) * 2, 2 * 128 * 512 * 2)
    assert short[1] == window + 2048 // 4 * (512 + 128) * 2 + tails[0] + 2048 // 256 * 1544
    assert short[2] == window + 2048 // 128 * 512 * 2 + tails[1]
    assert [layer_state_bytes(config, i) for i in range(3)] == [window, window + tails[0],
                                                                  window + tails[1]]


def test_a_missing_or_misshapen_tensor_is_named(tmp_path):
    folder = tmp_path / "v4"
    shutil.copytree(FIXTURE, folder)
    weights = load_file(folder / "model.safetensors")
    gone = "model.layers.1.attn.indexer.compressor.ape"
    save_file({k: v for k, v in weights.items() if k != gone}, folder / "model.safetensors")
    with pytest.raises(PretrainedFormatError, match=gone):
        load_pretrained(folder)
    weights["model.layers.2.attn.compressor.ape"] = np.zeros((4, 32), np.float32)
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(PretrainedFormatError,
                       match=r"model.layers.2.attn.compressor.ape has shape \(4, 32\)"):
        load_pretrained(folder)


def test_a_bad_v4_config_names_the_key(tmp_path):
    folder = tmp_path / "v4"
    shutil.copytree(FIXTURE, folder)
    config = json.loads((folder / "config.json").read_text())
    config["layer_types"][2] = "global_attention"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(PretrainedFormatError, match="layer_types"):
        load_pretrained(folder)
    with pytest.raises(ValueError, match="indexer 'oracle' ranks dense attention"):
        _flash_like().replace(indexer="oracle")
    exact = _flash_like().hierarchical.replace(exact=True)
    with pytest.raises(ValueError, match="hierarchical.exact must be False with v4"):
        _flash_like().replace(indexer="hierarchical", hierarchical=exact)


@pytest.mark.slow  # default-tier budget (11-12 s each): the fixture tests cover chunking
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_v4_model_from_its_config_alone_runs_chunked(dtype):
    """Random weights built from a config (no folder), windows of 16 for the sliding layer
    and the HCA ratio: in float32 chunks of 9 give one pass's logits (1e-4) and the same
    CSA selections; in bf16 the pass is finite and chunking changes the greedy token on
    at most 10% of rows (rounding moves near-tied selections and routes of random weights:
    4 of 75 rows when measured)."""
    from flax import nnx

    from model import Transformer

    base = _flash_like(dtype)
    config = base.replace(d_model=64, head_dim=64, index_heads=4, index_dim=32, top_k=8,
                          index_rope_dim=16, d_ff=64, max_seq_len=512,
                          v4=base.v4.replace(qk_rope_head_dim=16, sliding_window=16,
                                             hca_ratio=16, q_lora_rank=32, o_lora_rank=16),
                          moe=dict(n_routed_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=32,
                                   mlp_layer_types=("hash", "sparse", "sparse"),
                                   scoring_func="sqrtsoftplus", swiglu_limit=7.0))
    model = Transformer(config, rngs=nnx.Rngs(0))
    assert model.layer(0).mlp.tid2eid[...].dtype == jnp.int32
    tokens = np.random.default_rng(0).integers(0, 256, 75)
    runner = ModelRunner(model)
    whole, _, picked = runner.prefill(tokens, logits_from=0, capture=("indices",))
    chunked, _, picked_chunked = runner.prefill(tokens, logits_from=0, chunk=9,
                                                capture=("indices",))
    whole, chunked = np.asarray(whole, np.float32), np.asarray(chunked, np.float32)
    assert np.isfinite(whole).all() and np.isfinite(chunked).all()
    if dtype == "float32":
        np.testing.assert_allclose(chunked, whole, rtol=0, atol=1e-4 * np.abs(whole).max())
        np.testing.assert_array_equal(picked_chunked["indices"], picked["indices"])
    else:
        assert np.mean(chunked.argmax(-1) == whole.argmax(-1)) >= 0.9


@pytest.mark.slow  # default-tier budget (8.5 s: a program per layer); the logits test covers
@pytest.mark.parametrize("prompt", [0, 1, 2])  # the layers together
def test_every_layer_of_the_model_equals_transformers(tiny, prompt):
    """Each DecoderBlock of the loaded model (sliding, CSA, HCA, CSA; hash then learned
    routing), from the streams entering it in transformers' pass: the streams leaving it
    within 1e-4 of their largest value (per-kind figures: docs/models.md)."""
    from flax import nnx

    pretrained, reference = tiny
    model = pretrained.model
    hidden, tokens = reference[f"hidden_{prompt}"], jnp.asarray(reference[f"prompt_{prompt}"])
    caches = init_cache(model.config, 256)

    for layer in range(model.config.n_layers):
        # The layer's block and its own cache, as a stack of one (model.layer_cache).
        one = layer_of(caches, model.config, layer)
        stack = LayerCache({name: array[None] for name, array in one.fields.items()})
        run = nnx.jit(lambda block, streams, stack, tokens, layer=layer: block(
            streams, LayerView(stack, 0), 0, 256, tokens=tokens, layer=layer)[0])
        got = np.asarray(run(model.layer(layer), jnp.asarray(hidden[layer]), stack, tokens))
        want = hidden[layer + 1]
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 1e-4, f"layer {layer} ({model.config.v4.layer_types[layer]}): {err:.2e}"


@pytest.mark.slow  # default-tier budget: the released FP8 / FP4 fixture covers the names
def test_the_released_config_keys_and_tensor_names_load_the_same_model(tiny, tmp_path):
    """The fixture rewritten as the releases write it: config.json with compress_ratios per
    layer (and the HCA rate, 16 here, as compress_rate_hca), num_hash_layers,
    qk_rope_head_dim, a flat YaRN rope_parameters and compress_rope_theta; tensors without
    the `model.` prefix (embed.weight, norm.weight, hc_head_fn, layers.{i}.*) plus a
    multi-token-prediction layer past the model: the same config and bitwise the same
    logits as the transformers-form folder."""
    from model.pretrained.deepseek_v4 import RELEASED_TOP_LEVEL

    pretrained, reference = tiny
    config = json.loads((FIXTURE / "config.json").read_text())
    compress = config["rope_parameters"]["compress"]
    for key in ("layer_types", "compress_rates", "mlp_layer_types", "rope_parameters",
                "partial_rotary_factor"):
        config.pop(key)
    config.update(compress_ratios=[0, 4, 128, 4, 0], compress_rate_hca=16, num_hash_layers=2,
                  qk_rope_head_dim=8, compress_rope_theta=compress["rope_theta"],
                  rope_parameters={k: v for k, v in compress.items()
                                   if k not in ("rope_theta", "partial_rotary_factor",
                                                "attention_factor")})
    folder = tmp_path / "released"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE / name, folder / name)
    weights = load_file(FIXTURE / "model.safetensors")
    released = {RELEASED_TOP_LEVEL.get(k, k.removeprefix("model.")): v for k, v in weights.items()}
    released["layers.4.attn.wkv.weight"] = np.full((32, 64), np.nan, np.float32)  # MTP: unread
    save_file(released, folder / "model.safetensors")
    loaded = load_pretrained(folder)
    assert loaded.model.config == pretrained.model.config
    tokens = reference["prompt_1"]
    got = ModelRunner(loaded.model).prefill(tokens, logits_from=0)[0]
    want = ModelRunner(pretrained.model).prefill(tokens, logits_from=0)[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
