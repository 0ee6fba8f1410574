"""`gapserve frontend`: the OpenAI-compatible HTTP API (FastAPI + uvicorn) and the
client gRPC service, in one asyncio loop sharing one engine client (one session
stream to the scheduler), or with --scheduler-addresses one per data-parallel
replica behind the frontend's routing (frontend_svc/engine/replicas.py)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared.structured import compile_cache
from shared.config import frontend_parser, parse_args, tool_flags_problem
from shared.model_files.default_model import resolve_model
from shared.grpc_server import CHANNEL_OPTIONS, add_port
from shared.instance import HEADER as INSTANCE_HEADER
from shared.instance import health_service
from shared.link_security import LinkSecurity
from shared.ports import PortUnavailable, check_free, listening_socket
from shared.proto import generate_pb2_grpc

from frontend_svc.telemetry import observe
from frontend_svc.request.admission import Admission
from frontend_svc.api.auth import ApiKeys
from frontend_svc.request.caps import RequestCaps
from frontend_svc.request.context import Frontend
from frontend_svc.engine.drain import FLUSH_S, Drain, DrainGuard, DrainInterceptor
from frontend_svc.engine.engine_client import EngineClient
from frontend_svc.errors import EngineError
from frontend_svc.api.grpc_api import SERVICE_NAME, GenerationServicer
from frontend_svc.api.openai_api import build_app
from frontend_svc.engine.replica_router import RoutingRule
from frontend_svc.engine.replicas import ReplicaSet, check_endpoints
from frontend_svc.request.tokenizer import TextTokenizer
from frontend_svc.structured.tools import ToolConfig, load_template

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def main(argv: list[str] | None = None) -> int:
    parser = frontend_parser()
    args = parse_args(parser, argv)
    try:  # said before anything starts
        check_endpoints(args.scheduler_addresses or [args.scheduler_address],
                        args.kv_events_endpoints, args.kv_events_replay_endpoints)
    except ValueError as e:
        parser.error(str(e))
    if tool_flags_problem(args):
        parser.error(tool_flags_problem(args))
    try:  # both ports before anything is announced or loaded
        # --api-server-count N: N frontends share both ports on purpose
        shared = args.api_server_count > 1
        check_free(args.host, args.grpc_port, "--grpc-port", reuse_port=shared)
        http_socket = listening_socket(args.host, args.http_port, "--http-port",
                                       reuse_port=shared)
    except PortUnavailable as e:
        print(f"gapserve frontend: {e}", file=sys.stderr)
        return 2
    observe.setup(args)
    # a compile running past the bound no longer holds a compile thread
    compile_cache.CACHE.stuck_after_s = args.structured_outputs_compile_timeout_s
    model_dir = resolve_model(args.model)
    tokenizer = TextTokenizer.from_dir(model_dir)
    if args.chat_template:  # vLLM's --chat-template: replaces the model's for every chat
        tokenizer.chat_template = load_template(args.chat_template, tokenizer.special_tokens,
                                                "--chat-template")
    name = args.served_model_name or Path(model_dir).name
    try:
        asyncio.run(serve(args, tokenizer, name, str(model_dir), http_socket))
    except KeyboardInterrupt:
        pass
    except PortUnavailable as e:  # the gRPC port, taken since the check
        print(f"gapserve frontend: {e}", file=sys.stderr)
        return 2
    return 0


async def serve(args, tokenizer: TextTokenizer, served_model_name: str,
                model_path: str, http_socket: socket.socket) -> None:
    health_servicer = health.aio.HealthServicer()
    security = LinkSecurity.from_args(args)
    admission = Admission(args.max_queued_requests)
    drain = Drain()

    async def on_connection(serving: bool) -> None:
        serving = serving and not drain.draining  # a draining frontend stays NOT_SERVING
        if serving:  # the admission bound counts from the scheduler's running capacity
            try:
                admission.max_num_seqs = (await engine.get_status()).max_num_seqs
            except EngineError as exc:  # keep the last value; the bound stays finite
                observe.log.warning("no scheduler status for admission", error=exc.message)
            asyncio.get_running_loop().run_in_executor(fe.grammar_pool, fe.warm_grammar_vocab)
        for service in health_names:
            await health_servicer.set(service, SERVING if serving else NOT_SERVING)

    # `gapserve serve` asks for the instance's name: only its own child knows it
    health_names = ["", SERVICE_NAME, *([health_service(args.instance_id)]
                                        if args.instance_id else [])]
    engine = engine_for(args, on_connection, served_model_name, security)
    fe = Frontend(engine, tokenizer, served_model_name, model_path,
                  observe.Observer(served_model_name), ApiKeys.from_args(args),
                  RequestCaps.from_args(args), admission,
                  ThreadPoolExecutor(args.tokenizer_threads, thread_name_prefix="tokenize"),
                  tools=ToolConfig.from_args(args, tokenizer.chat_template),
                  compile_timeout_s=args.structured_outputs_compile_timeout_s)

    # a client's message is bounded like an HTTP body (--payload-limit); with
    # --api-server-count > 1, N frontends share the same ports; otherwise the port is
    # this process's alone (gRPC's default SO_REUSEPORT would share it with anyone)
    grpc_server = grpc.aio.server(interceptors=[DrainInterceptor(drain)], options=[
        *(o for o in CHANNEL_OPTIONS if o[0] != "grpc.max_receive_message_length"),
        ("grpc.max_receive_message_length", args.payload_limit),
        ("grpc.so_reuseport", 1 if args.api_server_count > 1 else 0)])
    generate_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(fe), grpc_server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], grpc_server)
    await on_connection(False)
    if args.api_server_count > 1:  # the others hold it too: no exclusive check
        if security.add_port(grpc_server, f"{args.host}:{args.grpc_port}") == 0:
            raise OSError(f"cannot bind {args.host}:{args.grpc_port}")
    else:
        add_port(grpc_server, security, args.host, args.grpc_port, "--grpc-port")
    await grpc_server.start()

    app = DrainGuard(build_app(fe, args.payload_limit), drain)
    http = HttpServer(uvicorn.Config(
        InstanceHeader(app, args.instance_id) if args.instance_id else app, host=args.host,
        port=args.http_port, log_level="warning", access_log=False,
        timeout_graceful_shutdown=FLUSH_S,  # the drain ran already: only a backstop
        ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    http_task = asyncio.create_task(http.serve(sockets=[http_socket]))
    engine_task = asyncio.create_task(engine.start())  # waits for the scheduler
    observe.log.info("frontend listening", http_port=args.http_port,
                     grpc_port=args.grpc_port, scheduler=engine.address,
                     data_parallel_routing=(args.data_parallel_routing
                                            if isinstance(engine, ReplicaSet) else None),
                     model=served_model_name, api_keys=len(fe.keys.keys),
                     priority_keys=len(fe.keys.priority_keys), grpc_tls=security.tls,
                     prefix_cache_scope=fe.keys.cache_scope if fe.keys.enabled else "global",
                     mtls=security.tls and security.ca is not None,
                     https=bool(args.ssl_certfile), max_queued_requests=args.max_queued_requests,
                     tool_call_parser=args.tool_call_parser,
                     enable_auto_tool_choice=args.enable_auto_tool_choice,
                     tools_template=fe.tools.template.origin if fe.tools.template else None,
                     trust_request_chat_template=args.trust_request_chat_template,
                     structured_outputs_compile_timeout_s=fe.compile_timeout_s)
    stop_task = asyncio.create_task(stop.wait())
    await asyncio.wait({http_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    if stop_task.done():  # SIGTERM: the ports stay open while running requests finish
        drain.draining = True
        await on_connection(False)
        await drain.run(admission, engine, args.drain_timeout_s)
    http.should_exit = True
    engine_task.cancel()
    await on_connection(False)
    await grpc_server.stop(grace=args.drain_timeout_s)  # open streams may finish
    await http_task
    await engine.close()
    fe.pool.shutdown(wait=False, cancel_futures=True)
    fe.utility_pool.shutdown(wait=False, cancel_futures=True)
    fe.grammar_pool.shutdown(wait=False, cancel_futures=True)
    observe.log.info("frontend stopped")


def engine_for(args, on_connection, model_name: str,
               security: LinkSecurity) -> EngineClient | ReplicaSet:
    """One scheduler's client, or with --scheduler-addresses (several) the replicas'."""
    addresses = args.scheduler_addresses or [args.scheduler_address]
    if len(addresses) == 1 and not args.kv_events_endpoints:
        return EngineClient(addresses[0], on_connection=on_connection,
                            model_name=model_name, security=security)
    return ReplicaSet(addresses, kv_endpoints=args.kv_events_endpoints,
                      replay_endpoints=args.kv_events_replay_endpoints,
                      rule=RoutingRule.from_args(args), on_connection=on_connection,
                      model_name=model_name, security=security)


class HttpServer(uvicorn.Server):
    """uvicorn's server without its signal handlers: on SIGTERM it would close the
    listening socket at once (and cut streams at its own timeout); the frontend
    drains first (frontend_svc/engine/drain.py), then sets should_exit."""

    def capture_signals(self):
        return contextlib.nullcontext()


class InstanceHeader:
    """ASGI: /health answers carry the --instance-id, so `gapserve serve` knows the
    answer came from its own frontend; status and body are unchanged for others."""

    def __init__(self, app, instance_id: str) -> None:
        self.app = app
        self.header = (INSTANCE_HEADER.encode(), instance_id.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/health":
            return await self.app(scope, receive, send)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


if __name__ == "__main__":
    sys.exit(main())
