"""Chaos soak: kill a random non-leader rank at a random moment of a generation, and check that every request
still ends once with transformers' greedy tokens, within a watchdog.

Each trial (seeded) picks a topology (2+2, 3+2, 2+3, 4+2), a data plane (direct over shm; direct over gloo
collectives; two_phase over gloo with two ranks per emulated node, `ranks_per_node=2`), a balancer (static, or
least_loaded with 2 redundant expert slots), micro_batches (1, 2) and a moment:
- "time": SIGKILL a random non-leader rank (attention or expert) 0.1-1.5 s after the requests are submitted;
- "before_report": an attention rank SIGKILLs itself once every rank has finished the forward of a random step
  (2-12), before the report gather (AFSERVE_FAULT, launch/runtime/step_protocol.py `fault_point`);
- "second": as "time", and a second non-leader rank (never the last expert rank) SIGKILLs itself during the
  re-forming that follows, once it has checked in alive and before the new generation forms (fault point
  "checked_in"): the leader has planned the generation with a rank that is gone;
- "rendezvous": as "second", but the second rank dies once it has marked itself ready to form the new
  generation (fault point "ready"): the others wait for it in the groups' rendezvous, a wait bounded at 10 s;
- "forming": as "second", but the second rank dies once the new generation's process groups formed, before its
  data plane and expert weights ("groups"), or once it has its weights, before the members agree that the
  generation formed ("weights"): no member adopts the generation, and they re-form without it;
- "stop": SIGSTOP a random non-leader rank 0.1-1.5 s in (it lives and keeps its connections, so no exchange
  fails: the leader's heartbeat watch must find it silent for rank_failure_s); SIGKILLed when the trial ends.
- "handover": once 30-400 tokens have streamed, a scale-in retires a random non-leader attention rank, which hands
  its requests and KV blocks over; a rank SIGKILLs itself during the change: the retiring one after sending the
  requests' list and before their KV ("mid_handover"), or it or another non-leader rank on the RESHAPE header
  ("reshape") or after the handover, before the ranks leave the old generation together ("handed_over");
- "scale": as "handover", a scale-out by one attention or expert rank, or a scale-in by one expert rank; the
  spawned joiner SIGKILLs itself once admitted, before the new generation forms ("admitted"), or a non-leader
  member at "reshape" or "handed_over". The change is given up and the job re-forms from the survivors; the
  scale request is asked again, and refused (saying a rank was lost) when it now lacks a joiner: that counts as
  a correct answer, any other refusal as an error.
--moments draws from a subset (the draws of the others stay as they were with the same list).
The workload: a tiny OLMoE checkpoint (built here), 12 prompts of 2-50 tokens, 64 greedy tokens each,
`ignore_eos`, max_num_seqs 2 per attention rank. The oracle: transformers' own greedy continuation of each prompt.
A trial is "ok" (every row equal), "lost" (a row missing or different), "hang" (the watchdog, --watchdog s, fired)
or "error" (generate raised). A kill that landed after the work was done re-forms nothing and is counted apart.
Printed: a table of trials per moment, per data plane and per balancer, and of all, with kills landed,
requests, lost, hangs, errors, and the median and p99 recovery (detect + groups + weights of the membership
change). --out writes every trial as JSON.
Run: python bench/chaos.py [--trials 20] [--seed 0] [--watchdog 60] [--moments time,second] [--out FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from launch import LLM, SamplingParams
from models.tiny import make_tiny_checkpoint

TOPOLOGIES = [(2, 2), (3, 2), (2, 3), (4, 2)]
MOMENTS = ["time", "before_report", "second", "stop", "handover", "scale", "rendezvous", "forming"]
CHANGE_MOMENTS = ("handover", "scale")
DATA_PLANES = [{"comm": "direct", "transport": "shm"}, {"comm": "direct", "transport": "collective"},
               {"comm": "two_phase", "transport": "collective", "ranks_per_node": 2}]
BALANCERS = [{"balancer": "static"}, {"balancer": "least_loaded", "redundant_experts": 2}]
MAX_NEW = 64


def plane_name(options: dict) -> str:
    """"direct/shm", "direct/collective" or "two_phase/collective": a trial's (or DATA_PLANES entry's) data plane."""
    return f"{options['comm']}/{options['transport']}"


def greedy_oracle(path: str, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time, EOS off."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def trial(path: str, prompts, expected, rng: random.Random, watchdog: float, moments: list[str]) -> dict:
    A, E = rng.choice(TOPOLOGIES)
    options = {**rng.choice(DATA_PLANES), **rng.choice(BALANCERS), "micro_batches": rng.choice([1, 2]),
               "micro_batch_min_tokens": 0}
    moment = rng.choice(moments)
    info = {"topology": f"{A}+{E}", **options, "moment": moment}
    if moment == "before_report":
        victim, step = rng.randrange(1, A), rng.randrange(2, 13)
        os.environ["AFSERVE_FAULT"] = f"before_report:{victim}:{step}"
        info.update(victim=victim, step=step)
    else:
        victim, delay = rng.randrange(1, A + E), round(rng.uniform(0.1, 1.5), 2)
        os.environ.pop("AFSERVE_FAULT", None)
        info.update(victim=victim, delay_s=delay)
        if moment in ("second", "rendezvous", "forming"):   # another non-leader rank; an expert rank stays
            second = rng.choice([r for r in range(1, A + E) if r != victim and (E > 2 or r < A or victim < A)])
            point = {"second": "checked_in", "rendezvous": "ready"}.get(moment) or rng.choice(["groups", "weights"])
            os.environ["AFSERVE_FAULT"] = f"{point}:{second}:1"
            info.update(second=second, **({"point": point} if moment == "forming" else {}))
        if moment in CHANGE_MOMENTS:
            scale, point, victim = draw_change(rng, moment, A, E)
            os.environ["AFSERVE_FAULT"] = f"{point}:{victim}:1"
            info.update(scale=scale, point=point, victim=victim, after_tokens=rng.randrange(30, 400))
            info.pop("delay_s")
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    killer = None
    try:
        with LLM(path, attention_ranks=A, expert_ranks=E, max_num_seqs=2, **options) as llm:
            rids = [llm.submit(p, params) for p in prompts]
            pid = llm.worker_pids[victim] if victim < A + E else None   # a joiner is spawned later
            if moment not in ("before_report",) + CHANGE_MOMENTS:
                sig = signal.SIGSTOP if moment == "stop" else signal.SIGKILL
                killer = threading.Timer(delay, os.kill, (pid, sig))
                killer.start()
            rows = {r: [] for r in rids}
            ends = {r: 0 for r in rids}
            open_rows, deadline = len(rids), time.monotonic() + watchdog
            asked, answer = moment not in CHANGE_MOMENTS, None
            try:
                while open_rows or (asked and moment in CHANGE_MOMENTS and answer is None):
                    msg = llm._poll(llm.outbox, deadline, "the chaos trial")
                    if msg[0] == "scale":
                        answer = msg[1]
                    for row, toks, finish, *_ in msg[1] if msg[0] == "out" else []:
                        rows[row] += toks
                        ends[row] += finish is not None
                        open_rows -= finish is not None
                    if not asked and sum(map(len, rows.values())) >= info["after_tokens"]:
                        llm.request_scale(**info["scale"])
                        asked = True
                changes = llm.stats()["membership_changes"]
            finally:
                if moment == "stop":   # before the LLM shuts down (it would wait for the stopped process)
                    killer.cancel()
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
    except RuntimeError as e:
        info.update(outcome="hang" if "timed out" in str(e) else "error", detail=str(e)[:300])
        return info
    finally:
        if killer is not None:
            killer.cancel()
        os.environ.pop("AFSERVE_FAULT", None)
    lost = sum(rows[r] != want or ends[r] != 1 for r, want in zip(rids, expected))
    failures = [c for c in changes if c["cause"] != "scale"]   # a planned change's own record is not a failure's
    outcome = "ok" if not lost else "lost"
    if answer is not None:
        info["answer"] = answer.get("error", "done")
        if "error" in answer and "a rank was lost while the job changed" not in answer["error"]:
            outcome = "error"
    info.update(outcome=outcome, lost=lost, requests=len(rids), landed=bool(failures),
                ranks_lost=sum(len(c.get("lost", [])) for c in failures))
    if failures:
        c = failures[0]
        info["recovery_s"] = round(sum(c.get(k, 0.0) for k in ("detect_s", "groups_s", "weights_s")), 3)
        info["change"] = c
    return info


def draw_change(rng: random.Random, moment: str, A: int, E: int) -> tuple[dict, str, int]:
    """A "handover" or "scale" trial's scale request (request_scale's arguments), its fault point and the member
    that dies there (never the leader, never the last expert rank; the first joiner spawned is member A + E)."""
    if moment == "handover":
        kind, retiring = "retire", rng.randrange(1, A)
        scale = {"retire": [retiring]}
    else:
        kind = rng.choice(["attention+1", "expert+1"] + (["expert-1"] if E > 2 else []))
        retiring = A + E - 1 if kind == "expert-1" else None
        scale = {"attention_ranks": A + 1} if kind == "attention+1" else \
            {"expert_ranks": E + (1 if "+" in kind else -1)}
    staying_experts = E - (retiring is not None and retiring >= A)
    members = [r for r in range(1, A + E) if r < A or staying_experts > 1 or r == retiring]
    points = [("reshape", r) for r in members] + [("handed_over", r) for r in members]
    if moment == "handover":
        points += [("mid_handover", retiring)] * len(members)   # as likely as the rest together
    elif "+" in kind:
        points += [("admitted", A + E)] * len(members)
    point, victim = rng.choice(points)
    return scale, point, victim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--watchdog", type=float, default=60.0, help="seconds a trial may take before it is a hang")
    ap.add_argument("--moments", default=",".join(MOMENTS), help=f"comma-separated, from {','.join(MOMENTS)}")
    ap.add_argument("--out", help="write every trial as JSON here")
    args = ap.parse_args()
    moments = args.moments.split(",")
    if not moments or any(m not in MOMENTS for m in moments):
        ap.error(f"--moments {args.moments!r}: pick from {','.join(MOMENTS)}")
    rng = random.Random(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist()
               for n in torch.randint(2, 51, (12,), generator=g)]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "olmoe")
        make_tiny_checkpoint("olmoe", path)
        expected = greedy_oracle(path, prompts)
        results = []
        for i in range(args.trials):
            r = trial(path, prompts, expected, rng, args.watchdog, moments)
            results.append(r)
            print(f"trial {i}: {json.dumps({k: v for k, v in r.items() if k != 'change'})}", flush=True)
    print("\n| trials of | trials | kills landed | requests | lost | hangs | errors | recovery median / p99 s |")
    print("|---|---|---|---|---|---|---|---|")
    groups = [(m, lambda r, m=m: r["moment"] == m) for m in moments]
    groups += [(plane_name(p), lambda r, p=p: plane_name(r) == plane_name(p)) for p in DATA_PLANES]
    groups += [(b["balancer"], lambda r, b=b: r["balancer"] == b["balancer"]) for b in BALANCERS]
    for label, pick in groups + [("all", lambda r: True)]:
        rs = [r for r in results if pick(r)]
        rec = sorted(r["recovery_s"] for r in rs if "recovery_s" in r)
        p99 = rec[min(len(rec) - 1, int(0.99 * len(rec)))] if rec else None
        print(f"| {label} | {len(rs)} | {sum(r.get('landed', False) for r in rs)} | "
              f"{sum(r.get('requests', 0) for r in rs)} | {sum(r.get('lost', 0) for r in rs)} | "
              f"{sum(r['outcome'] == 'hang' for r in rs)} | {sum(r['outcome'] == 'error' for r in rs)} | "
              + (f"{statistics.median(rec):.2f} / {p99:.2f} |" if rec else "- |"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"seed": args.seed, "trials": results}, f, indent=1)


if __name__ == "__main__":
    main()
