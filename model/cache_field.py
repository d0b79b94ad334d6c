"""What one cached array is (CacheField): the unit of model.cache's table of fields, and of
the attention kinds' own entries (model.attention_kinds), kept apart from both so that
each can name fields without importing the other."""

import dataclasses
import math
import operator
from collections.abc import Callable

PARTS = ("kv", "index")


@dataclasses.dataclass(frozen=True)
class CacheField:
    """part: "kv" | "index"; shape: config -> trailing dims; dtype: config -> dtype name;
    axes: logical axes of every dim, rows first (model.sharding); fill: an empty row's
    value. positions_per_row: the unit, as positions one row holds: 1 (a row per token), or
    the dotted name of the ModelConfig field that says (e.g. "hierarchical.block_size": a
    row per key block; a compressed cache names its compression ratio), or a tuple of such
    names whose product it is (a block of compressed entries). fixed_rows: None, or
    config -> a row count that does not grow with the positions cached (a ring of the last
    tokens, a layer's state: DeepSeek-V4's window and compressor tails); such a field is
    part of a request's state, not of its prefix."""

    part: str
    shape: Callable
    dtype: Callable
    axes: tuple
    fill: float = 0.0
    positions_per_row: int | str | tuple = 1
    fixed_rows: Callable | None = None

    @property
    def per_token(self):
        return self.positions_per_row == 1 and self.fixed_rows is None

    @property
    def is_state(self):
        return self.fixed_rows is not None

    def stride(self, config):
        """Positions one row holds, under `config`."""
        if isinstance(self.positions_per_row, int):
            return self.positions_per_row
        names = self.positions_per_row
        names = (names,) if isinstance(names, str) else names
        return math.prod(int(operator.attrgetter(n)(config)) for n in names)

    def rows(self, length, config):
        """Rows that hold the first `length` positions (a state field: its fixed rows)."""
        if self.fixed_rows is not None:
            return int(self.fixed_rows(config))
        return -(-int(length) // self.stride(config))


def model_dtype(config):
    return config.dtype
