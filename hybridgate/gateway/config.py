"""The gateway's settings: where it listens, its limits, authentication and TLS.

Data only (the settings root composes it); its checks read the token and key
files through `hybridgate.security.keys` and `hybridgate.gateway.auth`, which import
nothing but the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridgate.config import check_settings, setting
from hybridgate.gateway.auth import check_token
from hybridgate.security.keys import check_secret_mode, read_secret_file


@dataclass(frozen=True)
class GatewayConfig:
    host: str = setting("127.0.0.1", "address to listen on (loopback only by default)")
    port: int = setting(50051, "gRPC port (0 picks a free one)", low=0, high=65535)
    metrics_port: int | None = setting(None, "serve Prometheus metrics on this port (default: off)",
                                       low=0, high=65535)
    grace_s: float = setting(10.0, "seconds in-flight streams get to finish on SIGINT/SIGTERM",
                             flag="--grace-period", low=0)
    log_requests: bool = setting(False, "log one line per finished request: id, label, route, prompt and "
                                 "completion tokens, TTFT, total time, finish reason (never the prompt text)")
    log_request_text: bool = setting(False, "with log_requests, add each request's prompt text to its line")
    max_inflight_requests: int = setting(
        1024, "requests this gateway holds at once (accepted, not finished); one more is refused at once with "
              "RESOURCE_EXHAUSTED and a grpc-retry-pushback-ms trailer", low=1)
    http_port: int | None = setting(
        8000, "port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health, "
              "/metrics) on --host; 0 picks a free one; an empty value turns it off", low=0, high=65535)
    served_model_name: tuple[str, ...] = setting(
        (), "the model name(s) the APIs answer to and report (GetModelInfo, /v1/models, the metrics' model_info; "
            "the first is the name; repeat for aliases): default the GGUF file's stem (spaces and other "
            "characters outside letters, digits and . _ - as -), with its general.name as an alias")
    allow_client_routes: bool = setting(
        False, "honour a request's `route` field (gpu, cpu, gpu->cpu): an operator's tool and the tests' handle; "
               "without it a route other than auto is INVALID_ARGUMENT")
    auth_token: str | None = setting(
        None, "require `authorization: Bearer TOKEN` on every call but health (UNAUTHENTICATED otherwise); "
              "prefer --auth-token-file or the variable, since a flag shows in the process list (default: off)",
        secret=True, check=check_token)
    auth_token_file: str | None = setting(
        None, "read the bearer token from this file (mode 0600 or narrower; surrounding whitespace dropped)")
    tls_cert: str | None = setting(None, "serve gRPC and the HTTP port over TLS with this PEM certificate chain (with --tls-key)")
    tls_key: str | None = setting(None, "the PEM private key of --tls-cert (mode 0600 or narrower)")
    tls_client_ca: str | None = setting(
        None, "mutual TLS: PEM CA certificates that clients' certificates must chain to; a client without "
              "one is refused in the handshake (needs --tls-cert)")

    def __post_init__(self) -> None:
        check_settings(self)
        if self.auth_token_file:
            token = read_secret_file(self.auth_token_file, "--auth-token-file")
            if self.auth_token not in (None, "", token):  # equal: a copy made by dataclasses.replace
                raise ValueError("--auth-token and --auth-token-file: give one of them, not both")
            try:
                check_token(token)
            except ValueError as exc:
                raise ValueError(f"--auth-token-file: the token in {self.auth_token_file} {exc}") from None
            object.__setattr__(self, "auth_token", token)  # resolved once here: every door reads auth_token
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key: give both or neither")
        if self.tls_key:
            check_secret_mode(self.tls_key, "--tls-key")  # refused before anything starts
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca: mutual TLS needs TLS on the port (--tls-cert and --tls-key)")
