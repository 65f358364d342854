"""Progress bars on stderr: a tqdm bar on a terminal; whole lines anywhere else.

Where stderr is a file, a pipe or a CI log, a redrawn bar leaves its carriage returns and its
last state behind (a bar closed early stays at 0% or 79%). There :func:`progress_bar` writes
whole lines instead: one every :data:`LINE_INTERVAL` seconds while it runs, and one when it is
closed saying what was done, so the last line is always the final state.
"""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["progress_bar", "shows_progress", "LINE_INTERVAL"]

LINE_INTERVAL = 30.0
"""Seconds between two progress lines when stderr is not a terminal."""


def progress_bar(total: int, description: str, *, unit: str = "B", unit_divisor: int = 1000, enabled: bool = True,
                 leave: bool = True) -> Any:
    """An object with ``update(n)`` and ``close()`` (tqdm's, on a terminal; see the module docstring).
    ``leave``: keep the finished bar on a terminal (False: cleared when closed)."""
    if not enabled:
        return _Silent()
    stream = sys.stderr
    if stream is not None and hasattr(stream, "isatty") and stream.isatty():
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=description, unit=unit, unit_scale=True, unit_divisor=unit_divisor,
                    dynamic_ncols=True, mininterval=0.5, leave=leave)
    return _LineProgress(total, description, unit, unit_divisor)


def shows_progress(bar: Any) -> bool:
    """Whether ``bar`` (None, or an object from :func:`progress_bar`) writes anything."""
    return bar is not None and not isinstance(bar, _Silent)


class _Silent:
    n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        pass


class _LineProgress:
    """Whole lines on stderr (module docstring)."""

    def __init__(self, total: int, description: str, unit: str, unit_divisor: int):
        self.total, self.description, self.unit, self.divisor = total, description, unit, unit_divisor
        self.n = 0
        self.started = self.last = time.monotonic()
        self.closed = False

    def _size(self, count: float) -> str:
        from tqdm import tqdm

        return f"{tqdm.format_sizeof(count, divisor=self.divisor)}{self.unit}"

    def _print(self, text: str) -> None:
        try:
            print(f"{self.description}: {text}", file=sys.stderr, flush=True)
        except (OSError, ValueError, AttributeError):  # stderr closed or missing: progress is not worth an error
            pass

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= LINE_INTERVAL and not self.closed:
            self.last = now
            share = f"{self.n / self.total:.0%} " if self.total else ""
            self._print(f"{share}({self._size(self.n)} of {self._size(self.total)}) after {now - self.started:.0f} s")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        seconds = time.monotonic() - self.started
        share = f"{self.n / self.total:.0%} " if self.total else ""
        rate = f", {self._size(self.n / seconds)}/s" if seconds > 0 else ""
        self._print(f"{share}({self._size(self.n)} of {self._size(self.total)}) in {seconds:.1f} s{rate}")
