"""python -m launch.plan: search deployment plans for a workload with the planner's step model.

The step costs come from a calibration on this machine (--calibrate, about 70 s on the CPU VM, the runtime's counters;
--save-profile keeps them) or a saved profile (--profile). The search covers the attention:expert split within
--ranks, micro_batches, the comm modes (--comm; plans on several nodes or with two_phase need --network, the
alpha-beta model their dispatch and combine is priced by) and redundant expert slots (--redundant-experts, priced
against the workload's expert load, --expert-load), plays the workload through each plan (launch/plan/model.py's
simulate) and prints the best plans by predicted output tok/s among those whose predicted TPOT p99 meets
--tpot-slo-ms, with each pool's utilisation; --out writes them all as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from .layout import load_network, parse_expert_load
from .model import COMM_MODES, Plan, StepCosts, simulate


def parse_range(text: str) -> tuple[int, int]:
    """'16:256' -> (16, 256); '64' -> (64, 64)."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        lo = hi = None
    if lo is None or lo < 1 or hi < lo:
        raise ValueError(f"length range {text!r}: give MIN:MAX with 1 <= MIN <= MAX, or one length")
    return lo, hi


def workload(requests: int, prompt: tuple[int, int], output: tuple[int, int], shape: str, seed: int = 0
             ) -> tuple[list[int], list[int]]:
    """Prompt lengths uniform in the range; output lengths uniform, or long-tailed (min + (max - min) * u^3,
    bench/throughput.py's shape) -> (prompt lengths, output lengths)."""
    if requests < 1:
        raise ValueError(f"--requests {requests}: the workload needs at least one request")
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(prompt[0], prompt[1] + 1, (requests,), generator=g)
    u = torch.rand(requests, generator=g)
    if shape == "longtail":
        u = u ** 3
    elif shape != "uniform":
        raise ValueError(f"output shape {shape!r}: use 'longtail' or 'uniform'")
    outputs = (output[0] + (output[1] - output[0]) * u).round().long()
    return prompts.tolist(), outputs.tolist()


