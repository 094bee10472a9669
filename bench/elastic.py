"""Elasticity: what a dead expert rank costs a running job, against what restarting the job would cost.

Scenario (the shipped Shakespeare MoE, or --model): 2 attention + 3 expert ranks spawned by LLM, a steady
stream of --requests greedy requests; once --kill-after tokens have streamed, one expert rank is SIGKILLed.
The job re-forms as 2 + 2 (launch/runtime/step_protocol.py) and every request completes; their tokens are checked
against a run with no failure (printed: identical or not).

Printed per repeat and as the median of --repeats:
- outage: from the SIGKILL to the first token streamed afterwards;
- the leader's breakdown: detect (first failed exchange -> every member accounted for), groups (the new
  generation's process groups and data plane), weights (expert slots copied between ranks or read from the
  checkpoint), and how many slots came from peers and from the checkpoint;
- the peer, measured in the same run: restarting the job instead (today's alternative when a rank dies and
  the job ends): a fresh 2 + 2 LLM's start-up plus its first token, with the same prompts.

Then scaling, on the same workload kept at about --in-flight requests in flight by a steady stream: 1 + 2
ranks grow to 2 + 4 (LLM.scale spawns the three ranks, which join; the expert ones take their experts from
peers), then shrink back to 1 + 2 (the leaving attention rank hands its requests and KV blocks over).
Printed per change and as medians: from the scale request to its completion; of that, leaving the old
generation together, forming the new one's groups, and moving weights (the rest of a scale-out is the new
processes starting); requests and KV blocks handed over; and the peer: restarting the job at the new size
(a fresh LLM's start-up plus its first token). Every output is checked against the reference run.
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


def steady(llm: LLM, prompts, params, in_flight: int, changes: list[dict], reference) -> tuple[list[dict], bool]:
    """Keep in_flight requests running (prompts in turn) until every change in changes has been made: the
    first once 4 * in_flight tokens have streamed, each next one as soon as the one before is done and
    in_flight more requests have been submitted. -> (each change's record plus its "scale_s", outputs
    identical to reference)."""
    got, done, records, rids = {}, set(), [], []
    streamed, asked_at, submitted_since = 0, None, 0
    deadline = time.monotonic() + 600
    while len(records) < len(changes) or len(done) < len(rids):
        if len(records) < len(changes) and len(rids) - len(done) < in_flight:
            rids.append(llm.submit(prompts[len(rids) % len(prompts)], params))
            got[rids[-1]] = []
            submitted_since += 1
        ready = streamed >= 4 * in_flight if not records else submitted_since >= in_flight
        if asked_at is None and len(records) < len(changes) and ready:
            llm.request_scale(**changes[len(records)])
            asked_at = time.monotonic()
        msg = llm._poll(llm.outbox, deadline, "bench/elastic.py")
        if msg[0] == "scale":
            records.append({**llm.take_scale_result(msg[1]), "scale_s": time.monotonic() - asked_at})
            asked_at, submitted_since = None, 0
            continue
        for rid, toks, finish, *_ in msg[1]:
            got[rid] += toks
            streamed += len(toks)
            if finish is not None:
                done.add(rid)
    identical = all(got[r] == reference[i % len(prompts)] for i, r in enumerate(rids))
    return records, identical


def scale_runs(args, prompts, params, options, reference) -> dict:
    """The scale-out / scale-in repeats and their medians."""
    runs = []
    for rep in range(args.repeats):
        with LLM(args.model, attention_ranks=1, expert_ranks=2, **options) as llm:
            (grow, shrink), identical = steady(llm, prompts, params, args.in_flight,
                                               [dict(attention_ranks=2, expert_ranks=4),
                                                dict(attention_ranks=1, expert_ranks=2)], reference)
            stats = llm.stats()
        t0 = time.monotonic()
        with LLM(args.model, attention_ranks=2, expert_ranks=4, **options) as fresh:
            fresh.generate(prompts[:1], SamplingParams(max_tokens=1))
            restart = time.monotonic() - t0
        run = {"identical": identical, "restart_2_4_s": restart, "handed_over_requests":
               stats["num_handed_over_requests"], "kv_blocks_handed_over": stats["kv_blocks_handed_over"]}
        for name, r in (("out", grow), ("in", shrink)):
            run.update({f"{name}_{k}": r[k] for k in ("scale_s", "detect_s", "groups_s", "weights_s",
                                                      "slots_from_peers", "slots_from_checkpoint")})
        runs.append(run)
        print(f"repeat {rep}: 1+2 -> 2+4 in {run['out_scale_s'] * 1e3:.0f} ms (leave {run['out_detect_s'] * 1e3:.0f}, "
              f"groups {run['out_groups_s'] * 1e3:.0f}, weights {run['out_weights_s'] * 1e3:.0f} ms, "
              f"{run['out_slots_from_peers']} slots from peers); 2+4 -> 1+2 in {run['in_scale_s'] * 1e3:.0f} ms "
              f"(leave {run['in_detect_s'] * 1e3:.0f}, groups {run['in_groups_s'] * 1e3:.0f}, weights "
              f"{run['in_weights_s'] * 1e3:.0f} ms; {run['handed_over_requests']} requests with "
              f"{run['kv_blocks_handed_over']} KV blocks handed over); restarting as 2+4 instead "
              f"{restart * 1e3:.0f} ms; outputs identical: {identical}", flush=True)
    keys = ("out_scale_s", "out_detect_s", "out_groups_s", "out_weights_s", "in_scale_s", "in_detect_s",
            "in_groups_s", "in_weights_s", "restart_2_4_s")
    med = {k: statistics.median(r[k] for r in runs) for k in keys}
    print(f"median of {len(runs)}: scale-out {med['out_scale_s'] * 1e3:.0f} ms (leave {med['out_detect_s'] * 1e3:.0f}, "
          f"groups {med['out_groups_s'] * 1e3:.0f}, weights {med['out_weights_s'] * 1e3:.0f} ms; the rest is the new "
          f"processes starting, while requests stream), scale-in {med['in_scale_s'] * 1e3:.0f} ms (leave "
          f"{med['in_detect_s'] * 1e3:.0f}, groups {med['in_groups_s'] * 1e3:.0f}, weights "
          f"{med['in_weights_s'] * 1e3:.0f} ms); restart as 2+4 {med['restart_2_4_s'] * 1e3:.0f} ms "
          f"({med['restart_2_4_s'] / med['out_scale_s']:.1f}x the scale-out); every run identical: "
          f"{all(r['identical'] for r in runs)}")
    return {"runs": runs, "median": med}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=SHIPPED_MODEL)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kill-after", type=int, default=200, help="tokens streamed before the SIGKILL")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--in-flight", type=int, default=4, help="requests kept in flight while scaling")
    ap.add_argument("--out", default=None, help="where the results go (default bench/results/elastic.json; "
                    "with --smoke, nowhere unless given)")
    ap.add_argument("--smoke", action="store_true", help="4 requests of 16 tokens, the kill after 8, one repeat: "
                    "a quick run that checks the bench works (tests run it; its figures mean little)")
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.max_tokens, args.kill_after, args.repeats, args.in_flight = 4, 16, 8, 1, 2
    elif args.out is None:
        args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "elastic.json")
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
    scaling = scale_runs(args, prompts, params, options, reference)
    if args.out is None:
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "topology": "2+3 -> 2+2", "requests": args.requests,
                   "max_tokens": args.max_tokens, "runs": runs, "median": med,
                   "scaling": {"topology": "1+2 -> 2+4 -> 1+2", "in_flight": args.in_flight, **scaling}},
                  f, indent=1)


if __name__ == "__main__":
    main()
