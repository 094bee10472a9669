"""Membership generations and failures: how the job forms a generation and re-forms when ranks are lost. The
planned changes (joining, scaling, draining) build on this in membership.py. This rank's runtime is reached
through `MemberRuntime` (changes.py) alone.

The job's process groups belong to a generation g: they are formed from the keys
under "afserve/g{g}/" of one TCP store, hosted by the leader's process. When a rank dies, the survivors'
next exchange with it fails (gloo raises from its TCP pairs; the shm transport sees the process gone), and
each survivor leaves generation g: it wakes its shm peers, aborts its process groups (which in turn breaks
the exchanges of ranks still waiting on it, so every survivor leaves within moments), and checks in under
"afserve/g{g}/alive/{member}". The leader waits until every member of g has checked in or is known dead:
its process is gone (members on the leader's host) or it has stopped heartbeating (launch/runtime/liveness.py).
It then makes the plan of generation g + 1 (members, roles, the new expert placement and the weight copies
that realise it: launch/runtime/planning.py) and publishes it under "afserve/g{g+1}/plan"; every member of
g + 1 forms the new groups and adopts the placement, and the leader re-sends the header of the step that was
in flight (launch/runtime/step_protocol.py). A member of the plan lost before g + 1 forms (every member first
waits for all to be "ready"; none adopts g + 1 until all have formed its groups and data plane and have their
expert weights, decided once in the store): the others check in again and the leader plans g + 2 without it.
The leader's own death ends the job: it holds the store and the request state.

A planned change (membership.py) that fails before its generation forms is given up ("afserve/g{g}/failed":
the members waiting to form it stop at once) and the job re-forms from the old generation's survivors in the
same way, under the given-up generation's number.
"""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from datetime import timedelta

import msgpack
import torch.distributed as dist

from comm.failures import is_peer_failure

from .changes import FormingFailed, MemberRuntime, MembershipChange, MembershipSettings
from .liveness import PREFIX, Heartbeat, Peers
from .planning import MembershipError
from .step_protocol import fault_point

logger = logging.getLogger("afserve")


