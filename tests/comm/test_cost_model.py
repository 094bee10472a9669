"""The alpha-beta cost model: the fit recovers known links, hop costs follow the busiest rank, calibrations
round-trip through JSON, and `auto` picks the mode the model favours on every rank alike while delivering
exactly what `direct` does."""
from __future__ import annotations

import pytest
import torch

from comm.cost_model import CostModel, LinkCost
from tests.dist_utils import run_ranks


def test_fit_recovers_alpha_and_beta():
    link = LinkCost.fit([(n, 20e-6 + n * 1e-9) for n in (64, 4096, 65536, 1 << 20)])
    assert link.alpha_s == pytest.approx(20e-6, rel=1e-6) and link.beta_s_per_byte == pytest.approx(1e-9, rel=1e-6)
    flat = LinkCost.fit([(64, 5e-6), (1 << 20, 4e-6)])      # noisy timings: never a negative beta
    assert flat.beta_s_per_byte == 0.0 and flat.alpha_s == pytest.approx(4.5e-6)


def test_layer_time_is_the_busiest_rank_per_hop():
    model = CostModel(LinkCost(1.0, 0.0), LinkCost(10.0, 0.0))
    node_of = [0, 0, 1, 1]
    # hop 1: rank 0 sends two intra messages (2 s); hop 2: one inter message (10 s), and rank 3 receives two
    hops = [[(0, 1, 8), (0, 1, 8)], [(1, 2, 8), (0, 3, 8), (1, 3, 8)]]
    assert model.layer_time(hops, node_of) == 2.0 + 20.0


def test_calibration_round_trips_and_bad_files_are_named(tmp_path):
    model = CostModel(LinkCost(3e-6, 1e-10), LinkCost(40e-6, 8e-10))
    path = str(tmp_path / "calib.json")
    model.save(path)
    assert CostModel.load(path) == model
    (tmp_path / "bad.json").write_text('{"intra": 1}')
    with pytest.raises(ValueError, match="calibration"):
        CostModel.load(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="missing.json"):
        CostModel.load(str(tmp_path / "missing.json"))


def _auto_fn(rank, world, A, rpn, favour):
    import torch.distributed as dist

    from comm.dispatcher import make_dispatcher
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if favour == "two_phase":       # inter-node messages dear, intra-node ones cheap
        model = CostModel(LinkCost(1e-6, 0.0), LinkCost(1e-3, 0.0))
    else:                           # every message costs the same: fewer hops win
        model = CostModel(LinkCost(1e-3, 0.0), LinkCost(1e-3, 0.0))
    kw = dict(group=dist.group.WORLD, hidden_size=8, top_k=2, dtype=torch.float32, device=torch.device("cpu"),
              num_sources=A, ranks_per_node=rpn)
    outs = {}
    for mode in ("direct", "auto"):
        d = make_dispatcher(mode, **kw, **({"model": model} if mode == "auto" else {}))
        d.set_capacity(6)
        g = torch.Generator().manual_seed(rank)
        if rank < A:
            hidden = torch.randint(-4, 5, (6, 8), generator=g).float()
            phy = torch.stack([torch.randperm((world - A) * 2, generator=g)[:2] for _ in range(6)])
            args = (hidden, A + phy // 2, phy % 2, torch.full((6, 2), 0.5))
        else:
            args = d.empty_tokens()
        rows, handle = d.dispatch(0, *args)
        out = d.combine(rows.hidden * (rows.slots >= 0).sum(1, keepdim=True), handle)
        outs[mode] = (out, rows.hidden.shape[0], d.describe())
    return outs


@pytest.mark.parametrize("favour", ["two_phase", "direct"])
def test_auto_follows_the_model_and_matches_direct(favour):
    res = run_ranks(_auto_fn, 8, 4, 4, favour)
    for r in range(8):
        assert torch.equal(res[r]["direct"][0], res[r]["auto"][0])
        assert res[r]["direct"][1] == res[r]["auto"][1]
        assert res[r]["auto"][2]["calls"] == {"direct": int(favour == "direct"), "two_phase": int(favour != "direct")}
