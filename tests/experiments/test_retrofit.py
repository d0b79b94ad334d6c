"""The retrofit on a teacher cache (experiments.training.teacher, .retrofit): its loss is
the warm-up's loss at the cached rows, the cache keeps what the model's pass captured, and
the recipe's command trains, resumes and ships a stage in the warm-up's formats."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from experiments.training import retrofit
from experiments.training import steps as ts
from experiments.training.teacher import (
    TeacherCache,
    WindowPlan,
    full_layers,
    make_teacher,
    repeat_spans,
    stratified_rows,
    window_rows,
)
from model import Transformer, get_config, with_config
from tests.pretrained_files import tiny_training_setup


def _model(**overrides):
    return Transformer(get_config("tiny", attention="dense", **overrides), rngs=nnx.Rngs(3))


def _cached_window(model, tokens, rows):
    """A teacher window in float32, straight from the model's own capture."""
    _, got = model.forward(tokens, capture=("indexer_input", "attention_target"),
                           capture_rows=rows)
    full = [i for i in range(model.config.n_layers) if not model.config.layer_is_shared(i)]
    return dict(hidden=jnp.stack([got["indexer_input"][i].hidden for i in full]),
                target=jnp.stack(got["attention_target"]), rows=rows)


@pytest.mark.slow  # 15 s from a cold cache; the sampled-rows loss stays in the default tier
@pytest.mark.parametrize("types", [None, "FS"])
def test_cached_loss_at_every_row_is_the_warmup_loss_and_its_gradient(types):
    """With every query kept, the teacher-cache loss and its gradient equal the warm-up's
    (which runs the model in the loss); a shared layer's target trains its full layer."""
    model = _model(**({"indexer_types": types} if types else {}))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, 56), jnp.int32)
    window = _cached_window(model, tokens, jnp.arange(56))
    graphdef, main_p, idx_p, rest = ts.split_model(model)

    def loss(kind, batch):
        def f(trainable):
            return ts.stage_loss(kind)(ts.merge_stage(graphdef, kind, trainable, main_p, rest),
                                       batch)
        return jax.value_and_grad(f)(idx_p)

    want, want_g = loss("indexer_warmup", tokens[None])
    got, got_g = loss("indexer_cached", window)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(got_g)) > 0


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_cached_loss_at_sampled_rows_is_the_mean_over_those_rows():
    """Stratified rows: the loss is the warm-up's per-query KL averaged over the rows."""
    model = _model()
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, 64), jnp.int32)
    rows = jnp.asarray(stratified_rows(64, 8, seed=4, first=8))
    got = ts.cached_indexer_kl_loss(model, _cached_window(model, tokens, rows))
    everything = _cached_window(model, tokens, jnp.arange(64))
    per_query = []
    for layer in range(model.config.n_layers):
        q, w, k = model.layer(layer).indexer(everything["hidden"][layer], jnp.arange(64))
        p = everything["target"][layer]
        per_query.append([ts.indexer_kl(q[r:r + 1], w[r:r + 1], k, p[r:r + 1],
                                        jnp.asarray([r])) for r in np.asarray(rows)])
    np.testing.assert_allclose(got, np.mean(per_query), rtol=1e-5)


def test_rows_are_stratified_and_spans_repeat_where_recorded():
    rows = stratified_rows(1000, 10, seed=2, first=100)
    assert len(rows) == 10 and np.all(np.diff(rows) > 0)
    assert np.all((rows >= 100 + 90 * np.arange(10)) & (rows < 100 + 90 * np.arange(1, 11)))
    base = np.arange(1000)
    out, placed = repeat_spans(base, np.random.default_rng(0), spans=4, span_tokens=(5, 20))
    assert len(placed) == 4
    src, dst, n = placed[-1]
    assert 5 <= n <= 20 and dst >= src + n
    np.testing.assert_array_equal(out[dst:dst + n], base[src:src + n])
    with pytest.raises(ValueError, match=r"WindowPlan.rows must be in \[1, "):
        WindowPlan(length=64, rows=65)
    with pytest.raises(ValueError, match="WindowPlan.repeat_share"):
        WindowPlan(length=64, rows=4, repeat_share=1.5)


