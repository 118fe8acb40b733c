"""This machine as measurements depend on it: :func:`host_key` (which host a calibration belongs
to) and :class:`CpuWatch` (how much CPU time other processes took while something was measured).
Pure: reads ``/proc`` and the process's own times (Linux; elsewhere what ``platform`` says, and no
watch)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
from pathlib import Path

import torch


def host_key() -> str:
    """This host as a cost model depends on it: the CPU's model name, its logical core count and a
    digest of its feature flags (Linux: ``/proc/cpuinfo``; elsewhere ``platform.processor()``), so
    that a cache directory shared by two hosts (a home directory on NFS, a copied cache) never hands
    one host's measurements to the other."""
    model, flags = platform.processor() or platform.machine(), ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name" and value.strip():
                model = value.strip()
            elif name.strip() == "flags" and not flags:
                flags = value.strip()
    digest = hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:8]
    return f"{model}-{os.cpu_count() or 0}cores-{digest}"


def _cpu_counters() -> tuple[float, float, float] | None:
    """``(busy, total, ours)`` in seconds: the whole machine's busy and total CPU time so far
    (``/proc/stat``, steal counted as busy: another guest ran) and this process's own; None where
    ``/proc/stat`` cannot be read."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
        hertz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    idle = ticks[3] + ticks[4]
    own = os.times()
    return (sum(ticks) - idle) / hertz, sum(ticks) / hertz, own.user + own.system


class CpuWatch:
    """A context that measures how much CPU time *other* processes took from this one while it was
    open: :attr:`others_share` in [0, 1], or None where the counters cannot be read (not Linux).

    Other processes contend only for the cores this process's ``threads`` need: on a machine with
    ``cores`` cores, the others' CPU time that fits in the ``cores - threads`` cores left over
    costs nothing, so ``others_share = (others' CPU time - (cores - threads) x wall time) /
    (threads x wall time)``, clamped to [0, 1]. On a 2-core machine measured with 2 threads that
    is simply the others' share of the machine; on a 64-core host it takes 62 busy cores before
    it counts. A cost model measured while it exceeded
    :data:`triedec.api.calibration.BUSY_SHARE` is marked busy."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or torch.get_num_threads()
        self._start: tuple[float, float, float] | None = None
        self.others_share: float | None = None

    def __enter__(self) -> CpuWatch:
        self._start = _cpu_counters()
        return self

    def __exit__(self, *exc: object) -> None:
        stop = _cpu_counters()
        if self._start is None or stop is None or stop[1] <= self._start[1]:
            return
        busy, total, ours = (b - a for a, b in zip(self._start, stop, strict=True))
        cores = os.cpu_count() or 1
        threads = min(self.threads, cores)
        wall = total / cores
        spare = (cores - threads) * wall
        self.others_share = min(1.0, max(0.0, (busy - ours - spare) / (threads * wall)))
