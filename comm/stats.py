"""Per-layer communication statistics recorded by every dispatcher call."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class PhaseStats:
    """Totals over calls for one (layer, dispatch|combine): bytes and messages this rank sent, wall time."""

    calls: int = 0
    bytes_sent: int = 0
    messages_sent: int = 0
    time_s: float = 0.0
    inter_node_bytes: int = 0       # the part of bytes_sent / messages_sent that crossed nodes
    inter_node_messages: int = 0

    def add(self, bytes_sent: int, messages_sent: int, time_s: float) -> None:
        """One call: its (intra-node) bytes and messages not recorded with add_message, and its time."""
        self.calls += 1
        self.bytes_sent += bytes_sent
        self.messages_sent += messages_sent
        self.time_s += time_s

    def add_message(self, nbytes: int, inter_node: bool) -> None:
        self.bytes_sent += nbytes
        self.messages_sent += 1
        if inter_node:
            self.inter_node_bytes += nbytes
            self.inter_node_messages += 1


class CommStats:
    """layer -> {"dispatch": PhaseStats, "combine": PhaseStats} for this rank."""

    def __init__(self) -> None:
        self.layers: dict[int, dict[str, PhaseStats]] = {}

    def phase(self, layer: int, name: str) -> PhaseStats:
        return self.layers.setdefault(layer, {"dispatch": PhaseStats(), "combine": PhaseStats()})[name]

    def to_dict(self) -> dict:
        return {str(layer): {k: asdict(v) for k, v in phases.items()} for layer, phases in self.layers.items()}
