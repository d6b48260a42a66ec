"""Process plumbing both stdio protocols share: the claimed stdout, a stdin reader, SIGTERM."""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable
from typing import BinaryIO, Generic, TypeVar

log = logging.getLogger("colibri")

T = TypeVar("T")


def claim_stdout() -> BinaryIO:
    """The protocol stream on stdout's pipe; fd 1 then points at stderr, so that nothing else
    (a stray print, a C library's message) can land between protocol lines."""
    sys.stdout.flush()
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(fd, "wb")


class LineWriter:
    """Writes each protocol line with one write, unbuffered (the flush is implied); a vanished
    reader is not fatal."""

    def __init__(self, stream: BinaryIO):
        self.stream = stream
        self.broken = False
        try:
            self._fd: int | None = stream.fileno()
            stream.flush()
        except (AttributeError, OSError, ValueError):
            self._fd = None  # not a file (an in-memory stream): write and flush it

    def send(self, line: bytes) -> None:
        if self.broken:
            return
        try:
            if self._fd is None:
                self.stream.write(line)
                self.stream.flush()
                return
            view = memoryview(line)
            while view:  # a pipe takes the whole line unless a signal cuts the write short
                view = view[os.write(self._fd, view) :]
        except (BrokenPipeError, ValueError, OSError) as e:
            self.broken = True  # the server is gone; finish quietly (EOF on stdin follows)
            log.warning("stdout closed (%s); output dropped from now on", e)


class Inbox(Generic[T]):
    """Frames read on a daemon thread, so the engine keeps decoding while the server is silent.

    `read()` returns the next frame or None at end of input; the thread stops after None or a
    frame for which `last(frame)` is true (the stream lost its framing). `wake(True)` is called
    after each frame is queued (not after those two: nothing reads on) and `wake(False)` before
    `take` looks at the queue: a flag that is up whenever a frame waits untaken (and at times
    just after it was taken), on which the engine cuts its decode bursts.
    """

    def __init__(
        self,
        read: Callable[[], T | None],
        last: Callable[[T], bool] = lambda _: False,
        wake: Callable[[bool], None] = lambda _: None,
    ):
        self._read, self._last, self._wake = read, last, wake
        self._queue: queue.Queue[T | None] = queue.Queue()
        threading.Thread(target=self._run, name="stdin-reader", daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                item = self._read()
            except Exception:  # an unreadable stdin ends the input like EOF does
                log.exception("reading stdin failed")
                item = None
            self._queue.put(item)
            if item is None or self._last(item):
                return  # (no wake: the engine reads nothing more, and only finishes its work)
            self._wake(True)

    def take(self, timeout: float) -> list[T | None]:
        """Every frame already read, waiting up to `timeout` seconds for the first one."""
        self._wake(False)  # (a frame queued from here on raises it again)
        try:
            items = [self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items


class Termination:
    """SIGTERM raises a flag that the loops check between steps (the handler does nothing else)."""

    def __init__(self) -> None:
        self.flag = threading.Event()
        try:
            signal.signal(signal.SIGTERM, lambda *_: self.flag.set())
        except ValueError:  # not the main thread (in-process use): no signal handling
            pass

    def requested(self) -> bool:
        return self.flag.is_set()
