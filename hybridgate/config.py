"""Settings machinery: `setting()` fields, and the flags, environment and file of any root, with one precedence.

Every setting is a field of a part's frozen dataclass declared with `setting()`,
which carries its help text and bounds; command-line flags, `HYBRIDGATE_*`
environment variables and the `--config FILE` TOML keys are derived from those
fields here, for whichever root dataclass the caller hands in, with the
precedence flag > environment > file > default. This module imports no part of
hybridgate: the parts' config modules import it, and the root that composes
them (`hybridgate.settings`) is an argument here, never an import.

One name per setting, in three spellings: the flag `--max-num-seqs`, the
environment variable `HYBRIDGATE_MAX_NUM_SEQS` and the TOML key `max-num-seqs`
(or `max_num_seqs`). The TOML file is flat: one key per setting, no sections,
since every name is unique across the root (argparse would refuse two flags of
one name anyway); a list setting takes a list, or a table whose `NAME = "VALUE"`
entries read as `NAME=VALUE` values (`[model]` then `chat = "a.gguf"`); a setting may also read a
table of tables (`setting(table=...)`: the fleet's `[models.NAME]`). The root itself
(`hybridgate.settings.Settings`) and which
parts each command uses live in `hybridgate.settings`.

    parser = argparse.ArgumentParser()
    add_settings(parser, include=("gateway", "router"), root=Settings)    # flags; defaults stay unset
    resolved = resolve(parser.parse_args())                 # + environment + file + defaults
    resolved.settings.gateway.port, resolved.sources["gateway.port"]   # 50051, "default"

Errors name where the value came from and the limit: argparse's
"argument --threads: must be >= 1, got 0", "HYBRIDGATE_THREADS: must be >= 1,
got 0", "hg.toml: threads: must be >= 1, got 0", and from a constructor
"threads: must be >= 1, got 0".
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import numbers
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

ENV_PREFIX = "HYBRIDGATE_"
CONFIG_ENV = "HYBRIDGATE_CONFIG"  # the --config FILE when no flag gives one
SOURCES = ("flag", "env", "file", "default")  # highest precedence first
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

# The HYBRIDGATE_* variables that are not settings, each read through `environment()`: with the settings'
# own (read by `resolve`) and CONFIG_ENV, every variable hybridgate reads is named in this module. Each is
# one a setting field cannot serve: read before any command's settings are parsed, by a function called
# without settings, or a test-only hook armed in child processes through their environment.
ENVIRONMENT = {
    "HYBRIDGATE_LOG_LEVEL": "every command's --log-level (read before the command's settings are parsed)",
    "HYBRIDGATE_AUTH_TOKEN": "generate's --auth-token, the client's (the gateway's is the setting of the same name)",
    "HYBRIDGATE_CACHE_DIR": "the cache folder of GGUF headers and info's runner verdicts (default ~/.cache/hybridgate)",
    "HYBRIDGATE_CPU_ISA": "the CPU kernels' ISA path when no settings chose one (the cpu_isa setting's variable)",
    "HYBRIDGATE_CPU_AMX": "auto or off: AMX prompt matmuls when no settings chose (the cpu_amx setting's variable)",
    "HYBRIDGATE_TEST_CRASH_AT_START": "test-only: a supervised worker raises at once",
    "HYBRIDGATE_TEST_FAULT": "test-only: faults the model runner injects (workers.faults)",
    "HYBRIDGATE_TEST_GPU_MEMORY": "test-only: a GPU worker's device memory counters, given (workers.gpu.sizing)",
    "HYBRIDGATE_TEST_HANDOFF_PAUSE": "test-only: pauses in the workers' hand-off states (workers.handoff)",
    "HYBRIDGATE_TEST_HANDOFF_PAUSE_SEED": "test-only: the seed of those pauses",
    "HYBRIDGATE_TEST_ROUTER_HANDOFF_PAUSE": "test-only: pauses in the router's hand-off states (router.handoff)",
}


def environment(name: str, default: str | None = None) -> str | None:
    """The value of the environment variable `name`, or `default` when it is unset.
    Raises KeyError for a name not in ENVIRONMENT (a new variable is declared there first)."""
    if name not in ENVIRONMENT:
        raise KeyError(f"{name}: not a variable hybridgate reads; declare it in hybridgate.config.ENVIRONMENT")
    return os.environ.get(name, default)


def setting(default: Any, help: str, *, flag: str | None = None, low: float | None = None,
            high: float | None = None, low_open: bool = False, choices: tuple | None = None,
            secret: bool = False, cli: bool = True, check: Callable[[Any], Any] | None = None,
            split: Callable[[str], tuple[str, ...]] | None = None,
            table: tuple[str, Callable[[dict], tuple[str, ...]]] | None = None) -> Any:
    """A dataclass field that is also a setting.

    `help` is the flag's help text (the default is appended where the flag is
    derived). `flag` overrides the derived `--field-name`; `low`/`high` bound a
    number (`low_open` excludes `low`); `choices` limits a string; `secret`
    keeps the value out of `hybridgate config`, logs and the dataclass's repr; `cli=False` keeps a
    field that is plumbing (set by `serve`, not by users) off the command line,
    the environment and the file. `check(value)` validates what bounds cannot
    (raising ValueError with the limit in its message). A mutable default
    (a list) is not allowed: use a tuple. For a tuple setting, `split(text)` reads its environment
    variable (default: comma-separated items), and `table` = (KEY, convert) reads a TOML table of
    tables under KEY as its value (`convert(table)`, raising ValueError naming the entry).
    """
    return dataclasses.field(default=default, repr=not secret, metadata={
        "help": help, "flag": flag, "low": low, "high": high, "low_open": low_open,
        "choices": choices, "secret": secret, "cli": cli, "check": check, "split": split, "table": table,
    })


@dataclasses.dataclass(frozen=True)
class Spec:
    """One setting of a root: where it sits (`path`), its names and its type.

    `kind` is int, float, str, bool or tuple (of str); `optional` when None is allowed.
    """

    path: str  # "gateway.port": attribute path from the root
    field: dataclasses.Field
    kind: type
    optional: bool

    @property
    def name(self) -> str:  # "port", "grace-period": the flag without its dashes
        return (self.field.metadata["flag"] or "--" + self.field.name.replace("_", "-")).removeprefix("--")

    @property
    def flag(self) -> str:
        return "--" + self.name

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper().replace("-", "_")

    @property
    def meta(self) -> Mapping[str, Any]:
        return self.field.metadata

    @property
    def default(self) -> Any:
        return self.field.default


def is_setting(f: dataclasses.Field) -> bool:
    return "help" in f.metadata


def _section_type(f: dataclasses.Field) -> type | None:
    factory = f.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None


@functools.cache
def _leaf_type(cls: type, name: str) -> tuple[type, bool]:
    """(kind, optional) of field `name` from its annotation: `int | None` → (int, True)."""
    hint = typing.get_type_hints(cls)[name]
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    optional = type(None) in args
    kinds = [a for a in args if a is not type(None)]
    kind = typing.get_origin(kinds[0]) or kinds[0] if len(kinds) == 1 else None
    if kind not in (int, float, str, bool, tuple):
        raise TypeError(f"{cls.__name__}.{name}: a setting is int, float, str, bool or tuple[str, ...], got {hint}")
    return kind, optional


@functools.cache
def specs(root: type) -> tuple[Spec, ...]:
    """Every setting under `root`, depth first in field order; a field whose default_factory
    is a dataclass is a section. Raises TypeError for a field that is neither (every field of
    a part's config must be declared with `setting()`, so its default is written once)."""
    out: list[Spec] = []

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            section = _section_type(f)
            if section is not None:
                walk(section, prefix + f.name + ".")
            elif is_setting(f):
                out.append(Spec(prefix + f.name, f, *_leaf_type(cls, f.name)))
            else:
                raise TypeError(f"{cls.__name__}.{f.name}: declare it with hybridgate.config.setting()")

    walk(root, "")
    return tuple(out)


def _describe(kind: type) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            tuple: "a list of strings"}[kind]


