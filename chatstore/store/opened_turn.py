"""One turn's handle, from its opening in the API to its record: `OpenedTurn`.

    API worker thread   store.open_turn(tenant, session, prompt) -> OpenedTurn
                        (what only SSD or Redis held is up in host memory and pinned there;
                        each chunk's tier as the turn found it; a borrowed prompt prefix)
    engine thread       Request(store_turn=opened): the connector's prepare_load reads the
                        stored history through it (and notes it: `served`, which the reply's
                        cached tokens are split by), load_history unpins it once read;
                        save_turn completes its TurnChain when the commit has indexed the chain
    API worker thread   append_turn(record, ..., turn=opened) takes the chain and writes it
                        with the turn's messages: one record write per turn
    event loop          end_turn(opened): whatever the turn did not use is let go (pins, and a
                        chain nobody took is recorded by the store's writer thread)

Nothing is found again by session key: what one turn opened travels with it. A handle dropped
without end_turn (a crashed caller) unpins its chunks when it is collected.

Plain values and one future; the store fills the callbacks in (sessions/turn_opening.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from chatstore.store.port_values import StoredSession
from chatstore.store.records.record import ChainRecord
from chatstore.store.session_kv import ChunkKey, SessionKey


def _no_check() -> bool:
    return True


class TurnChain:
    """The chain a turn's commit made its session's history, for the API to record with the
    turn's messages. Completed once by the store (the chain, or None: nothing was saved), taken
    once by the API's append; given up by the API when the turn ends without one, and then
    recorded by the store instead (see `complete` and `give_up`)."""

    def __init__(
        self, hurry: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext
    ) -> None:
        """hurry(): a context held while the API waits for the commit: the store's writer runs
        in the idle CPU class and lets a running prefill go first until something waits on it
        (chatstore/cpu_priority.py, store/commit/write_buffer.py), and the reply's last frame
        waits on this one."""
        self._hurry = hurry
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._value: ChainRecord | None = None
        self._current: Callable[[], bool] = _no_check
        self._taken = self._given_up = False

    def complete(
        self, value: ChainRecord | None, current: Callable[[], bool] = lambda: True
    ) -> bool:
        """Store side, once (later calls do nothing). current(): the chain is still the
        session's (a later turn or a cut has not replaced it). False when the API gave the turn
        up first: the caller records the chain itself."""
        with self._lock:
            if self._done.is_set():
                return True
            self._value, self._current = value, current
            self._done.set()
            return not self._given_up

    @property
    def completed(self) -> bool:
        return self._done.is_set()

    def take(self, timeout: float) -> ChainRecord | None:
        """API side: the committed chain, waiting up to timeout for the commit (the engine
        hands the turn to the store's writer before the reply ends); None when nothing was
        saved, the chain is no longer the session's, or the commit did not come in time."""
        if not self._done.is_set():
            with self._hurry():
                self._done.wait(timeout)
        with self._lock:
            if self._given_up or not self._done.is_set():
                return None
            self._taken = True
            value, current = self._value, self._current
            self._current = _no_check  # the check holds the store's index: not past its use
        return value if value is not None and current() else None

    def give_up(self) -> tuple[ChainRecord, Callable[[], bool]] | None:
        """API side: the turn ends without an append (aborted, failed). A chain completed and
        not taken is returned (with its `current` check) for the store to record; one not
        completed yet is recorded by the commit (`complete` returns False)."""
        with self._lock:
            if self._taken or self._given_up:
                return None
            self._given_up = True
            current, self._current = self._current, _no_check
            if self._done.is_set() and self._value is not None:
                return self._value, current
        return None


@dataclass(frozen=True)
class BorrowedPrefix:
    """A session without a stored chain borrows the stored chunks its prompt's leading full
    chunks hash to (a shared system prompt): served as its history to this turn only."""

    token_ids: list[int]
    chunks: list[ChunkKey]


@dataclass(eq=False)
class OpenedTurn:
    """A turn the store opened: see the module's doc. `origins`: each chunk's tier when the turn
    opened (how the reply counts its cached tokens); `pinned`: the chunks it keeps readable
    from host memory until the engine has read them; `chain`: None when the opener does not
    record the turn itself (then the commit writes the record)."""

    key: SessionKey
    origins: Mapping[ChunkKey, str] = field(default_factory=dict)
    borrowed: BorrowedPrefix | None = None
    pinned: list[ChunkKey] = field(default_factory=list)
    chain: TurnChain | None = None
    opened_at: float = field(default_factory=time.monotonic)
    from_remote: int = 0  # chunks the opening brought up from the remote tier (Redis)
    # The history the engine's admission was served (prepare_load, engine thread, before the
    # request's first output): what the reply's cached tokens are split by.
    served: StoredSession | None = None
    _unpin: Callable[[list[ChunkKey]], None] | None = field(default=None, repr=False)
    _finalizer: weakref.finalize[[list[ChunkKey]], OpenedTurn] | None = field(
        default=None, repr=False
    )

    @staticmethod
    def of(carried: object) -> OpenedTurn | None:
        """The handle an engine Request carries (`store_turn`, opaque to the engine)."""
        if carried is not None and not isinstance(carried, OpenedTurn):
            raise TypeError(f"store_turn is a {type(carried).__name__}, not an OpenedTurn")
        return carried

    def unpin_when_collected(self) -> None:
        """A handle dropped without its end (a crashed caller) still lets its chunks go."""
        if self._unpin is not None and self._finalizer is None:
            self._finalizer = weakref.finalize(self, self._unpin, self.pinned)

    def unpin(self) -> None:
        """Let the pinned chunks go (they may move down again); a second call does nothing.
        The handle lets go of the store too: a request or a reply may outlive the server (a
        test's, a metrics history's), and must not keep its tiers alive."""
        unpin, self._unpin = self._unpin, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if unpin is not None:
            unpin(self.pinned)  # empties the list

    def tokens_by_origin(self, start: int, end: int) -> dict[str, int]:
        """The served history's tokens [start, end) by the tier their chunk was in when the turn
        opened; {} when the engine served none."""
        return {} if self.served is None else self.served.tokens_by_origin(start, end)

    def nothing_saved(self) -> None:
        """The engine ended the turn without a save (no tokens, an error): the append waits for
        no commit."""
        if self.chain is not None:
            self.chain.complete(None)
