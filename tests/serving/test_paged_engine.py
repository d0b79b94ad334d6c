"""The paged cache served (tiny model, random weights): requests admitted by the pages they
need decode together past the slot layout's limit, each one's greedy tokens equal to the
model's own generation; a shared prompt prefix is held once, by reference; a pool too
small for every request at once makes them wait, never fail; the page pool's bookkeeping
(holds, LRU eviction of cached blocks, never of held ones)."""

import threading

import flax.nnx as nnx
import numpy as np
import pytest

import model
from serving.page_pool import PagePool
from serving.paged_engine import PagedEngine, batch_buckets
from serving.scheduler import Request, Scheduler

P = 64


@pytest.fixture(scope="module")
def tiny():
    return model.Transformer(model.get_config("tiny"), rngs=nnx.Rngs(5))


def _serve(engine, prompts, max_tokens):
    """Runs the prompts through a Scheduler at once -> (tokens per prompt, the most
    requests decoding together, the page counts seen at that moment)."""
    scheduler = Scheduler(engine)
    done, outputs = threading.Barrier(len(prompts) + 1, timeout=300), {}
    peak = {"running": 0, "counts": None}

    def deliver_for(i):
        def deliver(event):
            if event.kind == "token":
                outputs.setdefault(i, []).append(event.token)
                if len(scheduler.running) > peak["running"]:
                    peak["running"] = len(scheduler.running)
                    peak["counts"] = engine.page_counts()
            else:
                assert event.kind == "done", event
                threading.Thread(target=done.wait).start()
        return deliver

    requests = [Request(str(i), np.asarray(p, np.int32), max_tokens, deliver_for(i))
                for i, p in enumerate(prompts)]
    scheduler.start()
    for request in requests:
        scheduler.submit(request)
    done.wait()
    scheduler.stop()
    return [outputs[i] for i in range(len(prompts))], peak, requests


def _reference(net, prompt, max_tokens):
    return list(model.ModelRunner(net).generate(prompt, max_tokens))


def test_requests_past_the_slot_limit_decode_together_and_equal_generation(tiny):
    engine = PagedEngine(tiny, max_context=512, max_running=8, pool_pages=2 + 8 * 4,
                         page_tokens=P)
    engine.warmup(256)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, int(n)) for n in rng.integers(20, 200, 6)]
    # 40 tokens: each runs until the last has prefilled (one prefill chunk per turn)
    outputs, peak, _ = _serve(engine, prompts, 40)
    assert peak["running"] == 6  # the slot layout's default would have run 4
    for prompt, got in zip(prompts, outputs):
        assert got == _reference(tiny, prompt, 40)
    assert engine.page_counts()["in_use"] == 0  # every page given back


@pytest.mark.slow  # 9 s (serving.paged_bench's prefix part measures it on `small`)
def test_a_shared_prefix_is_held_once_and_prefill_starts_after_it(tiny):
    engine = PagedEngine(tiny, max_context=512, max_running=8, pool_pages=2 + 40,
                         page_tokens=P)
    rng = np.random.default_rng(1)
    shared = rng.integers(0, 256, 4 * P)
    first = np.concatenate([shared, rng.integers(0, 256, 10)])
    _serve(engine, [first], 4)  # caches the prefix's 4 pages
    tails = [rng.integers(0, 256, int(n)) for n in (5, 30, 70)]
    prompts = [np.concatenate([shared, t]) for t in tails]
    outputs, peak, requests = _serve(engine, prompts, 20)
    assert [r.cache_hit_tokens for r in requests] == [4 * P] * 3
    own = sum(-(-(len(t) + 20) // P) for t in tails)
    assert peak["running"] == 3
    assert peak["counts"]["in_use"] <= 4 + own  # the prefix's pages once, not three times
    assert peak["counts"]["shared"] == 4
    for prompt, got in zip(prompts, outputs):
        assert got == _reference(tiny, prompt, 20)


@pytest.mark.slow  # 11 s: three requests one after another
def test_a_pool_too_small_for_all_makes_requests_wait_not_fail(tiny):
    # 6 usable pages: one request of 200 + 30 tokens (4 pages) at a time
    engine = PagedEngine(tiny, max_context=256, max_running=4, pool_pages=2 + 6,
                         page_tokens=P, cache_prefixes=False)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, 200) for _ in range(3)]
    outputs, peak, requests = _serve(engine, prompts, 30)
    assert peak["running"] == 1
    assert all(r.finish_reason == "length" for r in requests)
    for prompt, got in zip(prompts, outputs):
        assert got == _reference(tiny, prompt, 30)
    with pytest.raises(ValueError, match="must hold one request of max_context .8 pages"):
        PagedEngine(tiny, max_context=512, max_running=4, pool_pages=2 + 6, page_tokens=P)


def test_page_pool_holds_shares_and_evicts_least_recent_unheld_blocks():
    pool = PagePool(2 + 4, 2)
    a = np.arange(6)
    pages = pool.allocate(3)
    pool.register(a, pages)  # blocks [0,1], [2,3], [4,5]
    hit, _ = pool.lookup(a, 5)  # at most 5 tokens: two blocks
    assert hit == pages[:2] and pool.counts()["shared"] == 2
    pool.release(hit)
    pool.release(pages)
    assert pool.counts() == {"in_use": 0, "shared": 0, "cached": 3, "free": 1}
    held, _ = pool.lookup(a, 2)  # holds block 0; blocks 1 and 2 stay evictable
    assert pool.allocate(4) is None  # 1 free + 2 evictable
    got = pool.allocate(3)
    assert pages[0] not in got and pool.counts()["cached"] == 0
    assert pool.lookup(a, 6)[0] == [pages[0]]  # the chain's tail went first
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([got[0]] * 2)


def test_batch_buckets():
    assert batch_buckets(64) == [4, 8, 16, 32, 64]
    assert batch_buckets(5) == [4, 8]
    assert batch_buckets(2) == [2]
