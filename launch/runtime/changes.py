"""What membership (launch/runtime/membership.py) works with: the settings every rank's Membership runs with,
the leader's account of each re-forming of the job, and what it needs of this rank's runtime."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from comm.topology import Topology


class FormingFailed(RuntimeError):
    """A generation did not form and no member adopted it: a member of its plan was lost before all were ready,
    a member gave it up, its process groups' rendezvous did not complete (a member died after it was ready), or
    a member was lost while its data plane formed and expert weights moved. The rank is as it was before (out of
    any generation)."""


@dataclass(slots=True, frozen=True)
class MembershipSettings:
    failure_s: float               # a member whose heartbeat is silent this long counts as dead
    collective_timeout_s: float    # the longest wait for a plan or for every member to check in
    startup_timeout_s: float       # the longest wait of a joiner for its admission
    expert_memory: int | None      # bytes of expert weights one expert rank may hold (None: no limit)


@dataclass(slots=True)
class MembershipChange:
    """One re-forming of the job, as the leader saw it (timings in seconds)."""

    generation: int
    lost: list[int]                # ranks of the old generation that were lost (or retired by a scale-in)
    cause: str
    lost_members: list[int] = field(default_factory=list)   # the same as members (their first ranks)
    joined_members: list[int] = field(default_factory=list)  # members that joined
    attention_ranks: int = 0       # the new generation's pools
    expert_ranks: int = 0
    prefill_ranks: int = 0         # PD: how many of the attention ranks only prefill (0: no PD)
    detect_s: float = 0.0          # from the first failed exchange to every member accounted for (a planned
                                   # change: from publishing the plan to every rank out of the old generation)
    groups_s: float = 0.0          # forming the new generation's process groups and data plane
    weights_s: float = 0.0         # expert weights copied between ranks and read from the checkpoint
    slots_from_peers: int = 0
    slots_from_checkpoint: int = 0
    started: float = field(default_factory=time.monotonic)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "started"}


class Launcher(Protocol):
    """What starts the ranks a scale request adds when the leader starts them itself (launch/joiners.py)."""

    def start(self, roles: list[str], deadline: float | None) -> None:
        """Start one joining rank per role; RuntimeError when this host has no room for them."""


class MemberRuntime(Protocol):
    """What membership needs of this rank's runtime (launch/runtime/runtime.py implements it). generation:
    the one this rank is in (-1 before its first); members: member ids by rank; topo: None before the first."""

    member: int
    generation: int
    members: list[int]
    topo: Topology | None
    left: bool              # this rank has left its generation (and not formed the next yet)
    launcher: Launcher | None   # the leader's own starter of joining ranks (under torchrun), else None

    def member_info(self) -> dict:
        """What this rank tells the leader when it checks in after a failure: its role (and expert budget)."""

    def new_member_ids(self, n: int) -> list[int]:
        """Leader: n member ids for ranks it asks the front to start, from the counter every joiner draws from."""

    def plan_generation(self, generation: int, infos: dict[int, dict], lost: list[int],
                        joined: list[tuple[int, dict]] = (), retiring: bool = False) -> dict:
        """Leader: the next generation's plan (launch/runtime/planning.py); MembershipError if impossible."""

    def regroup(self, plan: dict, agree: Callable[[bool], bool]) -> dict:
        """Form the plan's generation and gather its weights; adopt it (placement, slots, requests) only if
        agree(True) says every member has done the same -> {"groups_s", "weights_s"}; else agree(False) and
        FormingFailed, nothing adopted."""

    def leave_generation(self) -> None:
        """Abort and drop this generation's process groups and data plane."""

    def barrier(self) -> None:
        """Every rank of the current generation, between steps."""

    def start_reshape(self) -> None:
        """Leader, between steps: tell every rank the next generation's plan is published (RESHAPE)."""

    def moves_in_flight(self) -> bool:
        """Leader: the step in flight moves requests between attention ranks (PD), so after a failure the leader
        asks every attention rank which requests it holds."""

    def attention_blocks(self) -> list[tuple[int, int]]:
        """Leader: (free, total) KV blocks of each attention rank, as it last reported."""

    def send_requests(self, dst: int) -> None:
        """A retiring attention rank: hand its live requests and their KV blocks to attention rank dst."""

    def receive_requests(self, src: int) -> None:
        """Take over what attention rank src hands over."""

    def stage_experts(self, staged: list[list[int]]) -> None:
        """An expert rank: send or receive the plan's staged experts, kept for the next generation."""

    def hand_off_experts(self, plan: dict) -> None:
        """A retiring expert rank, out of the old generation: send the joiners the experts only it held."""

    def take_handoff(self, plan: dict) -> None:
        """A joining expert rank: receive those experts before forming the plan's generation."""

    def abandon_change(self) -> None:
        """A planned change failed before its generation formed: drop what was staged for it."""
