"""What both sides of the peer bench share, stdlib only: bench/peers.py (afserve's venv) and bench/vllm_offline.py
(the peer's venv, which loads this file by path) measure core utilisation from /proc and compare greedy tokens.

    before = CpuSample.read(os.getpid()); ...; util = CpuSample.read(os.getpid()).since(before)
    util.busy   # all cores' busy share over the interval, whoever ran (the machine may be shared)
    util.own    # the share of all cores' time spent by the process and its descendants
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

# /proc/stat's "cpu" line: user nice system idle iowait irq softirq steal guest guest_nice, in clock ticks (USER_HZ).
# guest and guest_nice are already counted in user and nice, so only the first 8 make up the total.
NUM_FIELDS = 8
IDLE_FIELDS = (3, 4)   # idle, iowait


@dataclass(slots=True, frozen=True)
class Utilisation:
    """Shares of all cores' time over an interval, 0..1 (nan when no tick passed)."""

    busy: float   # every process on the machine
    own: float    # the measured process tree only

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True, frozen=True)
class CpuSample:
    """Clock ticks since boot: all cores' busy (user, nice, system, irq, softirq, steal) and total (busy + idle +
    iowait) from /proc/stat, and own: user + system of one process tree (-1 when no tree was read)."""

    busy: int
    total: int
    own: int = -1

    @classmethod
    def from_stat_line(cls, line: str, own: int = -1) -> CpuSample:
        """From /proc/stat's aggregate line, e.g. "cpu  4705 150 1120 16250 520 0 11 0 0 0"."""
        parts = line.split()
        if not parts or parts[0] != "cpu":
            raise ValueError(f"not /proc/stat's aggregate cpu line: {line!r}")
        ticks = [int(x) for x in parts[1:1 + NUM_FIELDS]]
        idle = sum(ticks[i] for i in IDLE_FIELDS if i < len(ticks))
        return cls(busy=sum(ticks) - idle, total=sum(ticks), own=own)

    @classmethod
    def read(cls, root_pid: int | None = None, proc: str = "/proc") -> CpuSample:
        """Now; with root_pid, also that process's and its live descendants' ticks."""
        with open(os.path.join(proc, "stat")) as f:
            line = f.readline()
        return cls.from_stat_line(line, tree_ticks(root_pid, proc) if root_pid is not None else -1)

    def since(self, before: CpuSample) -> Utilisation:
        total = self.total - before.total
        if total <= 0:
            return Utilisation(float("nan"), float("nan"))
        own = (self.own - before.own) / total if self.own >= 0 and before.own >= 0 else float("nan")
        return Utilisation(busy=(self.busy - before.busy) / total, own=own)


def parse_pid_stat(text: str) -> tuple[int, int]:
    """(ppid, utime + stime) from /proc/<pid>/stat. The command name (field 2) may hold spaces and parentheses, so
    the fields are counted from its closing parenthesis: state, ppid, ... utime is field 14, stime 15."""
    rest = text[text.rindex(")") + 2:].split()
    return int(rest[1]), int(rest[11]) + int(rest[12])


def tree_ticks(root_pid: int, proc: str = "/proc") -> int:
    """User + system ticks of root_pid and every live descendant (a child that already exited is not counted)."""
    parent, ticks = {}, {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat")) as f:
                parent[int(name)], ticks[int(name)] = parse_pid_stat(f.read())
        except (OSError, ValueError, IndexError):   # the process exited while we listed
            continue
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root_pid]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total


def first_difference(ours: list[list[int]], theirs: list[list[int]]) -> tuple[int, int] | None:
    """(request, position) of the first token where two engines' outputs differ, or None when they are equal. A length
    difference counts at the shorter output's end; a different number of requests at the shorter list's end."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        for j, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return i, j
        if len(a) != len(b):
            return i, min(len(a), len(b))
    if len(ours) != len(theirs):
        return min(len(ours), len(theirs)), 0
    return None


def describe_difference(ours: list[list[int]], theirs: list[list[int]], names: tuple[str, str]) -> str | None:
    """A one-line account of first_difference for an error message, e.g. "request 2, position 17: afserve gave
    [.., 5, 9, ..], vLLM [.., 5, 7, ..] (from position 15)"; None when the outputs are equal."""
    diff = first_difference(ours, theirs)
    if diff is None:
        return None
    i, j = diff
    lo = max(0, j - 2)
    a = ours[i][lo:j + 3] if i < len(ours) else "no request"
    b = theirs[i][lo:j + 3] if i < len(theirs) else "no request"
    return f"request {i}, position {j}: {names[0]} gave {a}, {names[1]} {b} (from position {lo})"
