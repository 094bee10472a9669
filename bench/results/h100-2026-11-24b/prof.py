"""GPU profile: 1+1 ranks on one GPU (cuda_ipc), Qwen3-30B-A3B shape with 4 layers, steady decode; py-spy
samples both ranks from the outside (see prof.sh)."""
import os
import sys
import tempfile
import time

sys.path.insert(0, os.getcwd())
from bench.throughput import synthetic_checkpoint, workload
from launch import LLM, SamplingParams


def main():
    out = os.environ["OUT"]
    mb = int(os.environ.get("MB", "1"))
    path = synthetic_checkpoint(tempfile.mkdtemp(), 4, "cuda")
    prompts, _ = workload(256, model=path)
    with LLM(path, attention_ranks=1, expert_ranks=1, device="cuda", dtype="bfloat16", max_num_seqs=64,
             max_num_batched_tokens=512, micro_batches=mb, gpu_memory_utilization=0.8) as llm:
        llm.generate(prompts[:16], SamplingParams(max_tokens=8, ignore_eos=True))
        with open(f"{out}/pids.txt", "w") as f:
            f.write(" ".join(map(str, [os.getpid()] + llm.worker_pids)))
        t_end = time.time() + float(os.environ.get("SECS", "40"))
        while time.time() < t_end:
            t0 = time.perf_counter()
            outs = llm.generate(prompts[:128], SamplingParams(max_tokens=128, ignore_eos=True))
            dt = time.perf_counter() - t0
            n = sum(len(o.token_ids) for o in outs)
            print(f"mb={mb} {n} tokens in {dt:.2f}s: {n/dt:.0f} tok/s", flush=True)
        print(llm.stats()["steps"], "steps")


if __name__ == "__main__":
    main()
