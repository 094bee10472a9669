"""Elasticity: what a dead expert rank costs a running job, against what restarting the job would cost.

Scenario (the shipped Shakespeare MoE, or --model): 2 attention + 3 expert ranks spawned by LLM, a steady
stream of --requests greedy requests; once --kill-after tokens have streamed, one expert rank is SIGKILLed.
The job re-forms as 2 + 2 (launch/step_protocol.py) and every request completes; their tokens are checked
against a run with no failure (printed: identical or not).

Printed per repeat and as the median of --repeats:
- outage: from the SIGKILL to the first token streamed afterwards;
- the leader's breakdown: detect (first failed exchange -> every member accounted for), groups (the new
  generation's process groups and data plane), weights (expert slots copied between ranks or read from the
  checkpoint), and how many slots came from peers and from the checkpoint;
- the peer, measured in the same run: restarting the job instead (today's alternative when a rank dies and
  the job ends): a fresh 2 + 2 LLM's start-up plus its first token, with the same prompts.
Writes bench/results/elastic.json.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.throughput import workload
from launch import LLM, SamplingParams
from models import SHIPPED_MODEL


def stream(llm: LLM, prompts, params, kill_pid: int | None, kill_after: int) -> tuple[list[list[int]], float]:
    """Run prompts; SIGKILL kill_pid once kill_after tokens have streamed -> (outputs, outage seconds)."""
    rids = [llm.submit(p, params) for p in prompts]
    got = {r: [] for r in rids}
    left, killed_at, outage = set(rids), None, float("nan")
    while left:
        msg = llm._poll(llm.outbox, time.monotonic() + 300, "bench/elastic.py")
        if msg[0] != "out":
            continue
        if killed_at is not None and outage != outage and any(toks for _, toks, *_ in msg[1]):
            outage = time.monotonic() - killed_at
        for rid, toks, finish, *_ in msg[1]:
            got[rid] += toks
            if finish is not None:
                left.discard(rid)
        if kill_pid is not None and sum(map(len, got.values())) >= kill_after:
            os.kill(kill_pid, signal.SIGKILL)
            killed_at, kill_pid = time.monotonic(), None
    return [got[r] for r in rids], outage


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=SHIPPED_MODEL)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kill-after", type=int, default=200, help="tokens streamed before the SIGKILL")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "elastic.json"))
    args = ap.parse_args()
    prompts, _ = workload(args.requests, 0, max_output=args.max_tokens, model=args.model)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    options = dict(load_progress=False, max_num_seqs=args.requests)

    with LLM(args.model, attention_ranks=2, expert_ranks=3, **options) as llm:   # warm-up, and the reference
        reference, _ = stream(llm, prompts, params, None, 0)

    runs = []
    for rep in range(args.repeats):
        with LLM(args.model, attention_ranks=2, expert_ranks=3, **options) as llm:
            outs, outage = stream(llm, prompts, params, llm.worker_pids[3], args.kill_after)
            change = llm.stats()["membership_changes"][0]
        t0 = time.monotonic()
        with LLM(args.model, attention_ranks=2, expert_ranks=2, **options) as fresh:
            started = time.monotonic() - t0
            fresh.generate(prompts[:1], SamplingParams(max_tokens=1))
            restart = time.monotonic() - t0
        run = {"outage_s": outage, "identical": outs == reference, "restart_s": restart,
               "restart_startup_s": started, **{k: change[k] for k in ("detect_s", "groups_s", "weights_s",
                                                                         "slots_from_peers", "slots_from_checkpoint")}}
        runs.append(run)
        print(f"repeat {rep}: outage {outage * 1e3:.0f} ms (detect {run['detect_s'] * 1e3:.0f}, groups "
              f"{run['groups_s'] * 1e3:.0f}, weights {run['weights_s'] * 1e3:.0f} ms; {run['slots_from_peers']} "
              f"slots from peers, {run['slots_from_checkpoint']} from the checkpoint); restart instead "
              f"{restart * 1e3:.0f} ms; outputs identical to the run without failure: {run['identical']}",
              flush=True)
    med = {k: statistics.median(r[k] for r in runs) for k in ("outage_s", "detect_s", "groups_s", "weights_s",
                                                               "restart_s")}
    print(f"median of {len(runs)}: outage {med['outage_s'] * 1e3:.0f} ms vs restart {med['restart_s'] * 1e3:.0f} ms "
          f"({med['restart_s'] / med['outage_s']:.1f}x shorter); detect {med['detect_s'] * 1e3:.0f} ms, groups "
          f"{med['groups_s'] * 1e3:.0f} ms, weights {med['weights_s'] * 1e3:.0f} ms; every run identical: "
          f"{all(r['identical'] for r in runs)}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "topology": "2+3 -> 2+2", "requests": args.requests,
                   "max_tokens": args.max_tokens, "runs": runs, "median": med}, f, indent=1)


if __name__ == "__main__":
    main()
