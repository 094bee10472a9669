"""torchrun entry point: `torchrun --nproc-per-node W launch/serve.py --model DIR --attention-ranks A`.

Every rank joins the runtime. Until the HTTP front lands, attention rank 0 reads JSON lines on
stdin ({"prompt": str | [ids], plus SamplingParams fields}) and writes one JSON line per finished
request to stdout ({"id", "token_ids", "text", "finish_reason"} or {"error"}); EOF shuts every
rank down once the last request is answered. With --prompt it answers those prompts and exits.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading

if __package__ in (None, ""):  # run as a script by torchrun: make the project importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attention_nodes.sampling_params import SamplingParams
from launch.cli import add_engine_args, engine_options
from launch.llm import LLM


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def _read_requests(llm: LLM, max_tokens: int, state: dict) -> None:
    """stdin -> leader inbox. Bad lines are answered with an error and never reach the ranks."""
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            prompt = req.pop("prompt")
            params = SamplingParams(**{"max_tokens": max_tokens, **req})
            with state["lock"]:  # registered before the writer can see its first output
                state["open"][llm.submit(prompt, params)] = []
        except (ValueError, TypeError, KeyError) as e:
            _emit({"error": f"{type(e).__name__}: {e}"})
    with state["lock"]:
        state["eof"] = True
        if not state["open"]:
            llm.inbox.put(("shutdown",))


def _write_outputs(llm: LLM, state: dict) -> None:
    """leader outbox -> stdout, one line per finished request."""
    while True:
        msg = llm.outbox.get()
        if msg[0] != "out":
            continue
        for rid, toks, finish in msg[1]:
            with state["lock"]:
                acc = state["open"][rid]
                acc.extend(toks)
                if finish is None:
                    continue
                del state["open"][rid]
                done = state["eof"] and not state["open"]
            _emit({"id": rid, "token_ids": acc, "text": llm.decode(acc), "finish_reason": finish})
            if done:
                llm.inbox.put(("shutdown",))


def main(argv=None) -> int:
    p = add_engine_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--prompt", action="append", help="answer this prompt (repeatable) and exit")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args(argv)
    if not args.model:
        p.error("--model DIR is required")
    world = int(os.environ.get("WORLD_SIZE", 0))
    if not world:
        p.error("serve.py runs under torchrun (WORLD_SIZE is not set); for a local run use `make demo`")
    expert_ranks = args.expert_ranks if args.expert_ranks is not None else world - args.attention_ranks
    llm = LLM(args.model, attention_ranks=args.attention_ranks, expert_ranks=expert_ranks, **engine_options(args))
    if args.prompt:
        outs = llm.generate(args.prompt, SamplingParams(max_tokens=args.max_tokens))
        for o in outs:
            _emit({"id": o.request_id, "token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason})
        llm.shutdown()
        return 0
    rt = llm.runtime
    if rt.leader is None:
        rt.follow()
    else:
        state = {"lock": threading.Lock(), "open": {}, "eof": False}
        threading.Thread(target=_read_requests, args=(llm, args.max_tokens, state), daemon=True).start()
        threading.Thread(target=_write_outputs, args=(llm, state), daemon=True).start()
        rt.leader.serve(llm.inbox, llm.outbox, llm.config.heartbeat_s)
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
