"""Each default written once: in its `setting()` field, read from there everywhere else.

`test_config.test_no_default_is_defined_twice` walks the settings root (every
field a `setting()`, no flag with a default of its own). This file looks for
the copies that walk cannot see: the same literal written again as a
parameter's or a field's default in another module, the scheduler's limits
assumed by the router, and the gRPC sampling defaults restated at the edge.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hybridgate import config
from hybridgate.gateway.config import GatewayConfig
from hybridgate.gateway.convert import request_to_native
from hybridgate.settings import Settings
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.wire import SamplingParams

PACKAGE = Path(__file__).resolve().parents[2] / "hybridgate"
SOURCES = {p.relative_to(PACKAGE.parent).as_posix(): p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py")}


def _copies(name: str, literal: str) -> list[str]:
    """Lines (file:line) that give `name` the default `literal` again: `name: T = literal` or `name=literal`."""
    pattern = re.compile(rf"\b{re.escape(name)}\s*(?::[^=\n]+)?=\s*{re.escape(literal)}(?![\w.])")
    return [f"{path}:{text.count(chr(10), 0, m.start()) + 1}"
            for path, text in SOURCES.items() for m in pattern.finditer(text)]


def _literal(value) -> str:
    return repr(value)


# A copy pairs the field's name with its default, so even 0 or 1.0 is told apart; None, a bool, "" and ()
# are what most optional parameters default to, with no setting behind them.
SPECS = [s for s in config.specs(Settings) if isinstance(s.default, (int, float, str)) and
         not isinstance(s.default, bool) and s.default != ""]


def test_the_walk_finds_the_settings_that_were_copied():
    """The grep below would have caught the copies issue 29 listed (the scheduler's 64/2048, dead_after_s,
    max_inflight_requests): their settings are among those it checks."""
    names = {s.path.rsplit(".", 1)[-1] for s in SPECS}
    assert {"max_num_seqs", "max_num_batched_tokens", "dead_after_s", "max_inflight_requests"} <= names
    assert _copies("x", "2") == []
    assert re.search(r"\bmax_num_seqs\s*(?::[^=\n]+)?=\s*64(?![\w.])", "    max_num_seqs: int = 64\n")


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.path)
def test_no_setting_default_is_written_again(spec):
    """Only the setting itself may pair its field name with its default; every other module reads it
    from the config class (e.g. `dead_after_s: float = RouterConfig.dead_after_s`)."""
    name = spec.path.rsplit(".", 1)[-1]
    assert _copies(name, _literal(spec.default)) == [], f"{spec.path} = {spec.default!r} written again"


@pytest.mark.parametrize(("where", "pattern", "what"), [
    ("hybridgate/", r"\belse 64\b|\bor 2048\b", "the scheduler's limits assumed when a worker has not reported them"),
    ("hybridgate/", r"\bmax_num_seqs: int = 64\b|\bmax_num_batched_tokens: int = 2048\b",
     "the scheduler's limits as a default"),
    ("hybridgate/gateway/convert.py", r"HasField\([^)]*\)\s*else\s", "a gRPC sampling default restated at the edge"),
])
def test_the_known_copies_are_gone(where, pattern, what):
    found = [f"{path}:{text.count(chr(10), 0, m.start()) + 1}"
             for path, text in SOURCES.items() if path.startswith(where) and path != "hybridgate/workers/config.py"
             for m in re.finditer(pattern, text)]
    assert found == [], what


def test_an_empty_grpc_request_gets_the_documented_defaults():
    """DESIGN.md, Limits and defaults: temperature 1.0, top_p 1.0, top_k 0 (off), repetition_penalty 1.0;
    max_tokens and seed unset (the router picks them); special tokens skipped (generation.proto)."""
    _, params = request_to_native(pb.GenerateRequest(prompt="hi"))
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (1.0, 1.0, 0, 1.0)
    assert (params.max_tokens, params.seed, params.skip_special_tokens, params.stop, params.logprobs) == \
        (None, None, True, (), None)


def test_every_sampling_field_a_request_sets_reaches_the_params():
    given = dict(temperature=0.25, top_p=0.5, top_k=7, repetition_penalty=1.5, seed=9, max_tokens=3,
                 stop=["a", "b"], ignore_eos=True, skip_special_tokens=False, presence_penalty=0.75,
                 frequency_penalty=-0.5, min_p=0.125, stop_token_ids=[4, 5], logprobs=2, min_tokens=2)
    # A new field must be added here too; the constraint is a oneof of its own, with its own tests.
    assert set(given) | {"constraint"} == set(SamplingParams.__struct_fields__)
    _, params = request_to_native(pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="x")]),
                                                     **given))
    assert {k: getattr(params, k) for k in given} == \
        {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}
    _, zeroed = request_to_native(pb.GenerateRequest(prompt="p", temperature=0.0, top_k=0, seed=0))
    assert (zeroed.temperature, zeroed.top_k, zeroed.seed) == (0.0, 0, 0)  # set to zero is not unset


def test_secrets_stay_out_of_repr():
    """A config in a log line or a traceback never shows the bearer token or the Redis password."""
    token = "tok-4f8a9c1e7b"
    gateway = GatewayConfig(auth_token=token)
    settings = Settings(gateway=gateway)
    for text in (repr(gateway), repr(settings), str(settings)):
        assert token not in text
    assert "auth_token=" not in repr(gateway) and "port=50051" in repr(gateway)
    for spec in config.specs(Settings):
        if spec.meta["secret"]:
            assert not spec.field.repr, spec.path


READ = re.compile(r"os\.environ\.get\(|os\.getenv\(|os\.environ\[[^\]]+\](?!\s*=)|os\.environ\.setdefault\(")


def test_environment_variables_are_read_only_by_the_settings_machinery():
    """Every HYBRIDGATE_* variable is a setting's (read by config.resolve) or declared in
    config.ENVIRONMENT and read through config.environment(); Numba's own variables, which the
    CPU runner sets for Numba, are the one exception."""
    found = [f"{path}:{n}: {line.strip()}" for path, text in SOURCES.items() if path != "hybridgate/config.py"
             for n, line in enumerate(text.splitlines(), 1) if READ.search(line) and "NUMBA_" not in line]
    assert found == []
    assert READ.search('x = os.environ.get("HYBRIDGATE_X")') and not READ.search('os.environ["NUMBA_A"] = b')
    with pytest.raises(KeyError, match="HYBRIDGATE_NOT_DECLARED: not a variable hybridgate reads"):
        config.environment("HYBRIDGATE_NOT_DECLARED")


def test_every_declared_variable_is_used_somewhere():
    """The table holds no stale name: each variable is named in the module that reads it."""
    for name in config.ENVIRONMENT:
        assert name.startswith(config.ENV_PREFIX)
        constant = re.compile(rf'"{name}"|\b\w+ = "{name}"')
        assert any(constant.search(text) for path, text in SOURCES.items() if path != "hybridgate/config.py"), name
