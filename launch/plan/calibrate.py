"""Calibrating the planner's step costs (launch/plan/model.py) on this machine, from the runtime's own counters.

One engine of 1 attention + 1 expert rank, micro_batches=1, no prefix caching and a token budget that prefills
every window's prompts in one step, runs decode windows: N prompts of p tokens generate m1 tokens, then again
m2 > m1 tokens. The second generate's counters (`LLM.comm_stats()`) minus the first's are (m2 - m1) steps that
decode N sequences at contexts p + m1 .. p + m2, with the prefill cancelled (give or take one empty forward that
sometimes runs beside a generate: each figure is per call actually counted). Per window, per step and MoE layer
(an attention rank records two compute spans per layer, before the dispatch and while the experts work), they
give:
- the attention rank's compute per MoE layer (tokens N, attention pairs N * (p + (m1 + m2) / 2));
- the expert rank's grouped FFN per MoE layer (pairs N * top_k);
- the attention rank's dispatch + combine per MoE layer less the expert compute inside its combine, and of that
  its dispatch calls alone (its own sending; the rest is waiting on the round trip);
- the tail after the last MoE layer (N logit rows) and the step's host work outside all of these.
Prefill windows (N prompts of p tokens, one token each: a single step of N * p tokens and N * p * (p + 1) / 2
pairs) give the same figures for the steps that prefill: per token, a batch of hundreds costs less than the
decode windows' tens (a larger matmul), and fitted on decode windows alone the model under-predicted every
one-micro-batch plan by 7-20% on this VM.
Each window runs once untimed, then `passes` times, the windows taking turns; a window's figures are the
medians over its passes. On the 2-core VM one pass of a window varied by up to 2x (the expert compute of 64
decode tokens measured 0.45 and 1.05 ms in two windows of one pass) and a fresh engine runs slower than a warm
one, so single-pass calibrations put the same plan at 1,554 to 2,621 tok/s in three rounds of one run
(bench/results/cpu-2026-11-27c/plan_validation_run5.json).
Each cost is then a non-negative least-squares line (or plane) over the windows.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from comm.cost_model import nnls

from .model import StepCosts

# (sequences, prompt tokens): small and large batches, short and long contexts
WINDOWS = ((8, 16), (32, 16), (64, 16), (64, 384), (16, 384), (32, 200))
PREFILLS = ((4, 128), (2, 128), (8, 32), (16, 32))        # (prompts, tokens): steps of 256 and 512 tokens
M1, M2 = 8, 40
PASSES = 3
# engines of (attention, expert) ranks whose decode windows give what a rank beyond one on either side adds
PEERS = ((1, 2), (2, 1))
PEER_WINDOWS = ((32, 16), (64, 16), (32, 200))


def _totals(stats: dict) -> dict:
    """The counters a window reads, summed over MoE layers: the first attention rank's compute (s), tail (calls,
    s), dispatch + combine (s), its dispatch calls (s) and steps (calls, s); the busiest expert rank's compute
    (calls, s)."""
    ranks = stats["ranks"]
    attn = ranks[min((k for k, r in ranks.items() if r["role"] == "attention"), key=int)]
    comp = attn["compute"]
    layers = [k for k in comp if k != "-1"]
    comm = sum(p["time_s"] for layer in attn["layers"].values() for p in layer.values())
    sends = sum(layer["dispatch"]["time_s"] for layer in attn["layers"].values() if "dispatch" in layer)
    out = {"a_s": sum(comp[k]["time_s"] for k in layers),
           "tail_calls": comp.get("-1", {}).get("calls", 0), "tail_s": comp.get("-1", {}).get("time_s", 0.0),
           "comm_s": comm, "d_s": sends, "steps": attn["steps"]["calls"], "step_s": attn["steps"]["time_s"]}
    for k, r in ranks.items():      # per expert rank: a window takes the busiest over it (_busiest_expert)
        if r["role"] == "expert":
            ex = [v for layer, v in r["compute"].items() if layer != "-1"]
            out[f"e_calls@{k}"], out[f"e_s@{k}"] = sum(v["calls"] for v in ex), sum(v["time_s"] for v in ex)
    return out


def _delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in a}


def _busiest_expert(d: dict) -> tuple[int, float]:
    """A window's counters (a _delta) -> the calls and compute seconds of the expert rank busiest in it."""
    busiest = max((k for k in d if k.startswith("e_s@")), key=d.get)
    return d["e_calls@" + busiest[4:]], d[busiest]


