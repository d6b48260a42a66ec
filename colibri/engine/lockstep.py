"""Several hosts: one engine over the devices of every process (`jax.distributed`).

Every process loads the model and builds the same runner over one mesh of all their devices
(`parallel`); each jitted program then spans every process, and its collectives (the experts'
`psum`) need every process to run it, in the same order, with the same inputs. Process 0
serves the protocol: its scheduler drives a `Leader`, which sends each runner call that runs
programs to the others before making it (pickled, through `multihost_utils`' broadcast, so on
JAX's own channels); every other process runs `follow`, which makes the same calls on its own
runner and writes nothing to stdout. Host-only calls (reading a slot's KV, persisting usage)
stay on process 0.

Bursts that input may cut short would end after different steps in different processes, so
the leader never asks for them (`cuts` is False). Offloaded experts are staged by decisions
that depend on timing (which reads are done), so several processes need every expert resident.
"""

from __future__ import annotations

import logging
import pickle
from collections import OrderedDict
from typing import Any

import jax
import numpy as np

log = logging.getLogger("colibri")

# Runner calls that run programs over the mesh, so every process makes them.
MIRRORED = frozenset({"prefill", "decode_async", "import_slot", "prefill_traced", "full_logits"})
_STOP = "stop"
_KEPT = 16  # forwards a later call may chain behind (`after=`): the last few are enough


class _Forward:
    """A forward started by an earlier call, named by its number (decode_async's results are
    numbered in call order, the same in every process)."""

    def __init__(self, number: int):
        self.number = number


def initialize(coordinator: str, processes: int, process_id: int) -> None:
    """Join the processes (before JAX starts its backends): on the CPU, collectives over gloo."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=processes, process_id=process_id)
    log.info(
        "process %d of %d, %d local and %d devices in all",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def _broadcast(message: Any | None) -> Any:
    """Process 0's message, on every process (the others pass None)."""
    from jax.experimental import multihost_utils as mh

    data = pickle.dumps(message) if jax.process_index() == 0 else b""
    size = int(mh.broadcast_one_to_all(np.int64(len(data))))
    buf = np.frombuffer(data, np.uint8) if data else np.zeros(size, np.uint8)
    return pickle.loads(np.asarray(mh.broadcast_one_to_all(buf)).tobytes())


class Leader:
    """Process 0's runner: the scheduler's calls that run programs are sent to the other
    processes first (`MIRRORED`); everything else is the runner's own."""

    def __init__(self, runner):
        self._runner = runner
        self._numbers: OrderedDict[int, tuple[int, Any]] = OrderedDict()  # id -> (n, forward)
        self._next = 0

    def __getattr__(self, name: str):
        value = getattr(self._runner, name)
        if name not in MIRRORED:
            return value

        def call(*args, **kwargs):
            _broadcast((name, self._named(args), self._named(kwargs)))
            out = value(*args, **kwargs)
            if name == "decode_async":
                self._numbers[id(out)] = (self._next, out)
                self._next += 1
                while len(self._numbers) > _KEPT:
                    self._numbers.popitem(last=False)
            return out

        return call

    @property
    def cuts(self) -> bool:
        return False  # a cut would fall on different steps in different processes

    def _named(self, value):
        """Arguments with the forwards they chain behind replaced by their numbers."""
        if isinstance(value, tuple | list):
            return type(value)(self._named(v) for v in value)
        if isinstance(value, dict):
            return {k: self._named(v) for k, v in value.items()}
        if id(value) in self._numbers and self._numbers[id(value)][1] is value:
            return _Forward(self._numbers[id(value)][0])
        return value

    def stop(self) -> None:
        """Tell the other processes the session is over (they return from `follow`)."""
        _broadcast((_STOP, (), {}))


def follow(runner) -> None:
    """Make process 0's runner calls on this process's runner until it stops."""
    forwards: OrderedDict[int, Any] = OrderedDict()
    made = 0

    def resolved(value):
        if isinstance(value, tuple | list):
            return type(value)(resolved(v) for v in value)
        if isinstance(value, dict):
            return {k: resolved(v) for k, v in value.items()}
        if isinstance(value, _Forward):
            return forwards[value.number]
        return value

    while True:
        name, args, kwargs = _broadcast(None)
        if name == _STOP:
            return
        out = getattr(runner, name)(*resolved(args), **resolved(kwargs))
        if name == "decode_async":
            forwards[made] = out
            made += 1
            while len(forwards) > _KEPT:
                forwards.popitem(last=False)
