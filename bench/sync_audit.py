"""Host syncs per decode step, per rank, across topologies, comm modes and balancers (the sync audit).

Each cell starts an LLM with `sync_audit=True` on the shipped model, generates a few greedy requests and reads
every rank's `comm_stats()["ranks"][rank]["host_syncs"]` (comm/sync_audit.py). Printed per rank: its decode
steps, the most syncs one of them made, and the sites that made the most (path:line, syncs over all decode
steps). The target (docs/profiling.md, "Sync audit") is at most 1 on attention ranks (the sampled ids,
comm.sync_audit.host_read) and 0 on expert ranks.

The data plane is `--transport collective` by default: the dispatcher a CUDA run uses. `auto` would pick the
CPU-only shared-memory transport for `direct` on one node, whose polling reads of host memory count too.
Every balancer runs with `--redundant-experts` per expert rank, so that there are replicas to choose between.
These are counts, not times: there is no warm-up or repeat, and no peer to compare with.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch import LLM, SamplingParams  # noqa: E402
from launch.config import BALANCERS  # noqa: E402
from models import SHIPPED_MODEL  # noqa: E402

PROMPTS = ["ROMEO.\n", "Juliet.\nO Romeo, Romeo! wherefore art thou Romeo?\n", "Hamlet.\nTo be, or not to be,",
           "KING.\nWhat news from France?\n\nMESSENGER.\n", "Enter"]
TOPOLOGIES = ("1+1", "1+2", "2+2")
COMMS = ("direct", "two_phase")


def audit(model: str, attention_ranks: int, expert_ranks: int, num_prompts: int = 4, max_tokens: int = 6,
          **options) -> dict[str, dict]:
    """One cell: rank (str) -> {"role", "decode_steps", "max_per_decode_step", "sites"}."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num_prompts)]
    with LLM(model, attention_ranks=attention_ranks, expert_ranks=expert_ranks, sync_audit=True,
             load_progress=False, **options) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        ranks = llm.comm_stats()["ranks"]
    return {r: {"role": v["role"], **v["host_syncs"]} for r, v in sorted(ranks.items(), key=lambda kv: int(kv[0]))}


def top_sites(sites: dict[str, int], n: int) -> str:
    return ", ".join(f"{s} ({c})" for s, c in list(sites.items())[:n]) or "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=SHIPPED_MODEL)
    p.add_argument("--topologies", default=",".join(TOPOLOGIES), help="A+E pairs, comma-separated")
    p.add_argument("--comms", default=",".join(COMMS))
    p.add_argument("--balancers", default=",".join(BALANCERS))
    p.add_argument("--transport", default="collective", choices=("collective", "auto", "shm"))
    p.add_argument("--ranks-per-node", type=int, default=2, help="emulated nodes (two_phase aggregates per node)")
    p.add_argument("--redundant-experts", type=int, default=1, help="extra slots per expert rank")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--top", type=int, default=3, help="sites shown per rank")
    p.add_argument("--json", help="also write every cell's full report here")
    p.add_argument("--smoke", action="store_true", help="one cell (1+1, direct, static), 2 requests x 4 tokens: "
                   "a quick run that checks the bench works (tests run it; its figures mean little)")
    args = p.parse_args()
    if args.smoke:
        args.topologies, args.comms, args.balancers, args.prompts, args.max_tokens = "1+1", "direct", "static", 2, 4
    cells = {}
    print(f"model {args.model}, {args.prompts} greedy requests x {args.max_tokens} tokens, transport "
          f"{args.transport}, {args.ranks_per_node} ranks per node, {args.redundant_experts} redundant slot(s) "
          f"per expert rank; target: <= 1 per decode step on attention ranks, 0 on expert ranks\n")
    print("| A+E | comm | balancer | rank | role | decode steps | max/decode step | top sites (syncs) |")
    print("|---|---|---|---|---|---|---|---|")
    for topo in args.topologies.split(","):
        A, E = (int(n) for n in topo.split("+"))
        for comm in args.comms.split(","):
            for balancer in args.balancers.split(","):
                ranks = audit(args.model, A, E, args.prompts, args.max_tokens, comm=comm, balancer=balancer,
                              transport=args.transport, ranks_per_node=args.ranks_per_node,
                              redundant_experts=args.redundant_experts * E)
                cells[f"{topo}/{comm}/{balancer}"] = ranks
                for r, rep in ranks.items():
                    print(f"| {topo} | {comm} | {balancer} | {r} | {rep['role']} | {rep['decode_steps']} | "
                          f"{rep['max_per_decode_step']} | {top_sites(rep['sites'], args.top)} |", flush=True)
    worst = {role: max(rep["max_per_decode_step"] for ranks in cells.values() for rep in ranks.values()
                       if rep["role"] == role) for role in ("attention", "expert")}
    print(f"\nworst max/decode step: attention {worst['attention']} (target 1), expert {worst['expert']} (target 0)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(cells, f, indent=1)


if __name__ == "__main__":
    main()