def measure_windows(model: str, windows=WINDOWS, m1: int = M1, m2: int = M2, passes: int = PASSES,
                    prefills=PREFILLS, ranks: tuple[int, int] = (1, 1), **engine) -> list[dict]:
    """Run the decode and prefill windows on one engine of ranks = (attention, expert) ranks (each window once
    untimed, then `passes` times, taking turns) -> one record per window: its shape (sequences, and per attention
    rank tokens a step and pairs) and per-call seconds (the first attention rank's, the busiest expert rank's),
    the medians over its passes."""
    from launch import LLM, SamplingParams
    from models.checkpoint import Checkpoint

    A, E = ranks
    if passes < 1:
        raise ValueError(f"passes={passes}: a calibration measures each window at least once")
    uneven = [n for n, _ in (*windows, *prefills) if n % A]
    if uneven:
        raise ValueError(f"calibration windows of {uneven} sequences on {A} attention ranks: give multiples of {A}, "
                         "so that each rank takes the same share (the leader spreads them by free KV blocks)")
    spec = Checkpoint(model).spec
    L = sum(spec.moe_layers)
    g = torch.Generator().manual_seed(0)
    shapes = [("decode", n, p) for n, p in windows] + [("prefill", n, p) for n, p in prefills]
    prompts = {(kind, n, p): [torch.randint(3, spec.vocab_size, (p,), generator=g).tolist() for _ in range(n)]
               for kind, n, p in shapes}
    runs: dict[tuple[str, int, int], list[dict]] = {w: [] for w in prompts}
    budget = max(n * (p + 1) for _, n, p in shapes)
    with LLM(model, attention_ranks=A, expert_ranks=E, micro_batches=1, enable_prefix_caching=False,
             max_num_seqs=max(n for _, n, _ in shapes), max_num_batched_tokens=budget, **engine) as llm:
        for timed in [False] + [True] * passes:
            for key in shapes:
                if not timed:       # the warm pass: a fresh engine's first windows run slower than its later ones
                    llm.generate(prompts[key], SamplingParams(max_tokens=m1 if key[0] == "decode" else 1,
                                                              ignore_eos=True))
                elif key[0] == "decode":
                    runs[key].append(_window(llm, prompts[key], m1, m2, L))
                else:
                    runs[key].append(_prefill(llm, prompts[key], L))
    out = []
    for (kind, n, p), rs in runs.items():
        tokens, pairs = (n, n * (p + (m1 + m2) / 2)) if kind == "decode" else (n * p, n * p * (p + 1) / 2)
        out.append({"kind": kind, "seqs": n, "prompt": p, "tokens": tokens / A, "pairs": pairs / A, "passes": len(rs),
                    "attention_ranks": A, "expert_ranks": E,
                    **{k: statistics.median(r[k] for r in rs) for k in rs[0]}})
    return out


def _prefill(llm, prompts: list, L: int, tries: int = 3) -> dict:
    """One pass of a prefill window: the prompts' one step (one token each) -> its per-call figures. An empty
    forward beside it (it sometimes runs beside a generate) would halve them: such a pass is run again."""
    from launch import SamplingParams

    for _ in range(tries):
        s0 = _totals(llm.comm_stats())
        llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        d = _delta(s0, _totals(llm.comm_stats()))
        e_calls = _busiest_expert(d)[0]
        if d["steps"] == 1 and d["tail_calls"] == 1 and e_calls == L:
            return _per_call(d, L)
    raise RuntimeError(f"calibration prefill window ({len(prompts)} prompts of {len(prompts[0])} tokens): "
                       f"{d['steps']} steps and {e_calls} expert calls where 1 and {L} were expected, "
                       f"{tries} times")


def _window(llm, prompts: list, m1: int, m2: int, L: int) -> dict:
    """One pass of a window: generate m1 then m2 tokens of the prompts -> the second's counters less the first's,
    per call."""
    from launch import SamplingParams

    n = len(prompts)
    s0 = _totals(llm.comm_stats())
    llm.generate(prompts, SamplingParams(max_tokens=m1, ignore_eos=True))
    s1 = _totals(llm.comm_stats())
    llm.generate(prompts, SamplingParams(max_tokens=m2, ignore_eos=True))
    s2 = _totals(llm.comm_stats())
    d = _delta(_delta(s0, s1), _delta(s1, s2))
    steps = d["steps"]
    # one empty forward (no token) sometimes runs beside a generate, in either of the two: tolerated
    e_calls = _busiest_expert(d)[0]
    if abs(steps - (m2 - m1)) > 1 or d["tail_calls"] != steps or e_calls != steps * L:
        raise RuntimeError(f"calibration window ({n} sequences of {len(prompts[0])} tokens): {steps} steps, "
                           f"{d['tail_calls']} forwards, {e_calls} expert calls, where {m2 - m1}, "
                           f"{m2 - m1} and {(m2 - m1) * L} were expected, give or take one (did a step split "
                           "or preempt?)")
    return _per_call(d, L)


