"""The A:E autoscaler under a workload shift: output tok/s and TPOT over time with the autoscaler off and on.

A budget of 3 ranks on this machine. The workload shifts once: phase "short" is rounds of many short requests
(prompts of 4-8 tokens, 64 output tokens, 64 at a time: the expert pool's tokens dominate), then phase "long" is
rounds of fewer long ones (prompts of 600 tokens, 64 output tokens, 24 at a time: attention reads long contexts).
Three runs on fresh engines, each after one untimed round of each phase: static 1+2, static 2+1, and the
autoscaler (`autoscale=PROFILE`, window 32 steps, margin --margin) starting at 1+2. The step-cost profile is calibrated
first on this machine (launch/plan/calibrate.py, about 40 s), or read from --profile.

Every request is submitted at its round's start and its tokens are read as they stream: per round, output tok/s
(the round's tokens over its wall time), the median TPOT over its requests (first to last token over the tokens
between), and the pools at the round's end. Prints the rounds of each run, then per phase each run's tok/s (its
rounds' tokens over their summed time) and the autoscaler's ratio to each static split; --out writes the JSON and
--png the figure (tok/s and TPOT against time, the autoscaler's moves marked).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from attention_nodes.sampling_params import SamplingParams  # noqa: E402
from launch import LLM  # noqa: E402
from launch.plan.calibrate import calibrate  # noqa: E402
from models import SHIPPED_MODEL  # noqa: E402
from models.checkpoint import Checkpoint  # noqa: E402

RUNS = (("static 1+2", 1, 2, False), ("static 2+1", 2, 1, False), ("autoscale from 1+2", 1, 2, True))


def phases(vocab: int, short_rounds: int, long_rounds: int, seed: int = 0) -> list[tuple[str, list[list[int]]]]:
    """[(phase, one round's prompts)] in order: the short rounds, then the long ones."""
    g = torch.Generator().manual_seed(seed)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()
    short = [("short", [prompt(int(torch.randint(4, 9, (1,), generator=g))) for _ in range(64)])
             for _ in range(short_rounds)]
    return short + [("long", [prompt(600) for _ in range(24)]) for _ in range(long_rounds)]


def run_round(llm: LLM, prompts: list[list[int]], output: int) -> dict:
    """Submit the round's requests at once and read their tokens as they stream -> its wall time, tokens, TPOT."""
    params = SamplingParams(max_tokens=output, ignore_eos=True)
    t0 = time.perf_counter()
    rids = {llm.submit(p, params) for p in prompts}
    first, last, count = {}, {}, dict.fromkeys(rids, 0)
    open_ = set(rids)
    while open_:
        # _poll also starts the ranks a scale request (the autoscaler's) asks for, as generate() does
        msg = llm._poll(llm.outbox, time.monotonic() + 600, "bench round")
        if msg[0] != "out":
            continue
        now = time.perf_counter()
        for rid, toks, finish, *_ in msg[1]:
            if rid not in count:
                continue
            if toks:
                first.setdefault(rid, now)
                last[rid] = now
                count[rid] += len(toks)
            if finish is not None:
                open_.discard(rid)
    wall = time.perf_counter() - t0
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in rids if count[r] > 1]
    return {"start": t0, "wall_s": wall, "tokens": sum(count.values()), "tok_s": sum(count.values()) / wall,
            "tpot_ms": statistics.median(tpot) * 1e3 if tpot else None}


def run(model: str, attention: int, expert: int, profile: str | None, rounds, output: int, margin: float
        ) -> list[dict]:
    options = dict(autoscale=profile, autoscale_window=32, autoscale_margin=margin) if profile else {}
    with LLM(model, attention_ranks=attention, expert_ranks=expert, device="cpu", max_num_seqs=64,
             max_num_batched_tokens=512, **options) as llm:
        for phase in ("short", "long"):    # untimed: a fresh engine's first rounds are slower
            run_round(llm, next(p for name, p in rounds if name == phase)[:8], 8)
        out, t_start = [], time.perf_counter()
        for phase, prompts in rounds:
            r = run_round(llm, prompts, output)
            r.update(phase=phase, t=r.pop("start") - t_start, pools=dict(llm.stats()["pool_ranks"]))
            out.append(r)
        stats = llm.stats()
    if profile:
        out.append({"autoscale": stats["autoscale"],
                    "moves": [c for c in stats["membership_changes"] if c["cause"] == "autoscale"]})
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name, rounds in results.items():
        rs = [r for r in rounds if "phase" in r]
        ends = [r["t"] + r["wall_s"] for r in rs]
        top.step(ends, [r["tok_s"] for r in rs], where="pre", label=name)
        bottom.step(ends, [r["tpot_ms"] for r in rs], where="pre", label=name)
        if name.startswith("autoscale"):
            for prev, r in zip(rs, rs[1:]):
                if r["pools"] != prev["pools"]:
                    top.axvline(r["t"], color="grey", ls=":")
                    top.annotate(f"{r['pools']['attention']}+{r['pools']['expert']}", (r["t"], 0),
                                 xycoords=("data", "axes fraction"), fontsize=8)
    top.set_ylabel("output tok/s (round)")
    bottom.set_ylabel("TPOT p50 ms (round)")
    bottom.set_xlabel("seconds since the first timed round")
    top.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=SHIPPED_MODEL)
    ap.add_argument("--profile", help="step costs saved by `python -m launch.plan --calibrate --save-profile`")
    ap.add_argument("--short-rounds", type=int, default=8)
    ap.add_argument("--long-rounds", type=int, default=6)
    ap.add_argument("--output", type=int, default=64, help="output tokens per request")
    ap.add_argument("--margin", type=float, default=0.15, help="the autoscaler's autoscale_margin (default 0.15)")
    ap.add_argument("--out", help="write the rounds as JSON here")
    ap.add_argument("--png", help="write the figure here")
    ap.add_argument("--smoke", action="store_true", help="one round of each phase, 8 output tokens, a small "
                    "calibration: checks the bench works (tests run it; its figures mean little)")
    args = ap.parse_args()
    if args.smoke:
        args.short_rounds, args.long_rounds, args.output = 1, 1, 8
    profile = args.profile
    if profile is None:
        small = dict(windows=((8, 16), (32, 16), (16, 64))) if args.smoke else {}
        # the autoscaler scales the pools' busy time, which leaves the exchange out: no 1+2 / 2+1 engines
        costs = calibrate(args.model, device="cpu", peer_windows=(), **small)
        profile = os.path.join(tempfile.mkdtemp(prefix="autoscale-"), "profile.json")
        costs.save(profile)
        print(f"step costs: {costs.source}")
    rounds = phases(Checkpoint(args.model).spec.vocab_size, args.short_rounds, args.long_rounds)
    results = {name: run(args.model, A, E, profile if auto else None, rounds, args.output, args.margin)
               for name, A, E, auto in RUNS}
    print("| run | round | phase | pools at its end | tok/s | TPOT p50 ms | s |")
    print("|---|---|---|---|---|---|---|")
    for name, rs in results.items():
        for i, r in enumerate(x for x in rs if "phase" in x):
            pools = f"{r['pools']['attention']}+{r['pools']['expert']}"
            print(f"| {name} | {i} | {r['phase']} | {pools} | {r['tok_s']:.0f} | {r['tpot_ms']:.1f} | "
                  f"{r['wall_s']:.1f} |")
    print()
    print("| phase | " + " | ".join(results) + " | autoscale / static 1+2 | autoscale / static 2+1 |")
    print("|---|" + "---|" * (len(results) + 2))
    for phase in ("short", "long"):
        rate = {name: sum(r["tokens"] for r in rs if r.get("phase") == phase)
                / sum(r["wall_s"] for r in rs if r.get("phase") == phase) for name, rs in results.items()}
        auto = rate["autoscale from 1+2"]
        print(f"| {phase} | " + " | ".join(f"{v:.0f}" for v in rate.values())
              + f" | {auto / rate['static 1+2']:.2f}x | {auto / rate['static 2+1']:.2f}x |")
    moves = results["autoscale from 1+2"][-1]
    print(f"\nautoscaler moves: {[(m['attention_ranks'], m['expert_ranks']) for m in moves['moves']]}; decisions:")
    for d in moves["autoscale"]["decisions"]:
        print(" ", json.dumps(d))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"profile": profile, "runs": results}, f, indent=1)
    if args.png:
        plot(results, args.png)


if __name__ == "__main__":
    main()