def test_copy_distance_puts_every_source_that_far_back():
    """--copy-distance: each copy's source lies [lo, hi] tokens before it (the default draw
    makes far copies rare), and a range a span cannot fit is refused by name."""
    base = np.arange(4096)
    out, placed = repeat_spans(base, np.random.default_rng(3), spans=32, span_tokens=(4, 64),
                               distance=(2048, 3072))
    assert len(placed) == 32
    for src, dst, n in placed:
        assert 2048 <= dst - src <= 3072 and src >= 0 and dst + n <= 4096
    src, dst, n = placed[-1]
    np.testing.assert_array_equal(out[dst:dst + n], base[src:src + n])
    _, near = repeat_spans(base, np.random.default_rng(3), spans=32, span_tokens=(4, 64))
    assert np.median([d - s for s, d, _ in near]) < 2048
    with pytest.raises(ValueError, match=r"WindowPlan.copy_distance \(lo, hi\) must satisfy"):
        WindowPlan(length=4096, rows=4, span_tokens=(4, 64), copy_distance=(32, 1024))
    with pytest.raises(ValueError, match="WindowPlan.copy_distance"):
        WindowPlan(length=4096, rows=4, span_tokens=(4, 64), copy_distance=(64, 4090))


def test_copy_rows_lie_inside_intact_copies_and_the_count_holds():
    """copy_rows puts that share of the rows where a copy's source predicts the next token
    (inside the copy, not its first token, the copy intact up to there); the rest stay
    stratified; the count never changes (a jitted step compiles once)."""
    rng = np.random.default_rng(5)
    base = rng.permutation(4000)[:2000]  # distinct tokens: a match is only a copy
    tokens, placed = repeat_spans(base, rng, spans=6, span_tokens=(8, 40))
    plan = WindowPlan(length=2000, rows=64, first_row=100, copy_rows=0.5)
    rows = window_rows(plan, tokens, placed, seed=3)
    assert len(rows) == 64 and np.all(np.diff(rows) > 0) and rows.min() >= 100
    inside = [r for r in rows if any(
        d < r < d + n and np.array_equal(tokens[d:r + 1], tokens[s:s + r + 1 - d])
        for s, d, n in placed)]
    assert len(inside) >= 32
    assert len(window_rows(WindowPlan(length=2000, rows=64, copy_rows=1.0), tokens,
                           placed[:1], seed=3)) == 64  # fewer copy positions than asked
    np.testing.assert_array_equal(window_rows(WindowPlan(length=2000, rows=64), tokens,
                                              placed, seed=3),
                                  stratified_rows(2000, 64, seed=3))
    with pytest.raises(ValueError, match="WindowPlan.copy_rows"):
        WindowPlan(length=512, rows=4, copy_rows=-0.1)


@pytest.mark.slow  # 5 s, the default tier's budget
def test_teacher_cache_round_trip_and_a_new_key_empties_it(tmp_path):
    model = _model()
    tokens = np.random.default_rng(2).integers(0, 256, 48).astype(np.int32)
    rows = stratified_rows(48, 6, seed=0)
    entry = make_teacher(model)(tokens, rows)
    assert entry["hidden"].shape == (2, 48, 64) and entry["target"].shape == (2, 6, 48)
    f32 = _cached_window(model, jnp.asarray(tokens), jnp.asarray(rows))
    np.testing.assert_allclose(entry["target"].astype(np.float32), f32["target"],
                               rtol=1e-2, atol=1e-3)
    cache = TeacherCache(tmp_path, dict(a=1))
    cache.write("w0", tokens, rows, entry, repeats=[[1, 2, 3]])
    back = cache.read("w0")
    np.testing.assert_array_equal(back["hidden"], entry["hidden"])
    np.testing.assert_array_equal(back["rows"], rows)
    assert back["meta"] == {"repeats": [[1, 2, 3]]}
    assert TeacherCache(tmp_path, dict(a=1)).has("w0")
    assert not TeacherCache(tmp_path, dict(a=2)).has("w0")


