"""The one bucket rule of compiled shapes: context lengths round up to powers of two, and a
prefill runs in chunks whose padded size and key length are such buckets. The runner
prefills by it, serving warms up and labels metrics by it, the cost model counts by it.
Pure Python (no JAX)."""

from typing import NamedTuple

MIN_BUCKET = 256
MIN_CHUNK_BUCKET = 16


def length_bucket(n, minimum=MIN_BUCKET):
    """Smallest power of two >= max(n, minimum): compiled shapes stay few (log2 of the
    context) while compute stays within 2x of the real length."""
    return max(minimum, 1 << (int(n) - 1).bit_length())


def cache_positions(capacity, *, exact=False):
    """Positions of a cache made to hold `capacity`: its power-of-two bucket (caches of
    many sizes share programs), or, `exact`, `capacity` rounded up to a multiple of
    MIN_BUCKET, for a caller whose caches all have one capacity (the TTFT study: 8197
    positions are 8448, not 16384)."""
    if exact:
        return -(-int(capacity) // MIN_BUCKET) * MIN_BUCKET
    return length_bucket(capacity)


class Chunk(NamedTuple):
    """One step of a chunked prefill: tokens[offset:offset + length] at `position`, padded
    to `padded` rows, reading keys [0, kv_len) of the cache."""

    offset: int
    position: int
    length: int
    padded: int
    kv_len: int


def chunk_plan(n, *, start, capacity, chunk):
    """The chunks a prefill of n tokens at `start` into a cache of `capacity` positions runs
    (static shapes: padded and kv_len are powers of two, capped by the cache)."""
    plan = []
    for offset in range(0, n, chunk):
        length = min(chunk, n - offset)
        position = start + offset
        # Pad to a power-of-two bucket (few compiled shapes) but never past the cache:
        # dynamic_update_slice would clamp the write back over earlier positions.
        padded = min(chunk, length_bucket(length, minimum=MIN_CHUNK_BUCKET),
                     capacity - position)
        plan.append(Chunk(offset, position, length, padded,
                          min(capacity, length_bucket(position + padded))))
    return plan


def prefill_shapes(max_len, *, capacity, chunk):
    """Every (padded, kv_len) step shape chunk_plan gives prefills that end at or before
    max_len, from any start -> sorted list. Not listed: a last chunk the cache's end cuts
    below its bucket (capacity - position rows), which compiles on first use."""
    paddings = sorted({min(chunk, length_bucket(p, minimum=MIN_CHUNK_BUCKET))
                       for p in (1 << i for i in range(chunk.bit_length() + 1))})
    kv_lens = sorted({min(capacity, length_bucket(n))
                      for n in range(1, max(1, max_len) + 1, MIN_BUCKET)})
    return [(padded, kv_len) for kv_len in kv_lens for padded in paddings if padded <= kv_len]
