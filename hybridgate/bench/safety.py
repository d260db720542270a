"""The safety features' side of `hybridgate bench gateway`: TLS and auth against plaintext, side by side,
and the gateway's event-loop lag while large chat prompts arrive.

- `--tls`: a second gateway on the same instant worker serves TLS (a self-signed
  certificate made here with `cryptography`) and requires a bearer token; each
  concurrency runs plaintext then TLS, `--repeats` times alternately, and the
  report gives each one's median tokens/s and their ratio.
- `--large-chat-bytes N`: during each measured run, a thread of the bench process
  sends chat requests of N bytes and of N/2 bytes, alternately, one at a time,
  from their own connections (with the default model, 1 MiB is refused by its
  size bound at once, 512 KiB is rendered and tokenized in the gateway's prompt
  processes, then refused by its token count). The lag is read from the
  gateway's `hybridgate:event_loop_lag_seconds` histogram over the run: the
  fraction of probes within 20 ms and the p99 as a bucket bound.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import threading
import urllib.request
from pathlib import Path

TOKEN_ENV = "HYBRIDGATE_AUTH_TOKEN"
LAG = "hybridgate:event_loop_lag_seconds_bucket"


def self_signed(folder: str) -> tuple[str, str]:
    """(certificate, key) PEM paths of a new self-signed certificate for 127.0.0.1; the key has mode 0600."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hybridgate bench")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = Path(folder, "bench.pem"), Path(folder, "bench.key")
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def new_token() -> str:
    return secrets.token_urlsafe(24)


def lag_buckets(metrics_url: str) -> dict[float, float]:
    """Cumulative counts of the gateway's lag histogram by upper bound (seconds; inf last)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == LAG:
                out[float(s.labels["le"])] = s.value
    return dict(sorted(out.items()))


def lag_summary(before: dict[float, float], after: dict[float, float]) -> dict:
    """Over the window between two `lag_buckets`: probes, fraction within 20 ms, p99 and max as bucket bounds (ms)."""
    delta = {le: after[le] - before.get(le, 0.0) for le in after}
    count = delta.get(float("inf"), 0.0)
    if not count:
        return {"probes": 0, "within_20ms": None, "p99_ms_at_most": None, "max_ms_at_most": None}
    p99 = next(le for le, c in delta.items() if c >= 0.99 * count)
    worst = next(le for le, c in delta.items() if c >= count)
    return {"probes": int(count), "within_20ms": delta.get(0.02, 0.0) / count,
            "p99_ms_at_most": p99 * 1e3, "max_ms_at_most": worst * 1e3}


class LargeChats:
    """A thread sending chats of `size` and `size // 2` bytes alternately to `target`, one at a time, until
    `stop()`; counts the answers by status code. `tls_ca`, `token`: as the gateway requires."""

    def __init__(self, target: str, size: int, tls_ca: str | None = None, token: str | None = None):
        self.target, self.size, self.tls_ca, self.token = target, size, tls_ca, token
        self.answers: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import grpc

        from hybridgate.v1 import generation_pb2 as pb
        from hybridgate.v1 import generation_pb2_grpc as pb_grpc

        words = ("lighthouse", "keeper", "storm", "42", "über", "sea")
        text = " ".join(words[i % len(words)] for i in range(self.size // 4)).encode()
        k = 0
        while not self._stop.is_set():
            size = self.size if k % 2 == 0 else self.size // 2
            content = text[:size].decode("utf-8", errors="ignore")
            request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=content)]),
                                         max_tokens=8)
            options = [("grpc.max_send_message_length", 8 << 20)]
            channel = grpc.secure_channel(self.target, grpc.ssl_channel_credentials(Path(self.tls_ca).read_bytes()),
                                          options) if self.tls_ca else grpc.insecure_channel(self.target, options)
            metadata = (("authorization", f"Bearer {self.token}"),) if self.token else None
            with channel as ch:
                try:
                    list(pb_grpc.GenerationStub(ch).Generate(request, timeout=120, metadata=metadata))
                    code = "OK"
                except grpc.RpcError as exc:
                    code = exc.code().name
            key = f"{size} bytes: {code}"
            self.answers[key] = self.answers.get(key, 0) + 1
            k += 1

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join(180)
        return dict(self.answers)
