"""Bearer check, the token's settings and secret files (no server)."""

from __future__ import annotations

import os

import pytest

from hybridgate.config import report, resolve
from hybridgate.gateway.auth import bearer_ok
from hybridgate.gateway.server import GatewayConfig
from hybridgate.security.keys import read_secret_file
from hybridgate.settings import Settings

TOKEN = "s3cret-Token-0123456789"


@pytest.mark.parametrize("header, ok", [
    (f"Bearer {TOKEN}", True),
    (f"bearer {TOKEN}", True),  # the scheme is case-insensitive (RFC 7235 2.1)
    (f"BEARER  {TOKEN} ", True),
    (None, False),
    ("", False),
    ("Bearer", False),
    ("Bearer ", False),
    (TOKEN, False),  # no scheme
    (f"Basic {TOKEN}", False),
    (f"Bearer {TOKEN}x", False),
    (f"Bearer {TOKEN[:-1]}", False),
    (f"Bearer {TOKEN.upper()}", False),  # the token itself is case-sensitive
])
def test_bearer_ok(header, ok):
    assert bearer_ok(TOKEN, header) is ok


@pytest.mark.parametrize("expected", [None, ""])
def test_no_token_means_auth_off(expected):
    assert bearer_ok(expected, None) and bearer_ok(expected, "Bearer anything")


def _file(tmp_path, text: str, mode: int):
    path = tmp_path / "token"
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


def test_token_file_sets_auth_token(tmp_path):
    cfg = GatewayConfig(auth_token_file=_file(tmp_path, f"  {TOKEN}\n", 0o600))
    assert cfg.auth_token == TOKEN


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_wide_secret_file_is_refused(tmp_path, mode):
    path = _file(tmp_path, TOKEN, mode)
    with pytest.raises(ValueError) as info:
        GatewayConfig(auth_token_file=path)
    message = str(info.value)
    assert "--auth-token-file" in message and f"{mode:04o}" in message and "0600" in message
    assert TOKEN not in message


def test_token_and_file_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not both"):
        GatewayConfig(auth_token="another-token-entirely", auth_token_file=_file(tmp_path, TOKEN, 0o600))


def test_empty_and_missing_token_files(tmp_path):
    with pytest.raises(ValueError, match="is empty"):
        read_secret_file(_file(tmp_path, "\n", 0o600), "--auth-token-file")
    with pytest.raises(OSError, match="--auth-token-file: cannot read"):
        read_secret_file(str(tmp_path / "nope"), "--auth-token-file")


def test_bad_token_is_refused_without_showing_it():
    with pytest.raises(ValueError) as info:
        GatewayConfig(auth_token="has a space in it")
    assert "auth_token" in str(info.value) and "has a space" not in str(info.value)


def test_config_printer_masks_the_token():
    resolved = resolve(environ={"HYBRIDGATE_AUTH_TOKEN": TOKEN}, root=Settings)
    assert resolved.settings.gateway.auth_token == TOKEN and resolved.sources["gateway.auth_token"] == "env"
    for as_json in (False, True):
        text = report(resolved, as_json=as_json)
        assert TOKEN not in text and "<set>" in text


def test_curve_keys_round_trip_and_refusals(tmp_path):
    import zmq.auth

    from hybridgate.security.keys import Transport, TransportConfig, generate_keys, load_keys

    path = tmp_path / "deploy.key"
    made = generate_keys(path)
    assert (path.stat().st_mode & 0o777) == 0o600 and load_keys(str(path)) == made
    assert zmq.auth.load_certificate(f"{path}.pub") == (made.public, None)  # ZeroMQ's own reader agrees
    assert made.secret.decode() not in repr(made)
    with pytest.raises(FileExistsError):
        generate_keys(path)
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="has mode 0644"):
        TransportConfig(curve_key=str(path))
    bogus = tmp_path / "bogus.key"
    bogus.write_text("not a key\n")
    os.chmod(bogus, 0o600)
    with pytest.raises(ValueError, match="not a CURVE key file|holds no CURVE key pair"):
        load_keys(str(bogus))
    plain = Transport(TransportConfig())
    plain.check("ipc:///tmp/x", "--endpoint")  # ipc needs no keys
    with pytest.raises(ValueError, match=r"--endpoint tcp://127\.0\.0\.1:5: a tcp endpoint needs CURVE keys"):
        plain.check("tcp://127.0.0.1:5", "--endpoint")
    Transport(TransportConfig(insecure_tcp=True)).check("tcp://127.0.0.1:5", "--endpoint")


def test_keys_generate_writes_a_bearer_token_the_gateway_reads_and_keeps_it(tmp_path, capsys):
    import base64

    from hybridgate.cli import main
    from hybridgate.gateway.config import GatewayConfig

    token, key = tmp_path / "auth-token", tmp_path / "deploy.key"
    assert main(["keys", "generate", "--auth-token", str(token), str(key)]) == 0
    assert token.stat().st_mode & 0o777 == 0o600
    text = token.read_text().strip()
    assert len(base64.urlsafe_b64decode(text + "=")) == 32  # 256 random bits
    assert GatewayConfig(auth_token_file=str(token)).auth_token == text
    assert main(["keys", "generate", "--keep-existing", "--auth-token", str(token), str(key)]) == 0
    assert token.read_text().strip() == text and "kept " + str(token) in capsys.readouterr().out
    assert main(["keys", "generate", "--auth-token", str(token), str(tmp_path / "other.key")]) != 0
    assert "a token file is never overwritten" in capsys.readouterr().err
