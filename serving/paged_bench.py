"""python -m serving.paged_bench [--parts decode,ttft,prefix,concurrency,load] [--indexer I]
[--out FILE]

The paged cache (cache_layout: paged) against the slot layout (slots), in one process on
one model (default: the shipped `small` checkpoint), through the engines and the scheduler
the server runs (no HTTP: what is compared is the cache, not the transport). Both layouts
get the cache memory of the slot layout's defaults: 4 slots of 32768 positions, and the
pool the same 131072 positions (512 pages of 256, plus the 2 reserved; at most 32
requests decoding). Parts:

  decode       one batched decode step at 4 running requests (positions 1000, 3000, 5000,
               7000), the two layouts' steps interleaved, median of 30 each.
  ttft         a cold 4096-token prompt's TTFT (prefill start -> first token), 5 runs of
               each layout interleaved, median.
  prefix       8 requests that share a 16K-token prefix (after one request cached it):
               their TTFT with the slot layout's host-copy hit against the paged layout's
               pages by reference, interleaved one request at a time; then the 8 at once on
               the paged layout: pages in use and shared at the peak.
  concurrency  24 requests with prompts uniform in 1K-8K tokens (seed 0), max_tokens what
               keeps prompts plus max_tokens under 90% of the 131072 positions (155),
               submitted at once: the most
               decoding together, pages in use, wall time, and each greedy output against
               the same request generated alone (ModelRunner.generate).
  load         200 requests, prompts uniform in 256-4K tokens, Poisson arrivals at 1 per s,
               every 10th client aborting after its 4th token: lost and failed requests,
               p50 / p99 TTFT, output tokens per second, and outputs against references
               (an aborted request's tokens against the start of its reference), each
               layout on the same load in turn.
  equality     (not in the default list) six 300-1500-token prompts at once on a paged
               engine of 2048 positions, greedy outputs against generation alone: the
               short check on a real model (--model smollm2-135m).

Prints one JSON object per part as it ends; --out writes all of them.
"""

import argparse
import json
import random
import statistics
import threading
import time

import numpy as np

SLOTS, CONTEXT, PAGE = 4, 32768, 256


def _text_tokens(tokenizer, rng, n):
    from serving.bench import make_text
    return np.asarray(tokenizer.encode(make_text(rng, 2 * n))[:n], np.int32)


def _prefix_cache():
    from serving.prefix_cache import PrefixCache
    return PrefixCache(PAGE, max_blocks=4096, max_bytes=8 << 30)


def reset(slots, paged):
    """Both engines as new: empty caches, pools and prefix caches (their programs kept)."""
    slots.prefix_cache = _prefix_cache()
    slots.reset_slots()
    paged.reset_slots()


