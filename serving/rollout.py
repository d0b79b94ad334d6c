"""The rollout state of a canary deployment: which selection configuration (variant) is the
baseline, which is the canary, and the canary's share of new requests; promote, roll back
and set the share at run time; the recall guard.

A variant is one Engine of the same weights under other selection switches (serving.loading
builds them; variant 0 is the main config's, variant 1 the `canary:` block's). A request is
routed once, when it is admitted: `route` reads the state in one step and the request keeps
its variant (engine, prefix cache, metrics label) to its end, so a change applies to new
requests only and none runs on a half-changed config.

Routing: a stable hash (blake2b) of the client's X-Request-Id header, else the body's
`user`, else a server-generated id, mapped to [0, 1): below `share` -> canary. A retried
request with the same id lands on the same side. X-Dosa-Side forces a side.

Changes (POST /admin/rollout, serving.admin):
    set_share  the canary's share of new requests (0 stops routing to it)
    promote    the canary becomes the baseline (share 0); the old baseline stays loaded as
               the canary, so a rollback can restore it
    rollback   share > 0: share 0 (the canary gets no new requests); share 0 after a
               promote: the promote is undone (the previous baseline is the baseline again)
    guard_rollback  the guard's own rollback: share 0 when the canary's mean shadow recall
               over its last `guard_window` watched chunks is below `recall_floor`
The state lives in memory: a restart starts from the config file again.
"""

import collections
import dataclasses
import hashlib
import logging
import threading

log = logging.getLogger("serving.rollout")

SIDES = ("baseline", "canary")
ACTIONS = ("promote", "rollback", "set_share")
RECENT = 50  # watched chunks kept per variant for GET /admin/rollout


def route_fraction(key):
    """A request key's place in [0, 1): a stable hash (the same on every run and host)."""
    digest = hashlib.blake2b(str(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64


@dataclasses.dataclass(frozen=True)
class Variant:
    """One selection configuration: index of its engine, its model_version label, the
    selection switches it runs (for GET /admin/rollout and the change log)."""

    index: int
    model_version: str
    selection: dict


@dataclasses.dataclass(frozen=True)
class RolloutState:
    baseline: int
    canary: int | None
    share: float


class RolloutError(ValueError):
    """A change that cannot apply in the current state (the admin endpoint: 409)."""


class Rollout:
    def __init__(self, variants, *, share=0.0, recall_floor=None, guard_window=20,
                 on_change=None):
        """variants: [Variant] (one, or two: baseline and canary). on_change(action, old,
        new): called after each change (metrics)."""
        self.variants = list(variants)
        canary = 1 if len(self.variants) > 1 else None
        self.state = RolloutState(0, canary, float(share) if canary is not None else 0.0)
        self.recall_floor, self.guard_window = recall_floor, guard_window
        self.on_change = on_change
        self.changes = []  # (action, old, new) dicts, oldest first
        self._promoted_from = None  # the baseline a promote replaced (rollback restores it)
        self._lock = threading.Lock()
        self._recent = {v.index: collections.deque(maxlen=RECENT) for v in self.variants}
        self._guard = collections.deque(maxlen=guard_window)

    # ------------------------------------------------------------------ routing

    def route(self, key, forced=None):
        """-> (side, Variant) of a new request. key: its routing key (X-Request-Id, user or
        a server id); forced: None or a side (X-Dosa-Side). ValueError for a forced side
        that does not exist."""
        state = self.state  # one read: a concurrent change is seen whole or not at all
        if forced is not None:
            if forced not in SIDES:
                raise ValueError(f"X-Dosa-Side must be one of {list(SIDES)}, got {forced!r}")
            if forced == "canary" and state.canary is None:
                raise ValueError("X-Dosa-Side: canary, but no canary is configured (the "
                                 "serving config's canary block)")
            side = forced
        elif state.canary is not None and route_fraction(key) < state.share:
            side = "canary"
        else:
            side = "baseline"
        return side, self.variants[state.baseline if side == "baseline" else state.canary]

    # ------------------------------------------------------------------ changes

    def apply(self, action, share=None):
        """Applies a change -> (old, new) descriptions. RolloutError when it cannot apply
        (no canary; nothing to roll back), ValueError for a bad action or share."""
        with self._lock:
            old = self.state
            if action not in ACTIONS + ("guard_rollback",):
                raise ValueError(f"action must be one of {list(ACTIONS)}, got {action!r}")
            if old.canary is None:
                raise RolloutError(f"{action}: no canary is configured (the serving config's "
                                   "canary block)")
            if action == "set_share":
                if isinstance(share, bool) or not isinstance(share, (int, float)) \
                        or not 0.0 <= share <= 1.0:
                    raise ValueError(f"share must be a number in [0, 1], got {share!r}")
                new = dataclasses.replace(old, share=float(share))
            elif action == "promote":
                new = RolloutState(old.canary, old.baseline, 0.0)
                self._promoted_from = old.baseline
            elif action == "guard_rollback" or old.share > 0:
                new = dataclasses.replace(old, share=0.0)
            elif self._promoted_from is not None:
                new = RolloutState(self._promoted_from, old.baseline, 0.0)
                self._promoted_from = None
            else:
                raise RolloutError("rollback: nothing to roll back (the canary's share is "
                                   "already 0 and no promote is in effect)")
            self.state = new
            self._guard.clear()
            change = (action, self.describe(old), self.describe(new))
            self.changes.append(change)
        log.warning("rollout %s: %s -> %s", action, change[1], change[2])
        if self.on_change is not None:
            self.on_change(*change)
        return change[1], change[2]

    def observe(self, variant, recall):
        """A watched chunk's mean shadow recall on `variant`; the guard rolls the canary
        back when its last guard_window values average below recall_floor."""
        self._recent[variant].append(recall)
        state = self.state
        if self.recall_floor is None or variant != state.canary or state.share == 0:
            return
        self._guard.append(recall)
        if len(self._guard) == self.guard_window and \
                sum(self._guard) / len(self._guard) < self.recall_floor:
            log.warning("rollout guard: the canary's mean shadow recall over its last %d "
                        "watched chunks is %.4f < recall_floor %.4f", self.guard_window,
                        sum(self._guard) / len(self._guard), self.recall_floor)
            try:
                self.apply("guard_rollback")
            except RolloutError:
                pass

    # ------------------------------------------------------------------ reading

    def describe(self, state=None):
        state = self.state if state is None else state

        def side(index):
            if index is None:
                return None
            v = self.variants[index]
            return {"model_version": v.model_version, "selection": v.selection}

        return {"baseline": side(state.baseline), "canary": side(state.canary),
                "share": state.share}

    def recent_recall(self, variant):
        values = self._recent[variant]
        return (sum(values) / len(values)) if values else None

    def snapshot(self):
        """GET /admin/rollout's body."""
        state = self.state
        out = self.describe(state)
        for side, index in (("baseline", state.baseline), ("canary", state.canary)):
            if index is not None:
                out[side].update(recent_recall=self.recent_recall(index),
                                 watched_chunks=len(self._recent[index]))
        out.update(guard={"recall_floor": self.recall_floor, "guard_window": self.guard_window},
                   changes=len(self.changes), persisted=False)
        return out
