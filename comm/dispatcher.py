"""Dispatch (attention -> experts) and combine (experts -> attention) for one MoE layer.

Every rank calls both, in the same order, even with zero rows: attention ranks send tokens and
receive none; expert ranks send none and receive rows. A token crosses to an expert rank once,
however many of its top-k experts live there, carrying its K (slot, weight) pairs (slot -1 =
elsewhere). The expert rank returns one weighted-sum row per received row; the source adds
them up over ranks. Names: T tokens, H hidden, K top-k, W world size, N rows.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .stats import CommStats


@dataclass(slots=True)
class ReceivedRows:
    """hidden `[N, H]`; slots `[N, K]` int64 local slot, -1 = not on this rank; weights `[N, K]` fp32."""

    hidden: torch.Tensor
    slots: torch.Tensor
    weights: torch.Tensor


@dataclass(slots=True)
class DispatchHandle:
    """What combine needs to route results back: row2token `[N_sent]` int64 source token of each sent
    row; send/recv counts per peer rank (python lists, the all_to_all splits)."""

    layer: int
    num_tokens: int
    row2token: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]


class Dispatcher(ABC):
    """Comm-mode interface. `dispatch` then `combine`, once per MoE layer, on every rank."""

    def __init__(self, group: dist.ProcessGroup, hidden_size: int, top_k: int, dtype: torch.dtype,
                 device: torch.device, stats: CommStats | None = None):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.hidden_size, self.top_k = hidden_size, top_k
        self.dtype, self.device = dtype, device
        self.stats = stats or CommStats()

    @abstractmethod
    def dispatch(self, layer: int, hidden: torch.Tensor, dst_ranks: torch.Tensor, slots: torch.Tensor,
                 weights: torch.Tensor) -> tuple[ReceivedRows, DispatchHandle]:
        """hidden `[T, H]`; dst_ranks `[T, K]` int64 world rank of each choice's replica; slots `[T, K]`
        int64 slot on that rank; weights `[T, K]` fp32 -> (rows this rank must compute, handle)."""

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """expert_out `[N_received, H]` -> `[T, H]` summed over the ranks each token visited."""

    def empty_tokens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Zero-token inputs for ranks with nothing to send (expert ranks, idle attention ranks)."""
        K = self.top_k
        z = torch.empty(0, K, dtype=torch.int64, device=self.device)
        return (torch.empty(0, self.hidden_size, dtype=self.dtype, device=self.device), z, z,
                torch.empty(0, K, dtype=torch.float32, device=self.device))


def pack_rows(hidden: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One uint8 row per token: hidden bytes, then K int32 slots, then K fp32 weights -> one message per peer."""
    return torch.cat([hidden.contiguous().view(torch.uint8), slots.to(torch.int32).view(torch.uint8),
                      weights.to(torch.float32).view(torch.uint8)], dim=1)


def unpack_rows(buf: torch.Tensor, hidden_size: int, top_k: int, dtype: torch.dtype) -> ReceivedRows:
    hb = hidden_size * torch.empty(0, dtype=dtype).element_size()
    hidden = buf[:, :hb].contiguous().view(dtype)
    slots = buf[:, hb:hb + 4 * top_k].contiguous().view(torch.int32).to(torch.int64)
    weights = buf[:, hb + 4 * top_k:].contiguous().view(torch.float32)
    return ReceivedRows(hidden, slots, weights)


def plan_rows(dst_ranks: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, world_size: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deduplicate (token, destination) pairs, sorted by destination then token.

    Returns row2token `[N]`, row_dst `[N]`, row_slots `[N, K]` (-1 where the choice is on another
    rank), row_weights `[N, K]`. Vectorised: no loop over tokens.
    """
    T, K = dst_ranks.shape
    tok = torch.arange(T, device=dst_ranks.device)[:, None].expand(T, K)
    keys = (dst_ranks * T + tok).flatten()
    uniq, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    row_slots = torch.full((uniq.numel(), K), -1, dtype=torch.int64, device=dst_ranks.device)
    row_weights = torch.zeros(uniq.numel(), K, dtype=torch.float32, device=dst_ranks.device)
    kk = torch.arange(K, device=dst_ranks.device).expand(T, K).flatten()
    row_slots[inverse, kk] = slots.flatten()
    row_weights[inverse, kk] = weights.flatten().float()
    return uniq % max(T, 1), uniq // max(T, 1), row_slots, row_weights


class DirectDispatcher(Dispatcher):
    """One variable-split all_to_all_single over the world (the splits are exchanged first)."""

    def dispatch(self, layer, hidden, dst_ranks, slots, weights):
        t0 = time.perf_counter()
        row2token, row_dst, row_slots, row_weights = plan_rows(dst_ranks, slots, weights, self.world_size)
        send_counts_t = torch.bincount(row_dst, minlength=self.world_size).to(torch.int64)
        recv_counts_t = torch.empty_like(send_counts_t)
        dist.all_to_all_single(recv_counts_t, send_counts_t, group=self.group)
        send_counts, recv_counts = send_counts_t.tolist(), recv_counts_t.tolist()
        payload = pack_rows(hidden[row2token], row_slots, row_weights)
        recv = torch.empty(sum(recv_counts), payload.shape[1], dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(recv, payload, recv_counts, send_counts, group=self.group)
        rows = unpack_rows(recv, self.hidden_size, self.top_k, self.dtype)
        self.stats.phase(layer, "dispatch").add(payload.numel(), sum(c > 0 for c in send_counts),
                                                time.perf_counter() - t0)
        return rows, DispatchHandle(layer, hidden.shape[0], row2token, send_counts, recv_counts)

    def combine(self, expert_out, handle):
        t0 = time.perf_counter()
        back = torch.empty(sum(handle.send_counts), self.hidden_size, dtype=self.dtype, device=self.device)
        dist.all_to_all_single(back, expert_out.to(self.dtype).contiguous(), handle.send_counts,
                               handle.recv_counts, group=self.group)
        out = torch.zeros(handle.num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        out.index_add_(0, handle.row2token, back)
        self.stats.phase(handle.layer, "combine").add(
            expert_out.numel() * expert_out.element_size(), sum(c > 0 for c in handle.recv_counts),
            time.perf_counter() - t0)
        return out


DISPATCHERS: dict[str, type[Dispatcher]] = {"direct": DirectDispatcher}


def make_dispatcher(mode: str, **kwargs) -> Dispatcher:
    if mode not in DISPATCHERS:
        raise ValueError(f"comm mode {mode!r} is not available; choose one of {sorted(DISPATCHERS)}")
    return DISPATCHERS[mode](**kwargs)
