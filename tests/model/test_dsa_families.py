"""DeepSeek-V3.2 and GLM-5 loaded from Hugging Face folders in their released naming, against
transformers' own implementation: tiny random models whose logits, indexer selections and
greedy generations transformers recorded (tests/fixtures/dsa/make_fixtures.py wrote the
fixtures under tests/fixtures/dsa/, with torch; these tests need neither torch nor a
network). Prompts with a near-tie at a top-k boundary were redrawn there, so the selected
index sets can be compared exactly."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelRunner, with_config
from model.cache import bytes_per_token, init_cache, layer_bytes_per_token
from model.pretrained import PretrainedFormatError, load_pretrained

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "dsa"
FAMILIES = ("deepseek_v32", "glm_moe_dsa")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    folder = FIXTURES / request.param
    pre = load_pretrained(folder)
    reference = np.load(folder / "reference.npz")
    return request.param, pre, reference


def _prompts(reference):
    return [reference[f"prompt_{j}"] for j in range(3)]


def test_logits_and_selected_sets_equal_transformers(family):
    name, pre, reference = family
    runner = ModelRunner(pre.model)
    config = pre.model.config
    for j, prompt in enumerate(_prompts(reference)):
        logits, _, got = runner.prefill(prompt, logits_from=0, capture=("indices",))
        want = reference[f"logits_{j}"]
        err = float(np.max(np.abs(np.asarray(logits) - want)))
        assert err <= 1e-4 * float(np.max(np.abs(want))), (name, j, err)
        for layer in range(config.n_layers):
            # A shared GLM-5 layer attends to its full layer's selection (transformers
            # records the full layers only).
            source = config.selection_source(layer)
            ref = reference[f"indices_{j}_{source}"]
            for t in range(len(prompt)):
                mine = set(got["indices"][layer, t][got["indices"][layer, t] >= 0].tolist())
                theirs = {int(s) for s in ref[t] if s <= t}
                assert mine == theirs, (name, j, layer, t)


def test_the_config_is_the_checkpoints(family):
    name, pre, _ = family
    c = pre.model.config
    hf = json.loads((FIXTURES / name / "config.json").read_text())
    assert (c.mla.kv_lora_rank, c.moe.n_routed_experts, c.top_k) == (
        hf["kv_lora_rank"], hf["n_routed_experts"], hf["index_topk"])
    assert c.yarn.factor == hf["rope_parameters"]["factor"]
    assert c.index_rope_interleaved == (name == "glm_moe_dsa")
    assert c.indexer_types == (() if name == "deepseek_v32" else tuple(hf["indexer_types"]))
    assert pre.info["family"] == name and pre.info["indexer"] == "checkpoint"
    # The multi-token-prediction layer past num_hidden_layers is in the files, not the model.
    assert pre.model.config.n_layers == hf["num_hidden_layers"]


def test_latent_cache_bytes_per_token():
    """Measured from allocated caches (the difference of two lengths) against (kv_lora_rank
    + qk_rope_head_dim + index_head_dim) x itemsize per layer, plus the block summaries of
    the hierarchical indexer, (3 d_I + 2) x 4 bytes per block."""
    config = load_pretrained(FIXTURES / "deepseek_v32").model.config
    sizes = {n: sum(a.nbytes for a in jax.tree.leaves(init_cache(config, n)))
             for n in (512, 1024)}
    measured = (sizes[1024] - sizes[512]) / 512
    m, B = config.mla, config.hierarchical.block_size
    per_layer = (m.kv_lora_rank + m.qk_rope_head_dim + config.index_dim) * 4
    summaries = (3 * config.index_dim + 2) * 4 / B
    assert measured == config.n_layers * (per_layer + summaries)
    assert layer_bytes_per_token(config, 0) == {
        "kv": (m.kv_lora_rank + m.qk_rope_head_dim) * 4, "index_keys": config.index_dim * 4,
        "block_summaries": summaries}
    # The latent, not expanded K and V (which would be 4 heads x (24 + 16) x 4 bytes).
    assert bytes_per_token(config)["kv"] == config.n_layers * (32 + 8) * 4
    # V3.2 itself in bf16: (512 + 64) x 2 + 128 x 2 = 1408 B per token and layer, against
    # 81,920 B for expanded K (128 heads x 192 dims) and V (128 x 128) in bf16.
    v32 = config.replace(dtype="bfloat16", mla=m.replace(kv_lora_rank=512, qk_rope_head_dim=64),
                         index_dim=128, index_rope_dim=64)
    per = layer_bytes_per_token(v32, 0)
    assert per["kv"] + per["index_keys"] == 1408
    assert 128 * 192 * 2 + 128 * 128 * 2 == 81920


def test_a_wrong_tensor_names_the_file_and_the_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    src = FIXTURES / "glm_moe_dsa"
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    bad = dict(tensors)
    bad["model.layers.0.self_attn.kv_b_proj.weight"] = np.zeros((3, 3), np.float32)
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(PretrainedFormatError, match=r"tensor model\.layers\.0\.self_attn"
                                                    r"\.kv_b_proj\.weight has shape \(3, 3\)"):
        load_pretrained(tmp_path)
    del bad["model.layers.0.self_attn.kv_b_proj.weight"]
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(PretrainedFormatError, match=r"missing.*kv_b_proj"):
        load_pretrained(tmp_path)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_greedy_decode_chunked_prefill_and_absorbed_form(family):
    """Greedy generation equals transformers' generate with its cache; a prefill in chunks
    of 16 equals one shot; the expanded (reference) MLA form equals the absorbed one."""
    name, pre, reference = family
    model = pre.model
    for j, prompt in enumerate(_prompts(reference)):
        tokens = list(ModelRunner(model).generate(prompt, 8, stop_tokens=()))
        assert tokens == reference[f"generate_{j}"].tolist(), (name, j)
    prompt = _prompts(reference)[1]
    one, _ = ModelRunner(model).prefill(prompt, logits_from=0)
    chunked, _ = ModelRunner(with_config(model, model.config.replace(prefill_chunk=16))).prefill(
        prompt, logits_from=0)
    np.testing.assert_allclose(chunked, one, rtol=1e-5, atol=1e-5)
    expanded = with_config(model, model.config.replace(
        mla=model.config.mla.replace(absorb=False)))
    runners = [ModelRunner(m) for m in (model, expanded)]
    outs = []
    for runner in runners:
        logits, cache = runner.prefill(prompt[:50], capacity=len(prompt))
        steps = []
        for i, t in enumerate(prompt[50:]):
            logits, cache = runner.decode(int(t), cache, 50 + i)
            steps.append(np.asarray(logits))
        outs.append(np.stack(steps))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-4, atol=1e-4 * np.abs(outs[0]).max())
    assert jnp.asarray(outs[0]).shape == (len(prompt) - 50, model.config.vocab_size)