class Generations:
    """This rank's side of forming generations and of re-forming after a failure. `changes`: the leader's record
    of every re-forming."""

    def __init__(self, runtime: MemberRuntime, store: dist.Store, host: str, port: int,
                 settings: MembershipSettings):
        self._rt, self.store, self.member = runtime, store, runtime.member
        self.settings = settings
        self.changes: list[MembershipChange] = []
        self._left_generation = -1       # the last generation this rank has left
        self._given_up = -1              # the last generation this rank gave up forming (see _give_up)
        self._forming = -1               # the generation this rank is forming past the ready wait (-1: none)
        self._peers = Peers(store, self.member)
        self._heartbeat = Heartbeat(host, port, self.member,
                                    lambda: (max(runtime.generation, self._forming), self._left_generation),
                                    lambda: runtime.interrupt_generation(port), runtime.watched_members,
                                    settings.failure_s, settings.startup_timeout_s, max(10.0, 3 * settings.failure_s),
                                    lambda: self._forming >= 0)

    def close(self) -> None:
        self._heartbeat.close()

    # ----- the store ----------------------------------------------------------------------------------------
    def _key(self, generation: int, name: str) -> str:
        return f"{PREFIX}/g{generation}/{name}"

    def _publish_plan(self, generation: int, plan: dict) -> None:
        self.store.set(self._key(generation, "plan"), msgpack.packb(plan))

    def _read_plan(self, generation: int) -> dict:
        return msgpack.unpackb(self.store.get(self._key(generation, "plan")), strict_map_key=False)

    # ----- failures -----------------------------------------------------------------------------------------
    def _leave(self, cause: str, check_in: int | None = None) -> int:
        """Leave the current generation: wake shm peers, abort the process groups, check in as alive (under
        this generation's number, or check_in's: a planned change's failed plan) -> the generation left."""
        rt = self._rt
        gen = rt.generation
        logger.warning("rank %d (member %d): lost a peer in generation %d (%s); re-forming", rt.topo.rank,
                       self.member, gen, cause)
        self.store.set(self._key(gen, "leaving"), b"1")     # wedged members notice it (Heartbeat)
        rt.leave_generation()
        self._left_generation = gen
        self._check_in(gen if check_in is None else check_in)
        gc.collect()       # after checking in (it takes ~0.1 s): the old groups' last references go, gloo closes them
        return gen

    def rejoin(self, cause: str) -> bool:
        """A follower after a lost peer: wait for the leader's plan of the next generation and adopt it (a plan
        that fails to form: check in again, under its number, for the next). False: not in it, or no job; leave."""
        gen = self._leave(cause) + 1
        fault_point("checked_in", self.member, gen)   # counted alive for the next generation, gone before it forms
        return self._follow_plans(gen, after_failure=True)

    def _follow_plans(self, gen: int, after_failure: bool = False) -> bool:
        """A follower checked in for generation gen: wait for its plan and form it (a plan that fails to form:
        check in again, under its number, for the next). after_failure: this rank lost a peer between steps or in
        a step, so a planned change's plan of gen (it has "handover") cannot form: this rank never reached the
        old generation's last barrier; it is given up here, as by the change's other ranks. False: not in it, or
        no job; leave."""
        rank = self._rt.topo.rank
        for _ in range(len(self._rt.members) + 1):     # each failed forming loses at least one member
            try:
                self.store.wait([self._key(gen, "plan")], timedelta(seconds=self.settings.collective_timeout_s))
                plan = self._read_plan(gen)
            except Exception as e:       # the leader (and its store) is gone: the job is over
                logger.error("rank %d (member %d): no plan for generation %d (%s); leaving", rank, self.member, gen, e)
                return False
            planned = after_failure and "handover" in plan
            after_failure = False
            if planned and self.member in plan["members"]:
                self._give_up(gen)
            if "error" not in plan and (planned or self.store.check([self._key(gen, "failed")])):   # the next one
                self._check_in(gen)
                gen += 1
                continue
            if "error" in plan or self.member not in plan["members"]:
                logger.error("rank %d (member %d): not in generation %d: %s", rank, self.member, gen,
                             plan.get("error", "left out"))
                return False
            try:
                self._form(plan)
                return True
            except FormingFailed as e:
                logger.warning("rank %d (member %d): %s; checking in again", rank, self.member, e)
                self._check_in(gen)
                gen += 1
        return False

    def _form(self, plan: dict) -> dict:
        """Form the plan's generation once all its members are "ready" to (none then waits in the groups' rendezvous
        on a member that died before it was ready); FormingFailed, nothing changed here, when one's process is gone
        or its heartbeat stops first (or it stays silent past collective_timeout_s), or when a member gave the
        generation up; also when one is lost after it was ready: inside the groups' rendezvous (Runtime.regroup
        bounds that wait), or while the data plane forms and expert weights move. No member adopts the
        generation until every member has its weights (_agree), so either all of them take it on or none does."""
        gen = plan["gen"]
        self.store.set(self._key(gen, f"ready/{self.member}"), b"1")
        fault_point("ready", self.member, gen)   # ready, so the others go on into the groups' rendezvous

        def ready(m: int) -> dict | None:
            if self.store.check([self._key(gen, "failed")]):
                raise FormingFailed(f"generation {gen} was given up by a member that could not form it")
            return {} if self.store.check([self._key(gen, f"ready/{m}")]) else None
        _, lost = self._peers.survey(plan["members"], ready, self.settings.failure_s,
                                     self.settings.collective_timeout_s)
        if lost:
            self._give_up(gen)
            raise FormingFailed(f"members {sorted(lost)} were lost before generation {gen} formed")
        self._forming = gen
        try:
            return self._rt.regroup(plan, lambda ok: self._agree(gen, plan["members"], ok))
        finally:
            self._forming = -1

    def _agree(self, gen: int, members: list[int], ok: bool) -> bool:
        """Whether generation gen formed, decided once for all its members through the store: "formed" when all of
        them report they have their weights (ok), else "failed", set by the first member that failed (not ok) or
        that found one lost while waiting (process gone, heartbeat silent). Whichever is written first stands
        (compare_set), so no member adopts a generation that another gives up. A member that fails also marks the
        generation as being left: a member still waiting in one of its exchanges has its connections broken
        (Heartbeat) instead of waiting out a timeout."""
        outcome = self._key(gen, "outcome")
        if not ok:
            self.store.set(self._key(gen, "leaving"), b"1")
            return self.store.compare_set(outcome, "", "failed") == b"formed"
        if self.store.add(self._key(gen, "formed"), 1) == len(members):
            self.store.compare_set(outcome, "", "formed")
        _, lost = self._peers.survey([m for m in members if m != self.member],
                                     lambda m: {} if self.store.check([outcome]) else None,
                                     self.settings.failure_s, self.settings.collective_timeout_s, first_loss=True)
        if lost:
            self.store.compare_set(outcome, "", "failed")
        return self.store.get(outcome) == b"formed"

    def _give_up(self, gen: int) -> None:
        """Mark generation gen as not forming: its members still waiting for the others to be ready stop at once.
        Only a member that has not marked itself ready, or that saw one lost, may: nobody has got past the
        ready wait then."""
        self.store.set(self._key(gen, "failed"), b"1")
        self._given_up = max(self._given_up, gen)

    def reform_as_leader(self, cause: str) -> None:
        """The leader after a lost peer: account for every member, plan the next generation, publish it and
        adopt it. Raises MembershipError (after telling the others) when the job cannot go on."""
        t0 = time.monotonic()
        self._reform(self._leave(cause), cause, t0, held=self._rt.moves_in_flight())

    def _reform(self, gen: int, cause: str, t0: float, held: bool = False) -> MembershipChange:
        """The leader, checked in under gen: survey the members, plan generation gen + 1 without the lost ones,
        publish it and form it (again without any lost before it formed). held: between steps after a planned
        change failed, where a handover may have moved requests: the plan carries the requests each attention
        rank checked in holding, and the leader takes them as where they are; also after a failed step that moved
        requests between attention ranks (PD), for those."""
        members = self._rt.members
        survey, lost = members, []
        for _ in range(len(members)):   # a member lost before the planned generation forms: survey the rest again
            alive, newly = self._peers.survey(survey, lambda m, g=gen: self._checked_in(g, m),
                                              self.settings.failure_s, self.settings.collective_timeout_s)
            retired = [m for m, i in alive.items() if i.get("retired")]   # left by a change that then failed
            alive = {m: i for m, i in alive.items() if m not in retired}
            newly += retired
            lost = sorted(lost + newly)
            change = MembershipChange(gen + 1, [members.index(m) for m in lost], cause, lost,
                                      detect_s=time.monotonic() - t0, started=t0)
            try:
                plan = self._rt.plan_generation(gen + 1, alive, lost)
            except MembershipError as e:
                self._publish_plan(gen + 1, {"error": str(e)})
                raise
            if held:
                plan["held"] = {str(members.index(m)): i["requests"] for m, i in alive.items() if "requests" in i}
            self._publish_plan(gen + 1, plan)
            try:
                self._adopt(plan, change)
                break
            except FormingFailed as e:
                logger.warning("generation %d did not form: %s; re-forming again", gen + 1, e)
                survey, gen = list(alive), gen + 1   # everyone checks in again under the failed plan's number
                self._check_in(gen)
        else:
            self._publish_plan(gen + 1, {"error": "the job kept losing members while forming; giving up"})
            raise MembershipError("the job kept losing members while forming a new generation; giving up")
        logger.warning("generation %d: lost ranks %s; %d + %d ranks; detect %.2fs, groups %.2fs, weights %.2fs",
                       gen + 1, change.lost, change.attention_ranks, change.expert_ranks, change.detect_s,
                       change.groups_s, change.weights_s)
        return change

    def _check_in(self, gen: int) -> None:
        self.store.set(self._key(gen, f"alive/{self.member}"), msgpack.packb(self._rt.member_info()))

    def _checked_in(self, gen: int, member: int) -> dict | None:
        """The info a member checked in with after leaving generation gen (None: not yet)."""
        key = self._key(gen, f"alive/{member}")
        return msgpack.unpackb(self.store.get(key), strict_map_key=False) if self.store.check([key]) else None

    def _adopt(self, plan: dict, change: MembershipChange) -> None:
        """Leader: form the plan's generation and record the change."""
        timings = self._form(plan)
        change.groups_s, change.weights_s = timings["groups_s"], timings["weights_s"]
        change.slots_from_peers, change.slots_from_checkpoint = plan["from_peers"], plan["from_checkpoint"]
        change.attention_ranks = plan["attention_ranks"]
        change.expert_ranks = len(plan["members"]) - plan["attention_ranks"]
        change.prefill_ranks = plan["prefill_ranks"]
        self.changes.append(change)

    def _ready(self, gen: int) -> bool:
        return self.store.check([self._key(gen, f"ready/{self.member}")])



def failure_of(action: Callable, forming_only: bool = False) -> str | None:
    """Run action -> None, or the first line of the lost-peer error or FormingFailed it raised (forming_only:
    FormingFailed alone; a peer lost while the groups form propagates); any other error propagates. The caller
    handles the loss after this returns, outside the except block (a live traceback would keep the failed
    call's groups alive: see Runtime.leave_generation)."""
    try:
        action()
        return None
    except Exception as e:
        if not isinstance(e, FormingFailed) and (forming_only or not is_peer_failure(e)):
            raise
        return str(e).splitlines()[0][:200]
