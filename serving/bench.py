"""python -m serving.bench --url URL --requests N --rate R --context-len L [--repeat-context]

Load test of a running server as its clients see it: N streaming completions with Poisson
arrivals at R requests/s (R = inf: all at once), prompts of L characters (the byte model: L
tokens plus BOS; the usage chunk reports the real token count). TTFT is measured as a client
does: the timer starts before the POST and stops at the first SSE chunk that carries
generated text (a chat stream's role-only chunk does not count). Prints one JSON object:
TTFT p50/p90/p99, inter-token latency, output tokens per second under load, errors and
lost requests. --repeat-context sends one shared context with a different question each
time (the prefix cache's case): the first request is cold, the rest can hit.
"""

import argparse
import asyncio
import json
import math
import random
import sys
import time

import httpx

WORDS = ("the of and to in is was that for on with as by at from his her an which this "
         "be are or had were not but all their one there has been its who they more if "
         "into time after two other than some these may only over such first new years "
         "river stone garden window letter morning number station music paper market "
         "silver orange winter harbor engine forest signal county bridge").split()


def make_text(rng, n_chars):
    """Seeded words, exactly n_chars characters."""
    words, size = [], 0
    while size < n_chars:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:n_chars]


def make_prompts(n, context_len, *, repeat_context, seed):
    rng = random.Random(seed)
    shared = make_text(rng, context_len)
    prompts = []
    for i in range(n):
        question = f"\nQuestion {i}: what comes next?\nAnswer:"
        context = shared if repeat_context else make_text(rng, context_len)
        prompts.append(context[:max(0, context_len - len(question))] + question)
    return prompts


def percentile(values, q):
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary(values, scale=1000.0):
    """p50 / p90 / p99 / mean / min / max, in ms for seconds (scale 1000)."""
    if not values:
        return None
    out = {f"p{q}": percentile(values, q) * scale for q in (50, 90, 99)}
    out.update(mean=sum(values) / len(values) * scale, min=min(values) * scale,
               max=max(values) * scale)
    return {k: round(v, 3) for k, v in out.items()}


async def one_request(client, path, body, chat):
    """Streams one request -> dict(start, ttft, chunk_times, end, usage, error)."""
    out = dict(ttft=None, chunk_times=[], usage=None, error=None, done=False)
    out["start"] = start = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                out["error"] = f"HTTP {response.status_code}: {text[:200]}"
                out["status"] = response.status_code
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    out["done"] = True
                    break
                event = json.loads(data)
                if "error" in event:
                    out["error"] = f"in-stream {event['error'].get('code')}: " \
                                   f"{event['error'].get('message')}"
                    continue
                if event.get("usage"):
                    out["usage"] = event["usage"]
                for choice in event.get("choices", []):
                    text = choice.get("delta", {}).get("content") if chat else choice.get("text")
                    if text:
                        now = time.perf_counter()
                        if out["ttft"] is None:
                            out["ttft"] = now - start
                        out["chunk_times"].append(now)
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        out["end"] = time.perf_counter()
    return out


async def run(args):
    prompts = make_prompts(args.requests, args.context_len, repeat_context=args.repeat_context,
                           seed=args.seed)
    rng = random.Random(args.seed + 1)
    chat = args.endpoint == "chat"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.requests + 10,
                          max_keepalive_connections=args.requests + 10)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout)) as client:
        tasks = []
        began = time.perf_counter()
        for i, prompt in enumerate(prompts):
            body = dict(max_tokens=args.max_tokens, temperature=args.temperature, stream=True,
                        stream_options={"include_usage": True}, ignore_eos=args.ignore_eos)
            if chat:
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
            tasks.append(asyncio.create_task(one_request(client, path, body, chat)))
            if i < len(prompts) - 1 and math.isfinite(args.rate):
                await asyncio.sleep(rng.expovariate(args.rate))
        results = await asyncio.gather(*tasks)
    return report(results, args, time.perf_counter() - began)


def report(results, args, wall):
    ok = [r for r in results if r["error"] is None and r["done"]]
    errors = {}
    for r in results:
        if r["error"] is not None:
            key = r["error"].split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    lost = sum(1 for r in results if r["error"] is None and not r["done"])
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    gaps = [b - a for r in ok for a, b in zip(r["chunk_times"], r["chunk_times"][1:])]
    tokens = sum((r["usage"] or {}).get("completion_tokens", len(r["chunk_times"]))
                 for r in ok)
    span = (max(r["end"] for r in results) - min(r["start"] for r in results)) if results else 0
    cached = [((r["usage"] or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
              for r in ok]
    prompt_tokens = [(r["usage"] or {}).get("prompt_tokens") for r in ok if r["usage"]]
    out = dict(
        url=args.url, endpoint=args.endpoint, requests=len(results), completed=len(ok),
        errors=sum(errors.values()), errors_by_kind=errors, lost=lost,
        rate_per_s=args.rate if math.isfinite(args.rate) else "inf",
        context_chars=args.context_len, repeat_context=args.repeat_context,
        max_tokens=args.max_tokens, wall_s=round(wall, 3),
        prompt_tokens_mean=round(sum(prompt_tokens) / len(prompt_tokens), 1)
        if prompt_tokens else None,
        cached_tokens_mean=round(sum(cached) / len(cached), 1) if cached else None,
        ttft_ms=summary(ttfts), inter_token_latency_ms=summary(gaps),
        output_tokens=tokens,
        output_tokens_per_s=round(tokens / span, 3) if span else None,
        requests_per_s=round(len(ok) / span, 3) if span else None)
    if args.repeat_context and ok and ok[0]["ttft"] is not None:
        first = min(ok, key=lambda r: r["start"])
        rest = [r["ttft"] for r in ok if r is not first and r["ttft"] is not None]
        out["ttft_first_ms"] = round(first["ttft"] * 1000, 3)
        out["ttft_rest_p50_ms"] = round(percentile(rest, 50) * 1000, 3) if rest else None
    return out


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m serving.bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--rate", type=float, default=1.0,
                        help="mean arrivals per second (Poisson); inf: all at once")
    parser.add_argument("--context-len", type=int, default=512, help="prompt characters")
    parser.add_argument("--repeat-context", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate max_tokens every time (a fixed output length)")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--api-key")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.context_len < 1 or args.max_tokens < 1 or args.rate <= 0:
        parser.error("--requests, --context-len, --max-tokens and --rate must be positive")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if result["errors"] == 0 and result["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
