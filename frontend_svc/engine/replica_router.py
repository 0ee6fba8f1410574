"""Which replica (scheduler + workers) a request goes to: the routing rule of the
frontend's data parallelism (docs/scale_out.md, "The built-in rule").
Pure logic over what the caller measured; no network, tested on its own.

`kv-aware` is SGLang's cache-aware rule (sglang-router's `cache_aware` policy, with
the defaults of the pinned sglang-router 0.3.2, `python -m sglang_router.launch_router
--help`), with the prefix match read from each replica's KV cache events
(frontend_svc/engine/kv_index.py) instead of a tree of the texts routed so far, and one
condition of ours on a miss (3a):

1. Imbalance first: when the busiest and the idlest replica differ by more than
   `balance_abs_threshold` requests AND the busiest holds more than
   `balance_rel_threshold` times the idlest's, the idlest takes it (a hot prefix must
   not pile every request onto one replica while the others idle).
2. Otherwise the replica holding the longest cached prefix of the prompt takes it,
   if that prefix covers more than `cache_threshold` of the prompt's tokens (among
   equal prefixes, the less loaded; then the lower index).
3. Otherwise (a miss):
   a. if the prompt's full blocks fit in the free room of some replicas' pools but
      not of others (room: the pool's blocks less those its events report cached and
      those of prompts just routed there), only those with room are considered: a new
      prefix does not evict another where it need not;
   b. among them the least loaded (SGLang's miss rule since sgl-project/sglang#14650;
      before it, the smallest tree, which sent every miss to a busy replica whose
      cache happened to be small); among equally loaded, the one with the fewest
      cached blocks (the smallest tree); then in turn (so short prompts one at a time
      do not all land on replica 0).

Without 3a a miss went by load alone, and at a few requests in flight that count
says nothing about where a new prefix fits: with 4 users in flight and 4 long system
prompts on 2 replicas, the first user of the last prompt went wherever a request had
just finished, often the replica already holding two prompts; three prompts in a pool
sized for two evicted one, whose users then matched nothing and split over both
replicas (docs/scale_out.md, "Where a new prefix goes"). Once every pool is full
(cached blocks are freed lazily, so a busy pool stays full) no replica has room and
3b decides alone.

Load is the requests this frontend has in flight on the replica plus what the
other frontends had there at the last poll of its scheduler (frontend_svc/engine/replicas.py,
`Replica.load`). `round-robin` takes the replicas in turn. Only replicas in routing
(session open, SERVING) are candidates; the caller filters.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import FrontendFlags
from shared.flag_spec import from_flags

POLICIES = ("kv-aware", "round-robin")
# why a replica was chosen: the `reason` of gapserve:requests_routed and the log line
REASONS = ("prefix", "balance", "room", "least-loaded", "smallest-cache", "tie",
           "round-robin")
_TURNS = 1 << 30  # more than any number of replicas: ties go round from the last winner

# sglang-router 0.3.2's own defaults (sglang_router/router_args.py; its Router class
# docstring still names older ones, 0.5 / 32 / 1.0001, which its CLI no longer uses)
CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5


@dataclass(frozen=True, slots=True)
class RoutingRule:
    policy: str = "kv-aware"
    cache_threshold: float = CACHE_THRESHOLD
    balance_abs_threshold: int = BALANCE_ABS_THRESHOLD
    balance_rel_threshold: float = BALANCE_REL_THRESHOLD

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, "
                             f"got {self.policy!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache threshold must be within [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance thresholds: absolute >= 0, relative >= 1")

    @classmethod
    def from_args(cls, args) -> RoutingRule:
        """From the frontend's routing flags (shared/config.py RoutingFlags), whose
        names carry the routing_ prefix a field of this class does not need."""
        return from_flags(cls, args, FrontendFlags, renames={
            "policy": "data_parallel_routing", "cache_threshold": "routing_cache_threshold",
            "balance_abs_threshold": "routing_balance_abs_threshold",
            "balance_rel_threshold": "routing_balance_rel_threshold"})


@dataclass(frozen=True, slots=True)
class Candidate:
    """One replica in routing, as measured at this request's arrival."""

    index: int
    load: int  # requests in flight there (ours, plus the other frontends' as last polled)
    matched_blocks: int = 0  # leading prompt blocks its prefix cache holds (or was sent)
    cached_blocks: int = 0  # blocks in its prefix cache, and those of prompts just sent
    room: int | None = None  # its pool's blocks less cached_blocks (None: unknown)


@dataclass(frozen=True, slots=True)
class Decision:
    index: int
    matched_tokens: int  # of the prompt, cached at the chosen replica (0 for round-robin)
    reason: str  # one of REASONS

    def matched_blocks(self, block_size: int) -> int:
        return self.matched_tokens // block_size if block_size else 0


class ReplicaRouter:
    def __init__(self, rule: RoutingRule = RoutingRule()) -> None:
        self.rule = rule
        self._turn = 0  # the index to try next among equals (and for round-robin)

    def choose(self, candidates: list[Candidate], num_prompt_tokens: int,
               block_size: int) -> Decision | None:
        """The replica for one request; None when no replica is in routing."""
        if not candidates:
            return None
        if self.rule.policy == "round-robin":
            return self._round_robin(candidates)
        rule = self.rule
        idlest = min(candidates, key=lambda c: (c.load, self._order(c)))
        busiest = max(c.load for c in candidates)
        if busiest - idlest.load > rule.balance_abs_threshold \
                and busiest > idlest.load * rule.balance_rel_threshold:
            return self._took(idlest, block_size, "balance")
        best = max(c.matched_blocks for c in candidates)
        if best and best * block_size > rule.cache_threshold * max(num_prompt_tokens, 1):
            holder = min((c for c in candidates if c.matched_blocks == best),
                         key=lambda c: (c.load, c.index))
            return _decision(holder, block_size, "prefix")
        # a miss: where the prompt's blocks fit without evicting, then by load, then
        # the smallest cache, then in turn
        need = num_prompt_tokens // block_size if block_size else 0
        fit = [c for c in candidates if c.room is not None and c.room >= need]
        if fit and len(fit) < len(candidates):
            if len(fit) == 1:
                return self._took(fit[0], block_size, "room")
            candidates = fit
        least = min(c.load for c in candidates)
        idle = [c for c in candidates if c.load == least]
        if len(idle) < len(candidates) and len(idle) == 1:
            return self._took(idle[0], block_size, "least-loaded")
        fewest = min(c.cached_blocks for c in idle)
        small = [c for c in idle if c.cached_blocks == fewest]
        if len(small) == 1:
            reason = "least-loaded" if len(idle) < len(candidates) else "smallest-cache"
            return self._took(small[0], block_size, reason)
        return self._took(min(small, key=self._order), block_size, "tie")

    def _order(self, c: Candidate) -> int:
        return (c.index - self._turn) % _TURNS

    def _took(self, c: Candidate, block_size: int, reason: str) -> Decision:
        self._turn = c.index + 1  # the next tie starts after it
        return _decision(c, block_size, reason)

    def _round_robin(self, candidates: list[Candidate]) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.index)
        chosen = next((c for c in ordered if c.index >= self._turn), ordered[0])
        self._turn = chosen.index + 1
        return Decision(chosen.index, 0, "round-robin")


def _decision(c: Candidate, block_size: int, reason: str) -> Decision:
    return Decision(c.index, c.matched_blocks * block_size, reason)
