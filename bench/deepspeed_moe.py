"""Offline throughput: DeepSpeed-MoE expert parallelism (the colocated baseline) beside this runtime and HF
`generate`, on the same checkpoint and the same workload as bench/throughput.py, in one run.

DeepSpeed side: R ranks launched with `torchrun --standalone --nproc-per-node R`, gloo on CPU. Every rank loads
the HF Qwen3-MoE in fp32 and runs the full attention stack on its share of the requests; every sparse MoE block
is replaced by `deepspeed.moe.layer.MoE(ep_size=R)` holding the checkpoint's router weight and, on each rank,
its E/R local experts (the checkpoint's SwiGLU experts), tokens exchanged by DeepSpeed's all-to-all. Gating:
softmax top-k renormalised (as norm_topk_prob=True), no 2nd-expert sampling, no random token selection, no
noisy gate, drop_tokens=False (capacity = the all-reduced largest expert load, so nothing is dropped).
Requests go in rounds of 64 (throughput.py's batch), each round split across the R ranks; each rank runs HF
`generate` (static batch, left padding) on its part, and all ranks run the round for the round's longest
request (the all-to-all is collective). Only the tokens each request asked for count.

DeepSpeed needs num_experts % ep_size == 0, so R ranks are used only where R divides E. With E not a multiple
of 3 (8 or 16 experts) the 3-rank comparison against afserve's 1 attention + 2 expert ranks is impossible with
expert parallelism; the bench then compares at the rank counts around it that divide E (2 and 4 by default:
DeepSpeed on 2 ranks against afserve 1+1, on 4 against afserve 1+3, 2+2 and 3+1). `--ranks 3:1` runs DeepSpeed on
3 ranks with ep_size 1 (every rank holds all experts; no all-to-all) for reference.

Before timing, each DeepSpeed run checks its greedy tokens against transformers' own model on a few prompts of
the workload (same batches, same padding) and prints PASS/FAIL with the first mismatch (exit status 1 on FAIL).
Tokens are expected equal, logits only to ~1e-6 (fp32): transformers runs each expert on exactly its routed
tokens, DeepSpeed on its capacity buffer (padded to the largest load on any rank), and the CPU GEMM rounds the
same row differently when it has fewer than ~8 rows; at top-k > 2 DeepSpeed also sums the renormalising
denominator over all E experts in expert order rather than over the k picked ones in rank order.
The systems run one after another (the DeepSpeed jobs, then afserve per split, then HF), each warmed up, then
--repeats timed runs; prints the median, each run's figure, and the ratios. --smoke: 24 requests of at most 32
output tokens, 1 repeat. --check-only: only the check.

DeepSpeed on CPU: its CPU accelerator (chosen by DS_ACCELERATOR=cpu, which the bench sets) uses oneCCL when
oneccl_bindings_for_pytorch is importable and gloo otherwise; neither IPEX nor oneCCL is needed. Its inference
kernels (DeepSpeedMoEInference) are fused GPT blocks (LayerNorm, GELU experts) for CUDA and cannot express
Qwen3-MoE, so the training-side `deepspeed.moe.layer.MoE` in eval mode is what runs here.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.throughput import left_padded, workload  # noqa: E402
from models import SHIPPED_MODEL  # noqa: E402

BATCH = 64  # requests in flight in total, as throughput.py's HF batches and afserve's max_num_seqs


# ----- rank-count choice -------------------------------------------------------------------------------------
def parse_ranks(spec: str, num_experts: int) -> list[tuple[int, int]]:
    """'auto' or a comma list of R (ep_size R) or R:EP -> [(world, ep_size)], each checked against DeepSpeed's
    constraints (num_experts % ep_size == 0, world % ep_size == 0)."""
    if spec == "auto":
        if num_experts % 3 == 0:
            return [(3, 3)]
        below = [r for r in (2,) if num_experts % r == 0]
        above = [r for r in range(4, 9) if num_experts % r == 0][:1]
        if not below + above:
            raise SystemExit(f"no rank count in 2..8 divides num_experts={num_experts}; pass --ranks R:1")
        return [(r, r) for r in below + above]
    out = []
    for item in spec.split(","):
        world, _, ep = item.partition(":")
        world, ep = int(world), int(ep or world)
        if num_experts % ep or world % ep:
            raise SystemExit(f"--ranks {item}: DeepSpeed needs num_experts ({num_experts}) % ep_size ({ep}) == 0 "
                             f"and ranks ({world}) % ep_size == 0")
        out.append((world, ep))
    return out


def ours_splits(world: int, spec: str | None) -> list[tuple[int, int]]:
    """afserve (attention, expert) rank splits matched to a DeepSpeed world size: 1+(R-1), and 2+2 and 3+1 at
    R=4 (choosing the ratio is what disaggregation is for)."""
    if spec:
        pairs = [tuple(map(int, s.split("+"))) for s in spec.split(",")]
        return [p for p in pairs if sum(p) == world]
    return [(1, world - 1)] + ([(2, 2), (3, 1)] if world == 4 else [])


# ----- the DeepSpeed rank ----------------------------------------------------------------------------------
def _expert_cls():
    import torch
    from torch import nn

    class SwiGLUExpert(nn.Module):
        """One Qwen3-MoE expert, as transformers computes it: down(act(x @ gate^T) * (x @ up^T))."""

        def __init__(self, hidden: int, inter: int, act):
            super().__init__()
            self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)  # rows: gate then up, as gate_up_proj[e]
            self.down = nn.Linear(inter, hidden, bias=False)
            self.act = act

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down(self.act(gate) * up)

    return SwiGLUExpert


def _block_cls():
    from deepspeed.moe.layer import MoE
    from torch import nn

    class DeepSpeedMoEBlock(nn.Module):
        """Drop-in for Qwen3MoeSparseMoeBlock: [B, S, H] -> [B, S, H] through deepspeed.moe.layer.MoE."""

        def __init__(self, block, config, ep_size: int):
            super().__init__()
            E, k = config.num_experts, config.num_experts_per_tok
            H, I = config.hidden_size, config.moe_intermediate_size
            expert = _expert_cls()(H, I, block.experts.act_fn)
            self.moe = MoE(H, expert, num_experts=E, ep_size=ep_size, k=k,
                           capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=0,
                           noisy_gate_policy=None,            # no jitter / Gumbel noise on the gate
                           drop_tokens=False,                 # capacity = all-reduced max expert load: no drops
                           use_rts=False,                     # no random token selection
                           top2_2nd_expert_sampling=False)    # k=2: 2nd expert by argmax, not Gumbel sampling
            self.moe.set_deepspeed_parallelism()              # creates / joins the ep_size_{ep} process group
            self.moe.eval()

        def load(self, block, ep_rank: int) -> None:
            import torch
            ds = self.moe.deepspeed_moe
            local = ds.experts.deepspeed_experts
            with torch.no_grad():
                ds.gate.wg.weight.copy_(block.gate.weight)
                for j, ex in enumerate(local):   # after the all-to-all, local j on ep rank r is expert r*n_local + j
                    e = ep_rank * len(local) + j
                    ex.gate_up.weight.copy_(block.experts.gate_up_proj[e])
                    ex.down.weight.copy_(block.experts.down_proj[e])

        def forward(self, hidden_states):
            out, _, _ = self.moe(hidden_states)
            return out

    return DeepSpeedMoEBlock


def deepspeed_model(path: str, ep_size: int):
    """The HF model with every sparse MoE block replaced by a DeepSpeed MoE layer of ep_size ranks."""
    import deepspeed.comm as dist
    import torch
    from deepspeed.utils import groups
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    cfg = model.config
    if cfg.model_type != "qwen3_moe":
        raise SystemExit(f"{path}: model_type {cfg.model_type!r}, this bench takes Qwen3-MoE checkpoints")
    Block = _block_cls()
    ep_rank = None
    for layer in model.model.layers:
        block = layer.mlp
        if not hasattr(block, "experts"):      # mlp_only_layers / decoder_sparse_step: dense MLP stays
            continue
        ds = Block(block, cfg, ep_size)
        if ep_rank is None:
            ep_rank = dist.get_rank(group=groups._get_expert_parallel_group(f"ep_size_{ep_size}"))
        ds.load(block, ep_rank)
        layer.mlp = ds
    return model.eval()


def share(items: list, rank: int, world: int) -> list:
    """rank's contiguous part of items (sizes differ by at most one)."""
    q, r = divmod(len(items), world)
    lo = rank * q + min(rank, r)
    return items[lo:lo + q + (rank < r)]