def problem(spec: Spec, value: Any) -> str | None:
    """What is wrong with `value` for `spec` ("must be >= 1, got 0"), or None when it is fine."""
    if value is None:
        return None if spec.optional else f"must be {_describe(spec.kind)}, got None"
    ok_type = {int: lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool),  # numpy ints too
               float: lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool),
               str: lambda v: isinstance(v, str), bool: lambda v: isinstance(v, bool),
               tuple: lambda v: isinstance(v, tuple) and all(isinstance(x, str) for x in v)}[spec.kind]
    if not ok_type(value):
        return f"must be {_describe(spec.kind)}, got {value!r}"
    if spec.kind is float and not math.isfinite(value):  # NaN passes every comparison; inf breaks timers
        return f"must be a finite number, got {value!r}"
    m = spec.meta
    low, high = m["low"], m["high"]
    if low is not None and (value <= low if m["low_open"] else value < low) \
            or high is not None and value > high:
        if low is not None and high is not None:
            bound = f"in {'(' if m['low_open'] else '['}{low}, {high}]"
        elif low is not None:
            bound = f"{'>' if m['low_open'] else '>='} {low}"
        else:
            bound = f"<= {high}"
        return f"must be {bound}, got {value!r}"
    if m["choices"] is not None and value not in m["choices"]:
        return f"must be one of {', '.join(map(str, m['choices']))}, got {value!r}"
    if m["check"] is not None:
        try:
            m["check"](value)
        except ValueError as exc:
            return str(exc).removeprefix(spec.flag + ": ")
    return None


