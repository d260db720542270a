"""The root settings: the parts' frozen configs composed into one, with one precedence.

Every setting is a field of a part's frozen dataclass declared with `setting()`,
which carries its help text and bounds; command-line flags, `HYBRIDGATE_*`
environment variables and the `--config FILE` TOML keys are derived from those
fields here, with the precedence flag > environment > file > default.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def setting(default: Any, help: str, *, flag: str | None = None, low: float | None = None,
            high: float | None = None, low_open: bool = False, choices: tuple | None = None,
            secret: bool = False, cli: bool = True) -> Any:
    """A dataclass field that is also a setting.

    `help` is the flag's help text (the default is appended where the flag is
    derived). `flag` overrides the derived `--field-name`; `low`/`high` bound a
    number (`low_open` excludes `low`); `choices` limits a string; `secret`
    keeps the value out of `hybridgate config` and logs; `cli=False` keeps a
    field that is plumbing (set by `serve`, not by users) off the command line.
    """
    return dataclasses.field(default=default, metadata={
        "help": help, "flag": flag, "low": low, "high": high, "low_open": low_open,
        "choices": choices, "secret": secret, "cli": cli,
    })