def engines(net):
    """(slot Engine, PagedEngine) of the same cache memory, both warmed up for 16K keys."""
    from serving.engine import Engine
    from serving.paged_engine import PagedEngine

    slots = Engine(net, max_context=CONTEXT, slots=SLOTS, prefix_cache=_prefix_cache())
    paged = PagedEngine(net, max_context=CONTEXT, max_running=32, page_tokens=PAGE,
                        pool_pages=2 + SLOTS * CONTEXT // PAGE)
    for engine in (slots, paged):
        engine.warmup(16384 + 64)
    return slots, paged


def serve(engine, jobs, *, seconds=None):
    """Runs jobs [(arrival s, prompt, max_tokens, abort_after or None)] through a Scheduler
    -> (records, peak): records[i] = {tokens, ttft, finish}; peak = the most requests
    decoding together and the page counts then."""
    from serving.scheduler import Request, Scheduler

    scheduler = Scheduler(engine)
    records = [{"tokens": [], "ttft": None, "finish": None, "hit": None} for _ in jobs]
    peak = {"running": 0, "pages": None}
    left = threading.Semaphore(0)
    requests = []

    def deliver_for(i):
        def deliver(event):
            record = records[i]
            if event.kind == "token":
                record["tokens"].append(event.token)
                if record["ttft"] is None:
                    record["ttft"] = event.time - requests[i].arrival
                if jobs[i][3] is not None and len(record["tokens"]) == jobs[i][3]:
                    scheduler.cancel(requests[i])
                if len(scheduler.running) > peak["running"]:
                    peak["running"] = len(scheduler.running)
                    if hasattr(engine, "page_counts"):
                        peak["pages"] = engine.page_counts()
            else:
                record["finish"] = event.finish_reason or event.kind
                record["hit"] = requests[i].cache_hit_tokens
                left.release()
        return deliver

    scheduler.start()
    t0 = time.perf_counter()
    for i, (arrival, prompt, max_tokens, _) in enumerate(jobs):
        delay = t0 + arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        requests.append(Request(str(i), prompt, max_tokens, deliver_for(i)))
        scheduler.submit(requests[-1])
    for _ in jobs:
        left.acquire(timeout=seconds)
    wall = time.perf_counter() - t0
    scheduler.stop()
    return records, peak, wall


def references(net, jobs):
    import model
    runner = model.ModelRunner(net)
    return [list(runner.generate(prompt, max_tokens)) for _, prompt, max_tokens, _ in jobs]


def _equal(records, refs, jobs):
    """Requests whose tokens are their reference's (an aborted one's: its start)."""
    return sum(r["tokens"] == ref[:len(r["tokens"])] and (job[3] is not None
               or r["tokens"] == ref) for r, ref, job in zip(records, refs, jobs))


# ------------------------------------------------------------------ parts

def part_decode(net, tokenizer, slots, paged):
    from serving.engine import Sampling
    rng = random.Random(1)
    lengths = (1000, 3000, 5000, 7000)
    batch = {}
    for slot, n in enumerate(lengths):
        prompt = _text_tokens(tokenizer, rng, n)
        for engine in (slots, paged):
            state = engine.begin_prefill(prompt, 64) if engine is paged else \
                engine.begin_prefill(prompt)
            while not state.done:
                engine.prefill_step(state, None)
            engine.cache_prompt(state)
            engine.insert(slot, state)
        batch[slot] = (1, n, Sampling(), 1)
    times = {"slots": [], "paged": []}
    for _ in range(30):
        for name, engine in (("slots", slots), ("paged", paged)):
            t = time.perf_counter()
            engine.decode(batch)
            times[name].append(time.perf_counter() - t)
    for slot in batch:
        paged.release(slot)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"positions": lengths, "slots_ms": med["slots"], "paged_ms": med["paged"],
            "ratio": med["paged"] / med["slots"]}


def part_ttft(net, tokenizer, slots, paged):
    from serving.engine import Sampling
    rng = random.Random(2)
    times = {"slots": [], "paged": []}
    for _ in range(5):
        prompt = _text_tokens(tokenizer, rng, 4096)
        for name, engine in (("slots", slots), ("paged", paged)):
            t = time.perf_counter()
            state = engine.begin_prefill(prompt, 16) if name == "paged" else \
                engine.begin_prefill(prompt)
            while not state.done:
                engine.prefill_step(state, None)
            engine.first_token(state, Sampling())
            times[name].append(time.perf_counter() - t)
            if name == "paged":
                engine.discard(state)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"prompt_tokens": 4096, "slots_s": med["slots"], "paged_s": med["paged"],
            "ratio": med["paged"] / med["slots"], "runs": times}


