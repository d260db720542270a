"""Secret files and CURVE keys for ZeroMQ over tcp.

Secrets are read only from files their owner alone can read (mode 0600 or
narrower): a token or key in a file others can read is no longer a secret, so
a wider mode is refused, naming the flag, the path and the mode, never the
content (OpenSSH refuses private keys the same way).

CURVE (ZeroMQ RFC 26, CurveZMQ; libzmq's implementation of it) encrypts and
authenticates every `tcp://` socket. One deployment shares one key pair, made
by `hybridgate keys generate` and given to every process as `--curve-key FILE`:
a worker binds as the CURVE server with it and, through a ZAP handler (ZeroMQ
RFC 27), admits only clients presenting the same public key; routers and GPU
workers connect as clients with it, and check the server's key against it. So
only holders of the file can talk to a worker, and a peer without it sees a
handshake that fails. `ipc://` sockets stay plain, inside the 0700 folder.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from hybridgate.config import check_settings, setting

ZAP_DOMAIN = b"hybridgate"


def check_secret_mode(path: str, flag: str) -> None:
    """Raises ValueError naming `flag`, `path` and the mode when `path` grants any access to group or
    others, or is not a regular file; OSError naming `flag` when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise OSError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{flag}: {path} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise ValueError(f"{flag}: {path} has mode {mode:04o}, readable beyond its owner; a secret file must "
                         f"have mode 0600 or narrower (chmod 600 {path})")


def read_secret_file(path: str, flag: str) -> str:
    """The text of `path`, stripped of surrounding whitespace, after `check_secret_mode`.
    Raises ValueError (also when it is empty) or OSError, naming `flag`; never showing the content."""
    check_secret_mode(path, flag)
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if not text:
        raise ValueError(f"{flag}: {path} is empty")
    return text


@dataclass(frozen=True)
class CurveKeys:
    """A CURVE key pair, each key 40 bytes of Z85 text (32 raw bytes)."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # never the secret in a log line or a traceback
        return f"CurveKeys(public={self.public.decode()!r}, secret=<hidden>)"


def generate_keys(path: str | Path) -> CurveKeys:
    """Write a new key pair to `path` (created with mode 0600; an existing file is never
    overwritten: FileExistsError) in ZeroMQ's certificate format, which `zmq.auth.load_certificate`
    reads; also `path`.pub with the public key alone (mode 0644)."""
    import zmq

    public, secret = zmq.curve_keypair()
    text = ("#   hybridgate CURVE key pair: keep this file secret (mode 0600)\n"
            f"metadata\ncurve\n    public-key = \"{public.decode()}\"\n    secret-key = \"{secret.decode()}\"\n")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    Path(f"{path}.pub").write_text(f"metadata\ncurve\n    public-key = \"{public.decode()}\"\n")
    return CurveKeys(public, secret)


def generate_token(path: str | Path) -> None:
    """Write a new bearer token for --auth-token-file to `path`: 256 random bits, URL-safe base64
    (Python's `secrets.token_urlsafe`), created with mode 0600; an existing file is never
    overwritten (FileExistsError)."""
    import secrets

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")


def load_keys(path: str, flag: str = "--curve-key") -> CurveKeys:
    """The key pair in `path` (written by `generate_keys`). Raises ValueError naming `flag` when the
    mode is wider than 0600 or the file holds no secret key; OSError when unreadable."""
    import zmq
    import zmq.auth

    check_secret_mode(path, flag)
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError, zmq.ZMQError) as exc:
        raise ValueError(f"{flag}: {path} is not a CURVE key file ({type(exc).__name__})") from None
    if not public or not secret or len(public) != 40 or len(secret) != 40:
        raise ValueError(f"{flag}: {path} holds no CURVE key pair (make one with `hybridgate keys generate`)")
    return CurveKeys(public, secret)


@dataclass(frozen=True)
class TransportConfig:
    curve_key: str | None = setting(
        None, "CURVE key pair file made by `hybridgate keys generate` (mode 0600): encrypts and authenticates "
              "every tcp:// ZeroMQ socket; every process of one deployment takes the same file",
        flag="--curve-key")
    insecure_tcp: bool = setting(
        False, "allow tcp:// ZeroMQ endpoints without --curve-key: plaintext, and any peer is served")

    def __post_init__(self) -> None:
        check_settings(self)
        if self.curve_key:
            check_secret_mode(self.curve_key, "--curve-key")  # refused before anything starts


class Transport:
    """What a process applies to its ZeroMQ sockets: CURVE on tcp:// when keys are given.

    Built once per process from `TransportConfig` (the key file is read here). `insecure_tcp`
    allows tcp:// without keys. Raises ValueError/OSError naming --curve-key for a bad file.
    """

    def __init__(self, config: TransportConfig | None = None):
        config = config or TransportConfig()
        self.keys = load_keys(config.curve_key) if config.curve_key else None
        self.insecure_tcp = config.insecure_tcp
        self._authenticators: list = []

    def check(self, endpoint: str, flag: str) -> None:
        """Raises ValueError naming `flag` when `endpoint` is tcp:// with no keys and no --insecure-tcp."""
        if endpoint.startswith("tcp://") and self.keys is None and not self.insecure_tcp:
            raise ValueError(f"{flag} {endpoint}: a tcp endpoint needs CURVE keys: give --curve-key FILE (made by "
                             "`hybridgate keys generate`), or --insecure-tcp to run it in plaintext, open to any "
                             "peer that reaches the port")

    def server(self, sock, endpoint: str, flag: str = "--endpoint") -> None:
        """Before `sock.bind(endpoint)`: a CURVE server on tcp:// (clients checked by `authenticate`)."""
        self.check(endpoint, flag)
        if endpoint.startswith("tcp://") and self.keys is not None:
            sock.curve_secretkey, sock.curve_publickey = self.keys.secret, self.keys.public
            sock.curve_server = True
            sock.zap_domain = ZAP_DOMAIN

    def client(self, sock, endpoint: str, flag: str = "--worker") -> None:
        """Before `sock.connect(endpoint)`: a CURVE client on tcp://, expecting our own public key."""
        self.check(endpoint, flag)
        if endpoint.startswith("tcp://") and self.keys is not None:
            sock.curve_secretkey, sock.curve_publickey = self.keys.secret, self.keys.public
            sock.curve_serverkey = self.keys.public

    def authenticate(self, ctx) -> None:
        """Start a ZAP handler on `ctx` (a sync zmq.Context) admitting only clients with our public key.
        Call before binding; a no-op without keys. Stopped by `close`."""
        if self.keys is None:
            return
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx, log=_QuietLog())
        auth.start()
        auth.configure_curve_callback(domain=ZAP_DOMAIN.decode(), credentials_provider=_SameKey(self.keys.public))
        self._authenticators.append(auth)

    def close(self) -> None:
        for auth in self._authenticators:
            auth.stop()
        self._authenticators.clear()


class _SameKey:
    """ZAP credentials provider: a client is admitted when its public key is the deployment's."""

    def __init__(self, public: bytes):
        import zmq.utils.z85

        self._public = zmq.utils.z85.decode(public)

    def callback(self, domain: str, key: bytes) -> bool:
        import hmac

        import zmq.utils.z85

        raw = key if len(key) == 32 else zmq.utils.z85.decode(key)
        return hmac.compare_digest(raw, self._public)


class _QuietLog:
    """pyzmq's authenticator logs each refusal at DEBUG and each admission's key; keep key material out."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None
