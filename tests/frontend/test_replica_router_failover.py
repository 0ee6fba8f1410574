"""Data-parallel failover seen from the frontend, sessions simulated (no network):
a replica whose session breaks leaves routing, its open requests continue on
another replica as continuations on the same client queues, and a replica that
had nowhere to send them hands them over once another joins."""

import asyncio
import time

from frontend_svc.request.choice import Choice
from frontend_svc.engine import replicas as replicas_mod

from frontend_svc.engine.kv_index import KvIndex
from frontend_svc.engine.kv_subscriber import KvSubscriber
from frontend_svc.engine.replica_router import RoutingRule
from frontend_svc.engine.replicas import ReplicaSet, merge_status
from shared.proto import common_pb2, engine_pb2
from shared.types import ModelInfo, SamplingParams

INFO = ModelInfo("tiny", 100, 64, [2], 1, 1, 4, "float32", 32, 4)


def output(wire_id, tokens, finish=None):
    msg = engine_pb2.RequestOutput(request_id=wire_id, new_token_ids=tokens)
    if finish is not None:
        msg.finish_reason = finish
    return engine_pb2.EngineResponse(outputs=[msg])


def up(replicas: ReplicaSet, i: int) -> asyncio.Queue:
    """Replica i's session is open and its scheduler SERVING."""
    client = replicas.replicas[i].client
    client.model_info = INFO
    client.health.serving = True
    client._outbox = asyncio.Queue()
    client.connected.set()
    return client._outbox


def lose(replicas: ReplicaSet, i: int) -> None:
    """What EngineClient._run_sessions does when a session breaks."""
    client = replicas.replicas[i].client
    client.connected.clear()
    client._outbox = None
    client._suspend_all()


def two_replicas(policy="round-robin") -> ReplicaSet:
    return ReplicaSet(["127.0.0.1:1", "127.0.0.1:2"], rule=RoutingRule(policy=policy))


def test_open_requests_of_a_lost_replica_continue_on_the_other():
    async def body():
        replicas = two_replicas()
        out0, out1 = up(replicas, 0), up(replicas, 1)
        qa = replicas.add(Choice.for_prompt("a", [1, 2, 3], SamplingParams(max_tokens=10,
                                                                     seed=5)))
        qb = replicas.add(Choice.for_prompt("b", [4, 5], SamplingParams(max_tokens=10)))
        assert out0.get_nowait().add.request_id == "a"
        assert out1.get_nowait().add.request_id == "b"
        replicas.replicas[0].client._route(output("a", [7, 8]))
        lose(replicas, 0)
        assert [r.index for r in replicas.in_routing()] == [1]
        add = out1.get_nowait().add  # a's continuation, on replica 1
        assert list(add.prompt_token_ids) == [1, 2, 3, 7, 8]
        assert add.sampling_params.max_tokens == 8
        assert add.sampling_params.num_output_prefix_tokens == 2
        assert add.sampling_params.seed == 5
        assert replicas.replicas[0].client.num_active == 0
        assert replicas.replicas[0].failovers == 1
        replicas.replicas[1].client._route(output(add.request_id, [9],
                                                  common_pb2.FINISH_REASON_LENGTH))
        outs = [qa.get_nowait(), qa.get_nowait()]
        assert [o.new_token_ids for o in outs] == [[7, 8], [9]]
        assert all(o.req_id == "a" for o in outs) and outs[1].finished
        assert qb.empty() and replicas.num_active == 1  # b was never touched
        # new requests only go to the replica in routing
        replicas.add(Choice.for_prompt("c", [6], SamplingParams(max_tokens=2)))
        assert out1.get_nowait().add.request_id == "c"
        # an abort finds the replica that holds the request
        assert replicas.abort(["b"]) == 1
        assert list(out1.get_nowait().abort.request_ids) == ["b"]
        await replicas.close()
    asyncio.run(body())


