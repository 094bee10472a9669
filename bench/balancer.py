"""Replica choice under skewed routing: max/mean expert-rank load and decision time per layer.

Setup: 256 experts, top-8, 4096 tokens per layer, on 16, 32 and 64 expert ranks with 0%, 12.5% and 25%
redundant slots. Routing: Zipf s=1.0 and s=1.5 over experts (each token picks 8 distinct experts), and a
hot set that drifts (Zipf 1.0; every step one of the 16 hottest experts swaps places with a random colder one).
The placement is EPLB's (balancer/placement.py) from an EMA of the counts observed in warm-up steps; with
drift it is recomputed every 4 steps from the EMA, as live re-placement does. Every policy runs on the same
placement and the same routing. Printed per cell: mean over measured steps of max/mean rank load.
Decision time: the median per layer of every policy's choose() (what the runtime calls: for least_loaded the
plan from the per-expert counts, then each (token, expert) pair to a replica), and of least_loaded's plan alone
(the balanced split, identical on every attention rank; "cold" is its first call after the other policies ran,
"warm" the median of 10 calls back to back).
A second table follows the drift with three re-placement schemes for least_loaded at 25% redundancy: EPLB from
scratch every 4 steps (as above), EPLB every step, and balancer/drift.py's incremental moves (at most 8 slots a
step, on the steps whose predicted max/mean is above 1.10), and a bound: EPLB every step from the previous step's
exact counts (not an EMA), as if re-placement were free and instant but, like every scheme, one step late (the
routing of a step is known only once it ran). Per scheme the mean max/mean, its floor (the heaviest replica's even
share of its expert's load over the mean rank load, at least 1: what no replica choice gets below on that
placement), the slot copies per step and the re-placement's time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from balancer.drift import incremental_replan
from balancer.placement import eplb, slot_capacities
from balancer.policy import LeastLoadedPolicy, make_policy
from balancer.replan import plan_rebalance

E, K = 256, 8
POLICIES = ("static", "round_robin", "random", "least_loaded")


def trace(kind: str, steps: int, tokens: int, seed: int = 0) -> list[torch.Tensor]:
    """`steps` routings `[tokens, K]` of distinct experts per token."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(E, generator=g)
    s = {"zipf1.0": 1.0, "zipf1.5": 1.5, "drift": 1.0}[kind]
    base = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s
    out = []
    for _ in range(steps):
        if kind == "drift":
            hot = torch.randperm(16, generator=g)[:1]
            cold = 16 + torch.randperm(E - 16, generator=g)[:1]
            perm[hot], perm[cold] = perm[cold].clone(), perm[hot].clone()
        probs = torch.empty(E, dtype=torch.float64)
        probs[perm] = base
        out.append(torch.multinomial(probs.expand(tokens, E), K, replacement=False, generator=g))
    return out


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def run_cell(routing: list[torch.Tensor], n: int, redundant: int, warmup: int, replace_every: int | None):
    cap = slot_capacities(E, redundant, n)
    counts = [torch.bincount(ids.flatten(), minlength=E) for ids in routing]
    ema = None
    ratios = {p: [] for p in POLICIES}
    times = {p: [] for p in (*POLICIES, "plan", "warm")}
    placement = policies = None
    for t, ids in enumerate(routing):
        if t >= warmup:
            if placement is None or (replace_every and (t - warmup) % replace_every == 0):
                placement = eplb(ema[None], cap)
                policies = {name: make_policy(name, placement) for name in POLICIES}
            c = counts[t][None]
            phys = {}
            # least_loaded's plan alone (one attention rank), cold after the other policies ran, then warm
            ll: LeastLoadedPolicy = policies["least_loaded"]
            for name in POLICIES:
                phys[name], dt = timed(policies[name].choose, 0, ids, c, 0)
                times[name].append(dt)
            total = c[0]
            times["plan"].append(timed(ll.plan, 0, total)[1])
            times["warm"].append(statistics.median(timed(ll.plan, 0, total)[1] for _ in range(10)))
            for name, phy in phys.items():
                load = torch.bincount(phy.flatten() // placement.num_slots, minlength=n).double()
                ratios[name].append(float(load.max() / load.mean()))
        obs = counts[t].double()
        ema = obs if ema is None else 0.5 * ema + 0.5 * obs
    return ({p: statistics.mean(r) for p, r in ratios.items()},
            {p: statistics.median(v) * 1e6 for p, v in times.items()})


SCHEMES = {"EPLB every 4 steps": ("every", 4), "EPLB every step": ("every", 1),
           "incremental, <= 8 slots a step when predicted > 1.10": ("incremental", 8),
           "bound: EPLB of the previous step's exact counts": ("late", 1)}


def run_replacement(routing: list[torch.Tensor], n: int, redundant: int, warmup: int, scheme: tuple[str, int]
                    ) -> dict[str, float]:
    """least_loaded under a re-placement scheme (placement from the load EMA: EPLB from scratch every k steps,
    slots kept where experts stay; or balancer/drift.py's incremental moves of at most k slots, on the steps its
    predicted max/mean is above 1.10) -> mean max/mean, mean of the floor (the heaviest replica's even share over
    the mean rank load, at least 1: no replica choice gets below it on that placement), mean slot copies per step,
    median ms of the steps that ran a re-placement (the incremental one: every step; it moves nothing when the
    prediction is below the threshold)."""
    cap = slot_capacities(E, redundant, n)
    counts = [torch.bincount(ids.flatten(), minlength=E) for ids in routing]
    ema = placement = None
    ratios, floors, moved, plan_s = [], [], [], []
    for t, ids in enumerate(routing):
        if t >= warmup:
            t0, m = time.perf_counter(), 0
            if placement is None:
                placement = eplb(ema[None], cap)
            elif scheme[0] == "every" and (t - warmup) % scheme[1] == 0:
                replan = plan_rebalance(placement, ema[None], cap, [0] * n)
                placement, m = replan.placement, len(replan.moves)
            elif scheme[0] == "late":
                replan = plan_rebalance(placement, counts[t - 1].double()[None], cap, [0] * n)
                placement, m = replan.placement, len(replan.moves)
            elif scheme[0] == "incremental":
                replan = incremental_replan(placement, ema[None], scheme[1], cap, threshold=1.10)
                placement, m = replan.placement, len(replan.moves)
            else:
                t0 = None     # no re-placement this step
            if t > warmup:
                if t0 is not None:
                    plan_s.append(time.perf_counter() - t0)
                moved.append(m)
            c = counts[t][None]
            phy = make_policy("least_loaded", placement).choose(0, ids, c, 0)
            load = torch.bincount(phy.flatten() // placement.num_slots, minlength=n).double()
            ratios.append(float(load.max() / load.mean()))
            replicas = torch.bincount(placement.slot2expert[0][placement.slot2expert[0] >= 0], minlength=E)
            floors.append(max(1.0, float((counts[t] / replicas).max() / load.mean())))
        obs = counts[t].double()
        ema = obs if ema is None else 0.5 * ema + 0.5 * obs
    return {"max_mean": statistics.mean(ratios), "floor": statistics.mean(floors),
            "slots_moved": statistics.mean(moved), "plan_ms": statistics.median(plan_s) * 1e3 if plan_s else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=12, help="measured steps per routing (after 4 warm-up)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--smoke", action="store_true", help="512 tokens, 2 steps, 16 ranks: " +
                    "a quick run that checks the bench works (tests run it; its figures mean little)")
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.steps, args.ranks = 512, 2, [16]
    torch.set_num_threads(1)   # an attention rank's share of a CPU
    warmup = 4
    print(f"{E} experts, top-{K}, {args.tokens} tokens per layer; cells: max/mean expert-rank load "
          f"(mean over {args.steps} steps); times: median per layer, microseconds")
    header = (f"| routing | ranks | redundancy | {' | '.join(POLICIES)} | "
              f"{' | '.join(p + ' choose µs' for p in POLICIES)} | least_loaded plan µs cold / warm |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    summary = {}
    for kind in ("zipf1.0", "zipf1.5", "drift"):
        routing = trace(kind, warmup + args.steps, args.tokens)
        for n in args.ranks:
            for frac in (0.0, 0.125, 0.25):
                R = int(E * frac)
                ratios, times = run_cell(routing, n, R, warmup, 4 if kind == "drift" else None)
                summary[(kind, n, frac)] = (ratios, times)
                print(f"| {kind} | {n} | {frac:.1%} ({R}) | "
                      + " | ".join(f"{ratios[p]:.3f}" for p in POLICIES)
                      + " | " + " | ".join(f"{times[p]:.0f}" for p in POLICIES)
                      + f" | {times['plan']:.0f} / {times['warm']:.0f} |",
                      flush=True)
    print()
    print("Re-placement under drift (least_loaded; the placement from the EMA of the counts; slots moved per step "
          "over the measured steps after the first)")
    print("| routing | ranks | redundancy | scheme | max/mean | floor | slots moved per step | re-placement ms |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in ("drift", "zipf1.0"):
        routing = trace(kind, warmup + args.steps, args.tokens)
        for n in args.ranks:
            R = int(E * 0.25)
            for name, scheme in SCHEMES.items():
                r = run_replacement(routing, n, R, warmup, scheme)
                ms = "-" if r["plan_ms"] is None else f"{r['plan_ms']:.1f}"
                print(f"| {kind} | {n} | 25.0% ({R}) | {name} | {r['max_mean']:.3f} | {r['floor']:.3f} | "
                      f"{r['slots_moved']:.1f} | {ms} |", flush=True)
    print()
    for n in args.ranks:
        if ("zipf1.0", n, 0.25) in summary:
            r, t = summary[("zipf1.0", n, 0.25)]
            print(f"target: least_loaded max/mean at 25% redundancy, Zipf 1.0, {n} ranks: "
                  f"{r['least_loaded']:.3f} (<= 1.05); choose {t['least_loaded']:.0f} µs, "
                  f"plan {t['plan']:.0f} µs cold, {t['warm']:.0f} µs warm (<= 100 µs); "
                  f"round_robin {r['round_robin']:.3f}, random {r['random']:.3f}")


if __name__ == "__main__":
    main()