def part_prefix(net, tokenizer, slots, paged):
    rng = random.Random(3)
    shared = _text_tokens(tokenizer, rng, 16384)
    first = [(0.0, np.concatenate([shared, _text_tokens(tokenizer, rng, 40)]), 4, None)]
    jobs = [(0.0, np.concatenate([shared, _text_tokens(tokenizer, rng, 20 + 10 * i)]), 16,
             None) for i in range(8)]
    ttft = {"slots": [], "paged": []}
    for engine in (slots, paged):  # each caches the prefix
        serve(engine, first)
    for job in jobs:  # one request at a time, the layouts interleaved
        for name, engine in (("slots", slots), ("paged", paged)):
            records, _, _ = serve(engine, [job])
            ttft[name].append(records[0]["ttft"])
    records, peak, _ = serve(paged, jobs)  # the 8 at once
    prefix_pages = len(shared) // PAGE
    tails = sum(-(-(len(p) + n) // PAGE) - prefix_pages for _, p, n, _ in jobs)
    refs = references(net, jobs)
    return dict(prefix_tokens=len(shared), requests=len(jobs),
                ttft_s={k: statistics.median(v) for k, v in ttft.items()},
                ttft_runs=ttft, hit_tokens=[r["hit"] for r in records],
                peak_running=peak["running"], peak_pages=peak["pages"],
                prefix_pages=prefix_pages, tail_pages=tails,
                outputs_equal=_equal(records, refs, jobs))


def part_concurrency(net, tokenizer, slots, paged):
    rng = np.random.default_rng(0)
    text_rng = random.Random(0)
    lengths = rng.integers(1024, 8193, 24)
    budget = int(0.9 * SLOTS * CONTEXT)
    # as many as the budget leaves: the first request still decodes when the last one's
    # prefill (one chunk per decode step) ends
    max_tokens = int((budget - lengths.sum()) // len(lengths))
    jobs = [(0.0, _text_tokens(tokenizer, text_rng, int(n)), max_tokens, None)
            for n in lengths]
    refs = references(net, jobs)
    out = {"requests": len(jobs), "prompt_tokens": int(lengths.sum()),
           "max_tokens": max_tokens, "cache_positions": SLOTS * CONTEXT}
    for name, engine in (("slots", slots), ("paged", paged)):
        records, peak, wall = serve(engine, jobs)
        generated = sum(len(r["tokens"]) for r in records)
        out[name] = {"peak_decoding": peak["running"], "peak_pages": peak["pages"],
                     "wall_s": wall, "output_tokens_per_s": generated / wall,
                     "outputs_equal": _equal(records, refs, jobs),
                     "failed": sum(r["finish"] not in ("length", "stop") for r in records)}
    return out


def part_load(net, tokenizer, slots, paged, n=200, rate=1.0):
    rng = np.random.default_rng(4)
    text_rng = random.Random(4)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    jobs = [(float(arrivals[i]), _text_tokens(tokenizer, text_rng, int(rng.integers(256, 4097))),
             int(rng.integers(8, 33)), 4 if i % 10 == 9 else None) for i in range(n)]
    refs = references(net, jobs)
    out = {"requests": n, "rate_per_s": rate, "aborting": sum(j[3] is not None for j in jobs)}
    for name, engine in (("slots", slots), ("paged", paged)):
        records, peak, wall = serve(engine, jobs, seconds=1800)
        ttfts = [r["ttft"] for r in records if r["ttft"] is not None]
        generated = sum(len(r["tokens"]) for r in records)
        out[name] = {
            "lost": sum(r["finish"] is None for r in records),
            "failed": sum(r["finish"] == "error" for r in records),
            "cancelled": sum(r["finish"] == "cancelled" for r in records),
            "ttft_p50_s": float(np.percentile(ttfts, 50)),
            "ttft_p99_s": float(np.percentile(ttfts, 99)),
            "output_tokens_per_s": generated / wall, "wall_s": wall,
            "peak_decoding": peak["running"],
            "outputs_equal": _equal(records, refs, jobs)}
    return out


def part_equality(net, tokenizer, slots=None, paged=None):
    """Six text prompts (300-1500 tokens) at once on a paged engine of 2048 positions
    (pages of 256, room for all six): greedy outputs against generation alone (the short
    check on a real pretrained model: --model smollm2-135m)."""
    from serving.paged_engine import PagedEngine
    rng = random.Random(5)
    engine = PagedEngine(net, max_context=2048, max_running=8, page_tokens=PAGE,
                         pool_pages=2 + 6 * 8)
    jobs = [(0.0, _text_tokens(tokenizer, rng, n), 24, None)
            for n in (300, 500, 700, 900, 1200, 1500)]
    records, peak, wall = serve(engine, jobs)
    return {"requests": len(jobs), "peak_decoding": peak["running"],
            "outputs_equal": _equal(records, references(net, jobs), jobs), "wall_s": wall}


PARTS = {"decode": part_decode, "ttft": part_ttft, "prefix": part_prefix,
         "concurrency": part_concurrency, "load": part_load, "equality": part_equality}
SELF_CONTAINED = {"equality"}  # builds its own engine


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--indexer", default=None, help="the model's selection (default: "
                        "the checkpoint's)")
    parser.add_argument("--parts", default=",".join(p for p in PARTS if p != "equality"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from serving.loading import load_model
    overrides = {} if args.indexer is None else {"indexer": args.indexer}
    loaded = load_model(args.model, overrides, context=CONTEXT)
    results = {"model": loaded.model_id, "indexer": loaded.model.config.indexer}
    parts = args.parts.split(",")
    for part in parts:
        if part not in PARTS:
            raise SystemExit(f"--parts: unknown part {part!r}; parts are {sorted(PARTS)}")
    slots = paged = None
    if set(parts) - SELF_CONTAINED:
        slots, paged = engines(loaded.model)
    for part in parts:
        if slots is not None:
            reset(slots, paged)
        t = time.perf_counter()
        results[part] = PARTS[part](loaded.model, loaded.tokenizer, slots, paged)
        results[part]["seconds"] = time.perf_counter() - t
        print(json.dumps({part: results[part]}, default=str), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
