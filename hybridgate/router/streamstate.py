"""One request's stream as a state machine: pure (no queue, no worker, no clock).

`GenerationStream` (hybridgate/router/stream.py) turns each thing that
happens to a request into a `StreamEvent`, asks `transition` for the next
state and the action, and carries the action out. The facts a row depends on
(`StreamFacts`) are given with the event. The states are ordered, so
"finished" is one comparison (`state >= StreamState.DONE`).

    state     event             facts                                  next      action
    --------  ----------------  -------------------------------------  --------  ----------------
    NEW       PLACED                                                   RUNNING   -
    RUNNING   OUTPUT                                                   RUNNING   QUEUE
    RUNNING   LAST_OUTPUT                                              DONE      QUEUE
    RUNNING   FAILED            (a RequestError not worth a move)      DONE      ANSWER
    RUNNING   WORKER_LOST                                              MOVING    MOVE
    RUNNING   REFUSED           (no KV blocks, queue full)             MOVING    MOVE
    RUNNING   DROPPED           (Overload)                             MOVING    MOVE_ELSEWHERE
    RUNNING   STALLED                                                  MOVING    ABORT_AND_MOVE
    RUNNING   any of the four   ids streamed and resume off,           DONE      FAIL
                                or no moves left                                 (STALLED: ABORT_AND_FAIL)
    MOVING    PLACED                                                   RUNNING   -
    MOVING    NO_WORKER         cause REFUSED (every worker refused)   DONE      ANSWER
    MOVING    NO_WORKER         cause WORKER_AVAILABLE                 WAITING   WAIT
    MOVING    NO_WORKER         cause DROPPED, or resume off           DONE      FAIL
    MOVING    NO_WORKER         otherwise                              WAITING   WAIT
    WAITING   WORKER_AVAILABLE                                         MOVING    PLACE
    WAITING   STALLED                                                  DONE      FAIL
    RUNNING,  READ_TOO_SLOWLY                                          DONE      ABORT_AND_FAIL
      MOVING,
      WAITING
    NEW..     SHUT_DOWN         (the router closes)                    DONE      FAIL
      WAITING
    RUNNING,  STOPPED           (a stop string matched)                DONE      ABORT
      DONE
    any but   READ_LAST         (the caller got the last delta)        CLOSED    FINISH
      CLOSED
    any but   READ_ERROR        (the caller got the error)             CLOSED    ABORT_AND_FORGET
      CLOSED
    any but   LEFT              (the caller left the `async with`)     CLOSED    ABORT_AND_FORGET
      CLOSED                    (an abort of a finished one is a no-op)
    other pairs (an event a state does not take: late outputs of a   (same)    -
    finished request, a worker's news for a waiting one)

MOVING lasts one event: the move's placement answers PLACED or NO_WORKER at
once. Each placement uses its own worker-side request id, so a late output of
an earlier one never reaches the stream (the router drops it as unknown).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

MAX_MOVES = 8  # placements of one request (retries and resumes together) before it fails


class Stalled(msgspec.Struct, frozen=True):
    """Synthetic event from the router's stall timer: no progress for `request_stall_timeout_s`."""

    reason: str


class WorkerAvailable(msgspec.Struct, frozen=True):
    """Synthetic event: a worker is READY and this stream is waiting for one."""


class StreamState(enum.IntEnum):
    NEW = 0  # made, not entered: nothing sent
    RUNNING = 1  # on a worker (or a hand-off's pair of workers)
    MOVING = 2  # left its worker, being placed again
    WAITING = 3  # no READY worker to go to: waits for one (the stall timer bounds the wait)
    DONE = 4  # the last item is queued; the caller may still be reading
    CLOSED = 5  # the caller read the end or left; the router forgot it


class StreamEvent(enum.IntEnum):
    PLACED = 1  # a placement's request went out
    NO_WORKER = 2  # no READY worker to place it on
    OUTPUT = 3  # ids or progress from its worker
    LAST_OUTPUT = 4  # an output with a finish reason
    FAILED = 5  # a RequestError no other worker would answer otherwise
    WORKER_LOST = 6  # WorkerDead: its sequences are gone
    REFUSED = 7  # a RequestError another worker may not give (REPLACEABLE_CODES)
    DROPPED = 8  # Overload: the worker could not send to this router
    STALLED = 9  # no progress for request_stall_timeout_s
    WORKER_AVAILABLE = 10  # a worker is READY
    READ_TOO_SLOWLY = 11  # the caller's queue is full
    SHUT_DOWN = 12  # the router closes, or failed the stream itself
    STOPPED = 13  # the caller's side matched a stop string
    READ_LAST = 14  # the caller got the last delta
    READ_ERROR = 15  # the caller got the error
    LEFT = 16  # the caller left the `async with` before the end


