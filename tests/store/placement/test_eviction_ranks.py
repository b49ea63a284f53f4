"""Eviction from kept ranks (placement/chunk_ranks.py, issue 37 item 4): the same victims as the
walk over ranked owners it replaces (tests/support/eviction_reference.py), over randomized
workloads where many sessions share prefix chunks; and a victim that asks for no owner set and
ranks no session, however many sessions hold its tier's chunks."""

from __future__ import annotations

import random
import threading
from collections.abc import Hashable

import pytest

from chatstore.store.placement.chunk_placement import ChunkPlacement
from chatstore.store.placement.policies import PolicyChooser, SortedLookahead, make_policy
from chatstore.store.session_kv import ChunkKey, SessionKey, SessionKV
from chatstore.store.sessions.index import SessionChain, SessionIndex
from chatstore.store.tiers.base import IndexedTier
from tests.support.eviction_reference import reference_victim

SYSTEM = ChunkKey("t", "system")


class NameTier(IndexedTier):
    """A tier of chunk names only: which chunks a tier holds is all eviction reads of it."""

    def __init__(self, name: str) -> None:
        super().__init__(1 << 40)
        self.name = name

    def put(self, key: ChunkKey, value: SessionKV | None = None) -> None:
        self._index.set(key, 1)

    def get(self, key: ChunkKey) -> SessionKV | None:
        return None

    def delete(self, key: ChunkKey) -> bool:
        return self._index.pop(key)


class World:
    """An index, a session chooser, two tiers and pins, as the store wires them."""

    def __init__(self, policy: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.queue: list[SessionKey] = []
        policy_ = make_policy(policy, (200, 200))
        self.chooser = PolicyChooser(policy_, lambda: list(self.queue), lambda: 10.0)
        self.index = SessionIndex()
        self.pins: set[ChunkKey] = set()
        self.placement = ChunkPlacement(
            self.chooser, self.index.owners_of, self.index.position_of, self.pins, "dram"
        )
        self.tiers = {"dram": NameTier("dram"), "ssd": NameTier("ssd")}
        self.placement.bind_tiers(list(self.tiers.values()), threading.RLock())
        self.placement.follow(self.index)
        self.chains: dict[SessionKey, list[ChunkKey]] = {}
        self.made = 0

    def new_chunk(self) -> ChunkKey:
        self.made += 1
        return ChunkKey("t", f"c{self.made}")

    def turn(self, session: SessionKey, chain: list[ChunkKey]) -> None:
        self.chains[session] = chain
        self.index.set(session, SessionChain([], list(chain)))
        self.chooser.touch(session)
        for chunk in chain[-2:]:
            self.tiers[self.rng.choice(["dram", "ssd"])].put(chunk)

    def step(self) -> None:
        rng, sessions = self.rng, list(self.chains)
        op = rng.random()
        if op < 0.3 or len(sessions) < 3:  # a turn: a new session (maybe a fork) or a longer one
            if sessions and rng.random() < 0.5:
                other = self.chains[rng.choice(sessions)]
                chain = [*other[: rng.randint(1, len(other))], self.new_chunk()]
            else:
                chain = [SYSTEM, self.new_chunk()]
            self.turn(SessionKey("t", f"s{rng.randrange(60)}"), chain)
        elif op < 0.4:
            s = rng.choice(sessions)
            self.turn(s, [*self.chains[s], self.new_chunk()])
        elif op < 0.5:
            self.chooser.touch(rng.choice(sessions))
        elif op < 0.55:
            s = rng.choice(sessions)
            self.index.remove(s)
            self.chooser.forget(s)
            del self.chains[s]
        elif op < 0.6:
            s = rng.choice(sessions)
            if len(self.chains[s]) > 2:  # a truncation keeps the first chunk, drops the next
                self.chains[s] = [self.chains[s][0], *self.chains[s][2:]]
                self.index.set(s, SessionChain([], list(self.chains[s])))
        elif op < 0.65:
            self.chooser.set_priority(rng.choice(sessions), rng.choice([-1, 0, 0, 1, 2]))
        elif op < 0.75:
            self.queue = rng.sample(sessions, rng.randint(0, min(6, len(sessions))))
        elif op < 0.8:
            tier = self.tiers[rng.choice(["dram", "ssd"])]
            keys = tier.keys()
            if keys:
                tier.delete(rng.choice(keys))
            tier.put(self.new_chunk())  # a chunk nobody holds: an orphan
        elif op < 0.85:
            keys = self.tiers["dram"].keys()
            if keys and rng.random() < 0.6:
                self.pins.add(rng.choice(keys))
            elif self.pins:
                self.pins.discard(rng.choice(sorted(self.pins, key=str)))
        else:
            self.check_evictions(rng.randint(1, 3))

    def reference(self, tier: str, exclude: set[ChunkKey]) -> ChunkKey | None:
        candidates = [k for k in self.tiers[tier].keys() if k not in exclude]  # noqa: SIM118

        def rank(sessions: list[Hashable]) -> list[Hashable]:
            return self.chooser.rank(tier, sessions)  # the store's session ranking, queue too

        pinned = self.pins if tier == "dram" else frozenset()
        return reference_victim(
            candidates, self.index.owners_of, rank, self.index.position_of, pinned
        )

    def check_evictions(self, count: int) -> None:
        """count evictions from each tier, as the tiers make room: each victim leaves."""
        for name, tier in self.tiers.items():
            for _ in range(count):
                keys = tier.keys()
                exclude = set(self.rng.sample(keys, min(len(keys), self.rng.randint(0, 2))))
                expected = self.reference(name, exclude)
                assert self.placement.victim(tier, exclude) == expected
                if expected is None:
                    break
                tier.delete(expected)


@pytest.mark.parametrize("policy", ["lru", "fifo", "aware"])
@pytest.mark.parametrize("seed", range(6))
def test_victims_match_the_walk_over_ranked_owners(policy, seed):
    world = World(policy, seed)
    assert world.placement.ranks is not None  # the kept ranks answer, not the walk
    for _ in range(400):
        world.step()
    world.check_evictions(50)


def test_a_chooser_without_kept_ranks_walks_as_before():
    """Belady's values move with the future it is bound to, untold: the walk answers."""
    world = World("belady", 0)
    assert world.placement.ranks is None
    world.chooser.policy.bind(SortedLookahead())  # type: ignore[attr-defined]
    world.turn(SessionKey("t", "a"), [SYSTEM, world.new_chunk()])
    assert world.placement.victim(world.tiers["ssd"], ()) == world.reference("ssd", set())


def test_never_touched_sessions_go_first_one_session_at_a_time():
    """Sessions found on disk (restored, never touched) tie in the chooser's ranking; they go
    before touched ones, each session's chunks together and deepest first."""
    world = World("lru", 0)
    ssd = world.tiers["ssd"]
    restored = {}
    for i in range(3):
        chain = [SYSTEM, world.new_chunk(), world.new_chunk()]
        restored[chain[1]] = restored[chain[2]] = i
        world.index.set(SessionKey("t", f"u{i}"), SessionChain([], chain))
        for chunk in chain:
            ssd.put(chunk)
    mine = world.new_chunk()
    world.turn(SessionKey("t", "live"), [SYSTEM, mine])
    ssd.put(mine)
    order = []
    while (victim := world.placement.victim(ssd, ())) is not None:
        order.append(victim)
        ssd.delete(victim)
    owners = [restored[c] for c in order[:6]]
    assert owners[0::2] == owners[1::2] and sorted(owners[0::2]) == [0, 1, 2]
    assert all(world.index.position_of(c) == 2 for c in order[0:6:2])  # deepest first
    assert order[6:] == [mine, SYSTEM]  # the live session's, its own chunk before the shared


class Counted:
    """Counts the calls of the functions eviction might ask per owner."""

    def __init__(self, world: World) -> None:
        self.calls = {"owners_of": 0, "rank": 0, "rank_key": 0, "queued_rank_keys": 0}
        for obj, name in (
            (world.index, "owners_of"),
            (world.chooser, "rank"),
            (world.chooser, "rank_key"),
            (world.chooser, "queued_rank_keys"),
        ):
            setattr(obj, name, self._wrap(name, getattr(obj, name)))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)

        return counted


