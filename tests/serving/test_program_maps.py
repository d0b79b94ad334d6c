"""The memory-map budget (serving.program_maps): a server's warm-up stops compiling ahead at
its share of the kernel's cap on mappings, and between turns the compiled programs are
dropped when the process nears the cap, so no config makes the server die of an mmap
inside XLA (the default config with a hierarchical canary did, at warm-up)."""

import logging

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

import model
from serving import program_maps
from serving.engine import Engine
from serving.program_maps import COMPILE_EVENT, DROP_SHARE, WARM_SHARE, MapBudget


class FakeMaps:
    """A process's (mappings held, cap): clear_caches gives back all but `floor`."""

    def __init__(self, held, cap, floor=100):
        self.held, self.cap, self.floor, self.reads = held, cap, floor, 0

    def __call__(self):
        self.reads += 1
        return self.held, self.cap

    def clear(self):
        self.held = self.floor


def test_the_warm_up_shares_its_budget_and_programs_drop_near_the_cap(monkeypatch):
    maps = FakeMaps(1000, 10_000)
    monkeypatch.setattr(jax, "clear_caches", maps.clear)
    budget = MapBudget(usage=maps)
    warm_ceiling = WARM_SHARE * 10_000
    first = budget.warm_room_for(1, 2)  # the baseline: half of what the warm-up may add
    assert first()
    maps.held = 1000 + (warm_ceiling - 1000) / 2 + 1
    assert first()  # nothing compiled since the last look: /proc is not read again
    reads = maps.reads
    budget._on_event(COMPILE_EVENT, 0.5)
    assert not first() and maps.reads == reads + 1
    second = budget.warm_room_for(2, 2)  # the canary: the rest, up to WARM_SHARE
    assert second()
    maps.held = warm_ceiling + 1
    budget._on_event(COMPILE_EVENT, 0.5)
    assert not second()
    # Between turns: nothing happens under DROP_SHARE, or without a compile since the last
    # look; past it, after a compile, the programs are dropped, once.
    maps.held = DROP_SHARE * 10_000
    budget._on_event(COMPILE_EVENT, 0.5)
    assert not budget.check() and budget.drops == 0
    maps.held = DROP_SHARE * 10_000 + 1
    assert not budget.check()  # not read again: no compile since the last look
    budget._on_event(COMPILE_EVENT, 0.5)
    assert budget.check() and budget.drops == 1 and budget.usage() == (100, 10_000)
    assert not budget.check() and budget.drops == 1


def test_without_proc_nothing_is_limited():
    budget = MapBudget(usage=lambda: (0, 0))
    budget._on_event(COMPILE_EVENT, 0.5)
    assert budget.warm_room_for(1, 1)() and not budget.check()


def test_the_compile_event_is_what_jax_reports():
    x = jnp.ones(7).block_until_ready()
    budget = program_maps.MapBudget()
    seen = budget._compiles
    jax.jit(lambda x: x * 3 + 1).lower(x).compile()
    assert budget._compiles == seen + 1
    held, cap = program_maps.map_usage()
    assert held > 0 and cap > held  # Linux: what /proc says


def test_a_warm_up_out_of_room_stops_after_its_first_bucket_and_serves_the_rest(caplog):
    net = model.Transformer(model.get_config("tiny"), rngs=nnx.Rngs(2))
    engine = Engine(net, max_context=512, slots=2)
    asked = []

    def room():
        asked.append(1)
        return False

    with caplog.at_level(logging.WARNING, logger="serving.engine"):
        assert engine.warmup(512, room=room) == 1
    assert asked == [1]
    assert "warm-up stopped at 1 of 2 key-length buckets (up to 256 tokens)" in caplog.text
    # A prompt past the warmed bucket compiles its steps on first use.
    prompt = np.random.default_rng(0).integers(0, 256, 400)
    state = engine.begin_prefill(prompt)
    while not state.done:
        engine.prefill_step(state)
    want, _ = model.ModelRunner(net).prefill(prompt, capacity=512)
    np.testing.assert_allclose(np.asarray(state.logits), np.asarray(want), rtol=1e-5,
                               atol=1e-5)
