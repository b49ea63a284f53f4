"""Trace-driven placement-policy simulator (CachedAttention Fig. 21). No model, no I/O.

Replays a ShareGPT-shaped multi-turn trace (`policy_trace.py`: workload assumptions, schedules)
against a two-tier session-KV store, DRAM -> SSD, exclusive (a session lives in one tier), and
reports per policy the hit rate of turns that have history, the share of those hits served from
DRAM, and the token hit rate (history tokens found / history tokens needed). The policies are the
store's own (`chatstore.store.placement.policies`): aware, lru, fifo, and belady (furthest
next use, whole future known) as a reference bound; in realistic queues also aware+hint (aware
whose look-ahead also holds sessions whose client reported "typing", the stretch).

  * 9,000 sessions (`--quick`: 1,500 and capacities scaled down 1/6), ~52K turns; the first 20%
    of the turns warm the store and are not counted (paper: 10K of 52K)
  * KV bytes per token: 13B (LLaMA-2-13B fp16) 819,200 B = 0.78 MiB, context 4,096;
    SmolLM2-135M fp32 46,080 B, context 8,192
  * queue "oracle": the waiting queue is every future turn (a paper-style replay);
    "realistic@rho": one FIFO server at utilisation rho, the queue is what has arrived and waits
  * store: a turn looks its session up (DRAM hit, SSD hit or miss), then writes the grown KV to
    DRAM; room is made by `choose_victims` (DRAM demotes to SSD, SSD drops). After each event
    `prefetch_candidates` are promoted SSD -> DRAM over one SSD read channel (`--ssd-gbps`,
    default 5: the paper's "< 5 GB/s" disk; 0 = unlimited). A session whose prefetch has not
    finished when its turn starts counts as an SSD hit; no prefetch starts while the disk is
    booked for more than `--prefetch-backlog` s (2). Writes and demand reads are free.

Per setting it prints what the result depends on: queue depth (distinct sessions queued, mean),
median reuse distance (distinct other sessions run between two turns of a session), capacity in
sessions ((C_mem + C_ssd) / mean stored KV), live KV / capacity (KV of sessions that will run
again over C_mem + C_ssd, mean), and the SSD read rate each policy's prefetch asked for. The last
line is one JSON object for the headline setting (13B, 128 GB / 2 TB, think 600 s, oracle).

    .venv/bin/python bench/policy_sim.py            # full sweep (a few minutes)
    .venv/bin/python bench/policy_sim.py --quick    # two small settings (< 30 s)

Writes <plot dir>/policy_sim_hit_rate.png: hit rate per policy, one group of bars per capacity,
one panel per queue (`--plot-dir`, default bench/out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from functools import partial
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from policy_trace import (
    ARRIVE,
    HINT,
    Schedule,
    make_trace,
    oracle_schedule,
    realistic_schedule,
    reuse_distances,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import plots, progress
from chatstore.store.placement.policies import (
    BeladyPolicy,
    EvictionPolicy,
    SortedLookahead,
    make_policy,
)

GB = 10**9
MODELS = {"13B": (819_200, 4096), "SmolLM2-135M": (46_080, 8192)}  # bytes/token, context
POLICY_NAMES = ("aware", "lru", "fifo", "belady")
HINT_POLICY = "aware+hint"


@dataclass
class Result:
    hits: int = 0
    dram_hits: int = 0
    lookups: int = 0
    hit_tokens: int = 0
    hist_tokens: int = 0
    prefetch_bps: float = 0.0  # SSD reads for prefetch, 20%-80% of the trace
    queue_depth: float = 0.0
    live_over_cap: float = 0.0
    stored_kv: float = 0.0  # mean stored session KV, bytes


class TwoTierStore:
    """DRAM + SSD bookkeeping driven by a policy; sizes only, no data."""

    def __init__(
        self, policy: EvictionPolicy, caps: tuple[int, int], ssd_bps: float, backlog: float
    ) -> None:
        self.policy, self.caps, self.ssd_bps, self.backlog = policy, caps, ssd_bps, backlog
        self.ready_at: dict[int, float] = {}  # prefetched: DRAM copy complete at
        self.channel_free = 0.0
        self.prefetched = 0  # bytes

    def place(self, tier: int, s: int, size: int, lk: SortedLookahead) -> None:
        """Put `s` in `tier` or below, demoting or dropping what the policy picks."""
        pol = self.policy
        while tier < len(self.caps):
            need = pol.used(tier) + size - self.caps[tier]
            if size <= self.caps[tier]:
                victims = pol.choose_victims(tier, need, lk, incoming=s) if need > 0 else []
                if victims != [s]:
                    self._swap_in(tier, s, size, victims, lk)
                    return
            tier += 1
        pol.on_forget(s)

    def prefetch(self, now: float, lk: SortedLookahead) -> None:
        pol = self.policy
        for s in pol.prefetch_candidates(lk):
            if self.ssd_bps > 0 and self.channel_free - now > self.backlog:
                break  # the disk is busy for longer than a prefetch stays useful
            size = pol.size_of(s)
            if size > self.caps[0]:
                continue
            need = pol.used(0) + size - self.caps[0]
            victims = pol.choose_victims(0, need, lk, incoming=s) if need > 0 else []
            if victims == [s]:
                break  # later candidates are worth even less
            pol.on_remove(pol.tier_of(s), s)
            self._swap_in(0, s, size, victims, lk)
            self.prefetched += size
            if self.ssd_bps > 0:
                self.channel_free = max(now, self.channel_free) + size / self.ssd_bps
                self.ready_at[s] = self.channel_free

    def _swap_in(self, tier: int, s: int, size: int, victims: list, lk: SortedLookahead) -> None:
        pol = self.policy
        moved = [(v, pol.size_of(v)) for v in victims]
        for v, _ in moved:
            pol.on_remove(tier, v)
        pol.on_insert(tier, s, size)
        for v, vsize in moved:
            self.place(tier + 1, v, vsize, lk)


def replay(
    sched: Schedule, label: str, caps: tuple[int, int], bpt: int, gbps: float, backlog: float
) -> Result:
    hints = label == HINT_POLICY
    policy = make_policy("aware" if hints else label, caps)
    store = TwoTierStore(policy, caps, gbps * GB, backlog)
    future = SortedLookahead()  # the truth, keyed by run index
    for r in range(len(sched.sess) - 1, -1, -1):
        if sched.hist[r] == 0:
            future.push(sched.sess[r], r)
    queue = future if sched.oracle else SortedLookahead()  # the scheduler's, keyed by time
    if isinstance(policy, BeladyPolicy):
        policy.bind(future)
    res, warmup, live, samples = Result(), len(sched.sess) // 5, 0, 0
    rate_end, rate = len(sched.sess) * 4 // 5, []
    for kind, x, now in sched.events:
        if kind == HINT:
            if hints and queue.position(x) is None:
                queue.push(x, now + sched.lead_max)
                store.prefetch(now, queue)
            continue
        if kind == ARRIVE:
            s = sched.sess[x]
            if queue.position(s) is not None:
                queue.pop(s)  # its hint
            queue.push(s, now)
            store.prefetch(now, queue)
            continue
        s, r = sched.sess[x], x
        if r in (warmup, rate_end):  # prefetch rate over the steady part, 20%-80%
            rate.append((store.prefetched, now))
        tier = policy.tier_of(s)
        if r >= warmup:
            samples += 1
            res.queue_depth += len(queue)
            res.live_over_cap += live / sum(caps)
            res.stored_kv += policy.mean_kv_bytes()
            if sched.hist[r] > 0:
                res.lookups += 1
                res.hist_tokens += sched.hist[r]
                if tier is not None:
                    res.hits += 1
                    res.hit_tokens += sched.hist[r]
                    res.dram_hits += tier == 0 and store.ready_at.get(s, 0.0) <= now
        if tier is not None:
            policy.on_remove(tier, s)
        future.pop(s)
        if not sched.oracle:
            queue.pop(s)
        if sched.next_run[r] >= 0:
            future.push(s, sched.next_run[r])
        live += (sched.after[r] if sched.next_run[r] >= 0 else 0) * bpt - sched.hist[r] * bpt
        policy.on_access(s)
        store.place(0, s, sched.after[r] * bpt, queue)
        store.prefetch(now, queue)
    for f in ("queue_depth", "live_over_cap", "stored_kv"):
        setattr(res, f, getattr(res, f) / max(samples, 1))
    (b0, t0), (b1, t1) = rate
    res.prefetch_bps = (b1 - b0) / max(t1 - t0, 1e-9)
    return res


# -- the sweep ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    model: str
    dram_gb: int
    ssd_gb: int
    think: float
    load: float | None  # None = oracle queue

    def label(self) -> str:
        queue = "oracle" if self.load is None else f"realistic@{self.load:g}"
        ssd = f"{self.ssd_gb / 1000:g}T" if self.ssd_gb >= 1000 else f"{self.ssd_gb}G"
        return f"{self.model} {self.dram_gb}G/{ssd} think={self.think:g}s {queue}"

    def capacity_label(self) -> str:
        """What the plot groups by within one queue: model, capacities and (if not the
        paper's 600 s) the think time."""
        ssd = f"{self.ssd_gb / 1000:g}T" if self.ssd_gb >= 1000 else f"{self.ssd_gb}G"
        think = "" if self.think == 600.0 else f"\nthink {self.think:g} s"
        return f"{self.model}\n{self.dram_gb}G / {ssd}{think}"

    def queue_label(self) -> str:
        return "oracle queue" if self.load is None else f"realistic queue, load {self.load:g}"


def settings(quick: bool) -> list[Setting]:
    if quick:  # the headline at 1/6 scale: 1,500 sessions, capacities / 6
        return [Setting("13B", 21, 333, 600.0, None), Setting("13B", 21, 333, 600.0, 0.7)]
    out = [Setting("13B", 128, 2000, 600.0, None)]  # the headline first
    for load in (None, 0.7, 1.0, 1.3):
        for dram, ssd in ((128, 2000), (128, 10000), (64, 1000)):
            out.append(Setting("13B", dram, ssd, 600.0, load))
        out.append(Setting("SmolLM2-135M", 8, 128, 600.0, load))
    for think in (60.0, 1800.0):
        out.append(Setting("13B", 128, 2000, think, None))
        out.append(Setting("13B", 128, 2000, think, 0.7))
    return out[1:]


def run_setting(
    st: Setting, n_sessions: int, seed: int, gbps: float, backlog: float, lead_max: float
) -> dict:
    bpt, ctx = MODELS[st.model]
    trace = make_trace(n_sessions, st.think, seed)
    if st.load is None:
        sched, names = oracle_schedule(trace, ctx), POLICY_NAMES
    else:
        sched, names = (
            realistic_schedule(trace, ctx, st.load, lead_max),
            (*POLICY_NAMES, HINT_POLICY),
        )
    caps = (st.dram_gb * GB, st.ssd_gb * GB)
    results = {name: replay(sched, name, caps, bpt, gbps, backlog) for name in names}
    ref = results["aware"]
    return {
        "setting": st.label(),
        "queue_depth": ref.queue_depth,
        "hinted_queue_depth": results[HINT_POLICY].queue_depth if HINT_POLICY in results else None,
        "reuse_p50_sessions": float(np.median(reuse_distances(sched)[len(sched.sess) // 5 :])),
        "capacity_sessions": sum(caps) / max(ref.stored_kv, 1),
        "live_over_capacity": ref.live_over_cap,
        "policies": {
            n: {
                "hit_rate": r.hits / max(r.lookups, 1),
                "dram_share": r.dram_hits / max(r.hits, 1),
                "token_hit_rate": r.hit_tokens / max(r.hist_tokens, 1),
                "prefetch_gbps": r.prefetch_bps / GB,
            }
            for n, r in results.items()
        },
    }


def _num(x: float) -> str:
    return f"{x:.1f}" if x < 10 else f"{x:.0f}"


def print_setting(row: dict) -> None:
    depth = _num(row["queue_depth"])
    if row["hinted_queue_depth"] is not None:
        depth += f" (with typing hints {_num(row['hinted_queue_depth'])})"
    print(
        f"\n{row['setting']}: queue depth {depth} sessions, "
        f"reuse p50 {row['reuse_p50_sessions']:.0f} sessions, capacity "
        f"{row['capacity_sessions']:.0f} sessions, live KV / capacity "
        f"{row['live_over_capacity']:.2f}"
    )
    print(f"  {'policy':10} {'hit rate':>9} {'DRAM share':>11} {'token hit':>10} {'pf GB/s':>8}")
    for name, p in row["policies"].items():
        print(
            f"  {name:10} {p['hit_rate']:9.3f} {p['dram_share']:11.3f} "
            f"{p['token_hit_rate']:10.3f} {p['prefetch_gbps']:8.2f}"
        )


def plot_hit_rates(plot_dir: Path, chosen: list[Setting], rows: list[dict]) -> Path:
    """Hit rate by policy and capacity, a panel per queue (rows from `run_setting`)."""
    groups: dict[str, list[str]] = {}
    values: dict[str, dict[str, list[float]]] = {}
    for st, row in zip(chosen, rows, strict=True):
        queue = st.queue_label()
        groups.setdefault(queue, []).append(st.capacity_label())
        for name, p in row["policies"].items():
            values.setdefault(queue, {}).setdefault(name, []).append(p["hit_rate"])
    panels = [plots.Bars(q, groups[q], values[q]) for q in groups]
    return plots.bar_chart(
        plots.plot_path(plot_dir, "policy_sim", "hit_rate"),
        panels,
        title="policy_sim: hit rate of turns with history (DRAM + SSD), by policy and capacity",
        ylabel="hit rate",
        ymax=1.05,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1,500 sessions, two settings (< 30 s)")
    ap.add_argument("--sessions", type=int, default=None, help="sessions in the trace (9000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ssd-gbps", type=float, default=5.0, help="SSD read GB/s; 0 = unlimited")
    ap.add_argument(
        "--prefetch-backlog",
        type=float,
        default=2.0,
        help="no new prefetch while the SSD is busy for longer than this many seconds",
    )
    ap.add_argument("--only", default="", help="run the settings whose label contains this")
    ap.add_argument("--jobs", type=int, default=2, help="settings run in parallel")
    ap.add_argument("--hint-lead-max", type=float, default=60.0, help="typing hint, at most s")
    plots.add_argument(ap)
    progress.add_argument(ap)
    args = ap.parse_args()
    progress.configure(args)
    n_sessions = args.sessions or (1500 if args.quick else 9000)
    t0 = time.perf_counter()
    rows = []
    run = partial(
        run_setting,
        n_sessions=n_sessions,
        seed=args.seed,
        gbps=args.ssd_gbps,
        backlog=args.prefetch_backlog,
        lead_max=args.hint_lead_max,
    )
    with Pool(max(args.jobs, 1)) as pool:
        chosen = [st for st in settings(args.quick) if args.only in st.label()]
        settings_done = progress.track(pool.imap(run, chosen), "policy_sim settings", len(chosen))
        for row in settings_done:  # in order; each setting is seeded
            rows.append(row)
            print_setting(row)
            sys.stdout.flush()
    pol = [r["policies"] for r in rows]
    worse = [
        r["setting"]
        for r, p in zip(rows, pol, strict=True)
        if p["aware"]["hit_rate"] < p["lru"]["hit_rate"]
    ]
    print(f"\nsettings where aware < lru (hit rate): {worse or 'none'}")
    print(f"{len(rows)} settings in {time.perf_counter() - t0:.0f} s")
    plot_hit_rates(args.plot_dir, chosen, rows)
    head = rows[0]
    out = {f"hit_rate_{n}": round(p["hit_rate"], 4) for n, p in head["policies"].items()}
    out["dram_hit_share_aware"] = round(head["policies"]["aware"]["dram_share"], 4)
    out["setting"] = head["setting"]
    out["sessions"] = n_sessions
    print(json.dumps(out))


if __name__ == "__main__":
    main()
