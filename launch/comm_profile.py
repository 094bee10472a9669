"""Per-layer comm profile: what each MoE layer's dispatch and combine move and cost, measured on a running engine
or predicted for a cluster shape larger than this machine.

Measured (a plain process spawns the ranks; under torchrun every rank runs it and rank 0 reports):

    python launch/comm_profile.py --model DIR --attention-ranks 2 --expert-ranks 2 [--comm two_phase
        --ranks-per-node 2 ...any serve.py engine flag] [--prompts 16 --prompt-len 64 --max-tokens 32]

runs a seeded synthetic workload (random token ids, ignore_eos), reads `llm.comm_stats(events=True)` and reports,
per MoE layer and phase, bytes and messages sent inside and across nodes (summed over ranks) and the time per
call as the attention ranks see it (mean over calls, the slowest attention rank's; its combine includes the
experts' compute); per layer the attention ranks' and expert ranks' compute time per
call and the expert-rank load balance (max/mean). The Chrome trace is the ranks' own recent calls: compute,
dispatch and combine spans on one track per rank (ranks of one host share the clock).

Simulated (no ranks, no model):

    python launch/comm_profile.py --simulate --attention-ranks 32 --expert-ranks 32 --ranks-per-node 8 \\
        --hidden 7168 --top-k 8 [--tokens 8,16,32,64,128,256] [--comm-calibration FILE]

plans `direct`'s and `two_phase`'s messages per hop (dispatchers built on a Layout, not a process group) and
prices them with the alpha-beta cost model: a calibration file, or NVLink (450 GB/s, 3 us) inside a node and
400 Gbit/s InfiniBand (50 GB/s, 5 us) between nodes. The trace lays each mode's predicted hops end to end.

Writes to --out (default ./comm_profile): profile.json, trace.json (chrome://tracing or ui.perfetto.dev) and
profile.png; prints the table. On CUDA, measured times are host-side: a phase's time includes waiting for its
own collective, but compute that is only queued on the GPU shows up in the next wait.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch.cli import add_engine_args, engine_options

PHASES = ("dispatch", "combine")
NVLINK = {"alpha_s": 3e-6, "beta_s_per_byte": 1 / 450e9}
IB_400G = {"alpha_s": 5e-6, "beta_s_per_byte": 1 / 50e9}


# ----- measured ----------------------------------------------------------------------------------------------
def measure(args) -> dict | None:
    """Run the workload on a real engine -> the profile (None on ranks other than the leader)."""
    from launch import LLM, SamplingParams
    expert_ranks = args.expert_ranks
    if expert_ranks is None:
        world = int(os.environ.get("WORLD_SIZE", 0))
        expert_ranks = world - args.attention_ranks if world else 2
    options = {**engine_options(args), "timing_sync": True}    # CUDA: device times, not launch times
    with LLM(args.model, attention_ranks=args.attention_ranks, expert_ranks=expert_ranks, **options) as llm:
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(llm.spec.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
        stats = llm.comm_stats(events=True)
    return summarize(stats) if stats else None


def summarize(stats: dict) -> dict:
    """llm.comm_stats(events=True) -> per layer: each phase's bytes/messages (intra, inter; summed over ranks) and
    time per call as the attention ranks see it (the slowest one's mean: an expert rank's dispatch time is mostly
    waiting for attention, an attention rank's combine includes the experts' compute), compute per call by
    role, load balance; plus the raw events."""
    ranks = stats["ranks"]
    layers = sorted({int(layer) for r in ranks.values() for layer in r["layers"]})
    out = []
    for layer in layers:
        key, row = str(layer), {"layer": layer}
        for ph in PHASES:
            got = [r["layers"][key][ph] for r in ranks.values() if key in r["layers"]]
            inter_b = sum(p["inter_node_bytes"] for p in got)
            inter_m = sum(p["inter_node_messages"] for p in got)
            calls = max(p["calls"] for p in got)
            mine = [r["layers"][key][ph] for r in ranks.values() if r["role"] == "attention" and key in r["layers"]]
            row[ph] = {"calls": calls,
                       "intra_bytes": sum(p["bytes_sent"] for p in got) - inter_b, "inter_bytes": inter_b,
                       "intra_messages": sum(p["messages_sent"] for p in got) - inter_m, "inter_messages": inter_m,
                       "time_per_call_s": max(p["time_s"] / max(p["calls"], 1) for p in mine)}
        for role in ("attention", "expert"):
            got = [r["compute"][key] for r in ranks.values() if r["role"] == role and key in r.get("compute", {})]
            row[f"{role}_compute_per_call_s"] = max((c["time_s"] / max(c["calls"], 1) for c in got), default=0.0)
        load = stats.get("expert_load", {}).get("layers", {}).get(key)
        row["expert_max_mean"] = load["max_mean"] if load else None
        out.append(row)
    return {"mode": "measured", "comm": stats["comm"], "comm_mode": stats.get("comm_mode", {}), "layers": out,
            "events": {rank: r.get("events", []) for rank, r in ranks.items()},
            "roles": {rank: r["role"] for rank, r in ranks.items()}}


def measured_trace(profile: dict) -> dict:
    """Chrome trace events from the ranks' recorded calls: one track (tid) per rank, microseconds from the
    earliest event."""
    spans = [(int(rank), layer, name, start, end) for rank, evs in profile["events"].items()
             for layer, name, start, end in evs]
    t0 = min((s[3] for s in spans), default=0.0)
    events = [{"name": f"{name} L{layer}" if layer >= 0 else f"{name} tail", "cat": name, "ph": "X", "pid": 0,
               "tid": rank, "ts": (start - t0) * 1e6, "dur": (end - start) * 1e6, "args": {"layer": layer}}
              for rank, layer, name, start, end in spans]
    events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": int(rank),
                "args": {"name": f"rank {rank} ({role})"}} for rank, role in profile["roles"].items()]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


# ----- simulated ---------------------------------------------------------------------------------------------
def simulate(args) -> dict:
    """Each mode's planned messages per hop, priced by the cost model, at every token count."""
    import torch

    from comm.cost_model import CostModel, LinkCost
    A, E, R = args.attention_ranks, args.expert_ranks, args.ranks_per_node
    if E is None or R is None:
        raise SystemExit("--simulate needs --expert-ranks and --ranks-per-node")
    for name, v in (("--attention-ranks", A), ("--expert-ranks", E), ("--ranks-per-node", R),
                    ("--hidden", args.hidden), ("--top-k", args.top_k)):
        if v < 1:
            raise SystemExit(f"{name} must be at least 1, got {v}")
    model = CostModel.load(args.comm_calibration) if args.comm_calibration else \
        CostModel(LinkCost(**NVLINK), LinkCost(**IB_400G))
    sizes = simulate_layers(model, A, E, R, args.hidden, args.top_k, getattr(torch, args.sim_dtype), args.tokens)
    return {"mode": "simulated", "attention_ranks": A, "expert_ranks": E, "ranks_per_node": R, "hidden": args.hidden,
            "top_k": args.top_k, "dtype": args.sim_dtype, "cost_model": model.to_dict(), "sizes": sizes}


