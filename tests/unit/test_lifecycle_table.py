"""The worker client's lifecycle (`hybridgate.clients.lifecycle.Lifecycle`): one test per row of its table,
driven with synthetic events (no sockets)."""

from __future__ import annotations

import pytest

from hybridgate.clients.lifecycle import (
    MAX_ABANDONED,
    PROBE_FIRST_S,
    PROBE_MAX_S,
    Exited,
    HelloSeen,
    Lifecycle,
    MessageSeen,
    NewSocket,
    ProbeDue,
    ReadySeen,
    Refused,
    ReportDead,
    SendAbort,
    SendConnect,
    SendFailed,
    Silence,
)
from hybridgate.wire import WorkerState as S

BOOT, OTHER = "a" * 32, "b" * 32


def machine(state: S = S.CONNECTING, inflight=()) -> Lifecycle:
    """A lifecycle brought to `state` through the events that lead there (dead after 1 s, suspect after 0.5 s)."""
    lc = Lifecycle("ipc:///w", dead_after_s=1.0)
    if state == S.CONNECTING:
        return lc
    lc.on(HelloSeen(BOOT, ready=True), 0.0)
    for rid in inflight:
        lc.started(rid)
    if state == S.SUSPECT:
        lc.on(Silence(0.6), 0.0)
    elif state in (S.DEAD, S.PROBING):
        lc.on(Silence(1.1), 0.0)
        if state == S.PROBING:
            lc.on(ProbeDue(), 0.0)
    elif state == S.REFUSED:
        lc.on(Refused(), 0.0)
    assert lc.state == state
    return lc


def test_connecting_probe_due_sends_connect_with_doubling_capped_backoff():
    lc = machine()
    assert lc.probing and lc.next_probe_at == 0.0
    waits, now = [], 0.0
    for _ in range(8):
        assert lc.on(ProbeDue(), now) == [SendConnect()] and lc.state == S.CONNECTING
        waits.append(round(lc.next_probe_at - now, 6))
        now = lc.next_probe_at
    assert waits == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5, 0.5, 0.5]
    assert (PROBE_FIRST_S, PROBE_MAX_S) == (0.05, 0.5)


def test_connecting_hello_ready_is_ready():
    lc = machine()
    assert lc.on(HelloSeen(BOOT, ready=True), 1.0) == [] and lc.state == S.READY and lc.boot_id == BOOT


def test_connecting_hello_not_ready_stops_probing_until_ready():
    lc = machine()
    assert lc.on(HelloSeen(BOOT, ready=False), 1.0) == [] and lc.state == S.CONNECTING
    assert not lc.probing and lc.on(ProbeDue(), 1.0) == []


def test_connecting_ready_after_hello_is_ready_but_not_before():
    lc = machine()
    lc.on(ReadySeen(), 0.0)
    assert lc.state == S.CONNECTING  # READY without HELLO proves nothing about the model
    lc.on(HelloSeen(BOOT, ready=False), 0.0)
    lc.on(ReadySeen(), 0.0)
    assert lc.state == S.READY


def test_connecting_silence_counts_only_after_hello():
    lc = machine()
    assert lc.on(Silence(500.0), 0.0) == [] and lc.state == S.CONNECTING  # still loading its model
    lc.on(HelloSeen(BOOT, ready=False), 0.0)
    actions = lc.on(Silence(1.5), 2.0)
    assert lc.state == S.DEAD and actions == [ReportDead("worker ipc:///w silent for 1.5 s", BOOT)]


def test_ready_message_keeps_it_ready():
    lc = machine(S.READY)
    assert lc.on(MessageSeen(), 0.0) == [] and lc.state == S.READY
    assert lc.on(Silence(0.4), 0.0) == [] and lc.state == S.READY  # under suspect_after_s


def test_ready_silence_past_suspect_is_suspect():
    lc = machine(S.READY)
    assert lc.on(Silence(0.6), 0.0) == [] and lc.state == S.SUSPECT


def test_ready_failed_send_is_suspect():
    lc = machine(S.READY)
    assert lc.on(SendFailed("EAGAIN"), 0.0) == [] and lc.state == S.SUSPECT


def test_ready_silence_past_dead_is_dead_at_once():
    lc = machine(S.READY, inflight=["r1"])
    actions = lc.on(Silence(3.0), 5.0)
    assert lc.state == S.DEAD and [type(a) for a in actions] == [ReportDead]
    assert list(lc.abandoned) == ["r1"] and lc.next_probe_at == 5.0


def test_suspect_message_is_ready_again():
    lc = machine(S.SUSPECT)
    assert lc.on(MessageSeen(), 0.0) == [] and lc.state == S.READY


def test_suspect_silence_past_dead_reports_dead_and_keeps_inflight_ids():
    lc = machine(S.SUSPECT, inflight=["r1", "r2", "r3"])
    lc.finished("r2")
    actions = lc.on(Silence(1.2), 7.0)
    assert lc.state == S.DEAD and actions == [ReportDead("worker ipc:///w silent for 1.2 s", BOOT)]
    assert list(lc.abandoned) == ["r1", "r3"] and not lc.inflight


