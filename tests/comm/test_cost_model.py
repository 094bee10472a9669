"""The alpha-beta cost model: the layer fit recovers a known model and whether ports are shared, hop costs
follow the busiest rank or shared port, calibrations round-trip through JSON, the start-up calibration gives
every rank the same model (and an unreadable file fails every rank, none hangs), and `auto` picks the mode
the model favours on every rank alike while delivering exactly what `direct` does."""
from __future__ import annotations

import pytest
import torch

from comm.cost_model import CostModel, LinkCost, fit_layers, fit_port_sharing, nnls_relative, relative_errors
from comm.dispatcher import Layout
from comm.modes import make_dispatcher
from tests.conftest import wider
from tests.dist_utils import run_ranks


def _layers(world, sources, rpn, capacities):
    """Planned messages of direct and two_phase at each capacity, built from a Layout (no process group)."""
    kw = dict(group=Layout(world), hidden_size=64, top_k=4, dtype=torch.bfloat16, device=torch.device("cpu"),
              num_sources=sources, ranks_per_node=rpn)
    node_of = [r // rpn for r in range(world)]
    return [(make_dispatcher(m, **kw).planned_messages(C), node_of) for C in capacities
            for m in ("direct", "two_phase")]


def test_nnls_relative_recovers_exact_and_stays_non_negative():
    rows = [[1.0, float(n)] for n in (64, 4096, 65536, 1 << 20)]
    x = nnls_relative(rows, [20e-6 + r[1] * 1e-9 for r in rows])
    assert x[0] == pytest.approx(20e-6, rel=1e-6) and x[1] == pytest.approx(1e-9, rel=1e-6)
    flat = nnls_relative([[1.0, 64.0], [1.0, float(1 << 20)]], [5e-6, 4e-6])   # noisy: never a negative beta
    assert flat[1] == 0.0 and 4e-6 <= flat[0] <= 5e-6


@pytest.mark.parametrize("share", [1, 4])
def test_fit_layers_recovers_a_known_model_and_its_port_sharing(share):
    truth = CostModel(LinkCost(30e-6, 1 / 20e9), LinkCost(200e-6, 1 / 1e9), share)
    layers = _layers(8, 4, 4, (8, 32, 128, 512, 4096))
    samples = [(hops, node_of, truth.layer_time(hops, node_of)) for hops, node_of in layers]
    fitted = fit_port_sharing(samples, 4)
    assert fitted.ranks_per_nic == share
    assert max(abs(e) for e in relative_errors(fitted, samples)) < 1e-6
    assert fitted.params() == pytest.approx(truth.params(), rel=1e-4)


# Per-layer ms (direct, two_phase) measured by bench/comm_emulated.py at 1 Gbit/s (2+2 ranks, hidden 2048 bf16,
# top-8), by tokens per attention rank. Alternating from one fixed start, the fit settled at a 43% error on
# these; the best start reaches 9%.
MEASURED_1GBIT_MS = {8: (4.655, 3.503), 16: (6.478, 5.19), 32: (10.401, 8.038), 64: (19.197, 13.73),
                     128: (36.263, 23.805), 256: (70.984, 44.008), 4096: (1142.415, 657.062)}


def test_fit_layers_tries_several_starts_on_real_measurements():
    kw = dict(group=Layout(4), hidden_size=2048, top_k=8, dtype=torch.bfloat16, device=torch.device("cpu"),
              num_sources=2, ranks_per_node=2)
    modes = [make_dispatcher(m, **kw) for m in ("direct", "two_phase")]
    samples = [(d.planned_messages(T), [0, 0, 1, 1], ms[i] / 1e3) for T, ms in MEASURED_1GBIT_MS.items()
               for i, d in enumerate(modes)]
    fitted = fit_port_sharing(samples, 2)
    assert fitted.ranks_per_nic == 2                            # the two ranks of a node share the one veth
    assert max(abs(e) for e in relative_errors(fitted, samples)) < 0.10
    model, sse = fit_layers(samples, 2)
    assert sse == pytest.approx(sum(e * e for e in relative_errors(model, samples)))


def test_layer_time_is_the_busiest_rank_per_hop():
    model = CostModel(LinkCost(1.0, 0.0), LinkCost(10.0, 0.0))
    node_of = [0, 0, 1, 1]
    # hop 1: rank 0 sends two intra messages (2 s); hop 2: one inter message (10 s), and rank 3 receives two
    hops = [[(0, 1, 8), (0, 1, 8)], [(1, 2, 8), (0, 3, 8), (1, 3, 8)]]
    assert model.layer_time(hops, node_of) == 2.0 + 20.0


def test_a_shared_port_carries_the_inter_node_bytes_of_all_its_ranks():
    node_of = [0, 0, 1, 1]
    hops = [[(0, 2, 100), (1, 3, 100)]]             # two ranks of node 0 send across at once
    own = CostModel(LinkCost(0.0, 0.0), LinkCost(0.0, 1.0), ranks_per_nic=1)
    shared = CostModel(LinkCost(0.0, 0.0), LinkCost(0.0, 1.0), ranks_per_nic=2)
    assert own.layer_time(hops, node_of) == 100.0 and shared.layer_time(hops, node_of) == 200.0


def test_calibration_round_trips_and_bad_files_are_named(tmp_path):
    model = CostModel(LinkCost(3e-6, 1e-10), LinkCost(40e-6, 8e-10), ranks_per_nic=2)
    path = str(tmp_path / "calib.json")
    model.save(path)
    assert CostModel.load(path) == model
    assert CostModel.from_tensor(model.as_tensor()) == model
    (tmp_path / "old.json").write_text('{"intra": {"alpha_s": 1e-6, "beta_s_per_byte": 0}, '
                                       '"inter": {"alpha_s": 1e-5, "beta_s_per_byte": 0}}')
    assert CostModel.load(str(tmp_path / "old.json")).ranks_per_nic == 1    # one port per rank unless told
    (tmp_path / "bad.json").write_text('{"intra": 1}')
    with pytest.raises(ValueError, match="calibration"):
        CostModel.load(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="missing.json"):
        CostModel.load(str(tmp_path / "missing.json"))


def _auto_fn(rank, world, A, rpn, favour):
    import torch.distributed as dist

    from comm.modes import make_dispatcher
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
        d.flush()           # two_phase's last sends may be pending: every peer takes them before this rank leaves
        outs[mode] = (out, rows.hidden.shape[0], d.describe())
    return outs


@pytest.mark.parametrize("favour", ["two_phase", wider("direct")])
def test_auto_follows_the_model_and_matches_direct(favour):
    res = run_ranks(_auto_fn, 8, 4, 4, favour)
    for r in range(8):
        assert torch.equal(res[r]["direct"][0], res[r]["auto"][0])
        assert res[r]["direct"][1] == res[r]["auto"][1]
        assert res[r]["auto"][2]["calls"] == {"direct": int(favour == "direct"), "two_phase": int(favour != "direct")}


def _calibrate_fn(rank, world, path, corrupt):
    import torch.distributed as dist

    from comm.calibration import shared_model
    dist.init_process_group("gloo", rank=rank, world_size=world)
    kw = dict(group=dist.group.WORLD, hidden_size=32, top_k=2, dtype=torch.float32, device=torch.device("cpu"),
              num_sources=2, ranks_per_node=2)
    if corrupt:
        if rank == 0:
            with open(path, "w") as f:
                f.write("{not json")
        try:
            shared_model(path, **kw)
        except ValueError as e:
            return str(e)
        return None
    measured = shared_model(path, **kw)
    loaded = shared_model(path, **kw)
    return measured, loaded


def test_start_up_calibration_is_shared_saved_and_loaded(tmp_path):
    path = str(tmp_path / "calib.json")
    res = run_ranks(_calibrate_fn, 4, path, False)
    measured, loaded = res[0]
    assert all(r == (measured, loaded) for r in res)          # every rank holds rank 0's model
    assert measured == loaded == CostModel.load(path)
    assert min(measured.params()) >= 0 and measured.layer_time(*_layers(4, 2, 2, (8,))[0]) > 0
    assert measured.ranks_per_nic in (1, 2)


def test_an_unreadable_calibration_fails_every_rank(tmp_path):
    res = run_ranks(_calibrate_fn, 4, str(tmp_path / "calib.json"), True)
    assert res[0] and "calib.json" in res[0]
    assert all(r and "calibration" in r for r in res)