def test_with_no_other_replica_requests_wait_and_move_when_one_joins():
    async def body():
        replicas = two_replicas()
        out0 = up(replicas, 0)
        replicas.add(Choice.for_prompt("a", [1, 2], SamplingParams(max_tokens=4)))
        out0.get_nowait()
        lose(replicas, 0)  # replica 1 never came up: nowhere to go
        assert replicas.replicas[0].client.num_active == 1
        out1 = up(replicas, 1)
        await replicas._changed(1, True)  # what EngineClient._notify calls
        add = out1.get_nowait().add
        assert list(add.prompt_token_ids) == [1, 2] and add.request_id != "a"
        assert replicas.replicas[0].client.num_active == 0
        assert replicas.replicas[0].client._resume_deadline is None
        await replicas.close()
    asyncio.run(body())


def test_a_replica_that_comes_back_rejoins_routing():
    async def body():
        replicas = two_replicas()
        up(replicas, 0), up(replicas, 1)
        lose(replicas, 1)
        assert [r.index for r in replicas.in_routing()] == [0]
        out1 = up(replicas, 1)
        await replicas._changed(1, True)
        for name in ("x", "y"):
            replicas.add(Choice.for_prompt(name, [1], SamplingParams(max_tokens=1)))
        assert out1.qsize() == 1  # round robin reaches it again
        await replicas.close()
    asyncio.run(body())


def test_status_of_replicas_is_summed_with_usage_over_all_blocks():
    a = engine_pb2.EngineStatus(num_running=2, num_waiting=0, max_num_seqs=8, num_kv_blocks=100,
                                kv_cache_usage=0.5, diagnosis="healthy", window_s=10,
                                worker_addresses="w0:1")
    b = engine_pb2.EngineStatus(num_running=3, num_waiting=4, max_num_seqs=8, num_kv_blocks=300,
                                kv_cache_usage=0.1, diagnosis="concurrency_capped", window_s=10,
                                worker_addresses="w1:1")
    s = merge_status([a, b])
    assert (s.num_running, s.num_waiting, s.max_num_seqs, s.num_kv_blocks) == (5, 4, 16, 400)
    assert abs(s.kv_cache_usage - 0.2) < 1e-9 and s.window_s == 10
    assert s.diagnosis == "concurrency_capped" and s.worker_addresses == "w0:1;w1:1"


def test_a_replica_that_lost_its_workers_hands_its_requests_over_after_aborting_them():
    async def body():
        replicas = two_replicas()
        out0, out1 = up(replicas, 0), up(replicas, 1)
        queue = replicas.add(Choice.for_prompt("a", [1, 2], SamplingParams(max_tokens=6)))
        out0.get_nowait()
        replicas.replicas[0].client._route(output("a", [3]))
        replicas.replicas[0].client.health.serving = False  # its scheduler: NOT_SERVING
        await replicas._changed(0, False)
        assert list(out0.get_nowait().abort.request_ids) == ["a"]  # freed over there
        add = out1.get_nowait().add
        assert list(add.prompt_token_ids) == [1, 2, 3] and add.sampling_params.max_tokens == 5
        replicas.replicas[0].client._route(output("a", [99]))  # late: dropped
        replicas.replicas[1].client._route(output(add.request_id, [4],
                                                  common_pb2.FINISH_REASON_LENGTH))
        assert [queue.get_nowait().new_token_ids for _ in range(2)] == [[3], [4]]
        await replicas.close()
    asyncio.run(body())


def test_the_route_span_names_the_replica_and_the_matched_prefix_in_the_requests_trace():
    import io

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from shared.telemetry import get_tracer, setup_telemetry, shutdown_tracing
    from shared.telemetry.logs import reset_logging
    from shared.telemetry.tracing import context_carrier
    from opentelemetry import trace

    exporter = InMemorySpanExporter()
    setup_telemetry("frontend-test", span_exporter=exporter, log_format="json",
                    log_stream=io.StringIO())
    try:
        async def body():
            replicas = two_replicas(policy="kv-aware")
            up(replicas, 0), up(replicas, 1)
            root = get_tracer("test").start_span("request")
            carrier = context_carrier(trace.set_span_in_context(root))
            choice = Choice.for_prompt("a", list(range(10)), SamplingParams(max_tokens=1))
            choice.trace_context = carrier
            replicas.add(choice)
            root.end()
            await replicas.close()
            return root
        root = asyncio.run(body())
        route = next(s for s in exporter.get_finished_spans() if s.name == "route")
        assert route.attributes["gapserve.replica"] == 0
        assert route.attributes["gapserve.routing.matched_prefix_tokens"] == 0
        assert route.attributes["gapserve.routing.reason"] == "tie"  # two idle, empty replicas
        assert route.context.trace_id == root.context.trace_id
        assert route.parent.span_id == root.context.span_id
    finally:
        shutdown_tracing()
        reset_logging()


