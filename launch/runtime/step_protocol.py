"""The step protocol: what the leader and every other rank do each step, and how the job re-forms when its
membership changes. The one place that knows the header kinds.

Each step the leader (attention rank 0) broadcasts a `StepHeader` (comm/control.py) on the control group:
- STEP: every attention rank admits its new requests, applies its aborts and runs one forward (joining each
  MoE layer's dispatch and combine), samples, and sends its `StepReport` back; expert ranks serve the step's
  dispatches. IDLE: a heartbeat, nothing to run. PAUSE: a generate() call under torchrun is done.
  SHUTDOWN: leave.
- REBALANCE, COLLECT_STATS, COLLECT_EVENTS: every rank (the leader too) joins the runtime's collective for
  it, between steps (live re-placement, stats).
- RESHAPE: a planned membership change (a scale request, or ranks joining): the leader has published the
  next generation's plan; a retiring attention rank hands its requests and KV blocks to the rank the plan
  names, every rank leaves the current generation together, and the members of the next one form it (the
  retired ones exit).

Membership generations. The job's process groups belong to a generation g: they are formed from the keys
under "afserve/g{g}/" of one TCP store, hosted by the leader's process. When a rank dies, the survivors'
next exchange with it fails (gloo raises from its TCP pairs; the shm transport sees the process gone), and
each survivor leaves generation g: it wakes its shm peers, aborts its process groups (which in turn breaks
the exchanges of ranks still waiting on it, so every survivor leaves within moments), and checks in under
"afserve/g{g}/alive/{member}". The leader waits until every member of g has checked in or is known dead:
its process is gone (members on the leader's host) or it has stopped heartbeating ("afserve/hb/{member}",
bumped by a thread of every rank). It then makes the plan of generation g + 1
(members, roles, the new expert placement and the weight copies that realise it: balancer/replan.py) and
publishes it; every member of g + 1 forms the new groups and adopts the placement, and the leader re-sends
the header of the step that was in flight. An attention rank that had finished that step re-sends its
report; one that had not re-runs the same scheduled batch: nothing of a step is committed (KV positions
advanced, tokens sampled, generator states drawn) until its forward has passed every exchange, so a step
that failed half way leaves no trace. The leader's own death ends the job, as before: it holds the store
and the request state.

Joining. A rank that is not a member (spawned by LLM.scale, or launched against the job's pool address:
serve.py --role ... --pool-addr) reads the leader's settings from "afserve/config", loads what its role holds
before it has a place, and registers on the store queue "afserve/joins". Between steps the leader admits
registered ranks (those a scale request waits for, else any that came): it plans the next generation with
them (a joined expert rank takes its experts from peers or the checkpoint), publishes the plan, sets
"afserve/admit/{member}" to its number, and runs RESHAPE; the joiners form the new generation with the
others. Separate pool launches start the same way: the leader, alone, admits the first ranks that register
as generation 0.
"""
from __future__ import annotations

import gc
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from comm.control import StepHeader, StepReport
from comm.failures import is_peer_failure
from comm.shm import host_identity, process_alive

STEP, IDLE, PAUSE, SHUTDOWN = "step", "idle", "pause", "shutdown"
# every rank joins a collective between steps; COLLECT_EVENTS: the stats plus each rank's recent calls
REBALANCE, COLLECT_STATS, COLLECT_EVENTS = "rebalance", "collect_stats", "collect_events"
RESHAPE = "reshape"   # between steps: every rank moves to the next generation, whose plan is in the store
COLLECTIVES = (REBALANCE, COLLECT_STATS, COLLECT_EVENTS)

PREFIX = "afserve"
JOINS = f"{PREFIX}/joins"    # the store queue that ranks wanting to join register on
HEARTBEAT_INTERVAL_S = 0.2
JOIN_POLL_S = 0.2    # how often the leader looks for ranks registering to join

logger = logging.getLogger("afserve")


class MembershipError(RuntimeError):
    """The job cannot re-form without the ranks it lost (the message says what is missing)."""


