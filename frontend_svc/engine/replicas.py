"""Data parallelism in the frontend (docs/deploy.md, "Data parallelism and routing"):
N replicas, each a scheduler with its own workers, one engine Session each
(frontend_svc/engine/engine_client.py), behind the interface of a single EngineClient, so
the APIs, the drain and /metrics do not know there are several.

- Routing: each request goes where the rule of frontend_svc/engine/replica_router.py says,
  from each replica's in-flight count here and the prefix its KV cache events say
  it holds (kv_subscriber.py feeding kv_index.py).
- Failover: a replica whose session breaks, or whose scheduler reports NOT_SERVING
  (it lost its workers), leaves routing at once, and its open requests continue on
  the others as continuations (aborted first at a scheduler still connected) (continuation.py:
  prompt + output so far, num_output_prefix_tokens for seeded sampling): the
  client's stream pauses, nothing is lost. When no other replica is in routing
  they wait for their own as before, and move as soon as any replica joins. A
  replica that comes back rejoins routing with an empty index (its cache is new).
- Observability: `gapserve:requests_routed{replica,reason}`,
  `gapserve:routed_prefix_tokens`, `gapserve:replicas_in_routing`,
  `gapserve:replica_failovers{replica}`; a `route` span in the request's trace with
  `gapserve.replica` and `gapserve.routing.matched_prefix_tokens`; a `routed` log
  line per request (the replica, the reason, what each candidate held and carried);
  the `replica_failover` log line; per-replica rows in /v1/status (`describe`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from prometheus_client import Counter, Gauge, Histogram

from shared.link_security import LinkSecurity
from shared.proto import engine_pb2
from shared.telemetry import extract_context, get_logger, get_tracer
from shared.types import ModelInfo

from frontend_svc.telemetry import vllm_metrics
from frontend_svc.request.choice import Choice
from frontend_svc.engine.engine_client import EngineClient, Item
from frontend_svc.errors import EngineError
from frontend_svc.engine.kv_index import KvIndex, block_keys
from frontend_svc.engine.kv_subscriber import KvSubscriber
from frontend_svc.telemetry.metrics import TOKEN_BUCKETS
from frontend_svc.engine.replica_router import Candidate, Decision, ReplicaRouter, RoutingRule

log = get_logger(component="replicas")
LOAD_POLL_S = 1.0  # how often each replica's own count of its requests is read
# a fresh frontend is ready once every replica is in routing (as vLLM's data
# parallelism starts serving with all its engines), or this long after its start with
# at least one: a replica that never comes does not keep the others out of service
ALL_REPLICAS_GRACE_S = 60.0
_tracer = get_tracer("gapserve.frontend")

ROUTED = Counter("gapserve:requests_routed", "Requests (choices) sent to each data-parallel "
                 "replica, by the rule that chose it (frontend_svc/engine/replica_router.py).",
                 ["model_name", "replica", "reason"])
ROUTED_PREFIX = Histogram("gapserve:routed_prefix_tokens", "Prompt tokens the chosen replica "
                          "held in its prefix cache, by its KV events, when routed.",
                          ["model_name"], buckets=[0, *TOKEN_BUCKETS])
IN_ROUTING = Gauge("gapserve:replicas_in_routing", "Data-parallel replicas this frontend "
                   "routes to (session open, scheduler SERVING).", ["model_name"],
                   multiprocess_mode="max")
FAILOVERS = Counter("gapserve:replica_failovers", "Open requests moved from a lost "
                    "replica to another as continuations.", ["model_name", "replica"])


@dataclass(slots=True)
class Replica:
    index: int
    client: EngineClient
    kv: KvSubscriber | None = None  # started once the block size is known
    kv_endpoint: str | None = None
    replay_endpoint: str | None = None
    kv_task: asyncio.Task | None = None
    routed: int = 0
    failovers: int = 0  # requests moved away from it
    status: engine_pb2.EngineStatus | None = None  # the last one read
    others: int = 0  # requests other frontends had there at the last load poll

    @property
    def cached_blocks(self) -> int:
        return self.kv.index.num_blocks if self.kv is not None else 0

    @property
    def load(self) -> int:
        """Requests on this replica: ours, counted exactly, plus the other frontends'
        (--api-server-count, other Deployments) as its scheduler last reported."""
        return self.client.num_active + self.others

    @property
    def pool_blocks(self) -> int | None:
        """The replica's KV pool in blocks: its last polled status's, which follows a
        pool resized when a worker came back with another (scheduler.resize_kv_pool);
        before the first poll, the handshake's model info; None when neither came."""
        if self.status is not None and self.status.num_kv_blocks:
            return self.status.num_kv_blocks
        info = self.client.model_info
        return info.num_kv_blocks if info is not None else None

    def polled(self, status: engine_pb2.EngineStatus, ours: int) -> None:
        """A status read while `ours` of this frontend's requests were open there."""
        self.status = status
        self.others = max(0, status.num_running + status.num_waiting - ours)


