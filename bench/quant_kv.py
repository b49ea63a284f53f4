"""Quantised KV in the store (issue 25, item 3): what `kv_storage_dtype = int8` saves and costs
against bf16 storage, with the default model in the compute dtype this machine serves.

    kv_bytes_ratio_int8       bytes of one session's history where they land, int8 / bf16: the
                              DRAM tier's blocks (pool tensor bytes) and LMDB's stored values;
                              the larger of the two (per tier: kv_bytes_ratio_int8_<tier>)
    restore_ttft_ratio_int8kv TTFT of the next turn (--new tokens on --history tokens of stored
                              history, which is read from the tier, dequantised, rotated and
                              copied into the pool layer by layer during the prefill, as the
                              engine does) int8 / bf16; the larger of the DRAM and LMDB ratios
                              (each under restore_ttft_ratio_int8kv_<tier>, medians in ms under
                              restore_ttft_ms_<dtype>_<tier>). LMDB is read through the OS page
                              cache once warm (a restart's first read is not timed).
    ppl_int8kv_pct            perplexity of a continuation whose history KV was saved to and
                              loaded from the store, int8 vs bf16 storage, in percent; on the
                              truncation test's text (tests/data/declaration_and_lincoln.txt),
                              windows of --ppl-history + --ppl-cont tokens, pooled

The model computes with dense weights in the compute dtype (`weights = bf16`, or `fp32` where
the CPU serves fp32), so only the KV storage differs between the cases.

Driven without the engine, through StoreConnector and ModelRunner.forward as the engine calls
them (turn 1's prefill saves through the connector's save_layer; turn 2 loads with start_load /
wait_for_layer / finish_loads). Cases are interleaved per rep; medians count.

    python bench/quant_kv.py [--quick] [--no-progress]

`measure_kv(quick)` returns the same dict (bench/quant.py reads it); the script prints it as
JSON, last. --quick: the smallest sizes, a smoke run only (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import progress  # noqa: E402
from chatstore.config import Config, load_config  # noqa: E402
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk  # noqa: E402
from chatstore.engine.request import Request  # noqa: E402
from chatstore.engine.runtime import Runtime, create_runtime  # noqa: E402
from chatstore.store.attention_store import AttentionStore  # noqa: E402
from chatstore.store.settings import StoreSettings  # noqa: E402
from chatstore.transfer import StoreConnector  # noqa: E402

TEXT = ROOT / "tests" / "data" / "declaration_and_lincoln.txt"
STORAGE = {"bf16": torch.bfloat16, "int8": torch.int8}
TIERS = ("dram", "lmdb")
TENANT = "bench"


@dataclass(frozen=True)
class Sizes:
    history: int  # stored tokens before the timed turn
    new: int  # tokens the timed turn computes
    reps: int
    ppl_history: int
    ppl_cont: int
    ppl_windows: tuple[int, ...]  # token offsets into the text body


FULL = Sizes(history=1000, new=100, reps=7, ppl_history=900, ppl_cont=600, ppl_windows=(0, 1350))
QUICK = Sizes(history=64, new=8, reps=1, ppl_history=64, ppl_cont=32, ppl_windows=(0,))


class Rig:
    """The runtime, and per (storage dtype, tier) a store of that tier alone and its connector."""

    def __init__(self, runtime: Runtime, data_dir: Path) -> None:
        self.runtime = runtime
        self.cache, self.runner = runtime.kv_cache, runtime.runner
        self.block = self.cache.block_size
        self.stores: dict[tuple[str, str], AttentionStore] = {}
        self.conns: dict[tuple[str, str], StoreConnector] = {}
        self._ids = 0
        for name, dtype in STORAGE.items():
            for tier in TIERS:
                settings = StoreSettings(
                    data_dir=data_dir / f"{name}-{tier}",
                    dram_bytes=512 << 20 if tier == "dram" else 0,
                    ssd_bytes=2 << 30 if tier == "lmdb" else 0,
                    storage_dtype=dtype,
                    block_size=self.block,
                    persist="off",
                )
                model = runtime.model
                store = AttentionStore(settings, model.spec, model.fingerprint)
                self.stores[name, tier] = store
                self.conns[name, tier] = StoreConnector(store, self.cache, self.runner.rope)

    def table(self, tokens: int) -> list[int]:
        blocks = -(-tokens // self.block)
        assert blocks <= self.cache.num_blocks, "KV pool too small for the sizes asked"
        return list(range(blocks))

    def request(self, ids: list[int], session: str) -> Request:
        self._ids += 1
        return Request(f"q{self._ids}", list(ids), tenant=TENANT, session_id=session)

    def save(self, kind: tuple[str, str], ids: list[int], session: str) -> None:
        """Turn 1: `ids` prefilled with the connector saving their KV, then stored."""
        conn = self.conns[kind]
        req = self.request(ids, session)
        assert conn.num_external_tokens(req, 0) == 0
        table = self.table(len(ids) + 1)
        conn.begin_step([req.request_id])
        batch = ForwardBatch.build([SequenceChunk(ids, 0, table)], self.block, self.runner.device)
        token = int(self.runner.forward(batch, kv_sink=conn.save_layer)[-1].argmax())
        conn.request_finished(req, [*ids, token], table)
        self.stores[kind].flush_writes()

    def restored_turn(
        self, kind: tuple[str, str], ids: list[int], history: int, session: str, logits_all: bool
    ) -> torch.Tensor:
        """Turn 2: the first `history` tokens loaded from the store layer by layer during the
        prefill of the rest, as the engine does; the logits (every new token's, or the last)."""
        conn = self.conns[kind]
        req = self.request(ids, session)
        req.store_turn = self.stores[kind].open_turn(TENANT, session)  # the API's opening
        assert conn.num_external_tokens(req, 0) == history, "the history was not found whole"
        table = self.table(len(ids))
        conn.start_load(req, 0, history, table)
        chunk = SequenceChunk(ids[history:], history, table)
        batch = ForwardBatch.build([chunk], self.block, self.runner.device, all_logits=logits_all)
        logits = self.runner.forward(batch, layer_ready=conn.wait_for_layer)
        errors = conn.finish_loads()
        assert not errors, errors
        conn.forget(req.request_id)
        return logits

    def close(self) -> None:
        for kind, store in self.stores.items():
            self.conns[kind].close()
            store.close(flush_dram=False)


def stored_bytes(store: AttentionStore, tier: str) -> int:
    """The store's sessions where they landed: DRAM blocks (pool tensor bytes) or LMDB values
    (as stored, sealing included when it is on)."""
    # Each store has this one tier, large enough to hold every chunk the sessions name.
    chunks = {c for held in store.chunks_by_tier().values() for c in held}
    if tier == "dram":
        dram = store.tier("dram")
        return sum(dram.size_of(c) for c in chunks)
    ssd = store.tier("ssd")
    return sum(len(ssd.raw_value(c)) for c in chunks)


def text_ids(runtime: Runtime) -> list[int]:
    text = TEXT.read_text()
    body = text[text.index("In Congress") :].split("\n\n", 1)[1]
    return runtime.model.tokenizer.encode(body)


def measure_bytes_and_ttft(rig: Rig, ids: list[int], sizes: Sizes) -> dict[str, float]:
    """One session of `history` tokens saved into every store; its bytes; then the next turn
    timed from each store, interleaved per rep."""
    prompt = ids[: sizes.history + sizes.new]
    for kind in rig.stores:
        rig.save(kind, prompt[: sizes.history], "ttft")
    out: dict[str, float] = {}
    for tier in TIERS:
        b = {name: stored_bytes(rig.stores[name, tier], tier) for name in STORAGE}
        out[f"kv_bytes_{tier}_bf16"] = b["bf16"]
        out[f"kv_bytes_{tier}_int8"] = b["int8"]
        out[f"kv_bytes_ratio_int8_{tier}"] = round(b["int8"] / b["bf16"], 4)
    out["kv_bytes_ratio_int8"] = max(out[f"kv_bytes_ratio_int8_{t}"] for t in TIERS)
    times: dict[tuple[str, str], list[float]] = {kind: [] for kind in rig.stores}
    for kind in rig.stores:  # warm-up: the loader thread started, LMDB pages cached
        rig.restored_turn(kind, prompt, sizes.history, "ttft", logits_all=False)
    for _ in progress.track(range(sizes.reps), "restore TTFT reps"):
        for kind in rig.stores:
            t0 = time.perf_counter()
            int(rig.restored_turn(kind, prompt, sizes.history, "ttft", False)[-1].argmax())
            times[kind].append(time.perf_counter() - t0)
    for (name, tier), t in times.items():
        out[f"restore_ttft_ms_{name}_{tier}"] = round(statistics.median(t) * 1000, 2)
    for tier in TIERS:
        ratio = out[f"restore_ttft_ms_int8_{tier}"] / out[f"restore_ttft_ms_bf16_{tier}"]
        out[f"restore_ttft_ratio_int8kv_{tier}"] = round(ratio, 4)
    out["restore_ttft_ratio_int8kv"] = max(out[f"restore_ttft_ratio_int8kv_{t}"] for t in TIERS)
    return out


def measure_ppl(rig: Rig, ids: list[int], sizes: Sizes) -> dict[str, float]:
    """Pooled perplexity of each window's continuation, its history restored from bf16 and from
    int8 storage (DRAM: the same bytes LMDB and Redis keep), and computed fresh."""
    H, C = sizes.ppl_history, sizes.ppl_cont
    assert len(ids) >= max(sizes.ppl_windows) + H + C, "text too short for the windows asked"
    nll = {"fresh": 0.0, "bf16": 0.0, "int8": 0.0}
    count = 0
    for w, offset in enumerate(progress.track(sizes.ppl_windows, "perplexity windows")):
        window = ids[offset : offset + H + C]
        targets = torch.tensor(window[H + 1 :])
        fresh = ForwardBatch.build(
            [SequenceChunk(window, 0, rig.table(len(window)))],
            rig.block,
            rig.runner.device,
            all_logits=True,
        )
        logits = rig.runner.forward(fresh)[H:-1]
        nll["fresh"] += float(
            torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
        )
        for name in STORAGE:
            kind = (name, "dram")
            rig.save(kind, window[:H], f"ppl{w}")
            logits = rig.restored_turn(kind, window, H, f"ppl{w}", logits_all=True)[:-1]
            loss = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
            nll[name] += float(loss)
        count += len(targets)
    ppl = {name: math.exp(total / count) for name, total in nll.items()}
    return {
        "ppl_fresh": round(ppl["fresh"], 4),
        "ppl_bf16kv": round(ppl["bf16"], 4),
        "ppl_int8kv": round(ppl["int8"], 4),
        "ppl_tokens": count,
        "ppl_int8kv_pct": round(100 * (ppl["int8"] / ppl["bf16"] - 1), 3),
    }


def measure_kv(quick: bool = False) -> dict:
    """kv_bytes_ratio_int8, restore_ttft_ratio_int8kv, ppl_int8kv_pct and what they come from."""
    sizes = QUICK if quick else FULL
    data = Path(tempfile.mkdtemp(prefix="chatstore-bench-quant-kv-"))
    overrides = {"data_dir": str(data), "enable_prefix_cache": False}
    config = load_config(overrides=overrides)
    if "weights" in {f.name for f in fields(Config)}:  # dense weights: only the KV differs
        dense = {"bfloat16": "bf16", "float32": "fp32"}.get(config.resolved_dtype)
        if dense is not None:
            config = load_config(overrides={**overrides, "weights": dense})
    runtime = create_runtime(config)
    rig = Rig(runtime, data)
    try:
        ids = text_ids(runtime)
        with torch.no_grad():
            result: dict = {
                "quick": quick,
                "compute_dtype": str(runtime.kv_cache.dtype).removeprefix("torch."),
                "weights": getattr(config, "weights", "dense"),
                "torch_threads": torch.get_num_threads(),
                "history_tokens": sizes.history,
                "new_tokens": sizes.new,
                "reps": sizes.reps,
            }
            result.update(measure_bytes_and_ttft(rig, ids, sizes))
            result.update(measure_ppl(rig, ids, sizes))
    finally:
        rig.close()
        shutil.rmtree(data, ignore_errors=True)  # the LMDB files of every case
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smallest sizes: a smoke run only")
    progress.add_argument(parser)
    args = parser.parse_args()
    progress.configure(args)
    print(json.dumps(measure_kv(args.quick)))


if __name__ == "__main__":
    main()
