"""An alpha-beta cost model per link class (intra-node, inter-node) for choosing a comm mode per call.

A message of n bytes on a link class costs alpha + beta * n. A comm mode's layer is a sequence of hops; in
each hop every rank sends and receives some messages, and the hop takes as long as its busiest rank
(max over ranks of the larger of its send and receive sums); the layer's cost is the sum over hops, for
dispatch and combine. The dispatchers list their messages for a given step capacity
(`planned_messages`), so the model sees exactly what each mode would send, padding included.

Calibration: rank 0 ping-pongs with one rank on its node and one on another node for a few sizes, fits
alpha and beta per class by least squares, and broadcasts them, so every rank holds the same model and
makes the same choice. A calibration can be saved to JSON and loaded instead of measured.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

CALIBRATION_SIZES = (64, 16 << 10, 256 << 10, 1 << 20)   # bytes
CALIBRATION_REPEATS = 5


@dataclass(slots=True)
class LinkCost:
    alpha_s: float          # per message
    beta_s_per_byte: float  # per byte

    def time(self, nbytes: int) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes

    @classmethod
    def fit(cls, samples: list[tuple[int, float]]) -> LinkCost:
        """Least squares of seconds on bytes; alpha and beta kept non-negative."""
        x = torch.tensor([float(n) for n, _ in samples], dtype=torch.float64)
        y = torch.tensor([t for _, t in samples], dtype=torch.float64)
        A = torch.stack([torch.ones_like(x), x], dim=1)
        sol = torch.linalg.lstsq(A, y[:, None]).solution.flatten()
        alpha, beta = float(sol[0]), float(sol[1])
        if beta < 0:
            beta = 0.0
            alpha = float(y.mean())
        if alpha < 0:
            alpha = 0.0
            beta = float((x * y).sum() / (x * x).sum())
        return cls(alpha, beta)


@dataclass(slots=True)
class CostModel:
    intra: LinkCost
    inter: LinkCost

    def link(self, inter_node: bool) -> LinkCost:
        return self.inter if inter_node else self.intra

    def layer_time(self, hops: list[list[tuple[int, int, int]]], node_of: list[int]) -> float:
        """hops: per hop, (src rank, dst rank, bytes) messages -> predicted seconds."""
        total = 0.0
        for hop in hops:
            send: dict[int, float] = {}
            recv: dict[int, float] = {}
            for src, dst, nbytes in hop:
                t = self.link(node_of[src] != node_of[dst]).time(nbytes)
                send[src] = send.get(src, 0.0) + t
                recv[dst] = recv.get(dst, 0.0) + t
            total += max([*send.values(), *recv.values(), 0.0])
        return total

    def to_dict(self) -> dict:
        return {"intra": asdict(self.intra), "inter": asdict(self.inter)}

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        try:
            return cls(LinkCost(**d["intra"]), LinkCost(**d["inter"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"a comm calibration needs {{'intra': {{alpha_s, beta_s_per_byte}}, 'inter': ...}}; "
                             f"got {d!r}") from e

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> CostModel:
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"comm calibration file {path!r} could not be read: {e}") from e

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.intra.alpha_s, self.intra.beta_s_per_byte, self.inter.alpha_s,
                             self.inter.beta_s_per_byte], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> CostModel:
        v = t.tolist()
        return cls(LinkCost(v[0], v[1]), LinkCost(v[2], v[3]))


def _pingpong(group, me: int, peer: int, first: bool, device) -> list[tuple[int, float]]:
    """One-way time (half the median round trip) per calibration size between me and peer."""
    out = []
    for n in CALIBRATION_SIZES:
        buf = torch.zeros(n, dtype=torch.uint8, device=device)
        times = []
        for _ in range(CALIBRATION_REPEATS + 1):          # the first round warms the connection up
            t0 = time.perf_counter()
            if first:
                dist.send(buf, peer, group=group)
                dist.recv(buf, peer, group=group)
            else:
                dist.recv(buf, peer, group=group)
                dist.send(buf, peer, group=group)
            times.append((time.perf_counter() - t0) / 2)
        out.append((n, statistics.median(times[1:])))
    return out


def calibrate(group, node_of: list[int], device) -> CostModel:
    """Measure on the data-plane group (every rank calls it): rank 0 with the first other rank of its node
    (intra) and the first rank of another node (inter). A class with no such pair takes the other's fit."""
    me = dist.get_rank(group)
    W = len(node_of)
    intra_peer = next((r for r in range(1, W) if node_of[r] == node_of[0]), None)
    inter_peer = next((r for r in range(1, W) if node_of[r] != node_of[0]), None)
    fits: dict[str, LinkCost] = {}
    for name, peer in (("intra", intra_peer), ("inter", inter_peer)):
        if peer is None:
            continue
        if me in (0, peer):
            samples = _pingpong(group, me, peer if me == 0 else 0, me == 0, device)
            if me == 0:
                fits[name] = LinkCost.fit(samples)
        dist.barrier(group=group)
    if me == 0:
        intra = fits.get("intra") or fits.get("inter") or LinkCost(0.0, 0.0)
        model = CostModel(intra, fits.get("inter") or intra)
        t = model.as_tensor()
    else:
        t = torch.zeros(4, dtype=torch.float64)
    dist.broadcast(t, src=0, group=group)
    return CostModel.from_tensor(t)


def shared_model(group, node_of: list[int], device, path: str | None = None) -> CostModel:
    """The model every rank uses: rank 0 loads `path` when it exists, else every rank joins a calibration
    (and rank 0 saves it to `path` when given). Rank 0's model is broadcast, so all ranks agree."""
    me = dist.get_rank(group)
    have = torch.tensor([int(me == 0 and path is not None and os.path.exists(path))], dtype=torch.int64)
    dist.broadcast(have, src=0, group=group)
    if not int(have):
        model = calibrate(group, node_of, device)
        if me == 0 and path is not None:
            model.save(path)
        return model
    t = CostModel.load(path).as_tensor() if me == 0 else torch.zeros(4, dtype=torch.float64)
    dist.broadcast(t, src=0, group=group)
    return CostModel.from_tensor(t)
