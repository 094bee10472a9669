"""two_phase against direct on real gloo ranks with emulated nodes: on random routings (and the edge cases:
nodes of different sizes, A != E, ranks with zero tokens, every token to one rank) each expert rank receives
exactly the rows direct delivers and every source gets exactly direct's combined output; inter-node
messages per layer and direction are one per (source node, destination node) pair, against one per
(source, expert rank) pair crossing nodes for direct."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import wider
from tests.dist_utils import run_ranks

H, K, SLOTS = 8, 3, 4


def _routing(rank, A, E, T, seed, one_rank):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    # integers and quarter weights: every sum below is exact in fp32, so any summation order agrees
    hidden = torch.randint(-8, 9, (T, H), generator=g).float()
    hidden[:, 0] = rank
    hidden[:, 1] = torch.arange(T)
    if one_rank:
        phy = torch.stack([torch.randperm(SLOTS, generator=g)[:K] for _ in range(T)]) if T else \
            torch.empty(0, K, dtype=torch.int64)
    else:
        phy = torch.stack([torch.randperm(E * SLOTS, generator=g)[:K] for _ in range(T)]) if T else \
            torch.empty(0, K, dtype=torch.int64)
    weights = torch.randint(1, 8, (T, K), generator=g).float() / 4
    return hidden, A + phy // SLOTS, phy % SLOTS, weights


def _join(rank, world, A, rpn) -> dict:
    """Join the gloo group -> make_dispatcher's keyword arguments for this test's shapes. rpn: ranks per node
    (nodes are consecutive blocks of ranks), or the node of each rank (a job re-formed after losing ranks)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    nodes = {"nodes": rpn} if isinstance(rpn, list) else {"ranks_per_node": rpn}
    return dict(group=dist.group.WORLD, hidden_size=H, top_k=K, dtype=torch.float32, device=torch.device("cpu"),
                num_sources=A, **nodes)


def _inputs(d, rank, world, A, tokens, seed, one_rank):
    """A source's routed tokens, an expert rank's empty ones."""
    return _routing(rank, A, world - A, tokens[rank], seed, one_rank) if rank < A else d.empty_tokens()


def _expert_ffn(rows, rank):
    """What an expert rank returns for its rows: an integer-valued function of the row, its slots and the rank."""
    scale = (rows.slots + 1 + 10 * rank).float() * (rows.slots >= 0)
    return rows.hidden * (rows.weights * scale).sum(1, keepdim=True)


def _rank_fn(rank, world, A, rpn, tokens, seed, one_rank):
    from comm.modes import make_dispatcher
    kw = _join(rank, world, A, rpn)
    out = {}
    for mode in ("direct", "two_phase"):
        d = make_dispatcher(mode, **kw)
        results = []
        for layer, seed_ in enumerate((seed, seed + 1)):    # two layers: buffers and tags are reused
            d.set_capacity(max(tokens))
            rows, handle = d.dispatch(layer, *_inputs(d, rank, world, A, tokens, seed_, one_rank))
            combined = d.combine(_expert_ffn(rows, rank), handle)
            # both modes keep whole fixed-size blocks: empty row places (slot -1 everywhere) hold zeros
            valid = (rows.slots >= 0).any(1)
            assert not rows.hidden[~valid].any() and not rows.weights[~valid].any()
            # the rows that hold a token, in a canonical order: by (sender, token)
            key = rows.hidden[:, 0] * 10000 + rows.hidden[:, 1]
            order = torch.argsort(key[valid])
            rows.hidden, rows.slots, rows.weights = rows.hidden[valid], rows.slots[valid], rows.weights[valid]
            results.append({"rows": (rows.hidden[order], rows.slots[order], rows.weights[order]),
                            "out": combined})
        d.flush()       # two_phase's last sends may still be pending: let every peer take them before leaving
        out[mode] = {"results": results, "stats": d.stats.to_dict()}
    return out


