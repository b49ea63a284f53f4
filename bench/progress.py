"""Progress bars for long benchmark runs: tqdm on stderr, and only when stderr is a terminal.

A bench's last stdout line is the JSON tools read, so a bar never writes to stdout; it is off
when stderr is not a TTY (piped, captured, CI) or after `--no-progress`. While a bar is drawn,
the lines a bench prints to the same terminal go through `tqdm.external_write_mode`, which lifts
the bar, writes the whole line and redraws the bar below it, instead of the line landing in the
middle of the bar. stdout is wrapped so only when it is itself a terminal: a piped stdout is
never touched.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")
_enabled = True


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bars (they go to stderr)"
    )


def configure(args: argparse.Namespace) -> None:
    """Apply --no-progress for every bar this process draws from now on."""
    global _enabled
    _enabled = not args.no_progress


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


@contextmanager
def progress_bar(total: int | None, desc: str) -> Iterator[tqdm]:
    """A bar to `update()` by hand; a disabled bar (no output, same methods) when off."""
    stream = sys.stderr
    if isinstance(stream, _LineWriter):  # inside another bar: draw on the terminal itself
        stream = stream.raw
    on = _enabled and _is_tty(stream)
    # leave=None: a finished top-level bar stays (it shows how long the part took), a nested one
    # goes.
    bar = tqdm(total=total, desc=desc, file=stream, disable=not on, dynamic_ncols=True, leave=None)
    try:
        if not on:
            yield bar
            return
        with _lines_above_bars(stream):
            yield bar
    finally:
        bar.close()


def track(items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """Yield `items`, advancing a bar by one per item."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with progress_bar(total, desc) as bar:
        for item in items:
            yield item
            bar.update(1)


class _LineWriter(io.TextIOBase):
    """Writes whole lines to `out` with the bars on `bars` lifted meanwhile; holds a partial
    line until its newline (a bar redrawn after half a line would split it)."""

    def __init__(self, out: TextIO, bars: TextIO) -> None:
        self._out, self._bars, self._pending = out, bars, ""

    def write(self, text: str) -> int:
        self._pending += text
        if "\n" in self._pending:
            done, _, self._pending = self._pending.rpartition("\n")
            with tqdm.external_write_mode(file=self._bars):
                self._out.write(done + "\n")
                self._out.flush()
        return len(text)

    def close_out(self) -> None:
        if self._pending:
            self._out.write(self._pending)
            self._pending = ""
        self._out.flush()

    @property
    def raw(self) -> TextIO:
        return self._out

    def isatty(self) -> bool:
        return _is_tty(self._out)

    def fileno(self) -> int:
        return self._out.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._out, "encoding", "utf-8")


@contextmanager
def _lines_above_bars(bars: TextIO) -> Iterator[None]:
    saved = sys.stdout, sys.stderr
    wrap_out = _is_tty(saved[0]) and not isinstance(saved[0], _LineWriter)
    wrap_err = not isinstance(saved[1], _LineWriter)  # a bar already drawn wrapped it
    out = _LineWriter(saved[0], bars) if wrap_out else None
    err = _LineWriter(saved[1], bars) if wrap_err else None
    sys.stdout, sys.stderr = out or saved[0], err or saved[1]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        for writer in (out, err):
            if writer is not None:
                writer.close_out()
