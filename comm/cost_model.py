"""An alpha-beta cost model per link class (intra-node, inter-node) for choosing a comm mode per call.

A message of n bytes on a link class costs alpha + beta * n. A comm mode's layer is a sequence of hops; in
each hop every rank sends and receives some messages, and the hop takes as long as its busiest resource: a
rank (the larger of its send and receive sums) or, when ranks share a network port (`ranks_per_nic` > 1, as
the ranks of an emulated node share its one veth), a port (beta times the inter-node bytes all its ranks
send, or receive). The layer's cost is the sum over hops, for dispatch and combine. The dispatchers list
their messages for a given step capacity (`planned_messages`), so the model sees exactly what each mode would
send, padding included.

Fitting: `fit_layers` takes measured layers (their planned messages and seconds) and solves for the four
parameters by non-negative least squares on relative error. Which resource is busiest depends on the
parameters, so it alternates between the two a bounded number of times, from several starting guesses.
The start-up calibration that feeds it (timing real layers of both modes) lives in comm/calibration.py. A
calibration can be saved to JSON and loaded instead of measured.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass

import torch


@dataclass(slots=True)
class LinkCost:
    alpha_s: float          # per message
    beta_s_per_byte: float  # per byte


@dataclass(slots=True)
class CostModel:
    intra: LinkCost
    inter: LinkCost
    ranks_per_nic: int = 1      # ranks of a node that share one inter-node port (consecutive local indices)

    def params(self) -> list[float]:
        return [self.intra.alpha_s, self.intra.beta_s_per_byte, self.inter.alpha_s, self.inter.beta_s_per_byte]

    def layer_time(self, hops: list[list[tuple[int, int, int]]], node_of: list[int]) -> float:
        """hops: per hop, (src rank, dst rank, bytes) messages -> predicted seconds."""
        return sum(x * p for x, p in zip(layer_features(hops, node_of, self), self.params()))

    def to_dict(self) -> dict:
        return {"intra": asdict(self.intra), "inter": asdict(self.inter), "ranks_per_nic": self.ranks_per_nic}

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        try:
            return cls(LinkCost(**d["intra"]), LinkCost(**d["inter"]), int(d.get("ranks_per_nic", 1)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a comm calibration needs {{'intra': {{alpha_s, beta_s_per_byte}}, 'inter': ..., "
                             f"'ranks_per_nic': int}}; got {d!r}") from e

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
        return torch.tensor([*self.params(), float(self.ranks_per_nic)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> CostModel:
        v = t.tolist()
        return cls(LinkCost(v[0], v[1]), LinkCost(v[2], v[3]), int(v[4]))


def hop_resources(hop: list[tuple[int, int, int]], node_of: list[int], port_of: list[int] | None
                  ) -> list[list[float]]:
    """Per resource of one hop, its (intra messages, intra bytes, inter messages, inter bytes): each rank's
    sends and its receives and, when ports are shared (port_of: each rank's port), each port's inter-node
    bytes out and in."""
    vec: dict[tuple, list[float]] = {}
    for src, dst, nbytes in hop:
        inter = int(node_of[src] != node_of[dst])
        keys = [("send", src), ("recv", dst)]
        if inter and port_of is not None:
            keys += [("out", port_of[src]), ("in", port_of[dst])]
        for key in keys:
            v = vec.setdefault(key, [0.0, 0.0, 0.0, 0.0])
            if key[0] in ("send", "recv"):
                v[2 * inter] += 1
            v[2 * inter + 1] += nbytes
    return list(vec.values())


def ports(node_of: list[int], ranks_per_nic: int) -> list[int] | None:
    """Each rank's inter-node port: consecutive local indices of a node share one; None when each has its own."""
    if ranks_per_nic <= 1:
        return None
    out, seen, index = [], {}, {}
    for n in node_of:
        local = seen.get(n, 0)
        seen[n] = local + 1
        out.append(index.setdefault((n, local // ranks_per_nic), len(index)))
    return out


def layer_features(hops, node_of: list[int], model: CostModel) -> list[float]:
    """The layer's cost as counts: per hop the busiest resource's vector under `model`, summed over hops; the
    predicted seconds are its dot product with model.params()."""
    table = resource_table(hops, node_of, model.ranks_per_nic)
    return _busiest(table, torch.tensor(model.params(), dtype=torch.float64)).tolist()


def resource_table(hops, node_of: list[int], ranks_per_nic: int) -> list[torch.Tensor]:
    """Per hop with messages, `[resources, 4]` float64: each resource's (intra messages, intra bytes, inter
    messages, inter bytes). Independent of the parameters, so a fit builds it once per sample."""
    port_of = ports(node_of, ranks_per_nic)
    return [torch.tensor(v, dtype=torch.float64) for v in (hop_resources(h, node_of, port_of) for h in hops) if v]


def _busiest(table: list[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
    """Sum over hops of the vector of the hop's busiest resource under parameters p (ties: the first)."""
    total = torch.zeros(4, dtype=torch.float64)
    for v in table:
        total += v[int(torch.argmax(v @ p))]
    return total


def nnls(A: torch.Tensor, b: torch.Tensor) -> list[float]:
    """Non-negative x minimising |A x - b|^2 (A `[m, n]` float64, b `[m]`), over few unknowns: every support is
    solved by least squares (columns scaled to 1) and the best non-negative solution is kept; all zeros if none."""
    n = A.shape[1]
    scale = A.abs().amax(0).clamp_min(1e-300)
    b = b.reshape(-1, 1)
    best: tuple[float, list[float]] | None = None
    for keep in itertools.product((False, True), repeat=n):
        idx = [i for i in range(n) if keep[i]]
        if not idx:
            continue
        sol = torch.linalg.lstsq(A[:, idx] / scale[idx], b).solution.flatten() / scale[idx]
        if (sol < 0).any():
            continue
        x = [0.0] * n
        for i, v in zip(idx, sol.tolist()):
            x[i] = v
        err = float((A @ torch.tensor(x, dtype=torch.float64)[:, None] - b).pow(2).sum())
        if best is None or err < best[0]:
            best = (err, x)
    return best[1] if best else [0.0] * n


def nnls_relative(rows: list[list[float]], seconds: list[float]) -> list[float]:
    """Non-negative x minimising sum((row . x / seconds - 1)^2)."""
    A = torch.tensor(rows, dtype=torch.float64) / torch.tensor(seconds, dtype=torch.float64)[:, None]
    return nnls(A, torch.ones(A.shape[0], dtype=torch.float64))


# Where fit_layers starts: per link class a latency-bound (1 ms, 10 TB/s) or a bandwidth-bound (1 us, 100 MB/s)
# guess. Which resource is busiest depends on the parameters, so the alternation converges to a local optimum
# that depends on its start (measured: one start left a 43% error where another reached 9%); all 4 are tried.
_STARTS = ((1e-3, 1e-13), (1e-6, 1e-8))


def fit_layers(samples: list[tuple[list, list[int], float]], ranks_per_nic: int = 1,
               rounds: int = 8) -> tuple[CostModel, float]:
    """samples: (planned hops, node_of, measured seconds) of whole layers -> (the model that predicts them best,
    its sum of squared relative errors). From each start, alternate a bounded number of times between picking
    every hop's busiest resource and solving for the parameters; keep the best model over the starts."""
    tables = [resource_table(hops, node_of, ranks_per_nic) for hops, node_of, _ in samples]
    seconds = torch.tensor([t for _, _, t in samples], dtype=torch.float64)
    best: tuple[float, list[float]] | None = None
    for intra, inter in itertools.product(_STARTS, repeat=2):
        p = [*intra, *inter]
        for _ in range(rounds):
            rows = [_busiest(t, torch.tensor(p, dtype=torch.float64)).tolist() for t in tables]
            x = nnls_relative(rows, seconds.tolist())
            if x == p:
                break
            p = x
        pt = torch.tensor(p, dtype=torch.float64)
        err = float(sum((_busiest(t, pt) @ pt / s - 1) ** 2 for t, s in zip(tables, seconds)))
        if best is None or err < best[0] - 1e-12:
            best = (err, p)
    err, p = best
    return CostModel(LinkCost(p[0], p[1]), LinkCost(p[2], p[3]), ranks_per_nic), err


def fit_port_sharing(samples: list[tuple[list, list[int], float]], ranks_per_node: int) -> CostModel:
    """fit_layers with one inter-node port per rank and with one per node; the better fit wins, so the fit
    also tells whether a node's ranks share their port."""
    fits = [fit_layers(samples, share) for share in sorted({1, ranks_per_node})]
    return min(fits, key=lambda f: f[1])[0]


def relative_errors(model: CostModel, samples: list[tuple[list, list[int], float]]) -> list[float]:
    return [model.layer_time(hops, node_of) / t - 1 for hops, node_of, t in samples]
