"""A request stream's states (`hybridgate.router.streamstate.transition`): one test per row of its table,
driven with events and facts alone (no router, no worker)."""

from __future__ import annotations

import pytest

from hybridgate.router.streamstate import StreamAction as A
from hybridgate.router.streamstate import StreamEvent as E
from hybridgate.router.streamstate import StreamFacts
from hybridgate.router.streamstate import StreamState as S
from hybridgate.router.streamstate import transition

STREAMED = StreamFacts(streamed=True)
LIVE = (S.NEW, S.RUNNING, S.MOVING, S.WAITING)


def test_states_are_ordered_so_done_is_one_comparison():
    assert [s for s in S if s >= S.DONE] == [S.DONE, S.CLOSED]


def test_new_placed_is_running():
    assert transition(S.NEW, E.PLACED) == (S.RUNNING, A.NONE)


def test_running_output_is_queued():
    assert transition(S.RUNNING, E.OUTPUT) == (S.RUNNING, A.QUEUE)


def test_running_last_output_is_queued_and_done():
    assert transition(S.RUNNING, E.LAST_OUTPUT) == (S.DONE, A.QUEUE)


def test_running_failed_is_the_answer():
    assert transition(S.RUNNING, E.FAILED) == (S.DONE, A.ANSWER)


@pytest.mark.parametrize("event, action", [(E.WORKER_LOST, A.MOVE), (E.REFUSED, A.MOVE),
                                           (E.DROPPED, A.MOVE_ELSEWHERE), (E.STALLED, A.ABORT_AND_MOVE)])
@pytest.mark.parametrize("facts", [StreamFacts(), STREAMED], ids=["nothing streamed", "resumed"])
def test_running_leaving_its_worker_moves(event, action, facts):
    assert transition(S.RUNNING, event, facts) == (S.MOVING, action)


@pytest.mark.parametrize("event", [E.WORKER_LOST, E.REFUSED, E.DROPPED, E.STALLED])
@pytest.mark.parametrize("facts", [StreamFacts(streamed=True, resume=False), StreamFacts(moves_left=False)],
                         ids=["resume off", "no moves left"])
def test_running_leaving_its_worker_without_a_move_allowed_fails(event, facts):
    action = A.ABORT_AND_FAIL if event == E.STALLED else A.FAIL
    assert transition(S.RUNNING, event, facts) == (S.DONE, action)


def test_nothing_streamed_moves_even_with_resume_off():
    assert transition(S.RUNNING, E.WORKER_LOST, StreamFacts(resume=False)) == (S.MOVING, A.MOVE)


def test_moving_placed_is_running():
    assert transition(S.MOVING, E.PLACED, StreamFacts(cause=E.WORKER_LOST)) == (S.RUNNING, A.NONE)


def test_moving_no_worker_after_refusals_answers_with_the_refusal():
    assert transition(S.MOVING, E.NO_WORKER, StreamFacts(cause=E.REFUSED)) == (S.DONE, A.ANSWER)


def test_moving_no_worker_for_a_waiting_stream_waits_again():
    facts = StreamFacts(resume=False, cause=E.WORKER_AVAILABLE)
    assert transition(S.MOVING, E.NO_WORKER, facts) == (S.WAITING, A.WAIT)


@pytest.mark.parametrize("facts", [StreamFacts(cause=E.DROPPED), StreamFacts(resume=False, cause=E.WORKER_LOST)],
                         ids=["dropped", "resume off"])
def test_moving_no_worker_without_waiting_fails(facts):
    assert transition(S.MOVING, E.NO_WORKER, facts) == (S.DONE, A.FAIL)


@pytest.mark.parametrize("cause", [E.WORKER_LOST, E.STALLED])
def test_moving_no_worker_otherwise_waits(cause):
    assert transition(S.MOVING, E.NO_WORKER, StreamFacts(streamed=True, cause=cause)) == (S.WAITING, A.WAIT)


def test_waiting_worker_available_places_it():
    assert transition(S.WAITING, E.WORKER_AVAILABLE) == (S.MOVING, A.PLACE)


def test_waiting_stalled_fails():
    assert transition(S.WAITING, E.STALLED) == (S.DONE, A.FAIL)


@pytest.mark.parametrize("state", [S.RUNNING, S.MOVING, S.WAITING])
def test_reading_too_slowly_aborts_and_fails(state):
    assert transition(state, E.READ_TOO_SLOWLY) == (S.DONE, A.ABORT_AND_FAIL)


@pytest.mark.parametrize("state", LIVE)
def test_shut_down_fails(state):
    assert transition(state, E.SHUT_DOWN) == (S.DONE, A.FAIL)


@pytest.mark.parametrize("state", [S.RUNNING, S.DONE])
def test_a_stop_string_aborts_and_is_done(state):
    assert transition(state, E.STOPPED) == (S.DONE, A.ABORT)


@pytest.mark.parametrize("state", [*LIVE, S.DONE])
def test_reading_the_end_closes(state):
    assert transition(state, E.READ_LAST) == (S.CLOSED, A.FINISH)
    assert transition(state, E.READ_ERROR) == (S.CLOSED, A.ABORT_AND_FORGET)
    assert transition(state, E.LEFT) == (S.CLOSED, A.ABORT_AND_FORGET)


@pytest.mark.parametrize("event", list(E))
def test_closed_takes_nothing(event):
    assert transition(S.CLOSED, event) == (S.CLOSED, A.NONE)


@pytest.mark.parametrize("event", [E.OUTPUT, E.LAST_OUTPUT, E.FAILED, E.WORKER_LOST, E.REFUSED, E.DROPPED, E.STALLED,
                                   E.WORKER_AVAILABLE, E.READ_TOO_SLOWLY, E.SHUT_DOWN, E.PLACED, E.NO_WORKER])
def test_done_ignores_the_pumps_late_news(event):
    assert transition(S.DONE, event, STREAMED) == (S.DONE, A.NONE)


@pytest.mark.parametrize("state, event", [(S.NEW, E.OUTPUT), (S.NEW, E.READ_TOO_SLOWLY), (S.WAITING, E.OUTPUT),
                                          (S.WAITING, E.WORKER_LOST), (S.RUNNING, E.WORKER_AVAILABLE),
                                          (S.RUNNING, E.NO_WORKER), (S.MOVING, E.OUTPUT)])
def test_an_event_a_state_does_not_take_changes_nothing(state, event):
    assert transition(state, event) == (state, A.NONE)