class StreamAction(enum.IntEnum):
    NONE = 1
    QUEUE = 2  # hand the output to the caller
    ANSWER = 3  # hand the worker's error to the caller: it is the answer
    MOVE = 4  # place it again, the worker it left tried last
    MOVE_ELSEWHERE = 5  # place it again, never on the worker it left
    ABORT_AND_MOVE = 6  # abort it on its worker, then MOVE
    PLACE = 7  # a waiting stream tries to place itself
    WAIT = 8  # register as waiting for a READY worker
    FAIL = 9  # end with UNAVAILABLE (or the error given)
    ABORT_AND_FAIL = 10
    ABORT = 11  # abort it on its worker
    FINISH = 12  # the router forgets it; a hand-off frees what either worker may still hold of it
    ABORT_AND_FORGET = 13


@dataclass(frozen=True)
class StreamFacts:
    """What some rows depend on: `streamed` ids were received; `resume` is RouterConfig.
    resume_on_worker_loss; `moves_left` whether another placement is allowed (MAX_MOVES);
    `cause` the event that began the current move."""

    streamed: bool = False
    resume: bool = True
    moves_left: bool = True
    cause: StreamEvent | None = None


S, E, A = StreamState, StreamEvent, StreamAction
Row = tuple[StreamState, StreamAction] | Callable[[StreamEvent, StreamFacts], tuple[StreamState, StreamAction]]


def _move(event: StreamEvent, facts: StreamFacts) -> tuple[StreamState, StreamAction]:
    if (facts.streamed and not facts.resume) or not facts.moves_left:
        return S.DONE, A.ABORT_AND_FAIL if event == E.STALLED else A.FAIL
    return S.MOVING, _MOVES[event]


def _no_worker(event: StreamEvent, facts: StreamFacts) -> tuple[StreamState, StreamAction]:
    if facts.cause == E.REFUSED:
        return S.DONE, A.ANSWER
    if facts.cause == E.WORKER_AVAILABLE:
        return S.WAITING, A.WAIT
    if facts.cause == E.DROPPED or not facts.resume:
        return S.DONE, A.FAIL
    return S.WAITING, A.WAIT


_MOVES = {E.WORKER_LOST: A.MOVE, E.REFUSED: A.MOVE, E.DROPPED: A.MOVE_ELSEWHERE, E.STALLED: A.ABORT_AND_MOVE}


def _rows() -> list[list[Row]]:
    """The table as rows[state][event]: (next, action), or a function of the facts."""
    rows: list[list[Row]] = [[(state, A.NONE)] * (max(E) + 1) for state in S]
    for state in (S.NEW, S.RUNNING, S.MOVING, S.WAITING, S.DONE):
        rows[state][E.READ_LAST] = (S.CLOSED, A.FINISH)
        rows[state][E.READ_ERROR] = rows[state][E.LEFT] = (S.CLOSED, A.ABORT_AND_FORGET)
        if state != S.DONE:
            rows[state][E.SHUT_DOWN] = (S.DONE, A.FAIL)
        if state not in (S.NEW, S.DONE):
            rows[state][E.READ_TOO_SLOWLY] = (S.DONE, A.ABORT_AND_FAIL)
    rows[S.NEW][E.PLACED] = (S.RUNNING, A.NONE)
    running = rows[S.RUNNING]
    running[E.OUTPUT], running[E.LAST_OUTPUT] = (S.RUNNING, A.QUEUE), (S.DONE, A.QUEUE)
    running[E.FAILED] = (S.DONE, A.ANSWER)
    running[E.STOPPED] = rows[S.DONE][E.STOPPED] = (S.DONE, A.ABORT)
    for event in _MOVES:
        running[event] = _move
    rows[S.MOVING][E.PLACED] = (S.RUNNING, A.NONE)
    rows[S.MOVING][E.NO_WORKER] = _no_worker
    rows[S.WAITING][E.WORKER_AVAILABLE] = (S.MOVING, A.PLACE)
    rows[S.WAITING][E.STALLED] = (S.DONE, A.FAIL)
    return rows


_ROWS = _rows()


def transition(state: StreamState, event: StreamEvent,
               facts: StreamFacts | Callable[[], StreamFacts] = StreamFacts()) -> tuple[StreamState, StreamAction]:
    """(next state, action) for `event` in `state` (the table in this module's docstring). `facts` may be
    a function that makes them, called only for the rows that depend on them (the hot path, an output
    while RUNNING, needs none)."""
    row = _ROWS[state][event]
    if type(row) is tuple:
        return row
    return row(event, facts() if callable(facts) else facts)
