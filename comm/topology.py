"""Roles and nodes of every rank, and the process groups built on them.

World size W = A + E: ranks 0..A-1 are attention ranks, A..W-1 expert ranks.
Nodes come from torchrun (LOCAL_WORLD_SIZE) unless `ranks_per_node` overrides it: consecutive blocks of ranks at
start-up. A job that re-forms keeps each member on its node, so its ranks then name their nodes (`nodes`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(slots=True)
class Topology:
    rank: int
    world_size: int
    num_attention_ranks: int
    ranks_per_node: int
    forming: bool = False    # the leader of separate pool launches alone, before the first generation forms
    nodes: list[int] | None = None   # the node of each rank (None: consecutive blocks of ranks_per_node ranks)

    def __post_init__(self) -> None:
        A, W = self.num_attention_ranks, self.world_size
        if self.forming:
            return
        if A < 1:
            raise ValueError(f"attention_ranks={A} must be >= 1")
        if W - A < 1:
            raise ValueError(f"world size {W} leaves {W - A} expert ranks with attention_ranks={A}; "
                             f"launch attention_ranks + expert_ranks (>= 1) processes")
        if not 0 <= self.rank < W:
            raise ValueError(f"rank {self.rank} is outside world size {W}")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node={self.ranks_per_node} must be >= 1")
        if self.nodes is not None and len(self.nodes) != W:
            raise ValueError(f"nodes names the nodes of {len(self.nodes)} ranks in a world of {W}")

    @classmethod
    def from_env(cls, num_attention_ranks: int, ranks_per_node: int | None = None,
                 expected_world_size: int | None = None) -> Topology:
        """Read RANK / WORLD_SIZE / LOCAL_WORLD_SIZE as torchrun sets them."""
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except KeyError as e:
            raise RuntimeError(f"environment variable {e} is not set; launch with torchrun") from e
        if expected_world_size is not None and world != expected_world_size:
            raise ValueError(f"world size {world} != attention_ranks + expert_ranks = {expected_world_size}; "
                             f"launch exactly {expected_world_size} processes or change the split")
        rpn = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return cls(rank, world, num_attention_ranks, rpn)

    @property
    def num_expert_ranks(self) -> int:
        return self.world_size - self.num_attention_ranks

    @property
    def is_attention(self) -> bool:
        return self.rank < self.num_attention_ranks

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def expert_index(self) -> int:
        """Index of this rank in the expert pool (0..E-1)."""
        assert not self.is_attention
        return self.rank - self.num_attention_ranks

    @property
    def num_nodes(self) -> int:
        return len(self.node_ids)

    @property
    def node_ids(self) -> list[int]:
        """The nodes that hold ranks of this job, in order (after a re-forming, not always 0..num_nodes-1)."""
        return sorted({self.node_of(r) for r in range(self.world_size)})

    def node_of(self, rank: int) -> int:
        return self.nodes[rank] if self.nodes is not None else rank // self.ranks_per_node

    def local_index(self, rank: int) -> int:
        """The rank's place among its node's ranks (by rank)."""
        if self.nodes is None:
            return rank % self.ranks_per_node
        return self.nodes[:rank].count(self.nodes[rank])

    def rank_nodes(self) -> list[int]:
        """The node of every rank."""
        return [self.node_of(r) for r in range(self.world_size)]

    @property
    def role(self) -> str:
        return "attention" if self.is_attention else "expert"


@dataclass(slots=True)
class ProcessGroups:
    """world (the data plane, default group: NCCL when each rank has a GPU of its own, else gloo), control (gloo,
    CPU, always), attention (gloo: the per-step output gather), attention_data (the attention ranks on the data
    plane's backend: the balancer's per-layer count gather of device tensors). The last two are None on an
    expert rank."""

    world: dist.ProcessGroup
    control: dist.ProcessGroup
    attention: dist.ProcessGroup | None
    attention_data: dist.ProcessGroup | None

    @classmethod
    def form(cls, store: dist.Store, topo: Topology, backend: str, device, rendezvous_s: float,
             collective_timeout_s: float) -> ProcessGroups:
        """Initialise the default group on `store` and create the rest: a generation's groups, this rank placed by
        topo. Their rendezvous waits at most rendezvous_s, then raises with nothing formed (a member that died
        once it was ready never arrives); then the default group's collectives wait collective_timeout_s, the
        others' torch's default for their backend. NCCL: eager init on this rank's GPU (device_id), so the first
        point-to-point needs no lazy communicator."""
        bound = timedelta(seconds=rendezvous_s)
        dist.init_process_group(backend, store=store, rank=topo.rank, world_size=topo.world_size, timeout=bound,
                                device_id=device if backend == "nccl" else None)
        groups = cls.create(topo, timeout=bound)
        c10d = dist.distributed_c10d
        c10d._set_pg_timeout(timedelta(seconds=collective_timeout_s), groups.world)
        for g, kind in ((groups.control, "gloo"), (groups.attention, "gloo"), (groups.attention_data, backend)):
            if g is not None:
                c10d._set_pg_timeout(c10d._get_default_timeout(kind), g)
        groups.join_first_collectives(device)
        return groups

    @classmethod
    def create(cls, topo: Topology, timeout: timedelta | None = None) -> ProcessGroups:
        """timeout: each group's rendezvous and collectives (None: torch's default for the backend)."""
        # Every rank must call new_group for every group, in the same order.
        W = topo.world_size
        control = dist.new_group(list(range(W)), backend="gloo", timeout=timeout)
        attn_ranks = list(range(topo.num_attention_ranks))
        attention = dist.new_group(attn_ranks, backend="gloo", timeout=timeout)
        attention_data = dist.new_group(attn_ranks, timeout=timeout)
        if not topo.is_attention:
            return cls(dist.group.WORLD, control, None, None)
        return cls(dist.group.WORLD, control, attention, attention_data)

    def data_groups(self) -> list[dist.ProcessGroup]:
        """The groups on the data plane's backend that this rank belongs to."""
        return [g for g in (self.world, self.attention_data) if g is not None]

    def join_first_collectives(self, device) -> None:
        """One all_reduce on each data-plane group, every member joining, before anything else runs on it.
        NCCL's batch_isend_irecv (two_phase's messages, expert moves) lets a subset of a group's ranks take part
        only once a first collective of the whole group has run; this is that collective, at formation, where
        every member is present."""
        for g in self.data_groups():
            dist.all_reduce(torch.zeros(1, device=device), group=g)
