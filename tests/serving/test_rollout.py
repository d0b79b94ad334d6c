"""A canary rollout without a server (serving.rollout, serving.scheduler, serving.follower,
serving.config): stable routing by request id, a forced side, promote / rollback / set_share
and the recall guard, changes during concurrent requests (none lost, none run on two
configs), the leader's broadcast carrying each call's variant and shadow rows, and the
config's validation messages."""

import collections
import logging
import threading
import time

import numpy as np
import pytest

import model
from serving import follower
from serving.config import ServingConfig
from serving.engine import Prefill
from serving.rollout import Rollout, RolloutError, Variant, route_fraction
from serving.scheduler import Request, Scheduler


def two_sides(share=0.1, **kwargs):
    return Rollout([Variant(0, "base", {"indexer": "flat"}),
                    Variant(1, "cand", {"indexer": "hierarchical"})], share=share, **kwargs)


def test_share_0_1_routes_20_of_200_ids_the_same_way_every_run():
    ids = [f"req-{i}" for i in range(200)]
    sides = [two_sides().route(i)[0] for i in ids]
    canary = [i for i, side in zip(ids, sides) if side == "canary"]
    assert 10 <= len(canary) <= 30
    # A stable hash (blake2b), not Python's per-process one: the same ids on every run.
    assert len(canary) == 21 and canary[:3] == ["req-1", "req-6", "req-21"]
    assert [two_sides().route(i)[0] for i in ids] == sides
    assert all(two_sides().route(i)[1].model_version == "cand" for i in canary)
    assert 0.0 <= route_fraction("x") < 1.0 and route_fraction("x") == route_fraction("x")


def test_a_forced_side_wins_and_a_bad_one_is_refused():
    rollout = two_sides(share=0.0)
    assert rollout.route("req-1")[0] == "baseline"
    side, variant = rollout.route("req-1", forced="canary")
    assert (side, variant.index) == ("canary", 1)
    assert rollout.route("req-1", forced="baseline")[1].index == 0
    with pytest.raises(ValueError, match="X-Dosa-Side must be one of"):
        rollout.route("req-1", forced="both")
    alone = Rollout([Variant(0, "base", {})])
    with pytest.raises(ValueError, match="no canary is configured"):
        alone.route("r", forced="canary")
    with pytest.raises(RolloutError, match="no canary"):
        alone.apply("promote")


def test_promote_rollback_and_set_share_are_logged_and_counted(caplog):
    seen = []
    rollout = two_sides(share=0.1, on_change=lambda action, old, new: seen.append(action))
    with caplog.at_level(logging.WARNING, logger="serving.rollout"):
        old, new = rollout.apply("set_share", 0.5)
    assert (old["share"], new["share"]) == (0.1, 0.5)
    assert "rollout set_share" in caplog.text and "'share': 0.5" in caplog.text
    rollout.apply("promote")  # the canary is the baseline; the old baseline stays loaded
    assert (rollout.state.baseline, rollout.state.canary, rollout.state.share) == (1, 0, 0.0)
    assert rollout.route("any")[1].model_version == "cand"
    rollout.apply("rollback")  # share 0 after a promote: the promote is undone
    assert (rollout.state.baseline, rollout.state.canary) == (0, 1)
    rollout.apply("set_share", 0.2)
    rollout.apply("rollback")  # share > 0: the canary stops getting new requests
    assert (rollout.state.baseline, rollout.state.share) == (0, 0.0)
    with pytest.raises(RolloutError, match="nothing to roll back"):
        rollout.apply("rollback")
    with pytest.raises(ValueError, match=r"share must be a number in \[0, 1\]"):
        rollout.apply("set_share", 1.5)
    assert seen == ["set_share", "promote", "rollback", "set_share", "rollback"]
    snapshot = rollout.snapshot()
    assert snapshot["baseline"]["model_version"] == "base" and snapshot["changes"] == 5
    assert snapshot["persisted"] is False


