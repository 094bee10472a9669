"""Fixed-shape message blocks: where rows go and where they come back from, worked out on the device.

A block is `[bound + 1, width]` uint8: row 0 holds the number of valid rows (int64, in its first 8 bytes), rows
1..bound the row places; places past the count are empty (zeros; place_rows' rows carry slot -1 there too). Over
the collectives both sides know `bound` from the step capacity and the topology, so no size is exchanged and nobody
reads a count on the host: a receiver keeps the whole block and treats places past the count as empty. The
same-host inboxes (comm/shm_dispatcher.py) post the sender's own token count as the bound instead, so their blocks
are as long as the batch, not the capacity. These are pure functions over tensors (no `torch.distributed`); the
dispatchers (`direct`, `two_phase`, the inboxes' in-band counts) build their messages with them. Names: N rows,
D destinations, K top-k, B bytes per row.
"""
from __future__ import annotations

import torch


def count_of(blocks: torch.Tensor) -> torch.Tensor:
    """blocks `[..., bound + 1, width]` uint8 -> the count in row 0 of each, `[...]` int64 (on the device)."""
    return blocks[..., 0, :8].contiguous().view(torch.int64).squeeze(-1)


def set_count(block: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Write count (a 0-dim or 1-element int64 tensor) into row 0 of block `[bound + 1, width]`; returns block."""
    block[0, :8] = count.reshape(1).to(torch.int64).view(torch.uint8)
    return block


def valid_places(counts: torch.Tensor, bound: int) -> torch.Tensor:
    """counts `[M]` int64 -> `[M, bound]` bool: which row places of M blocks hold a row."""
    return torch.arange(bound, device=counts.device)[None, :] < counts[:, None]


def place_rows(head: torch.Tensor, dst: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, num_dst: int,
               bound: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row per (row, destination it names), in D blocks of `bound` places, with fixed shapes; an empty place
    holds zeros and slot -1, so it is empty whether or not its receiver reads the count.

    head `[N, hb]` uint8 (each row's hidden bytes); dst `[N, K]` int64 destination of each choice, 0..D-1 (any
    other value: none); slots `[N, K]`, weights `[N, K]` -> (blocks `[D * (bound + 1) + 1, hb + 8K]` uint8: per
    destination a count row and `bound` places, each row carrying its K int32 slots and fp32 weights (slot -1,
    weight 0 for choices bound elsewhere), then a scratch row that rows bound for no destination land in; hit
    `[N, D]` bool whether row n goes to d; pos `[N, D]` int64 its place there (0-based, in row order)).
    Needs N <= bound.
    """
    N, K = dst.shape
    assert bound >= N, (N, bound)
    dests = torch.arange(num_dst, device=dst.device)
    same = dst[:, None, :] == dests[None, :, None]                                     # [N, D, K]
    hit = same.any(dim=2)                                                              # [N, D]
    pos = torch.cumsum(hit, dim=0) - 1                                                 # [N, D]
    row_slots = torch.where(same, slots[:, None, :], -1).to(torch.int32)
    row_weights = torch.where(same, weights.float()[:, None, :], 0.0)
    hb = head.shape[1]
    rows = torch.cat([head[:, None, :].expand(N, num_dst, hb), row_slots.view(torch.uint8).view(N, num_dst, 4 * K),
                      row_weights.view(torch.uint8).view(N, num_dst, 4 * K)], dim=2)  # [N, D, B]
    B = hb + 8 * K
    blocks = torch.zeros(num_dst * (bound + 1) + 1, B, dtype=torch.uint8, device=dst.device)
    scratch = num_dst * (bound + 1)
    blocks[:scratch].view(num_dst, bound + 1, B)[:, 1:, hb:hb + 4 * K] = 255   # empty places: every slot -1
    place = torch.where(hit, dests[None, :] * (bound + 1) + 1 + pos, scratch)         # [N, D]
    if N:
        blocks.index_copy_(0, place.reshape(-1), rows.reshape(N * num_dst, B))
    blocks[dests * (bound + 1), :8] = hit.sum(dim=0).view(-1, 1).view(torch.uint8)
    return blocks, hit, pos


def compact(blocks: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge M blocks into one: blocks `[M, n + 1, width]` -> (block `[bound + 1, width]` holding every valid row,
    in block then row order, with the total count in row 0; where `[M, n]` int64 the place each row place went
    to, 1..bound, or bound + 1 for an empty one). Needs M * n <= bound."""
    M, n1, width = blocks.shape
    counts = count_of(blocks)                                                          # [M]
    starts = torch.cumsum(counts, dim=0) - counts
    where = torch.where(valid_places(counts, n1 - 1), 1 + starts[:, None] + torch.arange(n1 - 1,
                        device=blocks.device)[None, :], bound + 1)                      # [M, n]
    out = torch.zeros(bound + 2, width, dtype=torch.uint8, device=blocks.device)
    if where.numel():
        out.index_copy_(0, where.reshape(-1), blocks[:, 1:].reshape(-1, width))
    set_count(out, counts.sum())
    return out[:bound + 1], where


def expand(block: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """compact's inverse for results: block `[bound + 1, width]`, where `[M, n]` -> `[M, n, width]`, the row of
    each place (zeros for an empty one)."""
    padded = torch.cat([block, block.new_zeros(1, block.shape[1])])
    return padded.index_select(0, where.reshape(-1)).view(*where.shape, block.shape[1])


def gather_rows(back: torch.Tensor, hit: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """place_rows' inverse for results: back `[D, bound, H]` the rows each destination returned, hit/pos `[N, D]`
    as place_rows gave them -> `[N, H]`, each row's results summed over the destinations it visited."""
    D, bound, H = back.shape
    N = hit.shape[0]
    index = (torch.arange(D, device=hit.device)[None, :] * bound + pos.clamp(min=0)).reshape(-1)
    got = back.reshape(D * bound, H).index_select(0, index).view(N, D, H)
    return torch.where(hit[:, :, None], got, 0).sum(dim=1) if D > 1 else torch.where(hit, got[:, 0], 0)
