"""The Python API: `LLM(model=DIR, attention_ranks=A, expert_ranks=E, **options).generate(prompts, params)`."""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import time
from dataclasses import asdict, replace

from attention_nodes.sampling_params import SamplingParams
from models.checkpoint import Checkpoint, load_tokenizer

from .admission import Admission, sampling_defaults
from .config import EngineConfig, option_default
from .joiners import JoinerStarter
from .procs import (Answers, LocalOutbox, Outbox, free_port, kill_all, rank_context, spawn_is_fresh, start_joiner,
                    start_rank)
from .runtime.planning import check_autoscale, check_scale
from .samples import Abandoned, Gathering, RequestOutput, split_rows

logger = logging.getLogger("afserve")


class LLM:
    """Attention and expert ranks serving one checkpoint. From a plain process it spawns attention_ranks +
    expert_ranks local ranks; under torchrun (RANK and WORLD_SIZE set) it joins the job: every rank constructs it and
    calls generate() together, and rank 0 gets the outputs (other ranks get []). serving: under torchrun, the leader
    leads until shutdown and the others follow (serve.py); autoscale's joiners start beside it (launch/joiners.py)."""

    def __init__(self, model: str, attention_ranks: int = option_default("attention_ranks"),
                 expert_ranks: int = option_default("expert_ranks"), *, serving: bool = False, **options):
        torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        self._front(model, attention_ranks, expert_ranks, options, torchrun and not serving)
        if torchrun:
            self._join()
        else:
            self._spawn()

    def _front(self, model: str, attention_ranks: int, expert_ranks: int, options: dict,
               lockstep: bool = False) -> None:
        """Config, spec, tokenizer, ids, rank bookkeeping: a front's (process.py's too); lockstep: no autoscale."""
        self.config = EngineConfig.from_options(model, attention_ranks, expert_ranks, **options)
        self.spec = Checkpoint(self.config.model, mtp=self.config.scheduler.uses_mtp,     # fails fast if it is bad
                               generation_config=self.config.generation_config).spec
        check_autoscale(self.config.parallel, lockstep)
        if expert_ranks > self.spec.num_experts:
            raise ValueError(f"expert_ranks={expert_ranks} exceeds the model's {self.spec.num_experts} experts; "
                             f"use at most {self.spec.num_experts}")
        self.tokenizer = load_tokenizer(self.config.model, self.config.chat_template)
        self._ids, self._closed, self._procs, self._members = itertools.count(), False, [], []   # members: ids
        self._serving = False      # past start-up: a lost rank other than the leader is survivable
        self.lost_ranks: list[int] = []   # spawned ranks (first ranks) that died while serving
        self.retired_ranks: list[int] = []   # and those a scale-in retired (they exit on their own)
        self._abandoned = Abandoned()       # requests of a generate() that raised: their progress is dropped
        self._answers = Answers()           # stats() and the like's answers that generate() read in another thread
        self.runtime = None

    # ----- start-up -------------------------------------------------------------------------------------
    def _spawn(self) -> None:
        self._ctx = ctx = rank_context()
        world = self.config.parallel.world_size
        self._port = port = free_port()
        self._inbox, self._outbox, self._status = ctx.Queue(), Outbox(ctx), ctx.Queue()
        self._slots, self._members = list(range(world)), list(range(world))   # each process's local rank, member id
        for rank in range(world):
            self._procs.append(start_rank(ctx, rank, port, self.config, (self._inbox, self._outbox, self._status)))
        ready: dict[int, dict] = {}
        deadline = time.monotonic() + self.config.startup_timeout_s
        while len(ready) < world:
            msg = self._poll(self._status, deadline, "start-up")
            if msg[0] == "error":
                self._kill()
                raise RuntimeError(f"start-up failed on {msg[2]}")
            ready[msg[1]] = msg[2]
        self._set_limits(ready[0])
        self._serving = True

    def _join(self) -> None:
        from .runtime import Runtime
        self.runtime = rt = Runtime(self.config)
        if rt.leader is not None and self.config.parallel.autoscale:
            rt.launcher = JoinerStarter.beside_leader(self.config, rt.store)
        self._inbox, self._outbox = queue.Queue(), LocalOutbox()
        self._set_limits(asdict(self.runtime.info))

    def _lead(self, stop_when_idle: bool) -> str:
        """Under torchrun, on the leader: run the step loop (launch/runtime/step_protocol.py) on this thread."""
        from .runtime import lead
        return lead(self.runtime, self._inbox, self._outbox, self.config.heartbeat_s, stop_when_idle)

    def _follow(self) -> str:
        """Under torchrun, on every other rank: obey the leader's step headers until it pauses or shuts down."""
        from .runtime import follow
        return follow(self.runtime)

    def _set_limits(self, info: dict) -> None:
        self.max_model_len = info["max_model_len"]
        self.kv_capacity_tokens = info["num_kv_blocks"] * info["block_size"]
        self.admission = Admission(self.tokenizer, self.spec.vocab_size, self.config.scheduler.max_num_seqs,
                                   self.max_model_len, self.kv_capacity_tokens, self.spec.eos_token_ids,
                                   self.config.scheduler.scheduling_policy)

    @property
    def is_leader(self) -> bool:
        return self.runtime is None or self.runtime.leader is not None

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ----- requests -------------------------------------------------------------------------------------
    def submit(self, prompt, params: SamplingParams) -> str:
        """Validate one request and queue it for the leader; returns its request id. Progress arrives on `outbox`
        as ("out", [[request_id, [new ids], finish_reason or None, new prompt logprobs, new token logprobs, cached
        prompt tokens], ...]): prompt logprobs are (entry, rank) per new prompt position (a list after msgpack; None
        for the first), token logprobs an entry per new token, each None when not asked for; cached prompt tokens as
        RequestOutput.num_cached_tokens (None in an abort's row)."""
        given = self.admission.prompt_input(prompt)
        ids = given.ids
        params = params if given.cache_salt is None else replace(params, cache_salt=given.cache_salt)
        self.admission.check(ids, params)
        if params.stop:
            raise ValueError(f"SamplingParams.stop={params.stop!r}: submit's caller reads token ids, and stop strings "
                             f"are applied to text by generate() and the server; use stop_token_ids, or generate()")
        return self.enqueue(ids, params)

    def enqueue(self, ids: list[int], params: SamplingParams, stream: bool = True) -> str:
        """Queue token ids already checked by `admission`; returns the request id. stream=False:
        the leader may hold its progress back to send it in fewer messages (attention_nodes/leader.py)."""
        return self.enqueue_all([ids], [params], stream)[0]

    def enqueue_all(self, ids: list[list[int]], params: list[SamplingParams], stream: bool = True) -> list[str]:
        """enqueue for several requests in one inbox message: the leader takes them all before its next step."""
        # checked again here, in the caller's process: a field changed after construction would fail on a rank
        checked = [SamplingParams.from_dict(p.to_dict()) for p in params]
        for p in checked:
            self.admission.check_structured(p)      # (cached when `admission` compiled it already)
        checked = [p.to_dict() for p in checked]
        reqs = [{"id": f"req-{next(self._ids)}", "prompt": i, "params": d, "stream": stream}
                for i, d in zip(ids, checked)]
        self._inbox.put(("add", *reqs))
        return [r["id"] for r in reqs]

    @property
    def inbox(self):
        """The leader's command queue (see attention_nodes/leader.py for the commands)."""
        return self._inbox

    @property
    def outbox(self):
        """Progress from the leader, as `submit` describes it."""
        return self._outbox

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, *, priority: int | list[int] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, a vLLM prompt dict ({"prompt": text} or {"prompt_token_ids":
        ids}, each with an optional "cache_salt"), or a list of them. Returns one output per prompt, in order.
        priority (vLLM's): one for every prompt or one per prompt, set as their SamplingParams.priority (needs
        scheduling_policy "priority" unless 0). use_tqdm: vLLM's, taken and ignored (no progress bar)."""
        if self._closed:
            raise RuntimeError("this LLM has been shut down; create a new one")
        # none given: the checkpoint's generation_config.json defaults, as vLLM's LLM.generate (else greedy)
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        inputs = self.admission.prompt_inputs(prompts)
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(inputs)
        if len(params) != len(inputs):
            raise ValueError(f"{len(params)} sampling params for {len(inputs)} prompts; pass one or one per prompt")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("sampling_params must be SamplingParams instances")
        if priority is not None:
            ranks = list(priority) if isinstance(priority, (list, tuple)) else [priority] * len(inputs)
            if len(ranks) != len(inputs):
                raise ValueError(f"{len(ranks)} priorities for {len(inputs)} prompts; pass one or one per prompt")
            params = [replace(p, priority=r) for p, r in zip(params, ranks)]
        params = [p if i.cache_salt is None else replace(p, cache_salt=i.cache_salt) for i, p in zip(inputs, params)]
        ids = [i.ids for i in inputs]
        for i, p in zip(ids, params):
            self.admission.check(i, p)
        if not self.is_leader:
            self._follow()
            return []
        rids = self.enqueue_all(ids, params, stream=False)   # one message: the leader admits them together
        if self.runtime is not None:
            self._lead(stop_when_idle=True)
        got = Gathering(rids, params, self.tokenizer, self.spec.eos_token_ids)
        passed = []     # what is not this call's (a submit caller's progress, an answer): put back after
        try:
            while got.num_open or got.stopping:     # (a stopped sample's final row: about a step after its abort)
                msg = self._poll(self._outbox, None, "generate")
                if self._answers.keep(msg):      # for a stats(), comm_stats() or scale() in another thread
                    continue
                own, other = split_rows(msg, got.samples, got.grouped, self._abandoned)
                passed += [other] if other is not None else []
                for row in own:
                    if (stopped := got.take(row)) is not None and self.runtime is None:
                        self._inbox.put(("abort", stopped))       # a stop string ended it (torchrun: ran already)
        finally:
            # raised: the rows still to come are dropped, and what still runs is aborted
            for rid, left in got.unfinished().items():
                self._abandoned.add(rid, left)
                if got.num_open:
                    self._inbox.put(("abort", rid))
            self._outbox.put_back(passed)
        return got.outputs(ids, self.decode, [i.text for i in inputs])

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             use_tqdm: bool = False, chat_template: str | None = None, tools: list[dict] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (OpenAI-format message dicts) or a list of them through the chat
        template (this call's chat_template, a template or its file's path; else the engine's; tools and
        chat_template_kwargs reach it), then generate (launch/offline_chat.py)."""
        from .offline_chat import chat_prompts
        return self.generate(chat_prompts(self, messages, tools, add_generation_prompt, continue_final_message,
                                          chat_template_kwargs, chat_template), sampling_params)

    def beam_search(self, prompts, params) -> list:
        """vLLM's LLM.beam_search (launch/beam_search.py): one BeamSearchOutput per prompt, its best
        params.beam_width beams (BeamSearchParams), best first."""
        from .beam_search import beam_search
        return beam_search(self, prompts, params)

    def stats(self) -> dict:
        """Engine counters from the leader: steps, preemptions, prefill chunks, queue sizes, free KV blocks."""
        if self.runtime is not None:
            return self.runtime.leader.stats() if self.runtime.leader is not None else {}
        self._inbox.put(("stats",))
        return self._reply("stats")

    def comm_stats(self, events: bool = False) -> dict:
        """Per-layer data-plane statistics of every rank plus the expert-rank load balance; the schema is in
        docs/python_api.md. events: also each rank's most recent dispatch/combine calls (a timeline). Under torchrun
        every rank must call it (like generate); non-leaders get {}."""
        if not self.is_leader:
            self._follow()
            return {}
        self._inbox.put(("comm_stats", events))
        if self.runtime is not None:
            self._lead(stop_when_idle=True)
        return self._reply("comm_stats")

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's: every attention rank forgets its prefix cache (device blocks and host tier) between steps, so no
        later request finds anything cached before it. Running requests keep their blocks (here they never make it
        fail, so reset_running_requests changes nothing). Under torchrun every rank must call it (like
        generate); non-leaders get False."""
        if reset_connector:
            raise ValueError("reset_connector=True: this engine has no KV connector; leave it False")
        if not self.is_leader:
            self._follow()
            return False
        self._inbox.put(("reset_prefix_cache",))
        if self.runtime is not None:
            self._lead(stop_when_idle=True)
        return self._reply("reset_prefix_cache")

    def get_tokenizer(self):
        """vLLM's: the checkpoint's tokenizer (None when its directory has none)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what `generate` uses without SamplingParams (the checkpoint's generation_config.json defaults
        under the default `generation_config`, else SamplingParams())."""
        return SamplingParams(**dict(sampling_defaults(self.config)))

    def scale(self, attention_ranks: int | None = None, expert_ranks: int | None = None,
              retire: list[int] | None = None, prefill_ranks: int | None = None,
              decode_ranks: int | None = None) -> dict:
        """Resize the pools between steps. Growing a pool spawns ranks that join the job (an expert rank takes
        its experts from peers or the checkpoint); shrinking one retires its last ranks (they exit with status
        0), and `retire` names ranks to remove (any but rank 0). A PD job sizes its two attention pools with
        prefill_ranks and decode_ranks instead of attention_ranks. EPLB re-places the experts over the new expert
        pool; a retired attention rank hands its requests over to the others with their KV blocks.
        Returns the membership change's record (as in stats()["membership_changes"]). Requests in flight keep
        going; call it between generate() calls (it waits on the same queue). Spawned ranks only."""
        self.request_scale(attention_ranks, expert_ranks, retire, prefill_ranks, decode_ranks)
        return self.take_scale_result(self._reply("scale", self.config.startup_timeout_s))

    def request_scale(self, attention_ranks: int | None = None, expert_ranks: int | None = None,
                      retire: list[int] | None = None, prefill_ranks: int | None = None,
                      decode_ranks: int | None = None) -> None:
        """Ask for scale(...) without waiting, spawning the ranks that will join: the leader answers ("scale",
        record) on outbox between steps (reading the outbox through _poll spawns the ranks it asks for); pass that
        record to take_scale_result."""
        if self.runtime is not None:
            raise ValueError("scale() needs ranks spawned by LLM; under torchrun launch more ranks against the "
                             "job's --pool-addr, or drain ranks through the server's /admin/drain")
        request = {"attention_ranks": attention_ranks, "expert_ranks": expert_ranks, "prefill_ranks": prefill_ranks,
                   "decode_ranks": decode_ranks, "retire": list(retire or [])}
        check_scale(request, self.spec.num_experts, self.config.parallel.prefill_ranks > 0)
        # the leader, which knows the pools as they are now, answers ("spawn", roles) for the ranks to start
        self._inbox.put(("scale", {**request, "spawn": True}))

    def _spawn_joiner(self, role: str, member: int) -> None:
        """A rank that joins the running job as member `member` (the leader drew it from the job's counter), in
        the lowest local slot (GPU) no live rank holds."""
        start_joiner(self._ctx, member, role, self._port, f"127.0.0.1:{self._port}", self.config,
                     (self._inbox, self._outbox, self._status), self._slots, self._procs,
                     self.config.parallel.world_size)
        self._members.append(member)

    def take_scale_result(self, result: dict, autoscaled: bool = False) -> dict:
        """The leader's answer to a scale request: ValueError for a refused one; retired ranks are noted. autoscaled:
        the record of an autoscaler's move, which nobody waits for (a refused one retired nothing, raises nothing)."""
        if "error" in result and not autoscaled:
            raise ValueError(result["error"])
        self.retired_ranks += result.get("lost_members", [])
        return result

    def _reply(self, kind: str, timeout_s: float = 60) -> dict:
        """The leader's answer to a ("stats",), ("comm_stats",), ("reset_prefix_cache",) or ("scale", request)
        command; the progress read on the way goes back to the outbox's front, for its reader (`submit`)."""
        deadline = time.monotonic() + timeout_s
        passed = []
        try:
            while True:
                msg = self._poll(self._outbox, deadline, kind, lambda: self._answers.take(kind))
                if msg[0] == kind:
                    return msg[1]
                # another call's answer: kept for it; progress (less the abandoned requests'): put back
                if not self._answers.keep(msg) and (rest := split_rows(msg, (), (), self._abandoned)[1]) is not None:
                    passed.append(rest)
        finally:
            self._outbox.put_back(passed)

    def decode(self, ids: list[int]) -> str | None:
        """Token ids -> text with the checkpoint's tokenizer (None without one)."""
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def _poll(self, q, deadline: float | None, what: str, ready=None):
        """Wait on q while watching the ranks: a dead rank raises within ~0.2 s and takes the others down. The
        leader's ("spawn", roles) on the outbox (a scale request's joiners) starts those ranks here, and its
        ("autoscaled", record) is taken here. ready: returns what another thread read for this one, or None."""
        while True:
            if ready is not None and (got := ready()) is not None:
                return got
            try:
                msg = q.get(timeout=0.2)
                if msg[0] not in ("spawn", "autoscaled") or q is not self._outbox:
                    return msg
                fresh = msg[0] == "spawn" and spawn_is_fresh(msg[2], self.config.startup_timeout_s)
                for role, member in zip(msg[1], msg[3]) if fresh else ():   # a stale one's: skipped
                    self._spawn_joiner(role, member)
                if msg[0] == "autoscaled":
                    self.take_scale_result(msg[1], autoscaled=True)
                continue
            except queue.Empty:
                pass
            self.check_alive(what)
            if deadline is not None and time.monotonic() > deadline:
                self._kill()
                raise RuntimeError(f"{what} timed out; all ranks were stopped")

    def check_alive(self, what: str = "serving") -> None:
        """RuntimeError naming the rank if the leader (rank 0), or any rank during start-up, has died (the others
        are then stopped too). Once serving, the leader re-forms the job around any other lost rank
        (launch/runtime/step_protocol.py), so those are only logged and listed in lost_ranks. Ranks under torchrun are
        watched by torchrun itself."""
        # A rank that a scale-in retired exits with code 0, possibly before its scale result reaches this
        # process (take_scale_result then lists it): a clean exit while serving is a retirement, not a loss.
        dead = [(i, p.exitcode) for i, p in zip(self._members, self._procs) if not p.is_alive()
                and i not in self.retired_ranks and not (self._serving and i != 0 and p.exitcode == 0)]
        if not dead:
            return
        if self._serving and dead[0][0] != 0:
            for i, code in dead:
                if i not in self.lost_ranks:
                    self.lost_ranks.append(i)
                    logger.warning("rank %d died (exit code %s) during %s; the leader re-forms the job without it",
                                   i, code, what)
            return
        detail = ""
        try:
            while True:
                msg = self._status.get_nowait()
                if msg[0] == "error":
                    detail = f": {msg[2]}"
                    break
        except (queue.Empty, AttributeError):
            pass
        self._kill()
        self._closed = True
        raise RuntimeError(f"rank {dead[0][0]} died (exit code {dead[0][1]}) during {what}; "
                           f"all ranks were stopped{detail}")

    # ----- shutdown -------------------------------------------------------------------------------------
    def _kill(self) -> None:
        kill_all(self._procs)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.runtime is not None:
            if self.runtime.leader is not None:
                self._inbox.put(("shutdown",))
                self._lead(stop_when_idle=False)
            else:
                self._follow()
            self.runtime.close()
            return
        self._inbox.put(("shutdown",))
        for p in self._procs:
            p.join(timeout=10)
        self._kill()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self._procs and not self._closed:
                self._kill()