def simulate_layers(model, attention_ranks: int, expert_ranks: int, ranks_per_node: int, hidden: int, top_k: int,
                    dtype, tokens: list[int]) -> list[dict]:
    """Per token count: each mode's predicted seconds per hop (dispatch hops, then combine hops), per phase
    (bytes and messages per link class, seconds) and per layer, and two_phase/direct."""
    import torch

    from comm.dispatcher import Layout
    from comm.modes import make_dispatcher
    W = attention_ranks + expert_ranks
    node_of = [r // ranks_per_node for r in range(W)]
    kw = dict(group=Layout(W), hidden_size=hidden, top_k=top_k, dtype=dtype, device=torch.device("cpu"),
              num_sources=attention_ranks, ranks_per_node=ranks_per_node)
    modes = {m: make_dispatcher(m, **kw) for m in ("direct", "two_phase")}
    sizes = []
    for T in tokens:
        entry = {"tokens": T}
        for m, d in modes.items():
            hops = d.planned_messages(T)
            hops_s = [model.layer_time([h], node_of) for h in hops]      # a layer's time is the sum of its hops'
            half = len(hops) // 2
            entry[m] = {ph: {**_message_totals(hops[part], node_of), "time_s": sum(hops_s[part])}
                        for ph, part in zip(PHASES, (slice(0, half), slice(half, None)))}
            entry[m]["hops_s"] = hops_s
            entry[m]["layer_s"] = sum(hops_s)
        entry["two_phase_over_direct"] = entry["two_phase"]["layer_s"] / entry["direct"]["layer_s"]
        sizes.append(entry)
    return sizes


def _message_totals(hops, node_of) -> dict:
    inter = [b for h in hops for s, d, b in h if node_of[s] != node_of[d]]
    intra = [b for h in hops for s, d, b in h if node_of[s] == node_of[d]]
    return {"intra_bytes": sum(intra), "inter_bytes": sum(inter), "intra_messages": len(intra),
            "inter_messages": len(inter)}


def simulated_trace(profile: dict) -> dict:
    """Predicted hops end to end: one process per token count, one track per mode."""
    events = []
    for pid, entry in enumerate(profile["sizes"]):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"{entry['tokens']} tokens"}})
        for tid, m in enumerate(("direct", "two_phase")):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": m}})
            ts, hops = 0.0, entry[m]["hops_s"]
            for i, dur in enumerate(hops):
                ph = PHASES[0] if i < len(hops) // 2 else PHASES[1]
                events.append({"name": f"{ph} hop {i % (len(hops) // 2) + 1}", "cat": ph, "ph": "X", "pid": pid,
                               "tid": tid, "ts": ts * 1e6, "dur": dur * 1e6})
                ts += dur
    return {"traceEvents": events, "displayTimeUnit": "ms"}


