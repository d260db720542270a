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
from dataclasses import dataclass


class StreamState(enum.IntEnum):
    NEW = 0  # made, not entered: nothing sent
    RUNNING = 1  # on a worker (or a hand-off's pair of workers)
    MOVING = 2  # left its worker, being placed again
    WAITING = 3  # no READY worker to go to: waits for one (the stall timer bounds the wait)
    DONE = 4  # the last item is queued; the caller may still be reading
    CLOSED = 5  # the caller read the end or left; the router forgot it


class StreamEvent(enum.Enum):
    PLACED = "placed"  # a placement's request went out
    NO_WORKER = "no_worker"  # no READY worker to place it on
    OUTPUT = "output"  # ids or progress from its worker
    LAST_OUTPUT = "last_output"  # an output with a finish reason
    FAILED = "failed"  # a RequestError no other worker would answer otherwise
    WORKER_LOST = "worker_lost"  # WorkerDead: its sequences are gone
    REFUSED = "refused"  # a RequestError another worker may not give (REPLACEABLE_CODES)
    DROPPED = "dropped"  # Overload: the worker could not send to this router
    STALLED = "stalled"  # no progress for request_stall_timeout_s
    WORKER_AVAILABLE = "worker_available"  # a worker is READY
    READ_TOO_SLOWLY = "read_too_slowly"  # the caller's queue is full
    SHUT_DOWN = "shut_down"  # the router closes, or failed the stream itself
    STOPPED = "stopped"  # the caller's side matched a stop string
    READ_LAST = "read_last"  # the caller got the last delta
    READ_ERROR = "read_error"  # the caller got the error
    LEFT = "left"  # the caller left the `async with` before the end


class StreamAction(enum.Enum):
    NONE = "none"
    QUEUE = "queue"  # hand the output to the caller
    ANSWER = "answer"  # hand the worker's error to the caller: it is the answer
    MOVE = "move"  # place it again, the worker it left tried last
    MOVE_ELSEWHERE = "move_elsewhere"  # place it again, never on the worker it left
    ABORT_AND_MOVE = "abort_and_move"  # abort it on its worker, then MOVE
    PLACE = "place"  # a waiting stream tries to place itself
    WAIT = "wait"  # register as waiting for a READY worker
    FAIL = "fail"  # end with UNAVAILABLE (or the error given)
    ABORT_AND_FAIL = "abort_and_fail"
    ABORT = "abort"  # abort it on its worker
    FINISH = "finish"  # the router forgets it; a hand-off frees what either worker may still hold of it
    ABORT_AND_FORGET = "abort_and_forget"


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
_MOVES = {E.WORKER_LOST: A.MOVE, E.REFUSED: A.MOVE, E.DROPPED: A.MOVE_ELSEWHERE, E.STALLED: A.ABORT_AND_MOVE}
_RUNNING = {E.OUTPUT: (S.RUNNING, A.QUEUE), E.LAST_OUTPUT: (S.DONE, A.QUEUE), E.FAILED: (S.DONE, A.ANSWER),
            E.STOPPED: (S.DONE, A.ABORT)}
_ANY_LIVE = {E.READ_TOO_SLOWLY: (S.DONE, A.ABORT_AND_FAIL), E.SHUT_DOWN: (S.DONE, A.FAIL)}
_ENDS = {E.READ_LAST: (S.CLOSED, A.FINISH), E.READ_ERROR: (S.CLOSED, A.ABORT_AND_FORGET),
         E.LEFT: (S.CLOSED, A.ABORT_AND_FORGET)}


def transition(state: StreamState, event: StreamEvent,
               facts: StreamFacts = StreamFacts()) -> tuple[StreamState, StreamAction]:
    """(next state, action) for `event` in `state` (the table in this module's docstring)."""
    if state == S.CLOSED:
        return state, A.NONE
    if event in _ENDS:
        return _ENDS[event]
    if state == S.DONE:
        return (S.DONE, A.ABORT) if event == E.STOPPED else (S.DONE, A.NONE)
    if event in _ANY_LIVE and not (state == S.NEW and event == E.READ_TOO_SLOWLY):
        return _ANY_LIVE[event]
    if state == S.NEW:
        return (S.RUNNING, A.NONE) if event == E.PLACED else (state, A.NONE)
    if state == S.RUNNING:
        if event in _MOVES:
            return _move(event, facts)
        return _RUNNING.get(event, (state, A.NONE))
    if state == S.MOVING:
        if event == E.PLACED:
            return S.RUNNING, A.NONE
        return _no_worker(facts) if event == E.NO_WORKER else (state, A.NONE)
    if event == E.WORKER_AVAILABLE:  # WAITING
        return S.MOVING, A.PLACE
    return (S.DONE, A.FAIL) if event == E.STALLED else (state, A.NONE)


def _move(event: StreamEvent, facts: StreamFacts) -> tuple[StreamState, StreamAction]:
    if (facts.streamed and not facts.resume) or not facts.moves_left:
        return S.DONE, A.ABORT_AND_FAIL if event == E.STALLED else A.FAIL
    return S.MOVING, _MOVES[event]


def _no_worker(facts: StreamFacts) -> tuple[StreamState, StreamAction]:
    if facts.cause == E.REFUSED:
        return S.DONE, A.ANSWER
    if facts.cause == E.WORKER_AVAILABLE:
        return S.WAITING, A.WAIT
    if facts.cause == E.DROPPED or not facts.resume:
        return S.DONE, A.FAIL
    return S.WAITING, A.WAIT