def run_attention_step(worker, header: StepHeader) -> StepReport:
    """What every attention rank does with a STEP header. Re-sent headers (the same step, after the job
    re-formed) are idempotent: a finished step re-sends its report, an unfinished one re-runs its batch."""
    if header.step == worker.done_step:
        return worker.last_report
    if header.step != worker.started_step:
        worker.started_step = header.step
        worker.add_requests(header.requests_for(worker.rank))
        worker.abort(header.aborts_for(worker.rank))
    report = worker.step(header.capacity)
    worker.done_step, worker.last_report = header.step, report
    return report


# ----- the loops ------------------------------------------------------------------------------------------

def lead(rt, inbox, outbox, heartbeat_s: float, stop_when_idle: bool = False) -> str:
    """The leader's loop (rt: the Runtime of attention rank 0): run steps until shutdown (returns SHUTDOWN) or,
    with stop_when_idle, until all work is done (broadcasts PAUSE, returns PAUSE). Idle: blocks on the inbox,
    heartbeating every heartbeat_s. A lost rank re-forms the job and the step in flight is re-sent."""
    leader = rt.leader
    leader.outbox = outbox
    scales: list[dict] = []      # scale requests waiting for their joiners
    while True:
        aborts: dict[str, list[str]] = {}
        alive = True
        try:
            # Block (heartbeating) only when idle and serving; a generate() call ends as soon as it is done.
            # Scale requests or ranks waiting to join: poll.
            idle_wait = not leader.has_work and not stop_when_idle
            wait_s = JOIN_POLL_S if scales or rt.membership is not None and rt.membership.waiting else heartbeat_s
            cmd = inbox.get(timeout=wait_s) if idle_wait else inbox.get_nowait()
            alive = leader.handle(cmd, aborts, outbox)
            while alive:
                alive = leader.handle(inbox.get_nowait(), aborts, outbox)
        except queue.Empty:
            pass
        scales += [dict(r, deadline=time.monotonic() + rt.config.startup_timeout_s) for r in leader.take_scales()]
        if rt.membership is not None and _membership_changes(rt, scales, outbox) and aborts:
            ids = [i for v in aborts.values() for i in v]    # ranks were renumbered: route them again
            aborts.clear()
            for i in ids:
                leader.handle(("abort", i), aborts, outbox)
        for events in leader.take_queries():
            kind = COLLECT_EVENTS if events else COLLECT_STATS
            outbox.put(("comm_stats", _guarded(rt, lambda k=kind: collective(rt, k))))
        if not alive:
            rt.control.broadcast_header(StepHeader.empty(SHUTDOWN, leader.step_id))
            return SHUTDOWN
        if not leader.has_work and not aborts:
            kind = PAUSE if stop_when_idle else IDLE
            _guarded(rt, lambda k=kind: rt.control.broadcast_header(StepHeader.empty(k, leader.step_id)))
            if stop_when_idle:
                return PAUSE
            continue
        leader.inflight = StepHeader(STEP, *leader.next_step(aborts))
        reports = _guarded(rt, lambda: _step(rt))
        leader.collect(reports, outbox)
        if leader.rebalance_interval and leader.step_id % leader.rebalance_interval == 0:
            _guarded(rt, lambda: collective(rt, REBALANCE))


def _membership_changes(rt, scales: list[dict], outbox) -> bool:
    """Between steps: carry out the scale requests whose joiners are here (answering ("scale", record) on the
    outbox), in order; with none waiting, admit any rank that registered to join (a pool launched against the
    job's pool address grows it). Returns whether the job changed."""
    membership, gen = rt.membership, rt.generation
    while scales:
        record = _guarded(rt, lambda: membership.scale_as_leader(scales[0]))
        if record is None:
            return rt.generation != gen
        scales.pop(0)
        outbox.put(("scale", record))
    now = time.monotonic()
    if now - membership.last_poll >= JOIN_POLL_S:
        membership.last_poll = now
        joiners = membership.joiners()
        if joiners:
            record = _guarded(rt, lambda: membership.change_as_leader([], joiners, "join"))
            if "error" in record:   # tell them, so they exit instead of waiting
                logger.error("ranks %s cannot join: %s", [m for m, _ in joiners], record["error"])
                membership._admit([m for m, _ in joiners], record["error"])
                membership.waiting = []
    return rt.generation != gen


