"""The benchmarks' PNG plots and progress bars (bench/plots.py, bench/progress.py).

Plots are drawn from real runs kept tiny (the policy simulator on a 150-session trace, a
two-session multiturn run on the default model) and read back with matplotlib: a PNG of the
figure's size in pixels whose bars or lines carry the colours they were drawn in. The progress
bar runs in a child process whose stderr is a real pseudo-terminal: drawn there, never on stdout,
and nothing at all with --no-progress or when stderr is not a terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# matplotlib's default colour cycle: C0, C1, ... are the first, second, ... series drawn.
CYCLE = [(0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E), (0x2C, 0xA0, 0x2C), (0xD6, 0x27, 0x28)]
CYCLE += [(0x94, 0x67, 0xBD)]


@pytest.fixture
def bench_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Import paths as when a bench runs as a script: its own folder and the repository."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.syspath_prepend(str(ROOT))


def read_png(path: Path) -> np.ndarray:
    """The image as [H, W, 3] uint8, after checking it is a real, non-trivial PNG."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 10_000, len(data)  # axes, labels and data, not an empty canvas
    rgba = matplotlib.image.imread(path)
    return (rgba[..., :3] * 255).round().astype(np.uint8)


def has_colour(image: np.ndarray, rgb: tuple[int, int, int], at_least: int = 20) -> bool:
    return int(np.all(image == np.array(rgb, np.uint8), axis=-1).sum()) >= at_least


def test_policy_sim_hit_rate_plot_from_a_tiny_trace(bench_path, tmp_path: Path) -> None:
    from bench import policy_sim

    chosen = [
        policy_sim.Setting("13B", 2, 40, 600.0, None),
        policy_sim.Setting("13B", 2, 40, 600.0, 0.7),
        policy_sim.Setting("SmolLM2-135M", 1, 8, 600.0, None),
    ]
    rows = [policy_sim.run_setting(st, 150, 0, 5.0, 2.0, 60.0) for st in chosen]
    assert rows[0]["policies"]["aware"]["hit_rate"] > 0  # a trace with reuse to plot

    path = policy_sim.plot_hit_rates(tmp_path / "plots", chosen, rows)

    assert path == tmp_path / "plots" / "policy_sim_hit_rate.png"
    image = read_png(path)
    # bar_chart: 4 + 1.6 in per group of bars (3 groups over two panels) by 4.8 in, 100 dpi.
    assert image.shape == (480, 880, 3)
    # aware, lru, fifo, belady, and aware+hint (realistic queue only): each its own colour.
    for rgb in CYCLE:
        assert has_colour(image, rgb), rgb


def test_bar_chart_keeps_a_label_s_colour_across_panels(bench_path, tmp_path: Path) -> None:
    from bench import plots

    panels = [
        plots.Bars("a", ["x"], {"first": [1.0]}),
        plots.Bars("b", ["x", "y"], {"second": [2.0, 1.0], "first": [0.5, 1.5]}),
    ]
    image = read_png(plots.bar_chart(tmp_path / "bars.png", panels, title="t", ylabel="v"))
    assert image.shape == (480, 880, 3)
    assert has_colour(image, CYCLE[0]) and has_colour(image, CYCLE[1])
    assert not has_colour(image, CYCLE[2], at_least=1)  # two labels, two colours, not three


@pytest.mark.model
def test_multiturn_ttft_plot_from_a_tiny_run(bench_path, default_model, tmp_path: Path) -> None:
    from bench import multiturn
    from chatstore.config import load_config
    from chatstore.engine.runtime import create_runtime

    args = argparse.Namespace(
        sessions=2,
        arrival_rate=50.0,
        think_s=0.01,
        max_turns=3,
        reply_tokens=2,
        tier="dram",
        seed=1,
        read_buffer_layers=-1,
    )
    runtime = create_runtime(load_config(overrides={"kv_cache_bytes": 64 << 20}), default_model)
    plans = multiturn.make_workload(args)
    arms = {
        m: multiturn.summarize(asyncio.run(multiturn.run(m, args, runtime, plans, "")))
        for m in ("RE", "CA")
    }
    assert len(arms["CA"]["ttft_by_turn_s"]) >= 2  # at least one session came back

    path = multiturn.plot_ttft_by_turn(tmp_path, arms, "dram")

    assert path.name == "multiturn_ttft_by_turn.png"
    image = read_png(path)
    assert image.shape == (450, 800, 3)  # line_chart: 8 x 4.5 in at 100 dpi
    assert has_colour(image, CYCLE[0]) and has_colour(image, CYCLE[1])  # RE and CA lines


CHILD = """
import argparse, json, sys
sys.path.insert(0, {root!r})
from bench import progress
progress.configure(argparse.Namespace(no_progress={off}))
for i in progress.track(range(3), "steps"):
    print(f"line {{i}}", flush=True)
print(json.dumps({{"bench": "demo", "n": 3}}))
"""


def run_child(off: bool, stdout_tty: bool, stderr_tty: bool) -> tuple[str, str]:
    """(stdout, terminal output) of CHILD; the terminal is 100 columns wide."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(root=str(ROOT), off=off)],
        stdout=slave if stdout_tty else subprocess.PIPE,
        stderr=slave if stderr_tty else subprocess.PIPE,
        text=True,
    )
    os.close(slave)
    terminal = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        terminal += chunk
    os.close(master)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert not err, err  # a piped stderr: the bar stayed off
    return out or "", terminal.decode()


EXPECTED = 'line 0\nline 1\nline 2\n{"bench": "demo", "n": 3}\n'


def test_progress_bar_goes_to_a_terminal_stderr_and_never_to_stdout() -> None:
    out, terminal = run_child(off=False, stdout_tty=False, stderr_tty=True)
    assert out == EXPECTED  # the JSON line still last, nothing else on stdout
    assert "steps: 100%" in terminal and "3/3" in terminal


@pytest.mark.parametrize("off,stderr_tty", [(True, True), (False, False)])
def test_progress_bar_off_with_flag_or_without_a_terminal(off: bool, stderr_tty: bool) -> None:
    out, terminal = run_child(off=off, stdout_tty=False, stderr_tty=stderr_tty)
    assert out == EXPECTED
    assert terminal == ""


def test_lines_printed_under_a_bar_stay_whole() -> None:
    _, terminal = run_child(off=False, stdout_tty=True, stderr_tty=True)
    pieces = terminal.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    for line in ("line 0", "line 1", "line 2", '{"bench": "demo", "n": 3}'):
        assert line in pieces, terminal  # the bar was lifted, not run into the line
    assert "3/3" in terminal
    json.loads(pieces[[p.startswith("{") for p in pieces].index(True)])