def run_rounds(model, prompts, olens, rank: int, world: int, batch: int = BATCH) -> int:
    """Generate every round in lockstep; returns the useful tokens of this rank. A rank with nothing in a
    round still runs a one-token dummy batch: every MoE forward is a collective."""
    import torch
    n = 0
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            ps, os_ = share(prompts[i:i + batch], rank, world), share(olens[i:i + batch], rank, world)
            steps = max(olens[i:i + batch])            # the round's longest request, the same on every rank
            ids, mask = left_padded(ps or [[3]])
            out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, pad_token_id=0)
            assert out.shape[1] == ids.shape[1] + steps, "generation stopped early: ranks would fall out of step"
            n += sum(os_)
    return n


def check(model, ref, prompts, rank: int, world: int, tokens: int) -> dict:
    """Greedy tokens of the DeepSpeed model against transformers' on this rank's prompts (one batch, left
    padding, the same for both). Returns this rank's result."""
    import torch
    ps = share(prompts, rank, world)
    ids, mask = left_padded(ps or [[3]])
    kw = dict(attention_mask=mask, max_new_tokens=tokens, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        ds = model.generate(ids, **kw)
        hf = ref.generate(ids, **kw)
    w = ids.shape[1]
    res = {"rank": rank, "prompts": len(ps), "mismatch": None, "max_logit_diff": 0.0, "compared": 0}
    for j in range(len(ps)):
        a, b = ds.sequences[j, w:].tolist(), hf.sequences[j, w:].tolist()
        for t, (x, y) in enumerate(zip(a, b)):
            diff = float((ds.logits[t][j] - hf.logits[t][j]).abs().max())
            res["max_logit_diff"] = max(res["max_logit_diff"], diff)
            if x != y:
                top2 = hf.logits[t][j].topk(2).values
                res["mismatch"] = dict(prompt=j, position=t, deepspeed=x, transformers=y,
                                       hf_top2_gap=float(top2[0] - top2[1]), logit_diff=diff)
                break
            res["compared"] += 1
        if res["mismatch"]:
            break
    return res


def worker(args) -> None:
    import deepspeed
    import deepspeed.comm as dist
    import deepspeed.ops
    import torch
    from transformers import AutoModelForCausalLM

    # DeepSpeed's CPU backend JIT-compiles (g++, ninja; ~1 min the first time) a shared-memory all-reduce op at
    # init. Only inference_all_reduce (tensor-parallel inference) uses it; the MoE layer's all-to-all and its
    # capacity all-reduce go through torch.distributed (gloo) either way. Marking the op unavailable skips the
    # build, which DeepSpeed then handles as on a machine without a compiler.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads_per_rank or max(1, (os.cpu_count() or 1) // world))
    model = deepspeed_model(args.model, args.ep_size)
    result = {"ranks": world, "ep_size": args.ep_size, "deepspeed": deepspeed.__version__,
              "threads_per_rank": torch.get_num_threads()}

    if args.check_tokens:
        ref = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        ref.generation_config.eos_token_id = None
        cp, _ = workload(args.check_prompts * world, seed=1, model=args.model)
        mine = check(model, ref, cp, rank, world, args.check_tokens)
        del ref
        allres = [None] * world
        dist.all_gather_object(allres, mine)
        result["check"] = {"tokens": args.check_tokens, "ranks": allres,
                           "pass": all(r["mismatch"] is None for r in allres)}
    if not args.check_only:
        prompts, olens = workload(args.requests, max_output=args.max_output, model=args.model)
        run_rounds(model, prompts[:16], [8] * 16, rank, world, batch=16)   # warm-up
        runs = []
        for _ in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            n = run_rounds(model, prompts, olens, rank, world)
            dist.barrier()
            dt = time.perf_counter() - t0
            total = torch.tensor([n])
            dist.all_reduce(total)
            assert int(total) == sum(olens), (int(total), sum(olens))
            runs.append(int(total) / dt)
        result["runs"] = runs
    if rank == 0:
        with open(args.result_file, "w") as f:
            json.dump(result, f)
    dist.barrier()


# ----- the driver ------------------------------------------------------------------------------------------
def run_deepspeed(args, world: int, ep: int) -> dict:
    """Launch the DeepSpeed ranks with torchrun and return rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               os.path.abspath(__file__), "--worker", "--model", args.model, "--ep-size", str(ep),
               "--requests", str(args.requests), "--max-output", str(args.max_output), "--repeats", str(args.repeats),
               "--check-tokens", str(args.check_tokens), "--check-prompts", str(args.check_prompts),
               "--result-file", out]
        if args.threads_per_rank:
            cmd += ["--threads-per-rank", str(args.threads_per_rank)]
        if args.check_only:
            cmd.append("--check-only")
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if r.returncode != 0 or not os.path.exists(out):
            sys.stderr.write(r.stdout[-4000:] + r.stderr[-8000:])
            raise SystemExit(f"DeepSpeed ranks failed (exit {r.returncode}): {' '.join(cmd)}")
        with open(out) as f:
            return json.load(f)


def report_check(res: dict) -> bool:
    c = res["check"]
    n = sum(r["compared"] for r in c["ranks"])
    diff = max(r["max_logit_diff"] for r in c["ranks"])
    head = (f"check DeepSpeed {res['ranks']} ranks (ep_size {res['ep_size']}) vs transformers, first "
            f"{c['tokens']} greedy tokens of {sum(r['prompts'] for r in c['ranks'])} prompts:")
    if c["pass"]:
        print(f"{head} PASS ({n} tokens equal; max |logit diff| {diff:.2e})")
    else:
        bad = next(r for r in c["ranks"] if r["mismatch"])
        m = bad["mismatch"]
        print(f"{head} FAIL on rank {bad['rank']}, prompt {m['prompt']}, token {m['position']}: DeepSpeed "
              f"{m['deepspeed']}, transformers {m['transformers']} (|logit diff| {m['logit_diff']:.2e}, "
              f"transformers' top-2 gap {m['hf_top2_gap']:.2e}; max |logit diff| before it {diff:.2e})")
    return c["pass"]


def fmt(name: str, runs: list[float], ref: float | None = None) -> str:
    med = statistics.median(runs)
    tail = f"  {med / ref:.2f}x HF" if ref else ""
    return f"{name:<34}: {med:8.1f} output tok/s (runs: {', '.join(f'{x:.1f}' for x in runs)}){tail}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=SHIPPED_MODEL,
                    help="a Qwen3-MoE checkpoint directory (default: the shipped model)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=256, help="longest output of the workload (throughput.py's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ranks", default="auto", help="DeepSpeed rank counts: 'auto' or e.g. '2,4' or '3:1' "
                    "(R:ep_size); auto: 3 if 3 divides the expert count, else 2 and the next divisor above 3")
    ap.add_argument("--ours", default=None, help="afserve splits, e.g. '1+1,1+3,2+2' (default: 1+(R-1) per "
                    "DeepSpeed rank count R, and 2+2 and 3+1 at R=4)")
    ap.add_argument("--threads-per-rank", type=int, default=None)
    ap.add_argument("--check-tokens", type=int, default=16, help="greedy tokens compared with transformers (0: off)")
    ap.add_argument("--check-prompts", type=int, default=2, help="prompts per DeepSpeed rank in the check")
    ap.add_argument("--check-only", action="store_true", help="only the DeepSpeed-vs-transformers check; "
                    "exit status 1 on a mismatch")
    ap.add_argument("--smoke", action="store_true", help="a quick run: 24 requests of at most 32 tokens, 1 repeat")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ep-size", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if not os.path.isdir(args.model):
        raise SystemExit(f"no checkpoint at {args.model}; pass --model PATH (a Qwen3-MoE checkpoint directory)")
    if args.smoke:
        args.requests, args.repeats, args.max_output = min(args.requests, 24), 1, min(args.max_output, 32)

    import torch
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(args.model)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    plan = parse_ranks(args.ranks, E)
    if (k == 1) == bool(cfg.norm_topk_prob):
        print(f"note: k={k}, norm_topk_prob={cfg.norm_topk_prob}: DeepSpeed's top-1 gate keeps the softmax "
              "probability and its top-2/top-k gates always renormalise, so its weights differ from the checkpoint's")

    import deepspeed

    print(f"model {args.model}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {E} experts top-{k}; "
          f"deepspeed {deepspeed.__version__}, torch {torch.__version__}")
    print("DeepSpeed rank counts (world:ep_size): " + ", ".join(f"{w}:{e}" for w, e in plan)
          + ("" if E % 3 == 0 else f"  [3 ranks with expert parallelism impossible: {E} % 3 != 0]"))

    ds_results = []
    ok = True
    for world, ep in plan:
        res = run_deepspeed(args, world, ep)
        if "check" in res:
            ok &= report_check(res)
        ds_results.append(res)
    if args.check_only:
        raise SystemExit(0 if ok else 1)

    from transformers import AutoModelForCausalLM

    from bench.throughput import run_hf, run_ours
    from launch import LLM

    prompts, olens = workload(args.requests, max_output=args.max_output, model=args.model)
    print(f"workload: {len(prompts)} requests, prompt tokens {sum(map(len, prompts))}, output tokens "
          f"{sum(olens)} (min {min(olens)}, median {int(statistics.median(olens))}, max {max(olens)})")

    ours: dict[str, list[float]] = {}
    for split in dict.fromkeys(s for w, _ in plan for s in ours_splits(w, args.ours)):
        a, e = split
        # BATCH requests in flight in all, as HF and DeepSpeed have: max_num_seqs is per attention rank.
        with LLM(args.model, attention_ranks=a, expert_ranks=e, max_num_seqs=BATCH // a, max_num_batched_tokens=512,
                 threads_per_rank=args.threads_per_rank) as llm:
            run_ours(llm, prompts[:16], olens[:16])          # warm-up
            runs = []
            for _ in range(args.repeats):
                dt, n = run_ours(llm, prompts, olens)
                runs.append(n / dt)
        ours[f"afserve {a}+{e} ranks"] = runs

    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    run_hf(hf, prompts[:16], [8] * 16, batch=16)             # warm-up
    base = []
    for _ in range(args.repeats):
        dt, n = run_hf(hf, prompts, olens, batch=BATCH)
        base.append(n / dt)
    mb = statistics.median(base)

    print()
    print(fmt(f"HF generate, batch {BATCH}", base))
    for world, ep in plan:
        res = next(r for r in ds_results if r["ranks"] == world and r["ep_size"] == ep)
        md = statistics.median(res["runs"])
        print(fmt(f"DeepSpeed-MoE {world} ranks (ep_size {ep})", res["runs"], mb))
        for a, e in ours_splits(world, args.ours):
            runs = ours[f"afserve {a}+{e} ranks"]
            print(fmt(f"afserve {a}+{e} ranks", runs, mb) + f"  {statistics.median(runs) / md:.2f}x DeepSpeed")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