def _step(rt) -> list[StepReport]:
    """The step in flight (re-sent as the leader rewrote it when the job re-formed)."""
    header = rt.leader.inflight
    rt.control.broadcast_header(header)
    return rt.control.gather_reports(run_attention_step(rt.worker, header))


def collective(rt, kind: str):
    """Leader, between steps: tell every rank to join the collective for kind, and run it here too."""
    rt.control.broadcast_header(StepHeader.empty(kind, rt.leader.step_id))
    return rt.collective_hooks()[kind]()


def _guarded(rt, action):
    """Run one exchange of the leader's; when a peer is lost, re-form the job and run it again (a step's
    header is re-sent as it was, so ranks that had finished it re-send their reports)."""
    for _ in range(rt.config.parallel.world_size + 1):   # each re-forming loses at least one rank
        result, cause = _attempt(rt, action)
        if cause is None:
            return result
        rt.membership.reform_as_leader(cause)   # outside the except block: see Runtime.leave_generation
    raise MembershipError("the job kept losing ranks while re-forming; giving up")


def _attempt(rt, action) -> tuple[object, str | None]:
    """Run action -> (its result, None), or (None, the first line of the lost-peer error it raised); any other
    error propagates. The caller handles the loss after this returns, outside the except block."""
    try:
        return action(), None
    except Exception as e:
        if rt.membership is None or not is_peer_failure(e):
            raise
        return None, str(e).splitlines()[0][:200]


def follow(rt) -> str:
    """Every rank but the leader: obey step headers until pause or shutdown (returns which). A lost peer
    re-forms the job (returns SHUTDOWN if this rank is not part of the new generation)."""
    while True:
        kind, cause = _attempt(rt, lambda: _obey(rt))
        if cause is not None:
            if not rt.membership.rejoin(cause):   # outside the except block: see Runtime.leave_generation
                return SHUTDOWN
        elif kind in (SHUTDOWN, PAUSE):
            return kind
        elif kind == RESHAPE and not rt.membership.reshape():
            return SHUTDOWN


def _obey(rt) -> str:
    header = rt.control.broadcast_header(None)
    if header.kind in COLLECTIVES:
        rt.collective_hooks()[header.kind]()
    elif header.kind == STEP:
        if rt.topo.is_attention:
            rt.control.gather_reports(run_attention_step(rt.worker, header))
        else:
            rt.worker.step(header.capacity)
    return header.kind


# ----- membership -----------------------------------------------------------------------------------------

@dataclass(slots=True)
class MembershipChange:
    """One re-forming of the job, as the leader saw it (timings in seconds)."""

    generation: int
    lost: list[int]                # ranks of the old generation that were lost (or retired by a scale-in)
    cause: str
    lost_members: list[int] = field(default_factory=list)   # the same as members (their first ranks)
    joined_members: list[int] = field(default_factory=list)  # members that joined
    attention_ranks: int = 0       # the new generation's pools
    expert_ranks: int = 0
    detect_s: float = 0.0          # from the first failed exchange to every member accounted for (a planned
                                   # change: from publishing the plan to every rank out of the old generation)
    groups_s: float = 0.0          # forming the new generation's process groups and data plane
    weights_s: float = 0.0         # expert weights copied between ranks and read from the checkpoint
    slots_from_peers: int = 0
    slots_from_checkpoint: int = 0
    started: float = field(default_factory=time.monotonic)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "started"}