def check_settings(obj: Any) -> None:
    """For a part's `__post_init__`: every setting field of `obj` (not its sections, which check
    themselves) is of its type and within its bounds. Raises ValueError "field: must be ..."."""
    cls = type(obj)
    for f in dataclasses.fields(cls):
        if is_setting(f):
            spec = Spec(f.name, f, *_leaf_type(cls, f.name))
            error = problem(spec, getattr(obj, f.name))
            if error:
                raise ValueError(f"{f.name}: {error}")


def parse_text(spec: Spec, text: str) -> Any:
    """A value from a flag or an environment variable; raises ValueError with the limit."""
    if spec.optional and text == "":
        value = None
    elif spec.kind is bool:
        if text.strip().lower() not in _TRUE + _FALSE:
            raise ValueError(f"must be one of {', '.join(_TRUE + _FALSE)}, got {text!r}")
        value = text.strip().lower() in _TRUE
    elif spec.kind is tuple:
        value = spec.meta["split"](text) if spec.meta.get("split") else \
            tuple(x.strip() for x in text.split(",") if x.strip())
    else:
        try:
            value = spec.kind(text)
        except ValueError:
            raise ValueError(f"must be {_describe(spec.kind)}, got {text!r}") from None
    error = problem(spec, value)
    if error:
        raise ValueError(error)
    return value


# --- the command line --------------------------------------------------------------------------


def _root(root: type | None) -> type:
    if root is None:  # no default: this module imports no root (hybridgate.settings imports it)
        raise TypeError("no settings root: pass root= (hybridgate.settings.Settings), or parse arguments "
                        "from a parser that add_settings filled")
    return root


def select(root: type | None, include: Iterable[str] = ("",), exclude: Iterable[str] = ()) -> tuple[Spec, ...]:
    """The user-facing settings (not `cli=False`) under the `include` paths ("" is the whole
    root, "worker" a section, "worker.kind" one setting), less those under `exclude`."""

    def under(path: str, prefixes: Iterable[str]) -> bool:
        return any(p == "" or path == p or path.startswith(p + ".") for p in prefixes)

    return tuple(s for s in specs(_root(root)) if s.meta["cli"] and under(s.path, include)
                 and not under(s.path, exclude))