def test_the_guard_rolls_the_canary_back_below_its_floor_only():
    rollout = two_sides(share=0.5, recall_floor=0.8, guard_window=3)
    for recall in (0.7, 0.75, 0.9):  # mean 0.78 < 0.8, but the baseline's values never count
        rollout.observe(0, 0.1)
        rollout.observe(1, recall)
    assert rollout.state.share == 0.0 and rollout.changes[-1][0] == "guard_rollback"
    assert rollout.snapshot()["canary"]["recent_recall"] == pytest.approx(0.7833333)
    ok = two_sides(share=0.5, recall_floor=0.69, guard_window=3)
    for recall in (0.82, 0.78, 0.69):  # the shipped model's own hierarchical recall
        ok.observe(1, recall)
    assert ok.state.share == 0.5
    assert two_sides().recall_floor is None  # off by default


class FakeEngine:
    """One variant's engine: it records which requests (by prompt) it ran."""

    n_slots = 2
    prefix_cache = None
    config = model.get_config("tiny")

    def __init__(self, name, ran):
        self.name, self.ran = name, ran

    def begin_prefill(self, tokens):
        self.ran[int(tokens[0])].add(("prefill", self.name))
        return Prefill(np.asarray(tokens), None, 0, 0)

    def prefill_step(self, state):
        state.position = len(state.tokens)

    def first_token(self, state, sampling):
        self.ran[int(state.tokens[0])].add(("first", self.name))
        return 1

    def cache_prompt(self, state):
        pass

    def insert(self, slot, state):
        pass

    def decode(self, batch):
        time.sleep(0.001)
        return {slot: 1 for slot in batch}


def test_changes_during_concurrent_requests_lose_none_and_split_none():
    ran = collections.defaultdict(set)
    scheduler = Scheduler([FakeEngine("base", ran), FakeEngine("cand", ran)])
    scheduler.start()
    rollout = two_sides(share=0.5)
    results, routed = {}, {}
    done = threading.Semaphore(0)

    def submit(i):
        side, variant = rollout.route(f"id-{i}")
        routed[i] = variant.model_version
        events = []

        def deliver(event):
            events.append(event)
            if event.kind != "token":
                results[i] = events
                done.release()

        scheduler.submit(Request(id=f"id-{i}", prompt=np.array([i, 7, 7]), max_tokens=20,
                                 deliver=deliver, variant=variant.index))

    def change():
        for action, share in [("promote", None), ("rollback", None), ("set_share", 0.3),
                              ("promote", None), ("set_share", 0.7), ("rollback", None),
                              ("rollback", None)]:
            time.sleep(0.005)
            rollout.apply(action, share)

    changer = threading.Thread(target=change)
    changer.start()
    threads = [threading.Thread(target=submit, args=(i,)) for i in range(60)]
    for t in threads:
        t.start()
        time.sleep(0.001)
    for t in threads:
        t.join()
    changer.join()
    for _ in range(60):
        assert done.acquire(timeout=10)
    scheduler.stop()
    assert len(results) == 60 and len(rollout.changes) == 7
    for i, events in results.items():  # every request finished, all its tokens out
        assert events[-1].kind == "done" and events[-1].finish_reason == "length", i
        assert sum(e.kind == "token" for e in events) == 20
        # One engine from its prefill to its end: the one of the side it was routed to.
        assert ran[i] == {("prefill", routed[i]), ("first", routed[i])}
    assert {routed[i] for i in results} == {"base", "cand"}


def test_the_leaders_broadcast_carries_each_calls_variant_and_shadow_rows(monkeypatch):
    wire = collections.deque()
    monkeypatch.setattr(follower, "_broadcast",
                        lambda tree, is_source: wire.append(tree) or tree)
    calls = []

    class Recording:
        n_slots = 1

        def __init__(self, name, rows=None):
            self.name, self.rows = name, rows

        def begin_prefill(self, tokens):
            calls.append((self.name, "begin", list(map(int, tokens))))
            return Prefill(np.asarray(tokens), None, 0, 0)

        def shadow_plan(self, state):
            return self.rows

        def prefill_step(self, state, rows="plan"):
            calls.append((self.name, "step", None if rows is None else list(map(int, rows))))

        def insert(self, slot, state):
            calls.append((self.name, "insert", slot))

    leaders = follower.Leader.group([Recording("base"), Recording("cand", np.array([3, 5]))])
    for leader in leaders:
        state = leader.begin_prefill([9, 8, 7, 6])
        leader.prefill_step(state)
        leader.insert(0, state)
    leaders[0].shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        leaders[1].begin_prefill([1])
    sent, calls[:] = list(calls), []
    monkeypatch.setattr(follower, "_broadcast", lambda tree, is_source: wire.popleft())
    followers = [Recording("base"), Recording("cand")]
    assert follower.follow(followers) == 6
    assert calls == sent  # the same calls on the same variants, rows included
    assert ("cand", "step", [3, 5]) in calls and ("base", "step", None) in calls