def candidates(ranks: int, micro_batches: list[int], concurrencies: list[int], min_experts=1,
               max_seqs: int | None = None, comms=("direct",), redundant=(0,), ranks_per_node: int = 0) -> list[Plan]:
    """Every split of `ranks` ranks (at least one attention rank and min_experts expert ranks; min_experts may
    be a function of the redundant slots) with each micro-batch count, comm mode, redundant slot count and
    concurrency (requests in flight in all; max_num_seqs = concurrency // attention ranks, as bench/throughput.py
    sets it, at most max_seqs: what an attention rank's memory holds)."""
    if min(concurrencies) < 1:
        raise ValueError(f"--concurrency {min(concurrencies)}: at least one request must be in flight")
    if min(redundant) < 0:
        raise ValueError(f"--redundant-experts {min(redundant)}: redundant slots must be >= 0")
    least = min_experts if callable(min_experts) else (lambda _r: min_experts)
    plans = []
    for r in redundant:
        for a in range(1, ranks - max(least(r), 1) + 1):
            for c in concurrencies:
                seqs = max(1, c // a) if max_seqs is None else max(1, min(c // a, max_seqs))
                plans += [Plan(a, ranks - a, m, comm, max_num_seqs=seqs, max_num_batched_tokens=max(512, seqs),
                               ranks_per_node=ranks_per_node, redundant_experts=r)
                          for m in micro_batches for comm in comms]
    return list(dict.fromkeys(plans))


def search(costs: StepCosts, plans: list[Plan], prompts: list[int], outputs: list[int], tpot_slo_ms: float | None,
           rate: float | None = None, decode_only: bool = False, expert_load: list | None = None) -> list[dict]:
    """Predict every plan -> records sorted best first: those meeting the SLO by tok/s, then the others."""
    if costs.num_experts:       # an expert rank holds at least one slot (the engine refuses more ranks)
        plans = [p for p in plans if p.expert_ranks <= costs.num_experts + p.redundant_experts]
        if not plans:
            raise ValueError(f"every plan has more expert ranks than the model's {costs.num_experts} experts and "
                             "their redundant slots: plan fewer ranks, or more --redundant-experts")
    rows = []
    for plan in plans:
        pred = simulate(costs, plan, prompts, outputs, rate=rate, decode_only=decode_only,
                        expert_load=expert_load).to_dict()
        meets = tpot_slo_ms is None or pred["tpot_p99_ms"] <= tpot_slo_ms
        rows.append({"plan": plan.label(), "attention_ranks": plan.attention_ranks, "expert_ranks": plan.expert_ranks,
                     "micro_batches": plan.micro_batches, "max_num_seqs": plan.max_num_seqs, "comm": plan.comm,
                     "ranks_per_node": plan.ranks_per_node, "redundant_experts": plan.redundant_experts,
                     "meets_slo": meets, "tok_s_per_rank": pred["tok_s"] / (plan.attention_ranks + plan.expert_ranks),
                     **pred})
    return sorted(rows, key=lambda r: (not r["meets_slo"], -r["tok_s"]))


def _ints(flag: str, text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give whole numbers separated by commas, e.g. 1,2") from None


def main(argv: list[str] | None = None) -> int:
    from models import SHIPPED_MODEL

    from .hardware import HARDWARE, LAUNCH_S, PRESETS
    from .layout import links_model

    ap = argparse.ArgumentParser(prog="python -m launch.plan", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=SHIPPED_MODEL, help="checkpoint to calibrate on (default: the shipped "
                    f"model); with --hardware also a preset: {', '.join(PRESETS)}")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--calibrate", action="store_true", help="measure the step costs on this machine now")
    src.add_argument("--profile", help="step costs saved by an earlier --calibrate --save-profile")
    src.add_argument("--hardware", choices=sorted(HARDWARE), help="derive the step costs from this GPU's and "
                     "network's published figures (launch/plan/hardware.py): predictions at cluster scale")
    ap.add_argument("--save-profile", help="with --calibrate: write the step costs here")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="--calibrate on this device")
    ap.add_argument("--weight-bytes", type=float, default=1.0, help="--hardware: bytes per weight (1: FP8)")
    ap.add_argument("--kv-bytes", type=float, default=1.0, help="--hardware: bytes per KV element (1: FP8)")
    ap.add_argument("--host-ms", type=float, default=0.0, help="--hardware: host work per step, ms")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="--hardware: GPUs a node's NVLink joins")
    ap.add_argument("--ranks", type=int, default=3, help="ranks (GPUs) to split between the pools (default 3)")
    ap.add_argument("--micro-batches", default="1,2", help="micro-batch counts to try (default 1,2)")
    ap.add_argument("--comm", default="direct", help="comm modes to try, comma-separated: direct, two_phase "
                    "(default direct)")
    ap.add_argument("--network", help="the alpha-beta comm model that prices plans on several nodes or with "
                    "two_phase: a comm calibration JSON (comm=auto's comm_calibration file), or with --hardware "
                    "'links' (the GPU's NVLink and NIC figures)")
    ap.add_argument("--ranks-per-node", type=int, default=0, help="ranks per node of the plans (default: one node; "
                    "with --hardware and --network links, --gpus-per-node)")
    ap.add_argument("--redundant-experts", default="0", help="redundant expert slot counts to try (default 0)")
    ap.add_argument("--expert-load", help="the workload's per-expert load: zipf:S, or a JSON file of counts "
                    "([E] or [L][E]); default balanced")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", default="16:256", help="MIN:MAX prompt tokens, uniform (default 16:256)")
    ap.add_argument("--output-len", default="8:256", help="MIN:MAX output tokens (default 8:256)")
    ap.add_argument("--output-shape", default="longtail", help="longtail (default) or uniform")
    ap.add_argument("--concurrency", default="64", help="requests in flight in all; several, comma-separated, "
                    "are searched too (default 64)")
    ap.add_argument("--decode-only", action="store_true", help="prompts prefilled elsewhere (PD): decode only")
    ap.add_argument("--rate", type=float, default=None, help="arrivals per second (default: all at once)")
    ap.add_argument("--tpot-slo-ms", type=float, default=None, help="keep plans whose TPOT p99 is at most this")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--out", help="write every plan's prediction here (JSON)")
    args = ap.parse_args(argv)
    if args.ranks < 2:
        ap.error(f"--ranks {args.ranks}: a plan needs at least one attention and one expert rank")
    if args.save_profile and not args.calibrate:
        ap.error("--save-profile needs --calibrate (a --profile is saved already)")
    try:
        micro, concurrency = _ints("--micro-batches", args.micro_batches), _ints("--concurrency", args.concurrency)
        redundant, comms = _ints("--redundant-experts", args.redundant_experts), args.comm.split(",")
        if bad := [c for c in comms if c not in COMM_MODES]:
            raise ValueError(f"--comm {bad[0]!r}: choose from {', '.join(COMM_MODES)}")
        if args.ranks_per_node < 0:
            raise ValueError(f"--ranks-per-node {args.ranks_per_node}: give ranks per node >= 1 (0: one node)")
        prompt, output = parse_range(args.prompt_len), parse_range(args.output_len)
        prompts, outputs = workload(args.requests, prompt, output, args.output_shape)
        if args.rate is not None and not args.rate > 0:
            raise ValueError(f"--rate {args.rate}: arrivals per second must be > 0 (leave it out: all at once)")
        min_experts, max_seqs, costs, per_node = 1, None, None, args.ranks_per_node
        if args.profile:
            costs = StepCosts.load(args.profile)
        elif args.hardware:
            from .hardware import count_params, derive_costs, memory_limits, model_config
            counts, hw = count_params(model_config(args.model)), HARDWARE[args.hardware]
            costs = derive_costs(counts, hw, args.weight_bytes, args.kv_bytes, args.ranks > args.gpus_per_node,
                                 args.host_ms / 1e3)
            least, max_seqs = memory_limits(counts, hw, args.weight_bytes, args.kv_bytes, prompt[1] + output[1])
            if least >= args.ranks or max_seqs < 1:
                raise ValueError(f"--ranks {args.ranks}: {args.model} needs {least} expert ranks for its "
                                 f"experts on {hw.name} and room for a sequence on an attention rank: add ranks")

            def experts_for(r: int) -> int:
                return memory_limits(counts, hw, args.weight_bytes, args.kv_bytes, prompt[1] + output[1],
                                     redundant_experts=r)[0]
            min_experts = experts_for
            if args.network == "links":
                costs.network = links_model(hw.link_bytes_s, hw.link_latency_s + 2 * LAUNCH_S, hw.nic_bytes_s,
                                            hw.nic_latency_s + 2 * LAUNCH_S).to_dict()
                per_node = per_node or args.gpus_per_node
        if args.network not in (None, "links"):
            network = load_network(args.network)
        elif args.network == "links" and not args.hardware:
            raise ValueError("--network links takes the links of a --hardware GPU; with a calibration give a comm "
                             "calibration JSON")
        plans = candidates(args.ranks, micro, concurrency, min_experts, max_seqs, comms, redundant, per_node)
    except ValueError as e:
        ap.error(str(e))
    if costs is None:
        from .calibrate import calibrate
        try:
            costs = calibrate(args.model, device=args.device)
        except (ValueError, RuntimeError) as e:
            ap.error(f"--calibrate on {args.model!r}: {e}")
        if args.save_profile:
            costs.save(args.save_profile)
    if args.network not in (None, "links"):
        costs.network = network
    try:
        load = parse_expert_load(args.expert_load, costs.num_experts, costs.top_k) if args.expert_load else None
        rows = search(costs, plans, prompts, outputs, args.tpot_slo_ms, args.rate, args.decode_only, load)
    except ValueError as e:
        ap.error(str(e))
    print(f"step costs: {costs.source}")
    print(f"{'plan':<30} {'seqs':>5} {'tok/s':>9} {'per rank':>8} {'TPOT p50':>9} {'TPOT p99':>9} {'TTFT p99':>9} "
          f"{'attn util':>9} {'expert util':>11}  SLO")
    for r in rows[:args.top]:
        print(f"{r['plan']:<30} {r['max_num_seqs']:5d} {r['tok_s']:9.0f} {r['tok_s_per_rank']:8.0f} "
              f"{r['tpot_p50_ms']:7.1f}ms {r['tpot_p99_ms']:7.1f}ms {r['ttft_p99_ms']:7.0f}ms "
              f"{r['attention_util']:9.2f} {r['expert_util']:11.2f}  {'yes' if r['meets_slo'] else 'no'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"costs": costs.to_dict(), "plans": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
