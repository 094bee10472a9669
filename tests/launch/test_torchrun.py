"""launch/serve.py under torchrun joins the same runtime: its answers equal LLM.generate's; the JSON-lines
mode answers good requests, rejects bad ones without reaching the ranks, and shuts down on EOF."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from launch import LLM, SamplingParams
from launch.procs import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def torchrun(nproc: int, *args: str, stdin: str | None = None) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), os.path.join(ROOT, "launch", "serve.py"), *args]
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_serve_prompts_equal_generate(tiny_checkpoint):
    path = tiny_checkpoint("qwen2_moe")
    got = torchrun(4, "--model", path, "--attention-ranks", "2", "--prompt", "Hello experts",
                   "--prompt", "The quick brown fox", "--max-tokens", "7")
    with LLM(path, attention_ranks=1, expert_ranks=1) as llm:
        want = llm.generate(["Hello experts", "The quick brown fox"], SamplingParams(max_tokens=7))
    assert [g["token_ids"] for g in got] == [w.token_ids for w in want]
    assert [g["finish_reason"] for g in got] == [w.finish_reason for w in want]


def test_serve_json_lines(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    lines = [{"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True},
             {"prompt": [], "max_tokens": 3},
             {"prompt": [9, 9], "max_tokens": 5, "ignore_eos": True, "temperature": -1}]
    out = torchrun(3, "--model", path, "--attention-ranks", "1", "--stdin",
                   stdin="".join(json.dumps(x) + "\n" for x in lines))
    errors = [o["error"] for o in out if "error" in o]
    answers = [o for o in out if "token_ids" in o]
    assert len(errors) == 2 and "empty prompt" in errors[0] and "temperature=-1" in errors[1]
    assert len(answers) == 1 and len(answers[0]["token_ids"]) == 4 and answers[0]["finish_reason"] == "length"