# ----- output ------------------------------------------------------------------------------------------------
def table(profile: dict) -> str:
    if profile["mode"] == "simulated":
        head = (f"PREDICTED (alpha-beta model, not measured): {profile['attention_ranks']}+"
                f"{profile['expert_ranks']} ranks, {profile['ranks_per_node']} per node, hidden {profile['hidden']} "
                f"{profile['dtype']}, top-{profile['top_k']}\n"
                f"{'tokens':>6} {'mode':>9} {'phase':>8} {'intra MB':>9} {'inter MB':>9} {'intra msg':>9} "
                f"{'inter msg':>9} {'time us':>9}")
        lines = [head]
        for e in profile["sizes"]:
            for m in ("direct", "two_phase"):
                for ph in PHASES:
                    p = e[m][ph]
                    lines.append(f"{e['tokens']:>6} {m:>9} {ph:>8} {p['intra_bytes'] / 1e6:>9.3f} "
                                 f"{p['inter_bytes'] / 1e6:>9.3f} {p['intra_messages']:>9} {p['inter_messages']:>9} "
                                 f"{p['time_s'] * 1e6:>9.1f}")
            lines.append(f"{e['tokens']:>6} two_phase/direct per layer: {e['two_phase_over_direct']:.2f}")
        return "\n".join(lines)
    lines = [f"MEASURED: comm={profile['comm']}; per MoE layer, bytes and messages summed over ranks, times per "
             f"call (the slowest attention rank's; expert compute is inside its combine)",
             f"{'layer':>5} {'phase':>8} {'calls':>6} {'intra MB':>9} {'inter MB':>9} {'intra msg':>9} "
             f"{'inter msg':>9} {'time ms':>8} {'attn ms':>8} {'expert ms':>9} {'max/mean':>8}"]
    for row in profile["layers"]:
        for ph in PHASES:
            p = row[ph]
            attn, expert = row["attention_compute_per_call_s"], row["expert_compute_per_call_s"]
            extra = (f"{attn * 1e3:>8.3f} {expert * 1e3:>9.3f} {row['expert_max_mean'] or float('nan'):>8.3f}"
                     if ph == "dispatch" else "")
            lines.append(f"{row['layer']:>5} {ph:>8} {p['calls']:>6} {p['intra_bytes'] / 1e6:>9.3f} "
                         f"{p['inter_bytes'] / 1e6:>9.3f} {p['intra_messages']:>9} {p['inter_messages']:>9} "
                         f"{p['time_per_call_s'] * 1e3:>8.3f} {extra}")
    return "\n".join(lines)


