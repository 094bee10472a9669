"""The step protocol: what the leader and every other rank do each step. The one place that knows the header
kinds; how the job re-forms when its membership changes is launch/runtime/membership.py.

Each step the leader (attention rank 0) broadcasts a `StepHeader` (comm/control.py) on the control group:
- STEP: every attention rank admits its new requests, applies its aborts and runs one forward (joining each
  MoE layer's dispatch and combine), samples, and sends its `StepReport` back; expert ranks serve the step's
  dispatches. With PD's decode passes (attention_nodes/passes.py), decode ranks run several forwards and
  prefill ranks one spread over their rounds. IDLE: a heartbeat, nothing to run. PAUSE: a generate() call
  under torchrun is done. SHUTDOWN: leave.
- REBALANCE, COLLECT_STATS, COLLECT_EVENTS: every rank (the leader too) joins the collective for it, between
  steps (launch/runtime/collectives.py: live re-placement, stats).
- RESHAPE: a planned membership change (a scale request, or ranks joining): the leader has published the
  next generation's plan; every rank follows it (membership.py).

A lost peer makes an exchange raise; the leader re-forms the job (membership.py) and re-sends the header of
the step in flight. Every rank runs a re-sent step's exchanges again, whatever it had done of it: expert ranks
serve its dispatches as for any STEP header, an attention rank that had not finished it re-runs the same
scheduled batch, and one that had finished it joins every exchange with no tokens (`join_exchanges`) and
re-sends its report. So every expert rank hears from every source in every round, however far each rank had
got when the peer was lost (ranks finish a step at different moments: the last combine reaches one attention
rank before another is woken to re-form, and the experts may have served the whole step). Nothing of a step
is committed (KV positions advanced, tokens sampled, generator states drawn) until its forward has passed
every exchange, so a step that failed half way leaves no trace. A follower that loses a peer waits for the
leader's plan and adopts it.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from attention_nodes.passes import merge_reports
from comm.control import ControlPlane, StepHeader, StepReport
from comm.failures import is_peer_failure
from comm.sync_audit import SyncTally
from comm.topology import Topology

from ..config import EngineConfig
from .planning import MembershipError

STEP, IDLE, PAUSE, SHUTDOWN = "step", "idle", "pause", "shutdown"
# every rank joins a collective between steps; COLLECT_EVENTS: the stats plus each rank's recent calls
REBALANCE, COLLECT_STATS, COLLECT_EVENTS = "rebalance", "collect_stats", "collect_events"
RESET_CACHE = "reset_cache"   # every attention rank forgets its prefix cache (LLM.reset_prefix_cache)
RESHAPE = "reshape"   # between steps: every rank moves to the next generation, whose plan is in the store
COLLECTIVES = (REBALANCE, COLLECT_STATS, COLLECT_EVENTS, RESET_CACHE)

logger = logging.getLogger("afserve")


class StepRuntime(Protocol):
    """What the step loops need of a rank's runtime (launch/runtime/runtime.py implements it). membership is
    None when the job cannot re-form (the caller formed the process groups); leader only on rank 0;
    sync_tally only with the sync_audit option."""

    config: EngineConfig
    member: int             # this rank's number in the job's first generation (kept when ranks are renumbered)
    topo: Topology
    control: ControlPlane
    worker: object          # AttentionWorker or ExpertWorker
    leader: object | None   # attention_nodes/leader.py Leader
    membership: object | None   # launch/runtime/membership.py Membership
    sync_tally: SyncTally | None

    def rebalance(self) -> None: ...

    def gather_stats(self, events: bool = False) -> dict | None: ...

    def reset_prefix_cache(self) -> bool: ...

    def kv_transfer(self): ...


def run_attention_step(worker, header: StepHeader, tally: SyncTally | None = None, member: int = -1,
                       transfer: Callable = lambda: None) -> StepReport:
    """What every attention rank does with a STEP header. Re-sent headers (the same step, after the job
    re-formed) are idempotent: a finished step joins the step's exchanges with no tokens and re-sends its
    report, an unfinished one re-runs its batch (a re-sent header carries no PD moves or pushes: the leader took
    the requests as where the ranks said they hold them). tally: the sync audit's, when on: the forward and sampling
    run under it; a decode step is one whose own batch is (worker.is_decode_step). member: this rank's, for
    fault_point. transfer() -> the KVTransfer of PD moves and pushes.
    A header with several decode passes (PD, attention_nodes/passes.py): a prefill rank runs one forward over
    their rounds; every other rank runs one forward per pass, each committed as it ends, so a re-sent step joins
    the passes this rank committed with no tokens and runs the rest."""
    passes = header.decode_passes
    if header.step == worker.done_step:
        worker.join_exchanges(header.capacity, header.micro_batches, header.draft_passes, passes)
        return worker.last_report
    if header.step != worker.started_step:
        worker.started_step, worker.pass_reports = header.step, []
        worker.begin_step(header, transfer, lambda: fault_point("pd_move", member, header.step))

    def run() -> StepReport:
        if worker.rank < header.prefill_ranks and passes > 1:   # PD prefill rank: one forward over the passes
            worker.pass_reports = [replace(worker.step(header.capacity, header.micro_batches, passes), passes=0)]
        else:
            # One forward per pass, each committed (a re-sent step joins the committed ones' exchanges empty).
            worker.join_exchanges(header.capacity, header.micro_batches, 0, len(worker.pass_reports))
            forward_s = 0.0
            for _ in range(len(worker.pass_reports), passes):
                worker.pass_reports.append(worker.step(header.capacity, header.micro_batches))
                forward_s += worker.forward_s
            worker.forward_s = forward_s     # the step's (comm stats)
        report = merge_reports(worker.pass_reports)
        # Committed: if a peer is lost in the MTP passes, the re-sent step joins its exchanges with this report.
        worker.done_step, worker.last_report = header.step, report
        if header.draft_passes:
            fault_point("draft_passes", member, header.step)
        return worker.draft(header.draft_passes)
    worker.last_report = _audited(tally, run, lambda: worker.is_decode_step)
    return worker.last_report


def run_expert_step(worker, header: StepHeader, tally: SyncTally | None = None, member: int = -1) -> None:
    """What every expert rank does with a STEP header: serve its dispatches. tally: as for attention ranks;
    a decode step is one the header calls so (an expert rank does not see the batches)."""
    _audited(tally, lambda: worker.step(header.capacity, header.micro_batches, header.draft_passes,
                                        lambda: fault_point("draft_passes", member, header.step),
                                        header.decode_passes,
                                        lambda: fault_point("expert_pass", member, worker.multi_pass_steps)),
             lambda: header.is_decode)


def _audited(tally: SyncTally | None, step, is_decode):
    return step() if tally is None else tally.run(step, is_decode)


# ----- the leader -----------------------------------------------------------------------------------------

def lead(rt: StepRuntime, inbox, outbox, heartbeat_s: float, stop_when_idle: bool = False) -> str:
    """The leader's loop (attention rank 0): run steps until shutdown (returns SHUTDOWN) or, with
    stop_when_idle, until all work is done (broadcasts PAUSE, returns PAUSE). Idle: blocks on the inbox,
    heartbeating every heartbeat_s. A lost rank re-forms the job and the step in flight is re-sent."""
    leader, membership = rt.leader, rt.membership
    leader.outbox = outbox
    scales: list[dict] = []      # scale requests waiting for their joiners
    guard = _guard(rt)
    while True:
        aborts: dict[str, list[str]] = {}
        alive = True
        try:
            # Block (heartbeating) only when idle and serving; a generate() call ends as soon as it is done.
            # Scale requests or ranks waiting to join: poll.
            idle_wait = not leader.has_work and not stop_when_idle
            polling = scales or membership is not None and membership.has_joiners
            cmd = inbox.get(timeout=membership.poll_s if polling else heartbeat_s) if idle_wait else \
                inbox.get_nowait()
            alive = leader.handle(cmd, aborts, outbox)
            while alive:
                alive = leader.handle(inbox.get_nowait(), aborts, outbox)
        except queue.Empty:
            pass
        scales += [dict(r, deadline=time.monotonic() + rt.config.startup_timeout_s) for r in leader.take_scales()]
        if membership is not None and membership.between_steps(scales, outbox, guard) and aborts:
            ids = [i for v in aborts.values() for i in v]    # ranks were renumbered: route them again
            aborts.clear()
            for i in ids:
                leader.handle(("abort", i), aborts, outbox)
        for query, events in leader.take_queries():
            kind = RESET_CACHE if query == "reset_prefix_cache" else COLLECT_EVENTS if events else COLLECT_STATS
            outbox.put((query, guard(lambda k=kind: collective(rt, k))))
        if not alive:
            announce(rt, SHUTDOWN)
            return SHUTDOWN
        if not leader.has_work and not aborts:
            kind = PAUSE if stop_when_idle else IDLE
            guard(lambda k=kind: announce(rt, k))
            if stop_when_idle:
                return PAUSE
            continue
        t0 = time.perf_counter()
        leader.inflight = leader.next_step(aborts)
        reports = guard(lambda: _step(rt))
        leader.collect(reports, outbox)
        _timed_step(rt, t0)
        if leader.autoscaler is not None and membership is not None:
            _autoscale(rt, reports, scales)
        if leader.rebalance_interval and leader.step_id % leader.rebalance_interval == 0:
            guard(lambda: collective(rt, REBALANCE))


def _autoscale(rt: StepRuntime, reports: list[StepReport], scales: list[dict]) -> None:
    """Leader, after a step: show the autoscaler the attention ranks' work and busy and wall times (it waits while
    any scale request does); a move it asks for joins the scale requests (its joiners spawned by the LLM that
    spawned the job, its record answered on the outbox as ("autoscaled", record), which no caller waits for)."""
    request = rt.leader.autoscaler.observe(rt.topo.num_attention_ranks, rt.topo.num_expert_ranks,
                                           [r.work for r in reports], [r.busy_s for r in reports],
                                           [r.wall_s for r in reports], bool(scales), rt.generation)
    if request is not None:
        logger.info("autoscale: %s", rt.leader.autoscaler.decisions[-1])
        scales.append(dict(request, spawn=True, reply="autoscaled",
                           deadline=time.monotonic() + rt.config.startup_timeout_s))


def announce(rt: StepRuntime, kind: str) -> None:
    """Leader, between steps: broadcast a header of this kind (no requests)."""
    rt.control.broadcast_header(StepHeader.empty(kind, rt.leader.step_id))


def _step(rt: StepRuntime) -> list[StepReport]:
    """The step in flight (re-sent as the leader rewrote it when the job re-formed)."""
    header = rt.leader.inflight
    rt.control.broadcast_header(header, settle_later=True)   # gather_reports settles it (and raises if it failed)
    return rt.control.gather_reports(run_attention_step(rt.worker, header, rt.sync_tally, rt.member,
                                                        rt.kv_transfer))


def collective(rt: StepRuntime, kind: str):
    """Leader, between steps: tell every rank to join the collective for kind, and run it here too."""
    announce(rt, kind)
    return _run_collective(rt, kind)


def _run_collective(rt: StepRuntime, kind: str):
    if kind == REBALANCE:
        return rt.rebalance()
    if kind == RESET_CACHE:
        return rt.reset_prefix_cache()
    return rt.gather_stats(events=kind == COLLECT_EVENTS)


def _guard(rt: StepRuntime) -> Callable:
    """guard(action): run one exchange of the leader's; when a peer is lost, re-form the job and run it again
    (a step's header is re-sent as it was, so ranks that had finished it re-send their reports)."""
    def guard(action):
        for _ in range(rt.config.parallel.world_size + 1):   # each re-forming loses at least one rank
            result, cause = _attempt(rt, action)
            if cause is None:
                return result
            rt.membership.reform_as_leader(cause)   # outside the except block: see Runtime.leave_generation
        raise MembershipError("the job kept losing ranks while re-forming; giving up")
    return guard


def _attempt(rt: StepRuntime, action) -> tuple[object, str | None]:
    """Run action -> (its result, None), or (None, the first line of the lost-peer error it raised); any other
    error propagates. The caller handles the loss after this returns, outside the except block."""
    try:
        return action(), None
    except Exception as e:
        if rt.membership is None or not is_peer_failure(e):
            raise
        return None, str(e).splitlines()[0][:200]


# ----- every other rank -----------------------------------------------------------------------------------

def follow(rt: StepRuntime) -> str:
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


def _obey(rt: StepRuntime) -> str:
    header = rt.control.broadcast_header(None)
    if header.kind in COLLECTIVES:
        _run_collective(rt, header.kind)
    elif header.kind == STEP:
        if rt.topo.is_attention:
            t0 = time.perf_counter()
            report = run_attention_step(rt.worker, header, rt.sync_tally, rt.member, rt.kv_transfer)
            fault_point("before_report", rt.member, header.step)
            rt.control.gather_reports(report)
            _timed_step(rt, t0)
        else:
            run_expert_step(rt.worker, header, rt.sync_tally, rt.member)
    return header.kind


def _timed_step(rt: StepRuntime, t0: float) -> None:
    """Count an attention rank's step that began at t0 in its comm stats (unless it has just left the data
    plane: a rank handing its work over holds none)."""
    moe = getattr(rt.worker, "moe", None)
    if moe is not None:
        moe.dispatcher.stats.add_step(t0, time.perf_counter(), rt.worker.forward_s)


def fault_point(name: str, member: int, step: int) -> None:
    """Fault injection for tests and chaos runs: with AFSERVE_FAULT="name:member:step" in the environment (ranks
    inherit it; several, comma-separated), the rank of that member (its rank number in the job's first
    generation, kept when a re-forming renumbers the ranks, so a re-sent step does not kill the rank that took the
    number over) SIGKILLs itself when it reaches the point `name` in that step.
    Points: "before_report" (an attention rank that has finished its step's forward, before the report gather:
    the other ranks have finished the step too, so a re-sent step finds them done); "checked_in" (a follower
    re-forming after a lost peer, once it has checked in alive for the next generation and before it forms it;
    `step` is that generation's number: the leader plans it with this rank in it); "ready" (a member of a plan,
    once it has marked itself ready to form it: the others go on into the groups' rendezvous; `step` is the
    plan's generation); "groups" (a member once the plan's process groups formed, before its data plane and
    expert weights) and "weights" (once it has its weights, before every member has agreed the generation
    formed). In a planned change (scale,
    drain), `step` is the planned generation's number: "reshape" (a follower that got the RESHAPE header, before
    any handover), "mid_handover" (a retiring attention rank that has sent its requests' list, before their KV
    blocks), "handed_over" (a follower past the handover, before the ranks leave the old generation together),
    "admitted" (a joiner told its generation, before it forms it). "draft_passes": in a step with MTP passes, a
    rank past the step's target layers, before its passes (an attention rank: its step committed). "pd_move": a
    prefill rank in a step moving requests to decode ranks, between a move's description and its KV (it has
    dropped the requests). "expert_pass": an expert rank before each decode pass after the first of its n-th
    step with several (PD, attention_nodes/passes.py); `step` is n (which step that is depends on timing)."""
    spec = os.environ.get("AFSERVE_FAULT")
    if spec and f"{name}:{member}:{step}" in spec.split(","):
        os.kill(os.getpid(), signal.SIGKILL)