def _per_call(d: dict, L: int) -> dict:
    """Counters over d["steps"] steps of L MoE layers each -> a window's record: per MoE-layer call the
    attention compute, expert compute, comm less the expert compute and dispatch calls; per step the tail and
    the host work outside all of those."""
    steps = d["steps"]
    calls = steps * L
    e = _busiest_expert(d)[1] / calls
    return {"steps": steps, "a_s": d["a_s"] / calls, "e_s": e, "c_s": d["comm_s"] / calls - e,
            "d_s": d["d_s"] / calls, "tail_s": d["tail_s"] / steps,
            "host_s": (d["step_s"] - d["a_s"] - d["tail_s"] - d["comm_s"]) / steps}


def _nnls(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0 (comm/cost_model.nnls: the best of every support)."""
    return nnls(torch.tensor(rows, dtype=torch.float64), torch.tensor(y, dtype=torch.float64))


def fit(windows: list[dict], moe_layers: int, top_k: int, cores: float, source: str, **shape) -> StepCosts:
    """The step costs that best explain the windows' per-call seconds. shape: num_experts, hidden, dtype_bytes."""
    tokens = [w.get("tokens", w["seqs"]) for w in windows]      # a decode step runs a token per sequence
    a0, a_tok, a_ctx = _nnls([[1, t, w["pairs"]] for t, w in zip(tokens, windows)], [w["a_s"] for w in windows])
    e0, e_pair = _nnls([[1, t * top_k] for t in tokens], [w["e_s"] for w in windows])
    c0, c_tok = _nnls([[1, t] for t in tokens], [max(w["c_s"], 0.0) for w in windows])
    cd0, cd_tok = _nnls([[1, t] for t in tokens], [w.get("d_s", 0.0) for w in windows])
    l0, l_row = _nnls([[1, w["seqs"]] for w in windows], [w["tail_s"] for w in windows])
    h0, h_seq = _nnls([[1, w["seqs"]] for w in windows], [max(w["host_s"], 0.0) for w in windows])
    return StepCosts(a0=a0, a_tok=a_tok, a_ctx=a_ctx, e0=e0, e_pair=e_pair, c0=c0, c_tok=c_tok, l0=l0, l_row=l_row,
                     h0=h0, h_seq=h_seq, cd0=cd0, cd_tok=cd_tok, moe_layers=moe_layers, top_k=top_k, cores=cores,
                     source=source,
                     meta={"windows": windows}, **shape)


def fit_peers(costs: StepCosts, windows: list[dict]) -> None:
    """Set costs' per-peer terms from windows measured on engines of more than one rank a side: what each window's
    exchange (c_s) and sending (d_s) took beyond the 1+1 line at its tokens, per rank beyond one; the median over
    windows, at least 0. The expert side's from 1+E engines, the attention side's from A+1 engines."""
    extra: dict[str, list[float]] = {"c_peer_e": [], "cd_peer_e": [], "c_peer_a": []}
    for w in windows:
        A, E = w["attention_ranks"], w["expert_ranks"]
        c, cd = costs.exchange(w["tokens"])         # the 1+1 line at the window's tokens per attention rank
        over_c = w["c_s"] - c
        if A == 1 and E > 1:
            extra["c_peer_e"].append(over_c / (E - 1))
            extra["cd_peer_e"].append((w["d_s"] - cd) / (E - 1))
        elif E == 1 and A > 1:
            extra["c_peer_a"].append(over_c / (A - 1))
    for name, values in extra.items():
        if values:
            setattr(costs, name, max(0.0, statistics.median(values)))


def calibrate(model: str, windows=WINDOWS, peer_windows=PEER_WINDOWS, **engine) -> StepCosts:
    """Measure the windows on this machine (and the peer windows on each of PEERS) and fit -> the step costs
    (cores: this machine's, on CPU)."""
    from models.checkpoint import Checkpoint

    spec = Checkpoint(model).spec
    t0 = time.perf_counter()
    windows = measure_windows(model, windows, **engine)
    peers = [w for ranks in PEERS if peer_windows
             for w in measure_windows(model, peer_windows, prefills=(), ranks=ranks, **engine)]
    device = engine.get("device", "auto")
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    dtype = engine.get("dtype", "auto")
    dtype_bytes = (4 if on_cpu else 2) if dtype == "auto" else getattr(torch, dtype).itemsize
    costs = fit(windows, sum(spec.moe_layers), spec.top_k,
                float(os.cpu_count() or 1) if on_cpu else float("inf"),
                f"calibrated on this machine ({'cpu' if on_cpu else 'cuda'}) in {time.perf_counter() - t0:.0f} s",
                num_experts=spec.num_experts, hidden=spec.hidden_size, dtype_bytes=dtype_bytes)
    fit_peers(costs, peers)
    costs.meta.update(model=model, peer_windows=peers)
    return costs