def check_endpoints(addresses: list[str], kv_endpoints: list[str],
                    replay_endpoints: list[str]) -> None:
    """One KV events (and replay) endpoint per scheduler, in the same order, or none."""
    if not addresses:
        raise ValueError("data parallelism needs at least one scheduler address")
    for what, given in (("--kv-events-endpoints", kv_endpoints),
                        ("--kv-events-replay-endpoints", replay_endpoints)):
        if given and len(given) != len(addresses):
            raise ValueError(f"{what}: {len(given)} given for {len(addresses)} scheduler "
                             f"address(es); one each, in the order of --scheduler-addresses")


class ReplicaSet:
    def __init__(self, addresses: list[str], *, kv_endpoints: list[str] = (),
                 replay_endpoints: list[str] = (), rule: RoutingRule = RoutingRule(),
                 on_connection: Callable[[bool], Awaitable[None]] | None = None,
                 model_name: str = "", security: LinkSecurity | None = None,
                 kv_topic: str = "") -> None:
        check_endpoints(addresses, kv_endpoints, replay_endpoints)
        self.router = ReplicaRouter(rule)
        self.model_name = model_name
        self._on_connection = on_connection
        self._kv_topic = kv_topic
        self.replicas = [Replica(
            i, EngineClient(address, functools.partial(self._changed, i), model_name,
                            security, on_lost=self._lost),
            kv_endpoint=kv_endpoints[i] if kv_endpoints else None,
            replay_endpoint=replay_endpoints[i] if replay_endpoints else None)
            for i, address in enumerate(addresses)]
        self._start_tasks: list[asyncio.Task] = []
        # request id -> (the replica its prompt was routed to, the prompt's block keys):
        # held in that replica's index while the request is open there (kv_index.expect)
        self._holds: dict[str, tuple[Replica, list[bytes]]] = {}
        self._in_routing = IN_ROUTING.labels(model_name)
        self._all_joined = len(self.replicas) == 1  # every replica was in routing once
        self._started_at: float | None = None
        self._prefix_hist = ROUTED_PREFIX.labels(model_name)
        if rule.policy == "kv-aware" and not kv_endpoints:
            log.warning("kv_aware_routing_without_events",
                        reason="no --kv-events-endpoints: routing by load only")

    # ---- what an EngineClient offers the rest of the frontend

    @property
    def address(self) -> str:
        return ",".join(r.client.address for r in self.replicas)

    @property
    def model_info(self) -> ModelInfo | None:
        return next((r.client.model_info for r in self.replicas
                     if r.client.model_info is not None), None)

    @property
    def ready(self) -> bool:
        """Ready while any replica is in routing (a lost one's requests move to the
        others), but at start only once all are, or ALL_REPLICAS_GRACE_S has passed:
        a deployment that serves before its last replica joined sends every early
        request, and so every early prefix, to the first (the prefixes then stay
        there: a prefix-aware rule follows the cache)."""
        if not any(r.client.ready for r in self.replicas):
            return False
        if not self._all_joined:
            self._all_joined = all(r.client.ever_ready for r in self.replicas) or (
                self._started_at is not None
                and time.monotonic() - self._started_at >= ALL_REPLICAS_GRACE_S)
        return self._all_joined

    @property
    def ever_ready(self) -> bool:
        return any(r.client.ever_ready for r in self.replicas)

    @property
    def num_active(self) -> int:
        return sum(r.client.num_active for r in self.replicas)

    def in_routing(self) -> list[Replica]:
        return [r for r in self.replicas if r.client.ready]

    async def start(self) -> None:
        """Open every replica's session; returns once one is open (the others follow)."""
        self._started_at = time.monotonic()
        self._start_tasks = [asyncio.ensure_future(r.client.start()) for r in self.replicas]
        self._start_tasks.append(asyncio.ensure_future(self._grace_over()))
        self._start_tasks.append(asyncio.ensure_future(self._poll_load()))
        await asyncio.wait(self._start_tasks[:len(self.replicas)],
                           return_when=asyncio.FIRST_COMPLETED)

    async def _poll_load(self) -> None:
        """Every LOAD_POLL_S, each replica's running + waiting: what other frontends
        put there enters the load (a round trip per request would cost more)."""
        while True:
            await asyncio.sleep(LOAD_POLL_S)
            self._settle_ended()
            await self._read_statuses(LOAD_POLL_S)

    async def _grace_over(self) -> None:
        """Readiness may change with no replica changing (ready): tell the listener."""
        await asyncio.sleep(ALL_REPLICAS_GRACE_S)
        if not self._all_joined and self.ready:
            log.warning("replicas_missing_at_start", grace_s=ALL_REPLICAS_GRACE_S,
                        missing=[r.index for r in self.replicas if not r.client.ever_ready])
            if self._on_connection is not None:
                await self._on_connection(True)

    async def close(self) -> None:
        for task in self._start_tasks:
            task.cancel()
        for r in self.replicas:
            if r.kv_task is not None:
                r.kv_task.cancel()
        await asyncio.gather(*(r.client.close() for r in self.replicas))

    def add(self, choice: Choice) -> asyncio.Queue[Item]:
        req_id, prompt_token_ids = choice.req_id, choice.prompt_token_ids
        if any(r.client.holds(req_id) for r in self.replicas):
            raise EngineError(grpc.StatusCode.ALREADY_EXISTS, f"request {req_id!r} is running")
        replica, decision, candidates = self._route(prompt_token_ids)
        queue = replica.client.add(choice)
        self._hold(req_id, replica, prompt_token_ids)
        vllm_metrics.routed(req_id, replica.index)  # its vllm:* series: that engine's
        self._record(replica, decision, req_id, choice.trace_context, candidates)
        return queue

    def abort(self, req_ids: list[str]) -> int:
        found = 0
        for r in self.replicas:
            mine = [i for i in req_ids if r.client.holds(i)]
            if mine:
                found += r.client.abort(mine)
        for req_id in req_ids:
            self._settle(req_id)
            vllm_metrics.ended(req_id)
        return found

    def release(self, req_id: str) -> None:
        for r in self.replicas:
            if r.client.holds(req_id):
                r.client.release(req_id)
        self._settle(req_id)
        vllm_metrics.ended(req_id)

    def shutdown(self, error: EngineError) -> int:
        return sum(r.client.shutdown(error) for r in self.replicas)

    # ---- routing

    def _route(self, prompt: list[int]) -> tuple[Replica, Decision, list[Candidate]]:
        candidates = self.in_routing()
        if not candidates:  # none in routing: one that was up holds it until it is back
            candidates = [r for r in self.replicas if r.client.model_info is not None] \
                or self.replicas
        return self._choose(prompt, candidates)

    @property
    def _block_size(self) -> int:
        info = self.model_info
        return info.block_size if info is not None else 16

    def _keys(self, prompt: list[int]) -> list[bytes]:
        if self.router.rule.policy != "kv-aware":
            return []
        return block_keys(prompt, self._block_size)

    def _choose(self, prompt: list[int], candidates: list[Replica]
                ) -> tuple[Replica, Decision, list[Candidate]]:
        """The routing rule over `candidates` for `prompt` (a new request's, or a moved
        continuation's prompt + output), and what it saw of each candidate."""
        keys = self._keys(prompt)
        now = time.monotonic()
        seen = []
        for r in candidates:
            size = r.kv.index.size(now) if r.kv else 0
            pool = r.pool_blocks
            # the pool less what it caches (block 0 is the pool's own); unknown without
            # the replica's events or its pool's size
            room = max(pool - 1 - size, 0) if r.kv and pool is not None else None
            seen.append(Candidate(r.index, r.load, r.kv.index.match(keys, now) if r.kv else 0,
                                  size, room))
        decision = self.router.choose(seen, len(prompt), self._block_size)
        return self.replicas[decision.index], decision, seen

    def _hold(self, req_id: str, replica: Replica, prompt: list[int]) -> None:
        """The chosen replica is expected to hold the prompt's blocks while the request
        is open there (kv_index.expect), so a burst of one new prefix lands together."""
        if replica.kv is None:
            return
        keys = self._keys(prompt)
        if keys:
            replica.kv.index.expect(keys)
            self._holds[req_id] = (replica, keys)

    def _settle(self, req_id: str) -> None:
        held = self._holds.pop(req_id, None)
        if held is not None and held[0].kv is not None:
            held[0].kv.index.settle(held[1], time.monotonic())

    def _settle_ended(self) -> None:
        """Requests that ended without release() or abort() (a rejection, an error,
        a lost replica that gave up on them) let go of their holds here."""
        for req_id in [i for i, (r, _) in self._holds.items() if not r.client.holds(i)]:
            self._settle(req_id)
            vllm_metrics.ended(req_id)

    def _record(self, replica: Replica, decision: Decision, req_id: str,
                trace_context: dict[str, str] | None, candidates: list[Candidate]) -> None:
        replica.routed += 1
        ROUTED.labels(self.model_name, str(replica.index), decision.reason).inc()
        self._prefix_hist.observe(decision.matched_tokens)
        attributes = {"gapserve.replica": replica.index,
                      "gapserve.replica.address": replica.client.address,
                      "gapserve.routing.reason": decision.reason,
                      "gapserve.routing.matched_prefix_tokens": decision.matched_tokens}
        _tracer.start_span("route", context=extract_context(trace_context or {}),
                           attributes=attributes).end()
        log.info("routed", request_id=req_id, replica=replica.index, reason=decision.reason,
                 matched_blocks=decision.matched_blocks(self._block_size),
                 matched_prefix_tokens=decision.matched_tokens,
                 candidates=[{"replica": c.index, "load": c.load, "matched_blocks":
                              c.matched_blocks, "cached_blocks": c.cached_blocks,
                              "room": c.room} for c in candidates])

    # ---- replicas coming and going

    async def _changed(self, index: int, ready: bool) -> None:
        replica = self.replicas[index]
        if ready:
            self._start_kv(replica)
            self._rehome_stranded()
        elif replica.client.connected.is_set():  # session open, workers lost: health failed
            self._move_open(replica)
        self._in_routing.set(len(self.in_routing()))
        if self._on_connection is not None:
            await self._on_connection(self.ready)

    def _start_kv(self, replica: Replica) -> None:
        if replica.kv_endpoint is None or replica.kv is not None:
            return
        block_size = replica.client.model_info.block_size
        replica.kv = KvSubscriber(replica.kv_endpoint, replica.replay_endpoint,
                                  KvIndex(block_size), self._kv_topic, str(replica.index))
        replica.kv_task = asyncio.ensure_future(replica.kv.run())

    def _lost(self, client: EngineClient) -> None:
        """A replica's session broke (EngineClient calls this with no session open)."""
        replica = next(r for r in self.replicas if r.client is client)
        if replica.kv is not None:
            replica.kv.forget()
        self._in_routing.set(len(self.in_routing()))
        self._move_open(replica)

    def _rehome_stranded(self) -> None:
        """A replica joined: requests waiting on a replica that is still away move."""
        for replica in self.replicas:
            if not replica.client.ready and replica.client.num_active:
                self._move_open(replica)

    def _move_open(self, source: Replica) -> None:
        targets = [r for r in self.in_routing() if r is not source]
        if not targets:
            return  # nowhere to go: they wait for their own replica (or the next to join)
        moved = source.client.take_open()
        if not moved:
            return
        destinations: dict[int, int] = {}
        for open_ in moved:
            prompt = open_.prompt_token_ids + open_.generated
            target, _, _ = self._choose(prompt, targets)
            target.client.adopt(open_)
            self._settle(open_.req_id)
            self._hold(open_.req_id, target, prompt)
            vllm_metrics.routed(open_.req_id, target.index)
            destinations[target.index] = destinations.get(target.index, 0) + 1
        source.failovers += len(moved)
        FAILOVERS.labels(self.model_name, str(source.index)).inc(len(moved))
        log.warning("replica_failover", replica=source.index, address=source.client.address,
                    count=len(moved), to={str(k): v for k, v in destinations.items()})


    # ---- status

    async def get_status(self, timeout_s: float = 5.0) -> engine_pb2.EngineStatus:
        """Every reachable replica's status, summed (kv_cache_usage over all blocks; the
        diagnosis of the busiest replica); the rows stay for describe()."""
        good, replies = await self._read_statuses(timeout_s)
        if not good:
            error = next((e for e in replies if isinstance(e, EngineError)), None)
            raise error or EngineError(grpc.StatusCode.UNAVAILABLE, "no replica is connected")
        return merge_status(good)

    async def _read_statuses(self, timeout_s: float) -> tuple[list, list]:
        """GetStatus of every connected replica at once; each replica keeps its own."""
        reachable = [r for r in self.replicas if r.client.connected.is_set()]
        ours = [r.client.num_active for r in reachable]
        replies = await asyncio.gather(*(r.client.get_status(timeout_s) for r in reachable),
                                       return_exceptions=True)
        for r in self.replicas:
            if r not in reachable:
                r.status, r.others = None, 0
        good = []
        for r, mine, reply in zip(reachable, ours, replies):
            if isinstance(reply, engine_pb2.EngineStatus):
                r.polled(reply, mine)
                good.append(reply)
            else:
                r.status, r.others = None, 0
        return good, replies

    def describe(self) -> list[dict]:
        """One row per replica for /v1/status (as of the last get_status)."""
        rows = []
        for r in self.replicas:
            row = {"replica": r.index, "address": r.client.address,
                   "in_routing": r.client.ready, "connected": r.client.connected.is_set(),
                   "in_flight": r.client.num_active, "others_in_flight": r.others,
                   "routed": r.routed,
                   "failovers": r.failovers, "kv_events": r.kv_endpoint,
                   "cached_blocks": r.cached_blocks if r.kv is not None else None,
                   "kv_events_resets": r.kv.num_resets if r.kv is not None else None}
            if r.status is not None:
                row.update(num_running=r.status.num_running, num_waiting=r.status.num_waiting,
                           kv_cache_usage=r.status.kv_cache_usage,
                           diagnosis=r.status.diagnosis)
            rows.append(row)
        return rows


