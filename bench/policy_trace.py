"""The ShareGPT-shaped workload of `policy_sim.py` and the schedules it is replayed in.

Assumptions (ShareGPT has no timestamps, so arrivals follow the paper: Poisson), all seeded:
  * sessions arrive Poisson at 1/s
  * turns per session: 27% single-turn, else 1 + ceil(lognormal(1.387, 0.9)), capped at 200 ->
    mean ~5.75 (paper: 5.75, 73% multi-turn) with a heavy tail
  * tokens per turn: user ~ lognormal(mean 100, sigma 1.0), reply ~ lognormal(mean 250,
    sigma 0.8); the KV accumulates turn by turn and is truncated to the context window keeping
    the newest tokens (position-decoupled KV, paper §3.4)
  * think time between the end of a turn and the next: exponential, mean `think` seconds
  * client hint (realistic queue, stretch): the chat client reports "typing" when the user
    starts the next message: `min(think, user tokens / 1 tok/s, lead_max)` seconds before it is sent

A schedule is the order turns run in plus the event stream the store sees:

    (ARRIVE, r, t)   the turn that will be run r joins the waiting queue at t
    (RUN, r, t)      run r starts at t: its session's KV is looked up, then saved grown
    (HINT, s, t)     at t, session s starts typing; its next turn follows within `lead_max`
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np

ARRIVE, RUN, HINT = 0, 1, 2
TYPING_TOKENS_PER_S = 1.0


@dataclass
class Trace:
    """Per session: first arrival; per turn: user and reply tokens, think time after the turn."""

    start: np.ndarray  # [S] seconds
    user: list[np.ndarray]  # S x [turns]
    reply: list[np.ndarray]  # S x [turns]
    think: list[np.ndarray]  # S x [turns]

    def new_tokens(self, s: int, k: int) -> int:
        return int(self.user[s][k] + self.reply[s][k])


def make_trace(n_sessions: int, think_mean: float, seed: int) -> Trace:
    rng = np.random.default_rng(seed)
    start = np.cumsum(rng.exponential(1.0, n_sessions))
    multi = rng.random(n_sessions) >= 0.27
    extra = np.minimum(1 + np.ceil(rng.lognormal(1.387, 0.9, n_sessions)), 200)
    turns = np.where(multi, extra, 1).astype(int)
    user, reply, think = [], [], []
    for n in turns:
        user.append(np.clip(rng.lognormal(np.log(100) - 0.5, 1.0, n), 1, 4096).astype(int))
        reply.append(np.clip(rng.lognormal(np.log(250) - 0.32, 0.8, n), 1, 2048).astype(int))
        think.append(rng.exponential(think_mean, n))
    return Trace(start, user, reply, think)


@dataclass
class Schedule:
    """Turns in the order they run (index r) and the event stream of the replay."""

    sess: list[int]
    hist: list[int]  # KV tokens before the turn (0 = first turn)
    after: list[int]  # KV tokens after it
    time: list[float]  # start time
    next_run: list[int]  # the session's next run index, -1 if none
    events: list[tuple[int, int, float]]
    oracle: bool  # True: the waiting queue is the whole future
    lead_max: float = 0.0  # a hinted turn arrives at most this long after its hint


def _kv_tokens(trace: Trace, ctx: int) -> list[list[int]]:
    out = []
    for s in range(len(trace.start)):
        kv, acc = [], 0
        for k in range(len(trace.user[s])):
            acc = min(ctx, acc + trace.new_tokens(s, k))
            kv.append(acc)
        out.append(kv)
    return out


def _schedule(trace: Trace, ctx: int, runs: list[tuple[float, int, int]], events, oracle: bool):
    kv = _kv_tokens(trace, ctx)
    sess = [s for _, s, _ in runs]
    turn = [k for _, _, k in runs]
    next_run, last = [-1] * len(runs), {}
    for r in range(len(runs) - 1, -1, -1):
        next_run[r] = last.get(sess[r], -1)
        last[sess[r]] = r
    hist = [kv[s][k - 1] if k else 0 for s, k in zip(sess, turn, strict=True)]
    after = [kv[s][k] for s, k in zip(sess, turn, strict=True)]
    return Schedule(sess, hist, after, [t for t, _, _ in runs], next_run, events, oracle)


def oracle_schedule(trace: Trace, ctx: int) -> Schedule:
    """Paper-style replay: every turn known in advance, service instantaneous."""
    runs = []
    for s, (t0, think) in enumerate(zip(trace.start, trace.think, strict=True)):
        t = float(t0)
        for k in range(len(think)):
            runs.append((t, s, k))
            t += float(think[k])
    runs.sort()
    events = [(RUN, r, t) for r, (t, _, _) in enumerate(runs)]
    return _schedule(trace, ctx, runs, events, oracle=True)


def realistic_schedule(trace: Trace, ctx: int, load: float, lead_max: float) -> Schedule:
    """One FIFO server at utilisation `load`, service time proportional to the turn's tokens;
    a session's next turn arrives a think time after its previous turn *finished*."""
    total = sum(int(u.sum() + r.sum()) for u, r in zip(trace.user, trace.reply, strict=True))
    n_turns = sum(len(u) for u in trace.user)
    turn_rate = n_turns / float(trace.start[-1] - trace.start[0])
    sec_per_token = load / turn_rate / (total / n_turns)
    heap = [(float(t0), ARRIVE, s, 0) for s, t0 in enumerate(trace.start)]
    heapq.heapify(heap)
    queue: deque[tuple[float, int, int, int]] = deque()  # (arrival, session, turn, run index)
    runs, events, t_free, n_arrived = [], [], 0.0, 0
    while heap or queue:
        t_start = max(t_free, queue[0][0]) if queue else float("inf")
        if heap and heap[0][0] < t_start:
            t, kind, s, k = heapq.heappop(heap)
            if kind == HINT:
                events.append((HINT, s, t))
                continue
            queue.append((t, s, k, n_arrived))
            events.append((ARRIVE, n_arrived, t))
            n_arrived += 1
            continue
        _, s, k, r = queue.popleft()
        runs.append((t_start, s, k))
        events.append((RUN, r, t_start))
        t_free = t_start + sec_per_token * trace.new_tokens(s, k)
        if k + 1 < len(trace.think[s]):
            t_next = t_free + float(trace.think[s][k])
            heapq.heappush(heap, (t_next, ARRIVE, s, k + 1))
            heapq.heappush(heap, (t_next - _lead(trace, s, k + 1, lead_max), HINT, s, k + 1))
    sched = _schedule(trace, ctx, runs, events, oracle=False)
    sched.lead_max = lead_max
    return sched


def _lead(trace: Trace, s: int, k: int, lead_max: float) -> float:
    """How long before sending turn k the user starts typing it (never before the last reply)."""
    think = float(trace.think[s][k - 1])
    return min(think, float(trace.user[s][k]) / TYPING_TOKENS_PER_S, lead_max)


def reuse_distances(sched: Schedule) -> np.ndarray:
    """Distinct other sessions run between consecutive turns of a session (Fenwick tree)."""
    n = len(sched.sess)
    tree = [0] * (n + 1)

    def add(i: int, d: int) -> None:
        i += 1
        while i <= n:
            tree[i] += d
            i += i & -i

    def prefix(i: int) -> int:  # sum over [0, i)
        total = 0
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total

    last: dict[int, int] = {}
    out = []
    for r, s in enumerate(sched.sess):
        prev = last.get(s)
        if prev is not None:
            out.append(prefix(r) - prefix(prev + 1))
            add(prev, -1)
        add(r, 1)
        last[s] = r
    return np.asarray(out)
