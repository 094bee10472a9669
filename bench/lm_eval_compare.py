"""lm-eval against the server: the same two offline tasks scored by lm-eval's own `hf` backend (transformers in
this process's eval venv) and by its `local-completions` backend against launch/serve.py (1 attention + 2
expert ranks, loopback), in one run; the scores must be equal.

Tasks (tests/lm_eval/, built from the shipped model's held-out play by make_data.py, no download):
- shakespeare_mc: 24 multiple-choice items (loglikelihood: the server's `echo` + `logprobs` path);
- shakespeare_gen: 24 greedy generations cut at stop strings (generate_until).

lm-eval and its dependencies are large (about 1 GB with guidellm), so they live in their own venv, made by
`make eval`, not in the project's test venv; pass it with --eval-venv. Writes bench/results/lm_eval.json.
"""
from __future__ import annotations

import argparse
import glob
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

TASKS = "shakespeare_mc,shakespeare_gen"
METRICS = {"shakespeare_mc": ("acc,none", "acc_norm,none"), "shakespeare_gen": ("exact_match,strip",)}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def lm_eval(venv: str, backend: str, model_args: str, out: str, extra: list[str]) -> tuple[dict, float]:
    """Run lm_eval from the repository root (the task YAMLs name their data relative to it); returns its
    per-task results and the wall time."""
    cmd = [os.path.join(venv, "bin", "lm_eval"), "--model", backend, "--model_args", model_args,
           "--include_path", os.path.join(ROOT, "tests", "lm_eval"), "--tasks", TASKS, "--output_path", out,
           "--log_samples", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"lm_eval --model {backend} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    files = sorted(glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True))
    if not files:
        raise RuntimeError(f"lm_eval --model {backend} wrote no results under {out}")
    with open(files[-1]) as f:
        return json.load(f)["results"], wall


def samples(out: str, task: str) -> dict[int, list]:
    """doc id -> filtered responses, from lm_eval's --log_samples file for task."""
    files = sorted(glob.glob(os.path.join(out, "**", f"samples_{task}_*.jsonl"), recursive=True))
    with open(files[-1]) as f:
        return {d["doc_id"]: d["filtered_resps"] for d in map(json.loads, f)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # absolute at once: the tools run in another working directory (the Makefile passes --eval-venv .venv-eval)
    ap.add_argument("--eval-venv", type=os.path.abspath, default=os.path.join(ROOT, ".venv-eval"),
                    help="the venv holding lm_eval")
    ap.add_argument("--model", type=os.path.abspath, default=SHIPPED_MODEL)
    args = ap.parse_args()
    name = os.path.basename(os.path.normpath(args.model))
    with tempfile.TemporaryDirectory() as d:
        hf, hf_s = lm_eval(args.eval_venv, "hf", f"pretrained={args.model},dtype=float32", os.path.join(d, "hf"),
                           ["--device", "cpu", "--batch_size", "1"])
        with LocalServer(args.model, nproc=3, args=["--attention-ranks", "1", "--served-model-name", name]) as srv:
            model_args = (f"model={name},base_url={srv.url}/v1/completions,tokenizer={args.model},"
                          f"tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1,"
                          f"max_length=1024")
            ours, ours_s = lm_eval(args.eval_venv, "local-completions", model_args, os.path.join(d, "server"), [])
        # Beyond the scores: every choice's loglikelihood and greedy flag, and every generated text.
        mc_hf, mc_ours = samples(os.path.join(d, "hf"), "shakespeare_mc"), samples(os.path.join(d, "server"),
                                                                                    "shakespeare_mc")
        ll_diff = max(abs(float(a[0]) - float(b[0])) for k in mc_hf for a, b in zip(mc_hf[k], mc_ours[k]))
        greedy_diff = sum(a[1] != b[1] for k in mc_hf for a, b in zip(mc_hf[k], mc_ours[k]))
        gen_hf, gen_ours = samples(os.path.join(d, "hf"), "shakespeare_gen"), samples(os.path.join(d, "server"),
                                                                                       "shakespeare_gen")
        gen_diff = sum(gen_hf[k] != gen_ours[k] for k in gen_hf)
    rows, same = [], True
    print("| task | metric | lm-eval `hf` | lm-eval `local-completions` on afserve |")
    print("|---|---|---|---|")
    for task, metrics in METRICS.items():
        for m in metrics:
            a, b = hf[task][m], ours[task][m]
            same &= a == b
            rows.append({"task": task, "metric": m, "hf": a, "afserve": b})
            print(f"| {task} | {m.split(',')[0]} | {a:.4f} | {b:.4f} |")
    print(f"per choice: max |loglikelihood difference| {ll_diff:.2e}, is_greedy flags that differ: {greedy_diff}; "
          f"generations that differ: {gen_diff} of {len(gen_hf)}")
    print(f"scores equal: {same}; wall: hf {hf_s:.0f} s, local-completions {ours_s:.0f} s (including lm_eval start-up)")
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "lm_eval.json"), "w") as f:
        json.dump({"model": name, "scores": rows, "equal": same, "max_loglikelihood_diff": ll_diff,
                   "is_greedy_diffs": greedy_diff, "generation_diffs": gen_diff,
                   "wall_s": {"hf": hf_s, "afserve": ours_s}}, f, indent=1)
    if not same:
        sys.exit("lm-eval scores differ between the hf backend and the server")


if __name__ == "__main__":
    main()
