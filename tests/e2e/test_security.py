"""Auth, TLS, mutual TLS and CURVE end to end, and the refusals that guard them.

Real processes: one CPU worker (1 thread) bound on tcp:// with CURVE, and four
`hybridgate gateway`s on it: A (bearer token, TLS), M (mutual TLS), W (a wrong
CURVE key) and P (plaintext tcp, --insecure-tcp). Certificates are made here with
`cryptography` (a self-signed CA and certificates it signs); keys by
`hybridgate keys generate`.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from conftest import TIME_FACTOR, free_port
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.v1 import generation_pb2_grpc as pb_grpc
from procs import HYBRIDGATE, Proc

TOKEN = "tok-3f9a1c0d7e5b4a2f8c6d"
WRONG = "tok-00000000000000000000"
SERVICE = "hybridgate.v1.Generation"


# --- certificates ------------------------------------------------------------------------------


def _write(path: Path, data: bytes, mode: int = 0o644) -> str:
    path.write_bytes(data)
    os.chmod(path, mode)
    return str(path)


def _certificates(folder: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both signed by the CA (PEM paths)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def pem_key(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("hybridgate test CA")).issuer_name(name("hybridgate test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    out = {"ca": _write(folder / "ca.pem", ca.public_bytes(serialization.Encoding.PEM))}
    for who, san in (("server", x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                              x509.DNSName("localhost")])),
                     ("client", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(f"hybridgate test {who}")).issuer_name(ca.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1)))
        if san is not None:
            builder = builder.add_extension(san, critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        out[f"{who}_cert"] = _write(folder / f"{who}.pem", cert.public_bytes(serialization.Encoding.PEM))
        out[f"{who}_key"] = _write(folder / f"{who}.key", pem_key(key), 0o600)
    return out


# --- the processes -------------------------------------------------------------------------------


def _keys(folder: Path, name: str) -> str:
    path = folder / name
    out = subprocess.run([HYBRIDGATE, "keys", "generate", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and (path.stat().st_mode & 0o777) == 0o600, out.stdout + out.stderr
    return str(path)


def _gateway(folder: Path, name: str, model_path, endpoint: str, *extra: str, env=None) -> tuple[Proc, str]:
    proc = Proc(["gateway", "--model", str(model_path), "--port", "0", "--worker", endpoint, "--log-requests",
                 *extra], folder / f"{name}.log", env=env)
    port = proc.wait_for(r"gRPC on 127\.0\.0\.1:(\d+)").group(1)
    return proc, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def deployment(model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("security")
    certs = _certificates(folder)
    key, wrong_key = _keys(folder, "deploy.key"), _keys(folder, "other.key")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    worker = Proc(["worker", "--model", str(model_path), "--endpoint", endpoint, "--threads", "1",
                   "--curve-key", key], folder / "worker.log")
    procs = [worker]
    try:
        worker.wait_for(r"hybridgate worker: READY")
        a, a_target = _gateway(folder, "a", model_path, endpoint, "--curve-key", key, "--tls-cert",
                               certs["server_cert"], "--tls-key", certs["server_key"],
                               env={"HYBRIDGATE_AUTH_TOKEN": TOKEN})
        m, m_target = _gateway(folder, "m", model_path, endpoint, "--curve-key", key, "--tls-cert",
                               certs["server_cert"], "--tls-key", certs["server_key"], "--tls-client-ca", certs["ca"])
        w, w_target = _gateway(folder, "w", model_path, endpoint, "--curve-key", wrong_key)
        p, p_target = _gateway(folder, "p", model_path, endpoint, "--insecure-tcp")
        procs += [a, m, w, p]
        for proc in (a, m):
            proc.wait_for(r"hybridgate: READY \(cpu worker\)")
        yield dict(folder=folder, certs=certs, key=key, endpoint=endpoint, procs=procs,
                   a=a_target, m=m_target, w=w_target, p=p_target)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _tls(certs: dict, client_cert: bool = False) -> grpc.ChannelCredentials:
    def read(path: str) -> bytes:
        return Path(path).read_bytes()

    if client_cert:
        return grpc.ssl_channel_credentials(read(certs["ca"]), read(certs["client_key"]), read(certs["client_cert"]))
    return grpc.ssl_channel_credentials(read(certs["ca"]))


def _calls(channel: grpc.Channel, token: str | None) -> dict[str, object]:
    """Each RPC once, with `authorization: Bearer token` (none when None): its status code, or its answer."""
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else None
    timeout = 30 * TIME_FACTOR
    generation = pb_grpc.GenerationStub(channel)
    calls = {
        "Generate": lambda: list(generation.Generate(
            pb.GenerateRequest(prompt="Hello", max_tokens=2, ignore_eos=True, temperature=0),
            metadata=metadata, timeout=timeout)),
        "GetModelInfo": lambda: generation.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=timeout),
        "reflection": lambda: next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=metadata, timeout=timeout)),
        "health": lambda: health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE), metadata=metadata, timeout=timeout),
    }
    out = {}
    for name, call in calls.items():
        try:
            out[name] = call()
        except grpc.RpcError as exc:
            out[name] = exc.code()
    return out


def test_every_rpc_but_health_needs_the_token(deployment):
    channel = grpc.secure_channel(deployment["a"], _tls(deployment["certs"]))
    for token in (None, WRONG, ""):
        got = _calls(channel, token)
        assert {k: v for k, v in got.items() if k != "health"} == dict.fromkeys(
            ("Generate", "GetModelInfo", "reflection"), grpc.StatusCode.UNAUTHENTICATED), (token, got)
        assert got["health"].status == health_pb2.HealthCheckResponse.SERVING
    got = _calls(channel, TOKEN)
    assert sum(len(m.token_ids) for m in got["Generate"]) == 2
    assert [(w.endpoint, w.ready) for w in got["GetModelInfo"].workers] == [(deployment["endpoint"], True)]
    assert SERVICE in [s.name for s in got["reflection"].list_services_response.service]
    channel.close()


def test_tls_works_and_plaintext_to_it_fails(deployment):
    with grpc.insecure_channel(deployment["a"]) as plain:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5 * TIME_FACTOR)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    out = subprocess.run([HYBRIDGATE, "health", "--target", deployment["a"], "--tls-ca", deployment["certs"]["ca"]],
                         capture_output=True, text=True, timeout=60 * TIME_FACTOR)
    assert out.returncode == 0 and "SERVING" in out.stdout, out.stdout + out.stderr  # health needs no token
    # `hybridgate generate` over TLS, the token from the environment
    out = subprocess.run([HYBRIDGATE, "generate", "--target", deployment["a"], "--tls-ca", deployment["certs"]["ca"],
                          "--max-tokens", "3", "--ignore-eos", "--temperature", "0", "Hello"],
                         capture_output=True, text=True, timeout=60 * TIME_FACTOR,
                         env=dict(os.environ, HYBRIDGATE_AUTH_TOKEN=TOKEN))
    assert out.returncode == 0 and "completion_tokens=3" in out.stderr, out.stderr
    out = subprocess.run([HYBRIDGATE, "generate", "--target", deployment["a"], "--tls-ca", deployment["certs"]["ca"],
                          "Hello"], capture_output=True, text=True, timeout=60 * TIME_FACTOR,
                         env={k: v for k, v in os.environ.items() if k != "HYBRIDGATE_AUTH_TOKEN"})
    assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr, out.stderr


def test_mutual_tls_refuses_a_client_without_a_certificate(deployment):
    certs = deployment["certs"]
    with grpc.secure_channel(deployment["m"], _tls(certs, client_cert=True)) as channel:
        got = _calls(channel, None)  # no token configured on M
        assert sum(len(m.token_ids) for m in got["Generate"]) == 2
    for credentials in (_tls(certs), None):
        channel = grpc.secure_channel(deployment["m"], credentials) if credentials else \
            grpc.insecure_channel(deployment["m"])
        with channel:
            with pytest.raises(grpc.RpcError) as info:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5 * TIME_FACTOR)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_curve_worker_ignores_a_gateway_without_its_key(deployment):
    # A and M hold the key and are READY on the worker (the fixture waited); W (another key) and P
    # (plaintext) have been connecting all along: give them a few more seconds, then look.
    time.sleep(1.0 * TIME_FACTOR)
    for target in (deployment["w"], deployment["p"]):
        with grpc.insecure_channel(target) as channel:
            info = pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10 * TIME_FACTOR)
            assert [w.ready for w in info.workers] == [False], info
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE))
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    # `hybridgate health --worker` (the container health check) probes it with the key, and fails without
    for extra, code, state in ((("--curve-key", deployment["key"]), 0, "READY"), ((), 1, "CONNECTING")):
        out = subprocess.run([HYBRIDGATE, "health", "--worker", deployment["endpoint"], "--timeout",
                              str(2 * TIME_FACTOR), *extra], capture_output=True, text=True, timeout=60 * TIME_FACTOR)
        assert out.returncode == code and out.stdout.strip().endswith(state), out.stdout + out.stderr


def _refused(*args: str) -> str:
    out = subprocess.run([HYBRIDGATE, *args], capture_output=True, text=True, timeout=120 * TIME_FACTOR)
    assert out.returncode == 2, out.stdout + out.stderr
    return out.stderr


def test_a_tcp_endpoint_without_keys_refuses_to_start(deployment, model_path):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    for args in (("worker", "--model", str(model_path), "--endpoint", endpoint, "--threads", "1"),
                 ("gateway", "--model", str(model_path), "--port", "0", "--worker", endpoint)):
        err = _refused(*args)
        assert endpoint in err and "--curve-key" in err and "--insecure-tcp" in err, err


def test_a_key_file_readable_by_others_is_refused(deployment, model_path):
    wide = deployment["folder"] / "wide.key"
    wide.write_bytes(Path(deployment["key"]).read_bytes())
    os.chmod(wide, 0o644)
    err = _refused("worker", "--model", str(model_path), "--endpoint", f"tcp://127.0.0.1:{free_port()}",
                   "--curve-key", str(wide))
    assert re.search(rf"--curve-key: {re.escape(str(wide))} has mode 0644.*0600", err), err
    os.chmod(deployment["certs"]["server_key"], 0o644)
    try:
        err = _refused("gateway", "--model", str(model_path), "--port", "0", "--worker", "ipc:///nonexistent/w",
                       "--tls-cert", deployment["certs"]["server_cert"], "--tls-key", deployment["certs"]["server_key"])
        assert "--tls-key" in err and "0644" in err, err
    finally:
        os.chmod(deployment["certs"]["server_key"], 0o600)


def test_no_secret_in_any_log_line(deployment):
    """Last in the module: every process's log so far, at INFO, with request logging on."""
    key_text = Path(deployment["key"]).read_text()
    secret_key = re.search(r'secret-key = "(.+)"', key_text).group(1)
    tls_key = Path(deployment["certs"]["server_key"]).read_text().splitlines()[1]  # a line of the key's base64
    logs = {proc.log.name: proc.text() for proc in deployment["procs"]}
    assert "request id=" in logs["a.log"]  # the request log did run
    for name, text in logs.items():
        for secret in (TOKEN, WRONG, secret_key, tls_key):
            assert secret not in text, (name, secret)
