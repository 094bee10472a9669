import os, sys, time, statistics
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the repository
from launch import LLM, SamplingParams
from bench.throughput import workload
from models import SHIPPED_MODEL

def run(llm, prompts, olens):
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0) for o in olens]
    t = time.perf_counter(); outs = llm.generate(prompts, params); dt = time.perf_counter() - t
    return sum(len(o.token_ids) for o in outs) / dt

if __name__ == "__main__":
    A, E, M, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    prompts, olens = workload(256, model=SHIPPED_MODEL)
    with LLM(SHIPPED_MODEL, attention_ranks=A, expert_ranks=E, max_num_seqs=64 // A, max_num_batched_tokens=512,
             micro_batches=M, kv_cache_memory=(1 << 30) // A) as llm:
        run(llm, prompts[:16], olens[:16])
        ws = [workload(256, seed=r + 1, model=SHIPPED_MODEL) for r in range(reps)]
        xs = [run(llm, p, o) for p, o in ws]
        print(f"{A}+{E} mb={M} (ran {llm.stats()['micro_batches']}): median {statistics.median(xs):.0f} runs {[round(x) for x in xs]}", flush=True)