def _flag_type(spec: Spec) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return parse_text(spec, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = spec.kind.__name__
    return parse


def bounded(kind: type, low: float | None = None, high: float | None = None, low_open: bool = False,
            many: bool = False) -> Callable[[str], Any]:
    """An argparse type for a flag that is not a setting (a benchmark's knob), with the same
    bound checks and messages; `many` takes a comma-separated list ("1,4,16")."""
    one = _flag_type(Spec("value", setting(None, "", low=low, high=high, low_open=low_open), kind, False))
    if not many:
        return one

    def parse(text: str) -> list:
        return [one(x) for x in text.split(",")]

    parse.__name__ = f"comma-separated {kind.__name__}"
    return parse


def _help(spec: Spec, text: str | None = None) -> str:
    text = text or spec.meta["help"]
    default = spec.default
    if default is not None and default not in ((), "") and not spec.meta["secret"]:  # "": unset, as None
        shown = ("on" if default else "off") if spec.kind is bool else default
        text += f" (default {shown})"
    return text.replace("%", "%%") + f" [{spec.env}]"


def add_settings(parser: argparse.ArgumentParser, include: Iterable[str] = ("",), exclude: Iterable[str] = (),
                 root: type | None = None, required: Iterable[str] = (), helps: Mapping[str, str] | None = None) -> None:
    """Add one flag per selected setting (see `select`) and `--config FILE` to `parser`.

    A flag's default is left unset (argparse.SUPPRESS): `resolve` fills in the
    environment, the file and the dataclass default, so a default is written once.
    Bools get `--x/--no-x`; tuples repeat (`--worker A --worker B`). `required`
    paths must be given by a flag, the environment or the file. `helps`: this
    command's own help text of a setting by path, where the setting's own does
    not fit it (a client connects to the --host a server listens on).
    """
    include, exclude, required = tuple(include), tuple(exclude), tuple(required)
    chosen = select(root, include, exclude)
    group = parser.add_argument_group("settings (flag > HYBRIDGATE_* environment > --config file > default)")
    for spec in chosen:
        kwargs: dict[str, Any] = dict(dest=spec.path, default=argparse.SUPPRESS,
                                      help=_help(spec, (helps or {}).get(spec.path)))
        if spec.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif spec.kind is tuple:
            kwargs.update(action="append", metavar=spec.name.upper().replace("-", "_"))
        else:
            metavar = {int: "N", float: "X"}.get(spec.kind, spec.name.upper().replace("-", "_"))
            kwargs.update(type=_flag_type(spec), metavar=metavar)
            if spec.meta["choices"] is not None:
                kwargs.update(choices=spec.meta["choices"], metavar=None)
        group.add_argument(spec.flag, **kwargs)
    group.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                       help=f"TOML file of settings, flat keys named like the flags [{CONFIG_ENV}]")
    parser.set_defaults(settings_selection=(include, exclude, required, root))


# --- resolution ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Resolved:
    """The effective settings and, per setting path, where its value came from (one of SOURCES)."""

    settings: Any
    sources: dict[str, str]
    chosen: tuple[Spec, ...]
    config_file: str | None = None


def read_file(path: str, root: type | None = None) -> dict[str, Any]:
    """The TOML file's values by setting path. Raises ValueError naming the file, the key and
    the limit for an unknown key, a key given twice, or a bad value; OSError if unreadable."""
    import tomllib

    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML: {exc}") from None
    by_name = {s.name: s for s in select(root)}
    tables = {s.meta["table"][0]: s for s in by_name.values() if s.meta.get("table")}
    values: dict[str, Any] = {}
    for key, value in data.items():
        spec = by_name.get(key.replace("_", "-"))
        if spec is None and key in tables and isinstance(value, dict):  # [models.NAME] tables: one setting
            spec = tables[key]
            try:
                value = spec.meta["table"][1](value)
            except ValueError as exc:
                raise ValueError(f"{path}: [{key}]: {exc}") from None
        if spec is None:
            raise ValueError(f"{path}: {key}: unknown setting (keys are the flag names without --, "
                             f"e.g. max-num-seqs; sections are not used)")
        if spec.path in values:
            raise ValueError(f"{path}: {key}: given twice (as {spec.name}, {spec.name.replace('-', '_')} or a "
                             "table)")
        if spec.kind is tuple and isinstance(value, list):
            value = tuple(value)
        if spec.kind is tuple and isinstance(value, dict):  # a table of NAME = "VALUE": NAME=VALUE each
            value = tuple(f"{k}={v}" for k, v in value.items())
        if spec.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        error = problem(spec, value)
        if error:
            raise ValueError(f"{path}: {key}: {error}")
        values[spec.path] = value
    return values


def _build(cls: type, prefix: str, values: Mapping[str, Any]) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        section = _section_type(f)
        if section is not None:
            kwargs[f.name] = _build(section, prefix + f.name + ".", values)
        elif prefix + f.name in values:
            kwargs[f.name] = values[prefix + f.name]
    return cls(**kwargs)


