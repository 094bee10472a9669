"""Scratch: offline tok/s of one engine at A+E ranks and micro_batches M, the bench/throughput.py workload; after a
16-request warm-up, `reps` timed runs of bench/peers.py's timed_workloads (repeat: the same prompts each run;
fresh: workload seeds 1.. per run). Usage: mb_off.py A E M REPS [repeat|fresh]"""
import os, sys, time, statistics
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the repository
from launch import LLM
from bench.peers import greedy, timed_workloads
from bench.throughput import workload
from models import SHIPPED_MODEL


def run(llm, prompts, olens):
    t = time.perf_counter(); outs = llm.generate(prompts, greedy(olens)); dt = time.perf_counter() - t
    return sum(len(o.token_ids) for o in outs) / dt


if __name__ == "__main__":
    A, E, M, reps = (int(x) for x in sys.argv[1:5])
    mode = sys.argv[5] if len(sys.argv) > 5 else "repeat"
    prompts, olens = workload(256, model=SHIPPED_MODEL)
    with LLM(SHIPPED_MODEL, attention_ranks=A, expert_ranks=E, max_num_seqs=64 // A, max_num_batched_tokens=512,
             micro_batches=M, kv_cache_memory=(1 << 30) // A) as llm:
        run(llm, prompts[:16], olens[:16])
        xs = [run(llm, p, o) for p, o in timed_workloads(mode, 256, reps, SHIPPED_MODEL, prompts, olens)]
        print(f"{A}+{E} mb={M} (ran {llm.stats()['micro_batches']}): median {statistics.median(xs):.0f} "
              f"runs {[round(x) for x in xs]}", flush=True)