class Heartbeat:
    """A daemon thread that bumps "afserve/hb/{member}" every HEARTBEAT_INTERVAL_S on its own store client, and
    watches for a rank wedged in its generation: once some member has left generation g to re-form the job,
    this rank's main thread has wedge_s to leave it too. A gloo point-to-point wait on a peer that has left
    (not died) can block until the collective timeout, because gloo does not always close a departed rank's
    connections (seen with two_phase); such a rank exits instead, and the job re-forms without it (or, for
    the leader, ends at once rather than after the timeout)."""

    def __init__(self, host: str, port: int, membership: Membership, timeout_s: float, wedge_s: float):
        self.key = f"{PREFIX}/hb/{membership.member}"
        self.membership, self.wedge_s = membership, wedge_s
        self.stop = threading.Event()
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        self.thread = threading.Thread(target=self._run, name=f"afserve-heartbeat-{membership.member}",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        since: tuple[int, float] | None = None       # (generation, when its re-forming was first seen)
        while not self.stop.wait(HEARTBEAT_INTERVAL_S):
            try:
                self.store.add(self.key, 1)
                gen = self.membership.rt.generation
                if self.membership.left_generation >= gen or not self.store.check([f"{PREFIX}/g{gen}/leaving"]):
                    since = None
                    continue
            except Exception:      # the store's host (the leader) is gone: nothing left to tell
                return
            if since is None or since[0] != gen:
                since = (gen, time.monotonic())
            elif time.monotonic() - since[1] > self.wedge_s:
                logger.error("member %d: still in generation %d %.0fs after a peer left it (wedged in an exchange "
                             "with a departed rank); exiting so the job re-forms without this rank",
                             self.membership.member, gen, self.wedge_s)
                os._exit(70)


class Membership:
    """This rank's side of membership changes (rt: its Runtime). `changes`: the leader's record of them."""

    def __init__(self, rt, store: dist.Store, host: str, port: int, member: int, failure_s: float):
        self.rt, self.store, self.member = rt, store, member
        self.failure_s = failure_s
        self.changes: list[MembershipChange] = []
        self.left_generation = -1       # the last generation this rank has left
        self.heartbeat = Heartbeat(host, port, self, rt.config.startup_timeout_s, max(10.0, 3 * failure_s))
        self.host = host_identity()
        self.procs: dict[int, list] = {}   # member -> [host identity, pid], as read from the store
        self.waiting: list[tuple[int, dict]] = []   # leader: registered joiners not admitted yet
        self.last_poll = 0.0
        store.set(f"{PREFIX}/proc/{member}", msgpack.packb([self.host, os.getpid()]))

    def _key(self, generation: int, name: str) -> str:
        return f"{PREFIX}/g{generation}/{name}"

    def _publish_plan(self, generation: int, plan: dict) -> None:
        self.store.set(self._key(generation, "plan"), msgpack.packb(plan))

    def _read_plan(self, generation: int) -> dict:
        return msgpack.unpackb(self.store.get(self._key(generation, "plan")), strict_map_key=False)

    def _admit(self, members, answer: str) -> None:
        """Answer ranks waiting to join: the generation that admits them, or why they are refused."""
        for m in members:
            self.store.set(f"{PREFIX}/admit/{m}", answer)

    def _leave(self, cause: str) -> int:
        """Leave the current generation: wake shm peers, abort the process groups, check in as alive."""
        gen = self.rt.generation
        logger.warning("rank %d (member %d): lost a peer in generation %d (%s); re-forming", self.rt.topo.rank,
                       self.member, gen, cause)
        self.store.set(self._key(gen, "leaving"), b"1")     # wedged members notice it (Heartbeat)
        self.rt.leave_generation()
        self.left_generation = gen
        self.store.set(self._key(gen, f"alive/{self.member}"), msgpack.packb(self.rt.member_info()))
        gc.collect()       # after checking in (it takes ~0.1 s): the old groups' last references go, gloo closes them
        return gen

    def rejoin(self, cause: str) -> bool:
        """A follower after a lost peer: wait for the leader's plan of the next generation and adopt it.
        False: this rank is not part of it (or the job ended), leave."""
        gen = self._leave(cause)
        key = self._key(gen + 1, "plan")
        try:
            self.store.wait([key], timedelta(seconds=self.rt.config.collective_timeout_s))
            plan = self._read_plan(gen + 1)
        except Exception as e:       # the leader (and its store) is gone: the job is over
            logger.error("rank %d (member %d): no plan for generation %d (%s); leaving", self.rt.topo.rank,
                         self.member, gen + 1, e)
            return False
        if "error" in plan or self.member not in plan["members"]:
            logger.error("rank %d (member %d): not in generation %d: %s", self.rt.topo.rank, self.member, gen + 1,
                         plan.get("error", "left out"))
            return False
        self.rt.regroup(plan)
        return True

    def reform_as_leader(self, cause: str) -> None:
        """The leader after a lost peer: account for every member, plan the next generation, publish it and
        adopt it. Raises MembershipError (after telling the others) when the job cannot go on."""
        t0 = time.monotonic()
        gen = self._leave(cause)
        members = self.rt.members
        alive, lost = self._survey(gen, members)
        change = MembershipChange(gen + 1, [members.index(m) for m in lost], cause, sorted(lost),
                                  detect_s=time.monotonic() - t0, started=t0)
        try:
            plan = self.rt.plan_generation(gen + 1, alive, lost)
        except MembershipError as e:
            self._publish_plan(gen + 1, {"error": str(e)})
            raise
        self._publish_plan(gen + 1, plan)
        self._adopt(plan, change)
        logger.warning("generation %d: lost ranks %s; %d + %d ranks; detect %.2fs, groups %.2fs, weights %.2fs",
                       gen + 1, change.lost, change.attention_ranks, change.expert_ranks, change.detect_s,
                       change.groups_s, change.weights_s)

    def _adopt(self, plan: dict, change: MembershipChange) -> None:
        """Leader: form the plan's generation and record the change."""
        timings = self.rt.regroup(plan)
        change.groups_s, change.weights_s = timings["groups_s"], timings["weights_s"]
        change.slots_from_peers, change.slots_from_checkpoint = plan["from_peers"], plan["from_checkpoint"]
        change.attention_ranks = plan["attention_ranks"]
        change.expert_ranks = len(plan["members"]) - plan["attention_ranks"]
        self.changes.append(change)

    # ----- planned changes: scaling and joining -------------------------------------------------------------
    def joiners(self) -> list[tuple[int, dict]]:
        """Leader: the ranks that have registered to join and are not admitted yet, in order of arrival
        (member, info); those whose process is already gone are dropped."""
        while self.store.queue_len(JOINS) > 0:
            member, info = msgpack.unpackb(self.store.queue_pop(JOINS, block=False), strict_map_key=False)
            self.waiting.append((member, info))
        self.waiting = [(m, i) for m, i in self.waiting if not self._process_gone(m)]
        return list(self.waiting)

    def scale_as_leader(self, request: dict) -> dict | None:
        """Leader, between steps: carry out a scale request {"attention_ranks": n or None, "expert_ranks": n
        or None, "retire": [ranks] or None, "retire_hosts": [hostnames] or None, "deadline": monotonic time,
        optionally "cause" for the record}: retire the given ranks, then the last
        ranks of a pool above its target; admit registered joiners up to a pool's target. Returns the change's
        record, {"error": why} (nothing changes then), or None while joiners it needs have not registered yet
        (the caller asks again; past the deadline the request fails)."""
        rt = self.rt
        A, W = rt.topo.num_attention_ranks, rt.topo.world_size
        retire = list(request.get("retire") or [])
        hosts = request.get("retire_hosts") or []
        if hosts:
            on = self.ranks_on(hosts)
            if not on:
                return {"error": f"no rank of the job runs on host(s) {hosts}"}
            retire += on
        bad = [r for r in retire if isinstance(r, bool) or not isinstance(r, int) or not 0 < r < W]
        if bad:
            return {"error": f"cannot retire rank {bad[0]}: ranks 1..{W - 1} can be retired (rank 0 leads the "
                             f"job and holds its requests)"}
        attention = [r for r in range(1, A) if r not in retire]
        experts = [r for r in range(A, W) if r not in retire]
        want_a = request.get("attention_ranks") or len(attention) + 1
        want_e = request.get("expert_ranks") or len(experts)
        retire += attention[max(0, want_a - 1):] + experts[want_e:]
        if want_e < 1:
            return {"error": f"retiring ranks {sorted(retire)} would leave no expert rank; one must stay"}
        need_a, need_e = max(0, want_a - 1 - len(attention)), max(0, want_e - len(experts))
        waiting = self.joiners()
        join = [j for j in waiting if j[1]["role"] == "attention"][:need_a] + \
            [j for j in waiting if j[1]["role"] == "expert"][:need_e]
        if len(join) < need_a + need_e:
            if time.monotonic() < request["deadline"]:
                return None
            return {"error": f"scaling to {want_a} attention + {want_e} expert ranks needs {need_a} attention and "
                             f"{need_e} expert rank(s) to join, but {len(join)} registered in time; launch them "
                             f"against the job's pool address (serve.py --role ... --pool-addr)"}
        if not retire and not join:
            return {"unchanged": True, "attention_ranks": A, "expert_ranks": W - A}
        return self.change_as_leader([rt.members[r] for r in sorted(set(retire))], join,
                                     request.get("cause", "scale"))

    def ranks_on(self, hosts: list[str]) -> list[int]:
        """The ranks whose process runs on one of hosts (hostnames, as the process's host sees its own)."""
        return [r for r, m in enumerate(self.rt.members) if self._proc(m)[0].partition("/")[0] in hosts]

    def change_as_leader(self, retire: list[int], join: list[tuple[int, dict]], cause: str) -> dict:
        """Leader, between steps: a planned change (nobody failed): the members in retire leave (they exit),
        the joiners (member, info) join. Plan and publish the next generation, admit the joiners, tell every
        rank (RESHAPE), leave together, form it. Returns the change's record, or {"error": why} when the plan
        is refused (nothing changes then)."""
        rt, gen = self.rt, self.rt.generation
        budget = rt.config.parallel.expert_memory or 2**62
        infos = {m: {"expert_budget": budget} for m in rt.members}
        try:
            plan = rt.plan_generation(gen + 1, infos, retire, join, retiring=True)
        except MembershipError as e:
            return {"error": str(e)}
        plan["handover"] = self._plan_handover(retire)
        t0 = time.monotonic()
        self._publish_plan(gen + 1, plan)
        self._admit(plan["joined"], str(gen + 1))
        self.waiting = [j for j in self.waiting if j[0] not in plan["joined"]]
        change = MembershipChange(gen + 1, [rt.members.index(m) for m in retire], cause, sorted(retire),
                                  joined_members=list(plan["joined"]), started=t0)
        if gen >= 0:
            rt.control.broadcast_header(StepHeader.empty(RESHAPE, rt.leader.step_id))
            self._hand_over(plan)
            self._leave_together(gen)
        change.detect_s = time.monotonic() - t0
        self._adopt(plan, change)
        logger.warning("generation %d: retired %s, joined %s; %d + %d ranks; groups %.2fs, weights %.2fs", gen + 1,
                       change.lost_members, change.joined_members, change.attention_ranks, change.expert_ranks,
                       change.groups_s, change.weights_s)
        return change.to_dict()

    def form_pool(self, attention_ranks: int, expert_ranks: int) -> None:
        """The leader of separate pool launches, alone at start-up: a scale request to this many ranks of each
        pool, waited for until its ranks have registered (within startup_timeout_s): generation 0."""
        request = {"attention_ranks": attention_ranks, "expert_ranks": expert_ranks, "cause": "start",
                   "deadline": time.monotonic() + self.rt.config.startup_timeout_s}
        while (record := self.scale_as_leader(request)) is None:
            time.sleep(0.05)
        if "error" in record:
            raise MembershipError(record["error"])

    def join(self, role: str, info: dict) -> None:
        """A rank that is not a member yet: register (role and info) and wait until a generation admits it, then
        form that generation."""
        self.store.queue_push(JOINS, msgpack.packb([self.member, {**info, "role": role}]))
        key = f"{PREFIX}/admit/{self.member}"
        self.store.wait([key], timedelta(seconds=self.rt.config.startup_timeout_s))
        answer = self.store.get(key).decode()
        if not answer.isdigit():
            raise MembershipError(f"member {self.member} ({role}) was refused: {answer}")
        self.rt.regroup(self._read_plan(int(answer)))

    def reshape(self) -> bool:
        """A follower got RESHAPE: hand over its requests if it is a leaving attention rank (or take them over),
        leave the generation with everyone, then join the next one if it is a member (False: retired, leave
        the job)."""
        gen = self.rt.generation
        plan = self._read_plan(gen + 1)
        self._hand_over(plan)
        self._leave_together(gen)
        if self.member not in plan["members"]:
            logger.info("member %d: retired by a scale-in (generation %d)", self.member, gen + 1)
            return False
        self.rt.regroup(plan)
        return True

    def _plan_handover(self, retire: list[int]) -> dict[str, int]:
        """Leader: for each attention rank that retires, the staying one that takes over its requests and KV
        blocks (the most free blocks, charged for what it takes) -> {str(leaving rank): taking rank}."""
        rt = self.rt
        A = rt.topo.num_attention_ranks
        reports = rt.leader.reports
        staying = [r for r in range(A) if rt.members[r] not in retire]
        free = {r: reports[r].num_free_blocks for r in staying}
        out = {}
        for r in range(A):
            if rt.members[r] in retire:
                dst = max(staying, key=lambda k: (free[k], -k))
                free[dst] -= reports[r].num_blocks - reports[r].num_free_blocks
                out[str(r)] = dst
        return out

    def _hand_over(self, plan: dict) -> None:
        """Between steps, in the old generation: each retiring attention rank sends its live requests and their
        KV blocks to the rank the plan names (attention_nodes/handover.py), which takes them over (the
        requests' metadata goes over the control group, the KV over the data plane's); retiring expert ranks
        send the experts that only they hold to the staying ranks that take them (plan "staged"), which keep
        them for adopting the new placement."""
        rt = self.rt
        me = rt.topo.rank
        if not rt.topo.is_attention:
            rt.stage_experts(plan["staged"])
        for src, dst in sorted((int(s), d) for s, d in plan.get("handover", {}).items()):
            if me == src:
                meta, kv = rt.worker.hand_over()
                rt.control.send_object(meta, dst)
                if meta["num_blocks"]:
                    dist.send(kv, dst, group=rt.groups.world)
            elif me == dst:
                meta = rt.control.recv_object(src)
                kv = torch.empty(meta["shape"], dtype=rt.dtype, device=rt.device)
                if meta["num_blocks"]:
                    dist.recv(kv, src, group=rt.groups.world)
                rt.worker.take_over(meta, kv)

    def _leave_together(self, gen: int) -> None:
        """Every rank at once, between steps: nobody is mid-exchange, so the groups can go without a failure."""
        dist.barrier(group=self.rt.groups.control)
        self.rt.leave_generation()
        self.left_generation = gen
        gc.collect()

    def _survey(self, gen: int, members: list[int]) -> tuple[dict[int, dict], list[int]]:
        """Wait until each member of generation gen has checked in (alive: member -> its info) or has not
        heartbeaten for failure_s (lost), within collective_timeout_s (then the silent ones count as lost)."""
        alive: dict[int, dict] = {}
        lost: list[int] = []
        seen: dict[int, tuple[int, float]] = {}
        deadline = time.monotonic() + self.rt.config.collective_timeout_s
        while True:
            now = time.monotonic()
            for m in members:
                if m in alive or m in lost:
                    continue
                key = self._key(gen, f"alive/{m}")
                if self.store.check([key]):
                    alive[m] = msgpack.unpackb(self.store.get(key), strict_map_key=False)
                    continue
                if self._process_gone(m):
                    lost.append(m)
                    continue
                beat = self.store.add(f"{PREFIX}/hb/{m}", 0)
                if m not in seen or seen[m][0] != beat:
                    seen[m] = (beat, now)
                elif now - seen[m][1] > self.failure_s or now > deadline:
                    lost.append(m)
            if len(alive) + len(lost) == len(members):
                return alive, lost
            time.sleep(0.02)

    def _proc(self, member: int) -> list:
        """[host identity, pid] of a member's process (written once at its start-up: read once)."""
        if member not in self.procs:
            self.procs[member] = msgpack.unpackb(self.store.get(f"{PREFIX}/proc/{member}"))
        return self.procs[member]

    def _process_gone(self, member: int) -> bool:
        """The member's process is on this host and has exited (a quicker verdict than a silent heartbeat)."""
        host, pid = self._proc(member)
        return host == self.host and not process_alive(pid)

    def close(self) -> None:
        self.heartbeat.stop.set()