def plot(profile: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if profile["mode"] == "simulated":
        T = [e["tokens"] for e in profile["sizes"]]
        for m, mark in (("direct", "o-"), ("two_phase", "s-")):
            ax.plot(T, [e[m]["layer_s"] * 1e6 for e in profile["sizes"]], mark, label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per attention rank")
        ax.set_ylabel("predicted dispatch + combine per layer (us)")
        ax.set_title(f"PREDICTED: {profile['attention_ranks']}+{profile['expert_ranks']} ranks, "
                     f"{profile['ranks_per_node']} per node")
    else:
        L = [r["layer"] for r in profile["layers"]]
        bottom = [0.0] * len(L)
        parts = [("attention compute", lambda r: r["attention_compute_per_call_s"]),
                 ("dispatch", lambda r: r["dispatch"]["time_per_call_s"]),
                 ("combine (incl. expert compute)", lambda r: r["combine"]["time_per_call_s"])]
        for name, get in parts:
            v = [get(r) * 1e3 for r in profile["layers"]]
            ax.bar(L, v, bottom=bottom, label=name)
            bottom = [b + x for b, x in zip(bottom, v)]
        ax.plot(L, [r["expert_compute_per_call_s"] * 1e3 for r in profile["layers"]], "kD", label="expert compute")
        ax.set_xticks(L)
        ax.set_xlabel("MoE layer")
        ax.set_ylabel("ms per call (slowest attention rank)")
        ax.set_title(f"measured, comm={profile['comm']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = add_engine_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--simulate", action="store_true", help="predict a cluster shape with the cost model (no ranks)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=7168, help="--simulate: hidden size")
    p.add_argument("--top-k", type=int, default=8, help="--simulate: experts per token")
    p.add_argument("--sim-dtype", default="bfloat16", help="--simulate: activation dtype")
    p.add_argument("--tokens", default="8,16,32,64,128,256", help="--simulate: tokens per attention rank")
    p.add_argument("--out", default="comm_profile", help="directory for profile.json, trace.json, profile.png")
    args = p.parse_args(argv)
    if args.simulate:
        try:
            args.tokens = [int(t) for t in args.tokens.split(",")]
        except ValueError:
            p.error(f"--tokens takes comma-separated integers, got {args.tokens!r}")
        if min(args.tokens) < 1:
            p.error(f"--tokens must be positive, got {args.tokens}")
        profile = simulate(args)
        trace = simulated_trace(profile)
    else:
        if not args.model:
            p.error("--model DIR is required (or --simulate)")
        for name in ("prompts", "prompt_len", "max_tokens"):
            if getattr(args, name) < 1:
                p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
        profile = measure(args)
        if profile is None:     # not the leader
            return 0
        trace = measured_trace(profile)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile.json"), "w") as f:
        json.dump(profile, f)
    with open(os.path.join(args.out, "trace.json"), "w") as f:
        json.dump(trace, f)
    plot(profile, os.path.join(args.out, "profile.png"))
    print(table(profile))
    print(f"wrote {args.out}/profile.json, trace.json, profile.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
