"""A test-only fault hook: makes a model runner fail steps on purpose, to test failure isolation.

Enabled by one environment variable, read here and nowhere else, once when a
runner is built (it is a test switch, not a setting, so it is not part of the
configuration root). Its value is a comma-separated list of faults:

    HYBRIDGATE_TEST_FAULT=fail_request:<request_id>      raise `InjectedFault` in every step
                                                         that runs this request
    HYBRIDGATE_TEST_FAULT=oom_over_tokens:<n>            raise `MemoryError` in every step of
                                                         more than n tokens (a device that
                                                         holds n tokens of activations)

e.g. `fail_request:r3,oom_over_tokens:400`. Unset or empty: no hook, and the
runners pay one `is None` check per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridgate.config import environment
from hybridgate.workers.scheduler import ScheduledBatch

FAULT_ENV = "HYBRIDGATE_TEST_FAULT"


class InjectedFault(RuntimeError):
    """The failure the hook raises for `fail_request`."""


@dataclass(frozen=True)
class FaultHook:
    fail_requests: frozenset[str] = frozenset()
    oom_over_tokens: int | None = None

    @classmethod
    def parse(cls, spec: str) -> FaultHook | None:
        """The hook of `spec` (the variable's value); None when it names no fault.

        Raises:
            ValueError: an unknown fault kind or a bad token count, naming the variable.
        """
        fail, oom = set(), None
        for item in filter(None, (part.strip() for part in spec.split(","))):
            kind, _, value = item.partition(":")
            if kind == "fail_request" and value:
                fail.add(value)
            elif kind == "oom_over_tokens" and value.isdigit():
                oom = int(value)
            else:
                raise ValueError(f"{FAULT_ENV}: expected fail_request:<request_id> or oom_over_tokens:<n>, "
                                 f"got {item!r}")
        return cls(frozenset(fail), oom) if fail or oom is not None else None

    @classmethod
    def from_env(cls) -> FaultHook | None:
        return cls.parse(environment(FAULT_ENV, ""))

    def check(self, batch: ScheduledBatch) -> None:
        """Raise the fault this batch triggers, if any (called before the runner touches the device)."""
        for seq, _ in batch.entries:
            if seq.request_id in self.fail_requests:
                raise InjectedFault(f"injected fault for request {seq.request_id!r} ({FAULT_ENV})")
        if self.oom_over_tokens is not None and batch.num_tokens > self.oom_over_tokens:
            raise MemoryError(f"injected out-of-memory: a step of {batch.num_tokens} tokens > "
                              f"{self.oom_over_tokens} ({FAULT_ENV})")
