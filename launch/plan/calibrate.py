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
- the attention rank's dispatch + combine per MoE layer less the expert compute inside its combine;
- the tail after the last MoE layer (N logit rows) and the step's host work outside all of these.
Each cost is then a non-negative least-squares line (or plane) over the windows.
"""
from __future__ import annotations

import os
import time

import torch

from comm.cost_model import nnls

from .model import StepCosts

# (sequences, prompt tokens): small and large batches, short and long contexts
WINDOWS = ((8, 16), (32, 16), (64, 16), (64, 384), (16, 384), (32, 200))
M1, M2 = 8, 40


def _totals(stats: dict) -> dict:
    """The counters a window reads, summed over MoE layers: attention compute (s), tail (calls, s),
    dispatch + combine (s), steps (calls, s), expert compute (calls, s)."""
    ranks = stats["ranks"]
    attn, expert = ranks["0"], ranks["1"]
    comp = attn["compute"]
    layers = [k for k in comp if k != "-1"]
    comm = sum(p["time_s"] for layer in attn["layers"].values() for p in layer.values())
    ex = {k: v for k, v in expert["compute"].items() if k != "-1"}
    return {"a_s": sum(comp[k]["time_s"] for k in layers),
            "tail_calls": comp.get("-1", {}).get("calls", 0), "tail_s": comp.get("-1", {}).get("time_s", 0.0),
            "comm_s": comm, "steps": attn["steps"]["calls"], "step_s": attn["steps"]["time_s"],
            "e_calls": sum(v["calls"] for v in ex.values()), "e_s": sum(v["time_s"] for v in ex.values())}


def _delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in a}


def measure_windows(model: str, windows=WINDOWS, m1: int = M1, m2: int = M2, **engine) -> list[dict]:
    """Run the decode windows on one 1+1 engine -> one record per window: its shape and per-call seconds."""
    from launch import LLM, SamplingParams
    from models.checkpoint import Checkpoint

    spec = Checkpoint(model).spec
    L = sum(spec.moe_layers)
    g = torch.Generator().manual_seed(0)
    out = []
    budget = max(n * (p + 1) for n, p in windows)
    with LLM(model, attention_ranks=1, expert_ranks=1, micro_batches=1, enable_prefix_caching=False,
             max_num_seqs=max(n for n, _ in windows), max_num_batched_tokens=budget, **engine) as llm:
        llm.generate([[5] * 16] * 4, SamplingParams(max_tokens=4, ignore_eos=True))       # warm-up
        for n, p in windows:
            prompts = [torch.randint(3, spec.vocab_size, (p,), generator=g).tolist() for _ in range(n)]
            s0 = _totals(llm.comm_stats())
            llm.generate(prompts, SamplingParams(max_tokens=m1, ignore_eos=True))
            s1 = _totals(llm.comm_stats())
            llm.generate(prompts, SamplingParams(max_tokens=m2, ignore_eos=True))
            s2 = _totals(llm.comm_stats())
            d = _delta(_delta(s0, s1), _delta(s1, s2))
            steps = d["steps"]
            # one empty forward (no token) sometimes runs beside a generate, in either of the two: tolerated
            if abs(steps - (m2 - m1)) > 1 or d["tail_calls"] != steps or d["e_calls"] != steps * L:
                raise RuntimeError(f"calibration window ({n} sequences of {p} tokens): {steps} steps, "
                                   f"{d['tail_calls']} forwards, {d['e_calls']} expert calls, where {m2 - m1}, "
                                   f"{m2 - m1} and {(m2 - m1) * L} were expected, give or take one (did a step split "
                                   "or preempt?)")
            calls = steps * L
            e = d["e_s"] / calls
            out.append({"seqs": n, "prompt": p, "steps": steps,
                        "pairs": n * (p + (m1 + m2) / 2), "a_s": d["a_s"] / calls, "e_s": e,
                        "c_s": d["comm_s"] / calls - e, "tail_s": d["tail_s"] / steps,
                        "host_s": (d["step_s"] - d["a_s"] - d["tail_s"] - d["comm_s"]) / steps})
    return out


def _nnls(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0 (comm/cost_model.nnls: the best of every support)."""
    return nnls(torch.tensor(rows, dtype=torch.float64), torch.tensor(y, dtype=torch.float64))


def fit(windows: list[dict], moe_layers: int, top_k: int, cores: float, source: str) -> StepCosts:
    """The step costs that best explain the windows' per-call seconds."""
    a0, a_tok, a_ctx = _nnls([[1, w["seqs"], w["pairs"]] for w in windows], [w["a_s"] for w in windows])
    e0, e_pair = _nnls([[1, w["seqs"] * top_k] for w in windows], [w["e_s"] for w in windows])
    c0, c_tok = _nnls([[1, w["seqs"]] for w in windows], [max(w["c_s"], 0.0) for w in windows])
    l0, l_row = _nnls([[1, w["seqs"]] for w in windows], [w["tail_s"] for w in windows])
    h0, h_seq = _nnls([[1, w["seqs"]] for w in windows], [max(w["host_s"], 0.0) for w in windows])
    return StepCosts(a0=a0, a_tok=a_tok, a_ctx=a_ctx, e0=e0, e_pair=e_pair, c0=c0, c_tok=c_tok, l0=l0, l_row=l_row,
                     h0=h0, h_seq=h_seq, moe_layers=moe_layers, top_k=top_k, cores=cores, source=source,
                     meta={"windows": windows})


def calibrate(model: str, windows=WINDOWS, **engine) -> StepCosts:
    """Measure the windows on this machine and fit -> the step costs (cores: this machine's, on CPU)."""
    from models.checkpoint import Checkpoint

    spec = Checkpoint(model).spec
    t0 = time.perf_counter()
    windows = measure_windows(model, windows, **engine)
    device = engine.get("device", "auto")
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    costs = fit(windows, sum(spec.moe_layers), spec.top_k,
                float(os.cpu_count() or 1) if on_cpu else float("inf"),
                f"calibrated on this machine ({'cpu' if on_cpu else 'cuda'}) in {time.perf_counter() - t0:.0f} s")
    costs.meta["model"] = model
    return costs
