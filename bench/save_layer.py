"""Engine-thread cost of the save write stream per decode step: LayerSaver vs per-request copies.

During every forward the connector's save_layer receives each layer's new pre-RoPE K and V. The
baseline copies every request's rows separately (two copies and a position copy per request per
layer: what chatstore did before LayerSaver); LayerSaver makes one copy per layer of the whole
step's rows, into each request's own pages of its row arena, and places the rows once per step.
Timed: the 30 layers of one decode step of the default model's shape (3 KV heads x 64), batch
1 / 8 / 32, median of --reps.

    python bench/save_layer.py [--reps 200] [--plot-dir bench/out]

Writes <plot dir>/save_layer_ms_per_step.png: both schemes' ms per decode step, by batch size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import plots  # noqa: E402
from bench.engine_speed import median_seconds  # noqa: E402
from chatstore.transfer.layer_saver import LayerSaver  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, Q_HEADS = 30, 3, 64, 9


def per_request_copies(kept: dict, ids, positions, k, v, query_lens, layer: int) -> None:
    row = 0
    for rid, n in zip(ids, query_lens, strict=True):
        kept.setdefault(rid, {}).setdefault(layer, []).append(
            (
                positions[row : row + n].cpu(),
                k[row : row + n].to("cpu", torch.float32, copy=True),
                v[row : row + n].to("cpu", torch.float32, copy=True),
            )
        )
        row += n


def time_batch(batch: int, reps: int) -> dict[str, float]:
    """Median ms per decode step (all layers) of both schemes at this batch size."""
    ids = [f"r{i}" for i in range(batch)]
    query_lens = [1] * batch
    positions = torch.arange(batch) + 500
    qkv = torch.randn(batch, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)  # k, v: views, as in the runner
    k = qkv[:, Q_HEADS * HEAD_DIM : (Q_HEADS + KV_HEADS) * HEAD_DIM].view(-1, KV_HEADS, HEAD_DIM)
    v = qkv[:, (Q_HEADS + KV_HEADS) * HEAD_DIM :].view(-1, KV_HEADS, HEAD_DIM)
    saver = LayerSaver(LAYERS, torch.float32, torch.device("cpu"))
    for rid in ids:
        saver.track(rid)
    kept: dict = {}

    def ours() -> None:
        for layer in range(LAYERS):
            saver.save_layer(layer, k, v, positions, ids, query_lens)

    def baseline() -> None:
        for layer in range(LAYERS):
            per_request_copies(kept, ids, positions, k, v, query_lens, layer)

    return {
        name: median_seconds(fn, reps, warmup=10) * 1000
        for name, fn in (("baseline", baseline), ("ours", ours))
    }


def plot_by_batch(plot_dir: Path, by_batch: dict[int, dict[str, float]]) -> Path:
    names = {"baseline": "per-request copies (before)", "ours": "LayerSaver"}
    values = {names[k]: [ms[k] for ms in by_batch.values()] for k in names}
    return plots.bar_chart(
        plots.plot_path(plot_dir, "save_layer", "ms_per_step"),
        [plots.Bars("", [f"batch {b}" for b in by_batch], values)],
        title=f"save_layer: engine-thread save work per decode step ({LAYERS} layers, median)",
        ylabel="ms per decode step",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=200)
    plots.add_argument(parser)
    args = parser.parse_args()
    result: dict[str, object] = {"layers": LAYERS, "reps": args.reps}
    by_batch: dict[int, dict[str, float]] = {}
    for batch in (1, 8, 32):
        ms = by_batch[batch] = time_batch(batch, args.reps)
        ratio = ms["baseline"] / ms["ours"]
        print(
            f"batch {batch:2d}: per-request copies {ms['baseline']:.3f} ms, "
            f"LayerSaver {ms['ours']:.3f} ms per decode step ({ratio:.1f}x)",
            file=sys.stderr,
        )
        result[f"ms_per_step_b{batch}_baseline"] = round(ms["baseline"], 3)
        result[f"ms_per_step_b{batch}_ours"] = round(ms["ours"], 3)
        result[f"speedup_b{batch}"] = round(ratio, 2)
    plot_by_batch(args.plot_dir, by_batch)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