def test_a_reuse_pattern_trains_on_a_cache_of_every_layer():
    """The cache holds every layer's indexer input; a reuse pattern's kept layers take their
    slots, which is what the pattern's own teacher would have cached."""
    model = _model()
    shared = with_config(model, model.config.replace(indexer_types="FS"))
    tokens = np.random.default_rng(4).integers(0, 256, 40).astype(np.int32)
    rows = stratified_rows(40, 5, seed=1)
    entry = make_teacher(model)(tokens, rows)
    want = make_teacher(shared)(tokens, rows)
    got = retrofit.window_arrays(entry, full_layers(shared.config))
    assert got["hidden"].shape[0] == 1 and entry["hidden"].shape[0] == 2
    np.testing.assert_array_equal(np.asarray(got["hidden"]), want["hidden"])
    np.testing.assert_array_equal(np.asarray(got["target"]), want["target"])


def test_another_stages_teacher_cache_is_never_emptied(tmp_path):
    cache = TeacherCache(tmp_path, dict(a=1))
    cache.write("w0", np.zeros(4, np.int32), np.zeros(1, np.int32),
                dict(target=np.zeros((1, 1, 4), ml_dtypes.bfloat16)))
    with pytest.raises(ValueError, match="other settings .*a differ"):
        TeacherCache(tmp_path, dict(a=2), shared=True)
    assert TeacherCache(tmp_path, dict(a=1), shared=True).has("w0")


@pytest.mark.slow  # a tiny recipe run with its compilations
def test_recipe_trains_resumes_and_ships_a_stage(tmp_path, monkeypatch):
    gguf = tiny_training_setup(tmp_path, monkeypatch, retrofit)
    out = tmp_path / "stage"
    args = ["--model", gguf, "--out", str(out), "--seq-len", "128", "--windows", "3",
            "--rows", "16", "--heldout-rows", "32", "--spans", "2", "--span-tokens", "4,16",
            "--lr", "1e-2", "--warmup-steps", "1", "--patience", "5", "--copy-rows", "0.5"]
    retrofit.main([*args, "--epochs", "1"])
    first = json.loads((out / "warmup_log.json").read_text())
    assert first["steps"] == 3 and first["teacher_tokens"] == 3 * 128
    retrofit.main([*args, "--epochs", "3"])  # continues from the work folder: no new teacher
    log = json.loads((out / "warmup_log.json").read_text())
    assert log["steps"] == 9 and log["epochs"] == 3 and len(log["heldout_kl"]) == 4
    kls = [k for _, k in log["heldout_kl"]]
    assert min(kls[1:]) < kls[0]  # training lowers the held-out KL of fresh indexers
    assert set(log["heldout_kl_exact"]) == {"128", "2048"}
    for (_, parts), (_, kl) in zip(log["heldout_kl_parts"], log["heldout_kl"]):
        assert len(parts) == 2 and kl == pytest.approx(np.mean(parts))  # with the repeats
    meta = json.loads((out / "dsa.json").read_text())
    assert meta["config"]["attention"] == "sparse"
    assert meta["metadata"]["warmup"]["recipe"] == "teacher cache"
    assert (out / "indexer.safetensors").stat().st_size > 0
    # A reuse stage on the same teacher windows: no teacher pass, layer 1 reuses layer 0.
    reuse = tmp_path / "reuse"
    retrofit.main([*args[:2], "--out", str(reuse), *args[4:], "--epochs", "2", "--init", str(out),
                   "--teacher", str(tmp_path / "stage.work" / "teacher"),
                   "--indexer-types", "FS"])
    log = json.loads((reuse / "warmup_log.json").read_text())
    assert log["teacher_s"] == 0 and log["indexer_types"] == "FS" and log["steps"] == 6
    meta = json.loads((reuse / "dsa.json").read_text())
    assert meta["config"]["indexer_types"] == ["full", "shared"]
    names = safetensors.numpy.load_file(str(reuse / "indexer.safetensors"))
    assert {n.split(".")[1] for n in names} == {"0"}, sorted(names)  # layers.0.indexer...