def test_dead_probe_due_is_probing_and_sends_connect():
    lc = machine(S.DEAD)
    assert lc.probing and lc.on(ProbeDue(), 0.0) == [SendConnect()] and lc.state == S.PROBING


def test_probing_probe_due_resends_with_capped_backoff():
    lc = machine(S.PROBING)
    now, waits = lc.next_probe_at, []
    for _ in range(7):
        assert lc.on(ProbeDue(), now) == [SendConnect()] and lc.state == S.PROBING
        waits.append(round(lc.next_probe_at - now, 6))
        now = lc.next_probe_at
    assert waits == [0.1, 0.2, 0.4, 0.5, 0.5, 0.5, 0.5]  # the first (0.05 s) went out on DEAD → PROBING
    assert lc.on(MessageSeen(), now) == [] and lc.state == S.PROBING  # only a HELLO re-admits


@pytest.mark.parametrize("state", [S.DEAD, S.PROBING])
def test_false_death_hello_same_boot_is_ready_with_one_abort(state):
    lc = machine(state, inflight=["r1", "r2"])
    assert lc.on(HelloSeen(BOOT, ready=True), 9.0) == [SendAbort(("r1", "r2"))] and lc.state == S.READY
    assert not lc.abandoned and not lc.probing
    assert lc.on(HelloSeen(BOOT, ready=True), 9.1) == []  # the answers to later probes: nothing more


def test_false_death_hello_not_ready_waits_for_ready():
    lc = machine(S.PROBING)
    lc.on(HelloSeen(BOOT, ready=False), 0.0)
    assert lc.state == S.CONNECTING
    lc.on(ReadySeen(), 0.0)
    assert lc.state == S.READY


@pytest.mark.parametrize("state", [S.CONNECTING, S.READY, S.SUSPECT])
def test_new_boot_id_while_alive_reports_the_old_sequences_and_renews_the_socket(state):
    lc = machine(state, inflight=["r1"])
    if state == S.CONNECTING:
        lc.on(HelloSeen(BOOT, ready=False), 0.0)
        lc.started("r1")
    actions = lc.on(HelloSeen(OTHER, ready=True), 3.0)
    assert [type(a) for a in actions] == [ReportDead, NewSocket] and actions[0].boot_id == BOOT
    assert lc.state == S.CONNECTING and lc.boot_id == OTHER and not lc.inflight
    assert lc.probing and lc.next_probe_at == 3.0  # CONNECT again, on the new socket
    lc.on(HelloSeen(OTHER, ready=True), 3.1)
    assert lc.state == S.READY


@pytest.mark.parametrize("state", [S.DEAD, S.PROBING])
def test_new_boot_id_after_death_renews_the_socket_and_forgets_the_old_ids(state):
    lc = machine(state, inflight=["r1"])
    assert lc.on(HelloSeen(OTHER, ready=True), 3.0) == [NewSocket()]  # its streams were told already
    assert lc.state == S.CONNECTING and not lc.abandoned
    lc.on(HelloSeen(OTHER, ready=True), 3.1)
    assert lc.state == S.READY


def test_new_boot_without_sequences_reports_nothing():
    lc = machine(S.READY)
    assert lc.on(HelloSeen(OTHER, ready=True), 0.0) == [NewSocket()]


@pytest.mark.parametrize("state", [S.CONNECTING, S.READY, S.SUSPECT, S.DEAD, S.PROBING])
def test_refused_is_terminal(state):
    lc = machine(state)
    lc.on(Refused(), 0.0)
    assert lc.state == S.REFUSED
    for event in (HelloSeen(OTHER, True), ReadySeen(), MessageSeen(), Silence(9.0), ProbeDue(), SendFailed("x")):
        assert lc.on(event, 0.0) == [] and lc.state == S.REFUSED


def test_abandoned_ids_are_bounded_oldest_dropped():
    lc = machine(S.READY, inflight=[f"r{i}" for i in range(MAX_ABANDONED + 10)])
    lc.on(Silence(2.0), 0.0)
    assert len(lc.abandoned) == MAX_ABANDONED and next(iter(lc.abandoned)) == "r10"


def test_dead_after_must_be_positive():
    with pytest.raises(ValueError, match="dead_after_s"):
        Lifecycle("x", dead_after_s=0)


@pytest.mark.parametrize("state", [S.READY, S.SUSPECT])
def test_exited_is_dead_at_once(state):
    lc = machine(state, inflight=["r1"])
    actions = lc.on(Exited("killed by signal SIGKILL"), 2.0)
    assert lc.state == S.DEAD and actions == [ReportDead("worker ipc:///w exited (killed by signal SIGKILL)", BOOT)]


@pytest.mark.parametrize("state", [S.CONNECTING, S.DEAD, S.PROBING])
def test_exited_before_hello_or_after_death_changes_nothing(state):
    lc = machine(state)
    assert lc.on(Exited("exit code 1"), 0.0) == [] and lc.state == state