def shared_world(sessions: int) -> World:
    """S sessions hold the system chunk and one of their own, every chunk in the SSD tier; the
    first and the last session are queued."""
    world = World("aware", 0)
    ssd = world.tiers["ssd"]
    ssd.put(SYSTEM)
    for i in range(sessions):
        own = world.new_chunk()
        world.turn(SessionKey("t", f"s{i}"), [SYSTEM, own])
        ssd.put(own)
    world.queue = [SessionKey("t", "s0"), SessionKey("t", f"s{sessions - 1}")]
    return world


@pytest.mark.parametrize("sessions", [10, 3000])
def test_a_victim_ranks_no_owner_however_many_share_a_chunk(sessions):
    """Every victim until the tier is empty (10 sessions) or for twenty evictions (3,000) asks
    for no owner set and ranks no session; the queue is read once a decision. The victims are
    the walk's: least recently used first, the queued sessions' chunks last."""
    world, reference = shared_world(sessions), shared_world(sessions)
    ranks = world.placement.ranks
    assert ranks is not None
    with ranks._lock:
        ranks.apply()  # what the population queued
    counted = Counted(world)
    evictions = min(20, sessions + 1)
    ssd, expected = world.tiers["ssd"], []
    for _ in range(evictions):
        expected.append(reference.reference("ssd", set()))
        reference.tiers["ssd"].delete(expected[-1])
    victims = []
    for _ in range(evictions):
        victims.append(world.placement.victim(ssd, ()))
        ssd.delete(victims[-1])
    assert victims == expected
    assert counted.calls == {
        "owners_of": 0,
        "rank": 0,
        "rank_key": 0,
        "queued_rank_keys": evictions,
    }
    if sessions == 10:  # the queued sessions' own chunks last, the system chunk with s0's
        assert victims[-3:] == [ChunkKey("t", "c10"), ChunkKey("t", "c1"), SYSTEM]
