"""End to end: the HTTP API behind --auth-token-file and the gRPC port's TLS (one serve with a CPU worker),
and a taken --http-port."""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import subprocess
import urllib.parse
import urllib.error
import urllib.request

import gguf
import openai
import pytest

from conftest import TIME_FACTOR
from procs import HYBRIDGATE, Serve
from test_security import _certificates

TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_path):
    folder = tmp_path_factory.mktemp("auth")
    certs = _certificates(folder)
    token_file = folder / "token"
    token_file.write_text(TOKEN + "\n")
    os.chmod(token_file, 0o600)
    proc = Serve(folder / "serve.log", "--auth-token-file", str(token_file), "--tls-cert", certs["server_cert"],
                 "--tls-key", certs["server_key"])
    proc.ca = certs["ca"]
    proc.tls = ssl.create_default_context(cafile=certs["ca"])
    yield proc
    assert proc.stop() == 0, proc.text()


def sdk(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key=key, max_retries=0, timeout=60 * TIME_FACTOR,
                         http_client=openai.DefaultHttpxClient(verify=server.tls))


def test_the_http_api_speaks_tls_as_the_grpc_port_does(server):
    assert server.http_url.startswith("https://127.0.0.1:")
    assert urllib.request.urlopen(server.http_url + "/health", timeout=30, context=server.tls).status == 200
    plain = http.client.HTTPConnection(urllib.parse.urlsplit(server.http_url).netloc, timeout=30)
    with pytest.raises((http.client.HTTPException, ConnectionError)):  # plaintext to the TLS port gets no answer
        plain.request("GET", "/health")
        plain.getresponse()


def test_a_missing_or_wrong_token_is_401(server):
    for key in ("wrong-token", TOKEN + "x"):
        with pytest.raises(openai.AuthenticationError) as e:
            sdk(server, key).models.list()
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with pytest.raises(urllib.error.HTTPError) as e:  # no Authorization header at all
        urllib.request.urlopen(server.http_url + "/v1/models", timeout=30, context=server.tls)
    assert e.value.code == 401 and e.value.headers["WWW-Authenticate"] == "Bearer"
    assert urllib.request.urlopen(server.http_url + "/health", timeout=30, context=server.tls).status == 200  # open


def test_the_right_token_is_served(server, model_path):
    # The file's general.name (gguf's reader): an alias of the served name (the file's stem) by default.
    name = gguf.GGUFReader(model_path).fields["general.name"].contents()
    r = sdk(server, TOKEN).chat.completions.create(model=name, temperature=0, max_tokens=3,
                                                  messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert r.choices[0].message.content == "The capital of"


def test_a_taken_http_port_fails_at_once_naming_the_flag():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([HYBRIDGATE, "serve", "--port", "0", "--http-port", str(port)], capture_output=True,
                             text=True, timeout=60 * TIME_FACTOR)
    assert out.returncode != 0 and "--http-port" in out.stderr and f"127.0.0.1:{port}" in out.stderr, out.stderr
