"""torchrun entry point: `torchrun --nproc-per-node W launch/serve.py [--model DIR] --attention-ranks A`.

Without --model it serves the shipped Shakespeare MoE (models/shakespeare-moe).

Every rank joins the runtime. Attention rank 0 also starts the OpenAI-compatible HTTP server (FastAPI on
uvicorn) in a process of its own (launch/frontend/process.py), so JSON and detokenising never stall the step
loop, on --host/--port, 127.0.0.1:8000 by default; /health answers 503 until every rank has loaded its
weights. SIGTERM or SIGINT on rank 0 shuts every rank down (open requests get a 503); the other ranks leave
on the leader's shutdown header. A rank that fails makes the job exit non-zero.

Separate pool launches: `torchrun ... serve.py --role attention --pool-addr HOST:PORT --expert-ranks E` starts
the attention pool (its rank 0 leads, serves the job's store on PORT and HTTP) and waits until E expert ranks
have registered; `torchrun ... serve.py --role expert --pool-addr HOST:PORT` starts expert ranks (any number
of such launches, one per node or one for several). The job forms once all have registered; ranks launched
later against the same address join the running job, and POST /admin/drain {"ranks": [...]} removes ranks.

Other modes: with --prompt it answers those prompts and exits; with --stdin attention rank 0 reads JSON
lines ({"prompt": str | [ids], plus SamplingParams fields}) and writes one JSON line per finished request
({"id", "token_ids", "text", "finish_reason"} or {"error"}); EOF shuts every rank down.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time

if __package__ in (None, ""):  # run as a script by torchrun: make the project importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attention_nodes.sampling_params import SamplingParams
from launch.cli import add_engine_args, engine_options
from launch.frontend.answer import check_parsers, require_tokens
from launch.frontend.http_options import add_http_args, http_options
from launch.frontend.reasoning import PARSERS as REASONING_PARSERS
from launch.frontend.response_store import DEFAULT_CAPACITY as RESPONSES_STORE
from launch.frontend.tool_parsers import HARMONY
from launch.frontend.tool_parsers import NAMES as TOOL_PARSERS
from launch.llm import LLM
from launch.procs import leave_process
from launch.runtime import follow, lead
from models.checkpoint import load_tokenizer

SHUTDOWN_GRACE_S = 10.0   # after SIGTERM a rank that has not left by then exits non-zero


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def _say(text: str) -> None:
    print(f"afserve: {text}", file=sys.stderr, flush=True)


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
        for rid, toks, finish, *_ in msg[1]:
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


def _exit_later(seconds: float, why: str) -> None:
    """A bounded shutdown: if this process is still here after `seconds`, leave with status 1."""
    def run():
        time.sleep(seconds)
        _say(f"{why}: still running {seconds:.0f} s later, exiting with status 1")
        os._exit(1)
    threading.Thread(target=run, daemon=True).start()


def _leads(args) -> bool:
    """This process is attention rank 0, the leader: it serves HTTP (a single launch's rank 0, or the leader of
    separate pool launches)."""
    if args.role is None:
        return int(os.environ.get("RANK", "0")) == 0
    from launch.runtime.startup import leads_pool
    return leads_pool(args.role, args.leader_host)


def _serve_http(args, llm_kwargs: dict, model_name: str, http: tuple[dict, dict]) -> int:
    rank = int(os.environ.get("RANK", "0"))
    front = None
    if _leads(args):   # the HTTP front in its own process, listening before the weights load
        from launch.frontend.process import FrontProcess
        front = FrontProcess(args.host, args.port, args.api_key, model_name, args.model, llm_kwargs, {
            "tool_parser": args.tool_call_parser if args.enable_auto_tool_choice else None,
            "reasoning_parser": args.reasoning_parser, "responses_store": args.responses_store,
            "prompt_tokens_details": args.enable_prompt_tokens_details, "stream_interval": args.stream_interval},
            http)
    llm = LLM(args.model, serving=True, **llm_kwargs)
    rt = llm.runtime
    _say(f"rank {rank} ({rt.topo.role}) pid {os.getpid()} ready")
    if rt.leader is None:
        def on_term(signum, _frame):   # the leader decides; leave on its shutdown header
            _exit_later(SHUTDOWN_GRACE_S, f"rank {rank} got signal {signum}")
        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        try:
            follow(rt)
        except Exception as e:
            _say(f"rank {rank} failed: {type(e).__name__}: {e}")
            os._exit(1)
        rt.close()
        if rt.left:
            leave_process(0)
        return 0

    from dataclasses import asdict

    front.attach(asdict(rt.info))
    front.watch()
    _say(f"HTTP front pid {front.proc.pid}")

    def on_term(signum, _frame):
        _say(f"rank 0 got signal {signum}: shutting down every rank")
        _exit_later(SHUTDOWN_GRACE_S, "shutdown")
        front.inbox.put(("shutdown",))
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    _say(f"serving {model_name!r} on http{'s' if args.ssl_certfile else ''}://{args.host}:{args.port}")
    try:
        lead(rt, front.inbox, front.outbox, llm.config.heartbeat_s)
    except Exception as e:
        _say(f"the engine failed: {type(e).__name__}: {e}")
        os._exit(1)
    front.stop("the server is shutting down")
    rt.close()
    if front.lost:
        _say(f"the HTTP front exited (code {front.proc.exitcode}): the job shut down without it")
        return 1
    _say("shut down cleanly")
    return 0


def main(argv=None) -> int:
    p = add_engine_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or Anthropic's 'x-api-key: "
                                                    "KEY') on /v1/*")
    p.add_argument("--served-model-name", default=None, help="the model id clients pass (default: the directory "
                                                              "name of --model)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice 'auto' (the default when a chat request has tools): the model decides "
                        "whether to call a tool and --tool-call-parser finds the calls in its text (vLLM's flag)")
    p.add_argument("--tool-call-parser", choices=TOOL_PARSERS, default=None,
                   help="how tool_choice 'auto' finds calls in the output: hermes (<tool_call>{json}</tool_call>, "
                        "Hermes and Qwen models), deepseek_v3 (DeepSeek-V3 and R1), glm45 (GLM-4.5 to 4.7's "
                        "<arg_key>/<arg_value> calls), mistral ([TOOL_CALLS], Mistral and Mixtral) or openai "
                        "(GPT-OSS's harmony messages); needed by --enable-auto-tool-choice")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split a thinking model's reasoning (up to </think>) from its answer in chat responses: "
                        "deepseek_r1, qwen3, glm45, or openai_gptoss (GPT-OSS's analysis messages; vLLM's flag)")
    p.add_argument("--responses-store", type=int, default=RESPONSES_STORE, metavar="N",
                   help=f"keep the last N /v1/responses responses created with store true, for GET "
                        f"/v1/responses/ID and previous_response_id, in the HTTP front's memory; 0 keeps none "
                        f"(default {RESPONSES_STORE})")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens, the prompt tokens found in the prefix "
                        "cache, in chat and completion answers (and Anthropic's cache_read_input_tokens; vLLM's "
                        "flag; /v1/responses always reports them)")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="a streamed answer's chunks carry at least N new tokens (the first token and the last chunk "
                        "go at once; vLLM's flag): fewer, larger chunks cost the front and the client less per "
                        "token (default 1: every token)")
    add_http_args(p)
    p.add_argument("--prompt", action="append", help="answer this prompt (repeatable) and exit")
    p.add_argument("--stdin", action="store_true", help="JSON lines on stdin/stdout instead of HTTP")
    p.add_argument("--max-tokens", type=int, default=32, help="default max_tokens of --prompt and --stdin")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 0))
    if not world:
        p.error("serve.py runs under torchrun (WORLD_SIZE is not set); for a local run use `make demo`")
    if args.api_key == "":
        p.error("--api-key is empty: pass a key, or leave the flag out to serve without one")
    if args.stream_interval < 1:
        p.error(f"--stream-interval {args.stream_interval} is invalid: pass a number of tokens >= 1")
    try:
        http = http_options(args)      # checked once (its files read once), passed to the front
    except ValueError as e:
        p.error(str(e))
    if args.responses_store < 0:
        p.error(f"--responses-store {args.responses_store} is invalid: pass a count >= 0 (0 keeps none)")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        p.error(f"--enable-auto-tool-choice needs --tool-call-parser (one of {', '.join(TOOL_PARSERS)})")
    try:
        check_parsers(args.tool_call_parser, args.reasoning_parser)
    except ValueError as e:
        p.error(str(e))
    if (args.role is None) != (args.pool_addr is None):
        p.error("--role and --pool-addr go together: separate pool launches need both, a single launch neither")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.role is None:
        attention_ranks = args.attention_ranks
        expert_ranks = args.expert_ranks if args.expert_ranks is not None else world - args.attention_ranks
    else:   # the leader forms the job from this many of each; other ranks take the leader's settings
        attention_ranks = max(world, args.attention_ranks) if args.role == "attention" else 1
        expert_ranks = args.expert_ranks if args.expert_ranks is not None else 1
    llm_kwargs = dict(attention_ranks=attention_ranks, expert_ranks=expert_ranks, **engine_options(args))
    if not (args.prompt or args.stdin):
        if (args.reasoning_parser or args.tool_call_parser == HARMONY) and _leads(args):   # parsers that read tokens
            try:
                require_tokens(load_tokenizer(args.model), args.tool_call_parser, args.reasoning_parser, args.model)
            except ValueError as e:      # no such tokens, or a tokenizer that does not load
                p.error(str(e))
        name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
        return _serve_http(args, llm_kwargs, name, http)
    llm = LLM(args.model, serving=not args.prompt, **llm_kwargs)   # --prompt: every rank calls generate()
    if args.prompt:
        outs = llm.generate(args.prompt, SamplingParams(max_tokens=args.max_tokens))
        for o in outs:
            _emit({"id": o.request_id, "token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason})
        llm.shutdown()
        return 0
    rt = llm.runtime
    if rt.leader is None:
        follow(rt)
    else:
        state = {"lock": threading.Lock(), "open": {}, "eof": False}
        threading.Thread(target=_read_requests, args=(llm, args.max_tokens, state), daemon=True).start()
        threading.Thread(target=_write_outputs, args=(llm, state), daemon=True).start()
        lead(rt, llm.inbox, llm.outbox, llm.config.heartbeat_s)
    rt.close()
    if rt.left:
        leave_process(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