@pytest.mark.parametrize("values, message", [
    (dict(canary={"share": 1.5}), r"canary\.share must be a number in \[0, 1\], got 1\.5"),
    (dict(canary={"indexer": "exact"}), r"canary\.indexer must be null or one of"),
    (dict(canary={"top_k": 0}), r"canary\.top_k must be null or an integer in \[1, "),
    (dict(canary={"shares": 0.1}), r"canary: unknown CanaryConfig fields \['shares'\]"),
    (dict(canary={"recall_floor": 0}), r"canary\.recall_floor must be null or a number in "
                                       r"\(0, 1\]"),
    (dict(canary={"guard_window": 0}), r"canary\.guard_window must be an integer in \[1, "),
    (dict(canary=3), r"canary must be null or a mapping"),
    (dict(shadow_rate=1.2), r"shadow_rate must be null or a number in \[0, 1\]"),
    (dict(shadow_rows=0), r"shadow_rows must be an integer in \[1, 4096\]"),
    (dict(shadow_max_seconds_per_s=0), r"shadow_max_seconds_per_s must be a number in "
                                       r"\(0, 1\]"),
])
def test_config_errors_name_the_key_and_the_allowed_range(values, message):
    with pytest.raises(ValueError, match=message):
        ServingConfig(**values)


def test_a_canary_block_reads_case_insensitive_keys_and_sets_only_its_switches():
    config = ServingConfig(indexer="flat", canary={"INDEXER": "hierarchical",
                                                   "Candidate_Tokens": 4096, "share": 0.1,
                                                   "model_version": "v2"})
    assert config.canary.model_overrides() == {
        "indexer": "hierarchical",
        "hierarchical": {"candidate_tokens": 4096, "coarse_keep_ratio": None,
                         "length_budgets": None}}
    tiny = model.get_config("tiny")
    assert config.shadow_rate_for(tiny) == 0.0  # flat: nothing to watch
    assert config.canary.shadow_rate_for(tiny.replace(indexer="hierarchical")) == 0.1
    assert ServingConfig(shadow_rate=0.5).shadow_rate_for(tiny) == 0.5


def test_the_example_canary_config_is_the_default_with_a_watched_canary():
    from serving.config import DEFAULT_CONFIG, load_config

    default, canary = load_config(), load_config(DEFAULT_CONFIG.parent / "canary.yaml")
    assert canary.model_dump(exclude={"canary"}) == default.model_dump(exclude={"canary"})
    assert canary.canary.indexer == "hierarchical" and canary.canary.share == 0.1
    shipped = model.load_default_model()[0].config
    assert canary.canary.shadow_rate_for(shipped.replace(indexer="hierarchical")) == 0.1


def test_the_admin_endpoint_is_off_without_a_key_and_needs_it_otherwise():
    from fastapi.testclient import TestClient

    from serving.api import create_app
    from serving.service import Service
    from tests.serving.conftest import test_config

    off = TestClient(create_app(Service(test_config(api_key=None))))
    r = off.get("/admin/rollout")
    assert r.status_code == 403 and "set admin_key" in r.json()["error"]["message"]
    app = TestClient(create_app(Service(test_config(admin_key="admin"))))  # not loaded
    assert app.get("/admin/rollout", headers={"Authorization": "Bearer test-key"}
                   ).status_code == 401  # the API key is not the admin key
    r = app.post("/admin/rollout", headers={"Authorization": "Bearer admin"},
                 json={"action": "promote"})
    assert r.status_code == 503  # still loading: no rollout to change
