"""Per-layer communication statistics recorded by every dispatcher call, and a bounded log of the calls."""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field, fields

MAX_EVENTS = 4096       # calls kept per rank for a timeline (comm_profile's Chrome trace): the most recent ones


@dataclass(slots=True)
class PhaseStats:
    """Totals over calls for one (layer, dispatch|combine): bytes and messages this rank sent, wall time."""

    calls: int = 0
    bytes_sent: int = 0
    messages_sent: int = 0
    time_s: float = 0.0
    inter_node_bytes: int = 0       # the part of bytes_sent / messages_sent that crossed nodes
    inter_node_messages: int = 0
    log: object = field(default=None, repr=False, compare=False)      # (events deque, layer, phase) or None

    def add(self, bytes_sent: int, messages_sent: int, time_s: float) -> None:
        """One call that ends now: its (intra-node) bytes and messages not recorded with add_message, its time."""
        self.calls += 1
        self.bytes_sent += bytes_sent
        self.messages_sent += messages_sent
        self.time_s += time_s
        if self.log is not None:
            events, layer, phase = self.log
            end = time.perf_counter()
            events.append((layer, phase, end - time_s, end))

    def add_message(self, nbytes: int, inter_node: bool) -> None:
        self.bytes_sent += nbytes
        self.messages_sent += 1
        if inter_node:
            self.inter_node_bytes += nbytes
            self.inter_node_messages += 1

    def to_dict(self) -> dict:
        """The counters (not the shared event log, which asdict would deep-copy once per phase)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "log"}


class CommStats:
    """layer -> {"dispatch": PhaseStats, "combine": PhaseStats} for this rank, and `events`: the last MAX_EVENTS
    calls as (layer, phase, start, end) in time.perf_counter() seconds (CLOCK_MONOTONIC on Linux, so the ranks
    of one host share the clock)."""

    def __init__(self, max_events: int = MAX_EVENTS) -> None:
        self.sync = None      # called before each clock read (now()): the device's synchronize, when timing_sync
        self.layers: dict[int, dict[str, PhaseStats]] = {}
        self.compute: dict[int, list] = {}          # layer -> [calls, seconds] of this rank's own compute
        self.steps = [0, 0.0, 0.0]                  # attention ranks: [steps, seconds, of which in the forward]
        self.events: collections.deque = collections.deque(maxlen=max_events)

    def now(self) -> float:
        """time.perf_counter() once the device has finished what was queued (with `sync` set): on CUDA the
        kernels run after their launch returns, so without it a phase's time is its host-side launch time."""
        if self.sync is not None:
            self.sync()
        return time.perf_counter()

    def add_compute(self, layer: int, start: float, end: float) -> None:
        """This rank computed from start to end (perf_counter) for MoE layer `layer`: on an attention rank the
        forward up to that layer's dispatch (attention, router; -1: after the last MoE layer, up to the
        logits), on an expert rank the layer's grouped FFN."""
        c = self.compute.setdefault(layer, [0, 0.0])
        c[0] += 1
        c[1] += end - start
        self.events.append((layer, "compute", start, end))

    def add_step(self, start: float, end: float, forward_s: float) -> None:
        """An attention rank ran one step from start to end (perf_counter), forward_s of it in the model's forward:
        on the leader from choosing the step's work to handing its outputs over, elsewhere from the header's
        arrival to the report gather. The rest is the step's host work (scheduling, batch metadata, sampling,
        the header and reports)."""
        self.steps[0] += 1
        self.steps[1] += end - start
        self.steps[2] += forward_s

    def steps_dict(self) -> dict:
        return {"calls": self.steps[0], "time_s": self.steps[1], "forward_s": self.steps[2]}

    def compute_dict(self) -> dict:
        return {str(layer): {"calls": c, "time_s": t} for layer, (c, t) in sorted(self.compute.items())}

    def phase(self, layer: int, name: str) -> PhaseStats:
        phases = self.layers.get(layer)
        if phases is None:
            phases = self.layers[layer] = {p: PhaseStats(log=(self.events, layer, p)) for p in ("dispatch", "combine")}
        return phases[name]

    def to_dict(self) -> dict:
        return {str(layer): {k: v.to_dict() for k, v in phases.items()} for layer, phases in self.layers.items()}

    def events_list(self) -> list[list]:
        return [list(e) for e in self.events]
