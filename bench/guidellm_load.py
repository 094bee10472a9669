"""A load generator no one here wrote, against the server: guidellm (its default: streamed chat completions,
which send vLLM's stream_options.continuous_usage_stats), at a constant request rate for a bounded time, on
loopback, against launch/serve.py (1 attention + 2 expert ranks) serving the shipped model.

guidellm lives in the eval venv that `make eval` makes (--eval-venv). Prints its request totals (a run passes
with zero errored requests), TTFT, ITL and output throughput; writes bench/results/guidellm.json (the summary)
beside guidellm's own full report.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from launch.local_server import LocalServer  # noqa: E402
from models import SHIPPED_MODEL  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # absolute at once: the tools run in another working directory (the Makefile passes --eval-venv .venv-eval)
    ap.add_argument("--eval-venv", type=os.path.abspath, default=os.path.join(ROOT, ".venv-eval"),
                    help="the venv holding guidellm")
    ap.add_argument("--model", type=os.path.abspath, default=SHIPPED_MODEL)
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second (constant)")
    ap.add_argument("--seconds", type=int, default=25, help="how long guidellm sends (its whole run stays < 60 s)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    args = ap.parse_args()
    name = os.path.basename(os.path.normpath(args.model))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "GUIDELLM__MAX_WORKER_PROCESSES": "1"}     # a 2-core box: one worker process
    with tempfile.TemporaryDirectory() as d, \
            LocalServer(args.model, nproc=3, args=["--attention-ranks", "1", "--served-model-name", name]) as srv:
        report = os.path.join(d, "guidellm.json")
        cmd = [os.path.join(args.eval_venv, "bin", "guidellm"), "run",
               "--backend", f"kind=openai_http,target={srv.url},model={name}",
               "--tokenizer", f"kind=hf_auto,model={args.model}",
               "--profile", f"kind=constant,rate={args.rate}",
               "--constraint", f"kind=max_duration,seconds={args.seconds}",
               "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
               "--output", f"kind=json,path={report}", "--disable-console-interactive"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=300)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.exit(f"guidellm failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(report) as f:
            full = json.load(f)
        server_log = srv.log()
    bench = full["benchmarks"][0]
    m = bench["metrics"]
    totals = m["request_totals"]

    def stat(key: str) -> dict:
        s = m[key]["successful"]
        return {"median": s["median"], "p99": s["percentiles"]["p99"]}

    summary = {"guidellm": full["metadata"]["guidellm_version"], "request_format": "chat (guidellm's default)",
               "rate_per_s": args.rate, "duration_s": bench["duration"], "wall_s": wall, "requests": totals,
               "ttft_ms": stat("time_to_first_token_ms"), "itl_ms": stat("inter_token_latency_ms"),
               "output_tok_s": m["output_tokens_per_second"]["successful"]["mean"],
               "http_400s_in_server_log": server_log.count('" 400 ')}
    print(f"guidellm {summary['guidellm']}: {args.seconds} s at {args.rate} req/s, streamed chat completions, "
          f"{args.prompt_tokens} prompt / {args.output_tokens} output tokens; whole run {wall:.0f} s")
    print(f"requests: {totals['successful']} successful, {totals['errored']} errored, {totals['incomplete']} "
          f"incomplete (cut off by the time limit)")
    print(f"TTFT median {summary['ttft_ms']['median']:.1f} ms, p99 {summary['ttft_ms']['p99']:.1f} ms; "
          f"ITL median {summary['itl_ms']['median']:.2f} ms, p99 {summary['itl_ms']['p99']:.2f} ms; "
          f"output {summary['output_tok_s']:.0f} tok/s")
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "guidellm.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if totals["errored"]:
        sys.exit(f"{totals['errored']} requests failed")


if __name__ == "__main__":
    main()