def replaced(obj: Any, values: Mapping[str, Any]) -> Any:
    """A copy of the frozen config `obj` with the settings at `values`' paths ("router.chat_template")
    replaced, each section rebuilt (so checked) once. Raises ValueError as the constructors do."""
    if not values:
        return obj
    own = {path: v for path, v in values.items() if "." not in path}
    nested: dict[str, dict[str, Any]] = {}
    for path, v in values.items():
        if "." in path:
            head, _, rest = path.partition(".")
            nested.setdefault(head, {})[rest] = v
    own.update({head: replaced(getattr(obj, head), inner) for head, inner in nested.items()})
    return dataclasses.replace(obj, **own)


def resolve(args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None,
            include: Iterable[str] | None = None, exclude: Iterable[str] | None = None,
            root: type | None = None, config_file: str | None = None) -> Resolved:
    """The root's settings for a parsed command line: flag > environment > file > default.

    The selection (include/exclude/required/root) comes from `add_settings` through `args`
    unless given. Settings outside the selection keep their defaults. Raises ValueError naming
    the variable or the file key and the limit, or the missing required flag.
    """
    args = args or argparse.Namespace()
    environ = os.environ if environ is None else environ
    sel_include, sel_exclude, required, sel_root = getattr(args, "settings_selection", (("",), (), (), None))
    root = _root(root or sel_root)
    chosen = select(root, sel_include if include is None else include, sel_exclude if exclude is None else exclude)
    config_file = config_file or getattr(args, "config", None) or environ.get(CONFIG_ENV) or None
    from_file = read_file(config_file, root) if config_file else {}
    values: dict[str, Any] = {}
    sources = {s.path: "default" for s in chosen}
    for spec in chosen:
        if hasattr(args, spec.path):
            value, source = getattr(args, spec.path), "flag"
            if spec.kind is tuple:  # one string from a plain namespace (an embedder's, a test's) is one item
                value = (value,) if isinstance(value, str) else tuple(value)
        elif spec.env in environ:
            try:
                value, source = parse_text(spec, environ[spec.env]), "env"
            except ValueError as exc:
                raise ValueError(f"{spec.env}: {exc}") from None
        elif spec.path in from_file:
            value, source = from_file[spec.path], "file"
        else:
            continue
        values[spec.path], sources[spec.path] = value, source
    for path in required:
        spec = next(s for s in chosen if s.path == path)
        if spec.path not in values:
            raise ValueError(f"{spec.flag}: required (or {spec.env}, or {spec.name} in the --config file)")
    return Resolved(_build(root, "", values), sources, chosen, config_file)


# --- `hybridgate config` -----------------------------------------------------------------------------


def _value_at(settings: Any, path: str) -> Any:
    for part in path.split("."):
        settings = getattr(settings, part)
    return settings


def shown_value(spec: Spec, value: Any) -> Any:
    """What `hybridgate config` prints: never a secret's value, only whether it is set."""
    if spec.meta["secret"]:
        return "<set>" if value not in (None, "", ()) else "<unset>"
    return list(value) if isinstance(value, tuple) else value


def report(resolved: Resolved, as_json: bool = False,
           models: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None) -> str:
    """The effective settings and where each came from, as text lines or one JSON object
    {"config_file": ..., "settings": {path: {"value", "source", "flag", "env"}}}. `models`: per served
    model, its own rows of the same shape ("flag" then names what set it: a per-model key or a flag),
    printed after the root's as `models.NAME.path` lines and under "models" in the JSON."""
    rows = {s.path: {"value": shown_value(s, _value_at(resolved.settings, s.path)),
                     "source": resolved.sources[s.path], "flag": s.flag, "env": s.env} for s in resolved.chosen}
    if as_json:
        out: dict[str, Any] = {"config_file": resolved.config_file, "settings": rows}
        if models is not None:
            out["models"] = models
        return json.dumps(out, indent=2)
    every = dict(rows)
    for name, own in (models or {}).items():
        every.update({f"models.{name or '(default)'}.{path}": r for path, r in own.items()})
    width = max(len(p) for p in every)
    lines = [f"# config file: {resolved.config_file or '(none)'}"]
    lines += [f"{path:<{width}}  {json.dumps(r['value']):<24} {r['source']:<8} {r['flag']}"
              for path, r in every.items()]
    return "\n".join(lines)
