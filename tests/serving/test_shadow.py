"""Shadow recall (serving.shadow): the engine's recall and IoU of the deployed selection
against flat, on rows sampled from its own prefill pass, equal the offline evaluation's
(indexer.recall / indexer.iou on the same rows of the same prompt), and its programs are
compiled by the warm-up, not by the first watched request."""

import flax.nnx as nnx
import jax
import numpy as np
import pytest

import indexer
import model
from serving.engine import Engine
from serving.shadow import ShadowSampler, watched_layers


@pytest.fixture(scope="module")
def hierarchical():
    tiny = model.Transformer(model.get_config("tiny"), rngs=nnx.Rngs(1))
    # tiny: top_k 16, blocks of 8, a budget of 32 candidate tokens: recall < 1 past 32.
    return model.with_config(tiny, tiny.config.replace(indexer="hierarchical"))


class Compiles:
    """Counts backend compiles while active (jax.monitoring)."""

    def __init__(self):
        self.count = 0

    def __call__(self, event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        from jax._src import monitoring

        monitoring.unregister_event_duration_listener(self)


def watched_prefill(engine, prompt):
    state = engine.begin_prefill(prompt)
    while not state.done:
        engine.prefill_step(state)
    return state


@pytest.mark.slow
def test_the_warmup_compiles_the_shadow_programs(hierarchical):
    engine = Engine(hierarchical, max_context=256, slots=1,
                    shadow=ShadowSampler(1.0, 16, 1.0))
    engine.warmup(256)
    for n in (5, 64, 120, 250):
        with Compiles() as compiles:
            state = watched_prefill(engine, np.arange(n) % 256)
        assert compiles.count == 0, f"a watched prefill of {n} tokens compiled a program " \
                                    "the warm-up missed"
        assert len(state.shadow) == -(-n // 64)


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_shadow_recall_equals_offline_indexer_recall(hierarchical):
    engine = Engine(hierarchical, max_context=128, slots=1,
                    shadow=ShadowSampler(1.0, 16, 1.0))
    prompt = np.random.default_rng(0).integers(0, 256, 120)
    state = watched_prefill(engine, prompt)
    assert len(state.shadow) == 2  # both chunks of 64 tokens watched (rate 1)

    # Offline: the evaluation's route (a captured pass, the public API on its inputs).
    _, _, captured = model.ModelRunner(hierarchical).prefill(prompt,
                                                             capture=("indexer", "indices"))
    inputs, top_k = captured["indexer"], hierarchical.config.top_k
    flat = [np.asarray(indexer.flat_topk(inputs.q[i], inputs.w[i], inputs.k[i], top_k))
            for i in range(hierarchical.config.n_layers)]
    recalls = []
    for record in state.shadow:
        rows = list(record.positions)
        assert len(rows) == 16 and record.layers == (0, 1)
        for j, layer in enumerate(record.layers):
            deployed = captured["indices"][layer][rows]
            assert abs(record.recall[j] - indexer.recall(deployed, flat[layer][rows])) < 1e-6
            assert abs(record.iou[j] - indexer.iou(deployed, flat[layer][rows])) < 1e-6
            recalls.append(record.recall[j])
    assert min(recalls) < 1.0  # the budget is small: hierarchical misses some of flat's


def test_sampler_rate_budget_and_watched_layers():
    clock = [0.0]
    sampler = ShadowSampler(1.0, 4, 0.1, clock=lambda: clock[0])
    rows = sampler.plan(100, 64)
    assert len(rows) == 4 and rows.min() >= 100 and rows.max() < 164
    assert list(rows) == sorted(set(rows.tolist()))
    sampler.charge(2.0)  # 1 s of allowance (10 s x 0.1) spent twice over: in debt
    assert sampler.plan(0, 64) is None and sampler.skipped == 1
    clock[0] += 11.0  # 1.1 s of allowance back
    assert sampler.plan(0, 64) is not None
    assert ShadowSampler(0.0, 16, 0.05).plan(0, 64) is None
    off = ShadowSampler(0.25, 16, 1.0, seed=3)
    watched = sum(off.plan(0, 64) is not None for _ in range(400))
    assert 60 < watched < 140
    config = model.get_config("tiny", indexer="hierarchical", indexer_types="FS")
    assert watched_layers(config) == [(0, 0)]  # layer 1 attends to layer 0's selection
    assert watched_layers(config.replace(attention="dense")) == []
    assert watched_layers(config.replace(dense_layers=(0,))) == [(0, 1)]
