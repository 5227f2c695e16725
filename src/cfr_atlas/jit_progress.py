"""Saying so when numba compiles: the first run after an install (or after the kernels' source
changed) compiles every kernel it reaches, a minute or more of silence otherwise.

`report_compiles()` installs (once per process) a numba event listener for "numba:compile",
which numba fires only when it really compiles (a cache hit loads the machine code and fires
nothing). The first compile prints one header line; every outermost kernel compiled prints its
name when it starts and its seconds when done. Kernels compiled while another compiles
(callees) are part of that line. Not here: deciding when to call it (the CLI does, for
commands that run a model).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from numba.core import event

HEADER = ("cfr-atlas: compiling kernels (first run after install or upgrade; they are cached "
          "for the next runs)")


class CompileReporter(event.Listener):
    """Prints a line per outermost numba compilation to `stream` (None: whatever sys.stderr is
    at the time); counts them in `compiled`."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream
        self.compiled = 0
        self._depth = 0
        self._started = 0.0

    def on_start(self, ev) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        if self.compiled == 0:
            self._print(HEADER)
        self.compiled += 1
        self._started = time.perf_counter()
        self._print(f"  [{self.compiled}] {_name(ev.data['dispatcher'])} ...", end="")

    def on_end(self, ev) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._print(f" {time.perf_counter() - self._started:.1f} s")

    def _print(self, text: str, end: str = "\n") -> None:
        print(text, end=end, file=sys.stderr if self.stream is None else self.stream, flush=True)


def _name(dispatcher) -> str:
    fn = getattr(dispatcher, "py_func", None)
    if fn is None:
        return str(dispatcher)
    return f"{fn.__module__.removeprefix('cfr_atlas.')}.{fn.__qualname__}"


_installed: list[CompileReporter] = []  # the process's reporter, once installed


def report_compiles() -> CompileReporter:
    """The process's CompileReporter (writing to sys.stderr), installed on numba's
    "numba:compile" event on the first call; later calls return the same one."""
    if not _installed:
        _installed.append(CompileReporter())
        event.register("numba:compile", _installed[0])
    return _installed[0]
