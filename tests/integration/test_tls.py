"""TLS on every link, with a throwaway CA made here by the openssl CLI: the stack
runs with mutual TLS between its services (and HTTPS outside), a plaintext client
or a TLS client without a certificate signed by the CA cannot reach any gRPC
service, and a client holding one (plus the internal token, for inner services)
can."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.proto import engine_pb2, engine_pb2_grpc, generate_pb2, generate_pb2_grpc
from tests.integration.conftest import TINY_FLAGS, start_stack

TOKEN = "inner-secret"
pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def make_pki(where: Path) -> dict[str, Path]:
    """A CA, and one leaf for 127.0.0.1/localhost good for server and client auth;
    plus a second CA's leaf that the services must refuse."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=where, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (where / "leaf.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                    "extendedKeyUsage=serverAuth,clientAuth\n"
                                    "basicConstraints=CA:FALSE\n")
    for ca in ("ca", "rogue-ca"):
        run("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "1",
            "-subj", f"/CN={ca}")
        leaf = "leaf" if ca == "ca" else "rogue"
        run("req", *ec, "-keyout", f"{leaf}.key", "-out", f"{leaf}.csr", "-subj", "/CN=localhost")
        run("x509", "-req", "-in", f"{leaf}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-out", f"{leaf}.pem", "-days", "1", "-extfile", "leaf.ext")
    return {name: where / f"{name}" for name in
            ("ca.pem", "leaf.pem", "leaf.key", "rogue.pem", "rogue.key")}


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory, pki):
    stack = start_stack(tiny_model_dir, tmp_path_factory.mktemp("tls-stack"),
                        flags=[*TINY_FLAGS, "--tls-cert", str(pki["leaf.pem"]),
                               "--tls-key", str(pki["leaf.key"]), "--tls-ca", str(pki["ca.pem"]),
                               "--ssl-certfile", str(pki["leaf.pem"]),
                               "--ssl-keyfile", str(pki["leaf.key"]),
                               "--internal-token", TOKEN])
    yield stack
    stack.stop()


def tls_channel(address: str, pki, cert: str | None = "leaf") -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=pki["ca.pem"].read_bytes(),
        private_key=pki[f"{cert}.key"].read_bytes() if cert else None,
        certificate_chain=pki[f"{cert}.pem"].read_bytes() if cert else None)
    return grpc.secure_channel(address, creds)


def serving(channel: grpc.Channel) -> bool:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5)
    except grpc.RpcError:
        return False
    finally:
        channel.close()
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_https_api_serves_requests_that_crossed_every_mtls_link(stack, pki):
    url = f"https://127.0.0.1:{stack.http_port}"
    trust = ssl.create_default_context(cafile=str(pki["ca.pem"]))
    reply = httpx.post(url + "/v1/completions", verify=trust, timeout=60,
                       json={"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4


def test_only_clients_with_a_certificate_from_the_ca_reach_the_grpc_services(stack, pki):
    for address in (stack.worker_address, stack.scheduler_address, stack.grpc_address):
        assert not serving(grpc.insecure_channel(address)), address  # plaintext
        assert not serving(tls_channel(address, pki, cert=None)), address  # no client cert
        assert not serving(tls_channel(address, pki, cert="rogue")), address  # another CA
        assert serving(tls_channel(address, pki)), address


def test_an_mtls_client_still_needs_the_internal_token_for_the_scheduler(stack, pki):
    channel = tls_channel(stack.scheduler_address, pki)
    try:
        engine = engine_pb2_grpc.EngineStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            engine.GetStatus(engine_pb2.GetStatusRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        status = engine.GetStatus(engine_pb2.GetStatusRequest(), timeout=10,
                                  metadata=[("x-gapserve-internal-token", TOKEN)])
        assert status.num_kv_blocks > 0
    finally:
        channel.close()


def test_grpc_generate_over_mtls(stack, pki):
    channel = tls_channel(stack.grpc_address, pki)
    try:
        stub = generate_pb2_grpc.GenerationStub(channel)
        messages = list(stub.Generate(generate_pb2.GenerateRequest(
            token_ids={"ids": [1, 2, 3]},
            sampling_params={"max_tokens": 4, "ignore_eos": True}), timeout=60))
        assert messages[-1].final.usage.completion_tokens == 4
    finally:
        channel.close()