_FIRST_OF_BUSIEST = {"diagnosis", "summary", "lever", "admission_blocked_by"}


def merge_status(replies: list[engine_pb2.EngineStatus]) -> engine_pb2.EngineStatus:
    """One EngineStatus for several replicas: counts summed, usage over all blocks,
    the longest window, the busiest replica's diagnosis, every worker address."""
    busiest = max(replies, key=lambda s: (s.num_waiting, s.num_running))
    out = engine_pb2.EngineStatus()
    for f in out.DESCRIPTOR.fields:
        values = [getattr(s, f.name) for s in replies]
        if f.name in _FIRST_OF_BUSIEST:
            setattr(out, f.name, getattr(busiest, f.name))
        elif f.name == "worker_addresses":
            out.worker_addresses = ";".join(values)
        elif f.name == "window_s":
            out.window_s = max(values)
        elif f.name == "kv_cache_usage":
            total = sum(s.num_kv_blocks for s in replies)
            used = sum(s.kv_cache_usage * s.num_kv_blocks for s in replies)
            out.kv_cache_usage = used / total if total else 0.0
        elif f.type in (f.TYPE_STRING,):
            setattr(out, f.name, getattr(busiest, f.name))
        elif f.is_repeated:  # a numeric column (per position): summed per index
            width = max(len(v) for v in values)
            getattr(out, f.name).extend(sum(v[i] for v in values if i < len(v))
                                        for i in range(width))
        else:
            setattr(out, f.name, sum(values))
    return out