def test_other_frontends_requests_at_a_replica_count_in_its_load():
    async def body():
        replicas = two_replicas(policy="kv-aware")
        out0, out1 = up(replicas, 0), up(replicas, 1)
        replicas.add(Choice.for_prompt("mine", [1], SamplingParams(max_tokens=1)))  # -> replica 0
        out0.get_nowait()
        r0, r1 = replicas.replicas
        # replica 1's scheduler runs 40 requests of other frontends; replica 0 just ours
        r0.polled(engine_pb2.EngineStatus(num_running=1), ours=1)
        r1.polled(engine_pb2.EngineStatus(num_running=30, num_waiting=10), ours=0)
        assert (r0.load, r1.load) == (1, 40)
        replicas.add(Choice.for_prompt("next", [2], SamplingParams(max_tokens=1)))
        assert out0.qsize() == 1 and out1.empty()  # the idler one by the whole count
        assert replicas.describe()[1]["others_in_flight"] == 40
        await replicas.close()
    asyncio.run(body())


def test_a_fresh_frontend_is_ready_once_every_replica_joined_then_while_any_is():
    """Serving before the last replica joined sent every early prefix to the first
    (benchmarks/data_parallel.py saw 3 of 4 system prompts land on one replica)."""
    async def body():
        replicas = two_replicas("kv-aware")
        replicas._started_at = time.monotonic()
        up(replicas, 0)
        replicas.replicas[0].client.ever_ready = True  # what EngineClient._notify records
        assert not replicas.ready  # replica 1 has not joined yet
        up(replicas, 1)
        replicas.replicas[1].client.ever_ready = True
        assert replicas.ready
        lose(replicas, 1)
        assert replicas.ready  # a lost replica's requests move to the other
        await replicas.close()
    asyncio.run(body())


def test_a_replica_that_never_joins_keeps_the_frontend_unready_only_for_the_grace():
    async def body():
        replicas = two_replicas("kv-aware")
        replicas._started_at = time.monotonic()
        up(replicas, 0)
        replicas.replicas[0].client.ever_ready = True
        assert not replicas.ready
        replicas._started_at -= replicas_mod.ALL_REPLICAS_GRACE_S
        assert replicas.ready
        await replicas.close()
    asyncio.run(body())


def test_the_room_estimate_follows_a_replica_s_polled_pool_size():
    """A replica whose scheduler took over a worker with another KV pool after a loss
    (scheduler.resize_kv_pool) reports the new size in its status: the router's room
    estimate reads it there, not the model info of when its session opened."""
    async def body():
        replicas = two_replicas(policy="kv-aware")
        up(replicas, 0), up(replicas, 1)
        for r in replicas.replicas:
            r.kv = KvSubscriber("inproc://unused", None, KvIndex(INFO.block_size))
        r0, r1 = replicas.replicas
        _, _, seen = replicas._choose([1, 2, 3], replicas.replicas)
        assert [c.room for c in seen] == [INFO.num_kv_blocks - 1] * 2  # the handshake's
        r0.polled(engine_pb2.EngineStatus(num_kv_blocks=20), ours=0)  # resized to 20
        r1.polled(engine_pb2.EngineStatus(num_kv_blocks=INFO.num_kv_blocks), ours=0)
        _, _, seen = replicas._choose([1, 2, 3], replicas.replicas)
        assert [c.room for c in seen] == [19, INFO.num_kv_blocks - 1]
        await replicas.close()
    asyncio.run(body())

