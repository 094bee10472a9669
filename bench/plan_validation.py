"""The planner (python -m launch.plan) against the runtime: predicted and measured output tok/s for several plans
on this machine, bench/throughput.py's workload (256 requests, prompts of 16-256 tokens, long-tailed outputs of
8-256, 64 in flight in all).

The run goes in --repeats rounds. Each round calibrates the step costs afresh (launch/plan/calibrate.py: one 1+1
engine's counters; or reads --profile once), predicts every plan from the workload's prompt and output lengths,
and measures every plan once (a fresh engine, an untimed run, one timed run), in an order rotated each round, so that
this VM's drifting speed falls on every plan alike and each prediction comes from the machine of its round. A
plan's figures are the medians over the rounds. Prints each plan's predicted and measured tok/s and the error,
the median and largest error, and whether the planner's first choice is within 5% of the best measured plan;
--out writes it all as JSON.

Plans on emulated nodes (ranks_per_node) or with two_phase run their comm over gloo, which the step-cost
calibration does not measure: each round also starts one engine of 2 attention + 1 expert ranks on two emulated
nodes with comm=auto, whose start-up comm calibration (comm/calibration.py: real layers of both modes) writes the
alpha-beta model that prices those plans (launch/plan/layout.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.throughput import run_ours, workload  # noqa: E402
from launch import LLM  # noqa: E402
from launch.plan.model import COST_FIELDS, Plan, StepCosts, simulate  # noqa: E402
from models import SHIPPED_MODEL  # noqa: E402

PLANS = ("1,1,1", "1,1,2", "1,2,1", "1,2,2", "2,1,1", "2,1,2",
         "2,1,1,direct,1", "2,1,1,two_phase,2", "1,2,1,two_phase,1", "2,1,2,two_phase,2")


def parse_plan(text: str, max_seqs: int = 64) -> Plan:
    """'A,E,M[,comm[,ranks_per_node]]' -> the plan (max_num_seqs = max_seqs // A, as bench/throughput.py)."""
    parts = text.split(",")
    try:
        A, E, M = map(int, parts[:3])
        comm = parts[3] if len(parts) > 3 else "direct"
        per_node = int(parts[4]) if len(parts) > 4 else 0
    except (ValueError, IndexError):
        raise ValueError(f"--plans entry {text!r}: give A,E,M or A,E,M,comm,ranks_per_node") from None
    return Plan(A, E, M, comm, max_num_seqs=max_seqs // A, ranks_per_node=per_node)


def network_model(model: str) -> dict:
    """The comm model of this machine's gloo between emulated nodes: an engine's comm=auto start-up calibration
    on 2+1 ranks, 2 a node, written to a file and read back."""
    from launch.plan.layout import load_network

    path = os.path.join(tempfile.mkdtemp(prefix="plan-net-"), "comm.json")
    with LLM(model, attention_ranks=2, expert_ranks=1, ranks_per_node=2, comm="auto", comm_calibration=path,
             device="cpu"):
        pass
    return load_network(path)


def measure(model: str, plan: Plan, prompts, olens) -> float:
    """One timed run of the workload on a fresh engine for the plan, after an untimed run of the whole workload
    (a fresh engine's first full run was up to 25% slower than its later ones: its KV cache's first touch and
    thread start-up) -> output tok/s."""
    with LLM(model, attention_ranks=plan.attention_ranks, expert_ranks=plan.expert_ranks,
             micro_batches=plan.micro_batches, max_num_seqs=plan.max_num_seqs, max_num_batched_tokens=512,
             comm=plan.comm, ranks_per_node=plan.ranks_per_node or None, device="cpu") as llm:
        run_ours(llm, prompts, olens)
        dt, n = run_ours(llm, prompts, olens)
    return n / dt


def repredict(path: str, plans: list[Plan], plens: list[int], olens: list[int], drop: tuple[str, ...] = ()) -> None:
    """Each round of a saved run: its calibration's costs (those named in drop set to 0: an ablation) -> the
    current model's prediction of every plan, against the round's measured figure; medians over rounds, as a run
    reports them."""
    unknown = [name for name in drop if name not in COST_FIELDS]
    if unknown:
        raise SystemExit(f"--drop {','.join(unknown)}: not a step cost; give names among {', '.join(COST_FIELDS)}")
    with open(path) as f:
        saved = json.load(f)
    rounds = [StepCosts.from_dict({**r["costs"], **dict.fromkeys(drop, 0.0)}) for r in saved["rounds"]]
    rows = []
    for plan in plans:
        label = plan.label()
        pred = [simulate(costs, plan, plens, olens).tok_s for costs in rounds]
        meas = [r["measured"][label] for r in saved["rounds"]]
        p, m = statistics.median(pred), statistics.median(meas)
        rows.append({"plan": label, "predicted_tok_s": p, "measured_tok_s": m, "error": p / m - 1})
        print(f"{label:<26} predicted {p:8.0f} ({', '.join(f'{x:.0f}' for x in pred)})  measured {m:8.0f}  "
              f"error {100 * rows[-1]['error']:+.1f}%")
    summarize(rows)


def summarize(rows: list[dict]) -> tuple[list[float], float]:
    """Print a run's median and largest error and its first choice against the best measured plan -> (the
    absolute errors, the first choice's gap below the best)."""
    errors = [abs(r["error"]) for r in rows]
    first = max(rows, key=lambda r: r["predicted_tok_s"])
    best = max(rows, key=lambda r: r["measured_tok_s"])
    gap = 1 - first["measured_tok_s"] / best["measured_tok_s"]
    print(f"error: median {100 * statistics.median(errors):.1f}%, largest {100 * max(errors):.1f}% "
          f"(goal: median <= 10%, largest <= 20%)")
    print(f"planner's first choice {first['plan']} measured {first['measured_tok_s']:.0f} tok/s; best measured "
          f"{best['plan']} {best['measured_tok_s']:.0f}: {100 * gap:.1f}% below (goal: within 5%)")
    return errors, gap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=SHIPPED_MODEL)
    ap.add_argument("--profile", help="step costs saved by `python -m launch.plan --calibrate --save-profile`")
    ap.add_argument("--plans", default=";".join(PLANS),
                    help="A,E,M[,comm,ranks_per_node];... (default: 1+1, 1+2 and 2+1 on one node, each with 1 and 2 "
                    "micro-batches, and four plans on emulated nodes or with two_phase)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="write the table as JSON here")
    ap.add_argument("--repredict", metavar="RUN_JSON", help="measure nothing: predict a saved run's plans again "
                    "from its rounds' saved calibrations with the current model, beside its measured figures")
    ap.add_argument("--drop", default="", metavar="COSTS", help="with --repredict: these step costs (comma-separated "
                    "names, e.g. c_peer_e,cd_peer_e,c_peer_a) set to 0 in every round: the model without them")
    ap.add_argument("--smoke", action="store_true", help="two plans, 32 requests of at most 32 tokens, one run, "
                    "a small calibration: checks the bench works (tests run it; its figures mean little)")
    args = ap.parse_args()
    if args.drop and not args.repredict:
        raise SystemExit("--drop sets step costs to 0 in a saved run's rounds: give it with --repredict RUN_JSON")
    max_output = 256
    if args.smoke:
        args.requests, args.repeats, max_output, args.plans = 32, 1, 32, "1,1,1;2,1,1,two_phase,2"
    plans = [parse_plan(text) for text in args.plans.split(";")]
    collective = any(p.collective for p in plans)
    prompts, olens = workload(args.requests, max_output=max_output, model=args.model)
    plens = [len(p) for p in prompts]
    if args.repredict:
        return repredict(args.repredict, plans, plens, olens, tuple(filter(None, args.drop.split(","))))
    predicted: dict[Plan, list[float]] = {p: [] for p in plans}
    measured: dict[Plan, list[float]] = {p: [] for p in plans}
    costs = StepCosts.load(args.profile) if args.profile else None
    rounds = []
    for round_ in range(args.repeats):
        if not args.profile:
            from launch.plan.calibrate import PEER_WINDOWS, WINDOWS, calibrate
            small = {"windows": WINDOWS[:2], "passes": 1, "peer_windows": PEER_WINDOWS[:1]} if args.smoke else {}
            costs = calibrate(args.model, device="cpu", **small)
        if collective:
            costs.network = network_model(args.model)
        print(f"round {round_ + 1}: step costs {costs.source}", flush=True)
        rounds.append({"costs": costs.to_dict(), "predicted": {}, "measured": {}})
        k = round_ % len(plans)
        for plan in plans[k:] + plans[:k]:
            predicted[plan].append(simulate(costs, plan, plens, olens).tok_s)
            measured[plan].append(measure(args.model, plan, prompts, olens))
            rounds[-1]["predicted"][plan.label()] = predicted[plan][-1]
            rounds[-1]["measured"][plan.label()] = measured[plan][-1]
            print(f"  {plan.label():<26} predicted {predicted[plan][-1]:8.0f}  measured {measured[plan][-1]:8.0f}",
                  flush=True)
    rows = []
    for plan in plans:
        p, m = statistics.median(predicted[plan]), statistics.median(measured[plan])
        rows.append({"plan": plan.label(), "predicted_tok_s": p, "measured_tok_s": m, "predictions": predicted[plan],
                     "runs": measured[plan], "error": p / m - 1})
        print(f"{plan.label():<26} predicted {p:8.0f}  measured {m:8.0f} "
              f"(runs {', '.join(f'{r:.0f}' for r in measured[plan])})  error {100 * rows[-1]['error']:+.1f}%")
    errors, gap = summarize(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"costs": costs.to_dict(), "rounds": rounds, "rows": rows,
                       "median_error": statistics.median(errors), "max_error": max(errors),
                       "first_choice_gap": gap}, f, indent=1)


if __name__ == "__main__":
    main()