CASES = [
    # (A, E, ranks_per_node, tokens per source, all tokens to one expert rank)
    (2, 2, 2, [5, 7], False),
    wider(4, 4, 2, [6, 0, 9, 3], False),
    wider(4, 4, 4, [8, 8, 1, 5], False),
    (2, 3, 2, [0, 6], False),          # node sizes 2, 2, 1; a node mixing an attention and an expert rank
    wider(3, 2, 2, [4, 0, 7], False),  # A != E, mixed node
    (1, 3, 1, [9], False),             # one rank per node: every hop crosses nodes
    (2, 4, 3, [7, 5], True),           # every token to the first expert rank
    # nodes named per rank, as after a re-forming: 3+3 in nodes of two lost attention rank 1, the others kept
    # their nodes (0 | 1, 1 | 2, 2); and labels out of order, nodes mixing attention and expert ranks
    (2, 3, [0, 1, 1, 2, 2], [6, 4], False),
    wider(2, 3, [3, 1, 1, 3, 5], [5, 8], False),
    # an expert joiner numbered last fills the lowest node with room: node 1 holds expert ranks 2 and 4, not 3
    (2, 3, [0, 0, 1, 2, 1], [6, 4], False),
]


@pytest.mark.parametrize("A,E,rpn,tokens,one_rank", CASES)
def test_two_phase_matches_direct(A, E, rpn, tokens, one_rank):
    W = A + E
    res = run_ranks(_rank_fn, W, A, rpn, tokens, 3, one_rank)
    for r in range(W):
        for layer in range(2):
            d, t = res[r]["direct"]["results"][layer], res[r]["two_phase"]["results"][layer]
            for a, b in zip(d["rows"], t["rows"]):
                assert torch.equal(a, b), (r, layer)
            assert torch.equal(d["out"], t["out"]), (r, layer)
    node = (lambda x: rpn[x]) if isinstance(rpn, list) else (lambda x: x // rpn)   # noqa: E731
    src_nodes, dst_nodes = {node(x) for x in range(A)}, {node(x) for x in range(A, W)}
    for layer in ("0", "1"):
        for phase in ("dispatch", "combine"):
            inter = {m: sum(res[r][m]["stats"][layer][phase]["inter_node_messages"] for r in range(W))
                     for m in ("direct", "two_phase")}
            pairs = sum(1 for s in range(A) for e in range(A, W) if node(s) != node(e))
            # two_phase: one per node pair that crosses nodes; its intra-node hops never count
            assert inter["two_phase"] == sum(1 for a in src_nodes for b in dst_nodes if a != b), (phase, inter)
            if phase == "dispatch":      # direct: every source sends every expert rank its block
                assert inter["direct"] == pairs, inter
            else:                        # combine: as gathers/all_to_all, every expert rank answers each source
                assert inter["direct"] <= pairs
            assert inter["two_phase"] <= len(src_nodes) * len(dst_nodes)
            if isinstance(rpn, int) and rpn > 1 and A % rpn == 0 and E % rpn == 0 and phase == "dispatch":
                # full nodes, attention and experts apart: direct's rpn x rpn pairs per node pair become one
                assert inter["two_phase"] * rpn * rpn == inter["direct"], inter


def _overlap_rank_fn(rank, world, A, rpn, tokens, signals):
    """Sources start their dispatch, then signal (a file each); expert ranks post their receives only once every
    source has signalled. A source whose start_dispatch waited for an expert rank to receive would never signal,
    and the expert ranks would give up. Returns each source's combined output of both modes."""
    import os
    import time

    from comm.modes import make_dispatcher
    kw = _join(rank, world, A, rpn)
    out = {}
    for mode in ("direct", "two_phase"):
        d = make_dispatcher(mode, **kw)
        d.set_capacity(max(tokens))
        inputs = _inputs(d, rank, world, A, tokens, 5, False)
        if mode == "two_phase" and rank >= A:
            deadline = time.monotonic() + 30
            while not all(os.path.exists(os.path.join(signals, f"started{s}")) for s in range(A)):
                assert time.monotonic() < deadline, "a source's start_dispatch waited for the expert ranks"
                time.sleep(0.01)
        pending = d.start_dispatch(0, *inputs)
        if mode == "two_phase" and rank < A:
            open(os.path.join(signals, f"started{rank}"), "w").close()
        rows, handle = d.finish_dispatch(pending)
        out[mode] = d.combine(_expert_ffn(rows, rank), handle)
        d.flush()
    return out


@pytest.mark.parametrize("A,E,rpn,tokens", [(2, 2, 2, [5, 7]), (1, 3, 1, [9]), (2, 3, 2, [0, 6])])
def test_start_dispatch_does_not_wait_for_the_expert_ranks(A, E, rpn, tokens, tmp_path):
    res = run_ranks(_overlap_rank_fn, A + E, A, rpn, tokens, str(tmp_path), timeout=90)
    for r in range(A):
        assert torch.equal(res[r]["direct"], res[r]["two_phase"]), r
