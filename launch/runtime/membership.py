"""Membership: how the job re-forms when ranks die, join, retire or are drained, and how a leaving attention
rank's requests are handed over. This rank's runtime is reached through `MemberRuntime` (changes.py) alone.

Membership generations. The job's process groups belong to a generation g: they are formed from the keys
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
waits for all to be "ready"): the others check in again and the leader plans g + 2 without it. The leader's
own death ends the job: it holds the store and the request state.

Joining. A rank that is not a member (spawned by LLM.scale, or launched against the job's pool address:
serve.py --role ... --pool-addr) reads the leader's settings from "afserve/config", loads what its role holds
before it has a place, and registers on the store queue "afserve/joins". Between steps the leader admits
registered ranks (those a scale request waits for, else any that came): it plans the next generation with
them (a joined expert rank takes its experts from peers or the checkpoint), publishes the plan, sets
"afserve/admit/{member}" to its number, and runs RESHAPE; the joiners form the new generation with the
others. Separate pool launches start the same way: the leader, alone, admits the first ranks that register
as generation 0.

Planned changes (scaling, draining). On RESHAPE every rank reads the published plan; a retiring attention
rank hands its requests and KV blocks to the rank the plan names, retiring expert ranks send the experts only
they hold to the staying ranks that take them, every rank leaves the current generation together, and the
members of the next one form it (the retired ones exit).
"""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from datetime import timedelta

import msgpack
import torch.distributed as dist

from .changes import MemberRuntime, MembershipChange, MembershipSettings
from .liveness import PREFIX, Heartbeat, Peers
from .planning import MembershipError
from .step_protocol import fault_point

JOINS = f"{PREFIX}/joins"    # the store queue that ranks wanting to join register on
JOIN_POLL_S = 0.2    # how often the leader looks for ranks registering to join

logger = logging.getLogger("afserve")


class FormingFailed(RuntimeError):
    """A member of a planned generation was lost before the generation formed (nothing of it was formed)."""


class Membership:
    """This rank's side of membership changes. `changes`: the leader's record of them."""

    poll_s = JOIN_POLL_S

    def __init__(self, runtime: MemberRuntime, store: dist.Store, host: str, port: int,
                 settings: MembershipSettings):
        self._rt, self.store, self.member = runtime, store, runtime.member
        self.settings = settings
        self.changes: list[MembershipChange] = []
        self._left_generation = -1       # the last generation this rank has left
        self._peers = Peers(store, self.member)
        self._waiting: list[tuple[int, dict]] = []   # leader: registered joiners not admitted yet
        self._last_poll = 0.0
        self._heartbeat = Heartbeat(host, port, self.member, lambda: (runtime.generation, self._left_generation),
                                    lambda: runtime.interrupt_generation(port), runtime.watched_members,
                                    settings.failure_s, settings.startup_timeout_s, max(10.0, 3 * settings.failure_s))

    @property
    def has_joiners(self) -> bool:
        """Leader: ranks have registered to join and wait for admission."""
        return bool(self._waiting)

    def close(self) -> None:
        self._heartbeat.stop.set()

    # ----- the store ----------------------------------------------------------------------------------------
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

    # ----- failures -----------------------------------------------------------------------------------------
    def _leave(self, cause: str) -> int:
        """Leave the current generation: wake shm peers, abort the process groups, check in as alive."""
        rt = self._rt
        gen = rt.generation
        logger.warning("rank %d (member %d): lost a peer in generation %d (%s); re-forming", rt.topo.rank,
                       self.member, gen, cause)
        self.store.set(self._key(gen, "leaving"), b"1")     # wedged members notice it (Heartbeat)
        rt.leave_generation()
        self._left_generation = gen
        self._check_in(gen)
        gc.collect()       # after checking in (it takes ~0.1 s): the old groups' last references go, gloo closes them
        return gen

    def rejoin(self, cause: str) -> bool:
        """A follower after a lost peer: wait for the leader's plan of the next generation and adopt it (a plan
        that fails to form: check in again, under its number, for the next). False: not in it, or no job; leave."""
        gen = self._leave(cause) + 1
        rank = self._rt.topo.rank
        fault_point("checked_in", self.member, gen)   # counted alive for the next generation, gone before it forms
        for _ in range(len(self._rt.members)):         # each failed forming loses at least one member
            try:
                self.store.wait([self._key(gen, "plan")], timedelta(seconds=self.settings.collective_timeout_s))
                plan = self._read_plan(gen)
            except Exception as e:       # the leader (and its store) is gone: the job is over
                logger.error("rank %d (member %d): no plan for generation %d (%s); leaving", rank, self.member, gen, e)
                return False
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
        on a dead one); FormingFailed, nothing changed here, when one's process is gone or its heartbeat stops."""
        gen = plan["gen"]
        self.store.set(self._key(gen, f"ready/{self.member}"), b"1")
        _, lost = self._peers.survey(plan["members"], lambda m: {} if self.store.check([self._key(gen, f"ready/{m}")])
                                     else None, self.settings.failure_s, self.settings.collective_timeout_s)
        if lost:
            raise FormingFailed(f"members {sorted(lost)} were lost before generation {gen} formed")
        return self._rt.regroup(plan)

    def reform_as_leader(self, cause: str) -> None:
        """The leader after a lost peer: account for every member, plan the next generation, publish it and
        adopt it. Raises MembershipError (after telling the others) when the job cannot go on."""
        t0 = time.monotonic()
        gen = self._leave(cause)
        members = self._rt.members
        survey, lost = members, []
        for _ in range(len(members)):   # a member lost before the planned generation forms: survey the rest again
            alive, newly = self._peers.survey(survey, lambda m, g=gen: self._checked_in(g, m),
                                              self.settings.failure_s, self.settings.collective_timeout_s)
            lost = sorted(lost + newly)
            change = MembershipChange(gen + 1, [members.index(m) for m in lost], cause, lost,
                                      detect_s=time.monotonic() - t0, started=t0)
            try:
                plan = self._rt.plan_generation(gen + 1, alive, lost)
            except MembershipError as e:
                self._publish_plan(gen + 1, {"error": str(e)})
                raise
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
        self.changes.append(change)

    # ----- planned changes: scaling, joining, draining ------------------------------------------------------
    def between_steps(self, scales: list[dict], outbox, guard: Callable) -> bool:
        """Leader, between steps: carry out the scale requests whose joiners are here (answering ("scale",
        record) on the outbox), in order; with none waiting, admit any rank that registered to join (a pool
        launched against the job's pool address grows it). guard(action) runs an exchange, re-forming the job
        if a peer is lost. Returns whether the job changed."""
        gen = self._rt.generation
        while scales:
            record = guard(lambda: self.scale_as_leader(scales[0]))
            if record is None:
                return self._rt.generation != gen
            scales.pop(0)
            outbox.put(("scale", record))
        now = time.monotonic()
        if now - self._last_poll >= JOIN_POLL_S:
            self._last_poll = now
            joiners = self.joiners()
            if joiners:
                record = guard(lambda: self.change_as_leader([], joiners, "join"))
                if "error" in record:   # tell them, so they exit instead of waiting
                    logger.error("ranks %s cannot join: %s", [m for m, _ in joiners], record["error"])
                    self._admit([m for m, _ in joiners], record["error"])
                    self._waiting = []
        return self._rt.generation != gen

    def joiners(self) -> list[tuple[int, dict]]:
        """Leader: the ranks that have registered to join and are not admitted yet, in order of arrival
        (member, info); those whose process is already gone are dropped."""
        while self.store.queue_len(JOINS) > 0:
            member, info = msgpack.unpackb(self.store.queue_pop(JOINS, block=False), strict_map_key=False)
            self._waiting.append((member, info))
        self._waiting = [(m, i) for m, i in self._waiting if not self._peers.process_gone(m)]
        return list(self._waiting)

    def scale_as_leader(self, request: dict) -> dict | None:
        """Leader, between steps: carry out a scale request {"attention_ranks": n or None, "expert_ranks": n
        or None, "retire": [ranks] or None, "retire_hosts": [hostnames] or None, "deadline": monotonic time,
        optionally "cause" for the record}: retire the given ranks, then the last ranks of a pool above its
        target; admit registered joiners up to a pool's target. Returns the change's record, {"error": why}
        (nothing changes then), or None while joiners it needs have not registered yet (the caller asks again;
        past the deadline the request fails)."""
        rt = self._rt
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
        return [r for r, m in enumerate(self._rt.members) if self._peers.hostname(m) in hosts]

    def change_as_leader(self, retire: list[int], join: list[tuple[int, dict]], cause: str) -> dict:
        """Leader, between steps: a planned change (nobody failed): the members in retire leave (they exit),
        the joiners (member, info) join. Plan and publish the next generation, admit the joiners, tell every
        rank (RESHAPE), leave together, form it. Returns the change's record, or {"error": why} when the plan
        is refused (nothing changes then)."""
        rt, gen = self._rt, self._rt.generation
        budget = self.settings.expert_memory or 2**62
        infos = {m: {"expert_budget": budget} for m in rt.members}
        try:
            plan = rt.plan_generation(gen + 1, infos, retire, join, retiring=True)
        except MembershipError as e:
            return {"error": str(e)}
        plan["handover"] = self._plan_handover(retire)
        t0 = time.monotonic()
        self._publish_plan(gen + 1, plan)
        self._admit(plan["joined"], str(gen + 1))
        self._waiting = [j for j in self._waiting if j[0] not in plan["joined"]]
        change = MembershipChange(gen + 1, [rt.members.index(m) for m in retire], cause, sorted(retire),
                                  joined_members=list(plan["joined"]), started=t0)
        if gen >= 0:
            rt.start_reshape()
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
                   "deadline": time.monotonic() + self.settings.startup_timeout_s}
        while (record := self.scale_as_leader(request)) is None:
            time.sleep(0.05)
        if "error" in record:
            raise MembershipError(record["error"])

    def join(self, role: str, info: dict) -> None:
        """A rank that is not a member yet: register (role and info) and wait until a generation admits it, then
        form that generation."""
        self.store.queue_push(JOINS, msgpack.packb([self.member, {**info, "role": role}]))
        key = f"{PREFIX}/admit/{self.member}"
        self.store.wait([key], timedelta(seconds=self.settings.startup_timeout_s))
        answer = self.store.get(key).decode()
        if not answer.isdigit():
            raise MembershipError(f"member {self.member} ({role}) was refused: {answer}")
        self._form(self._read_plan(int(answer)))

    def reshape(self) -> bool:
        """A follower got RESHAPE: hand over its requests if it is a leaving attention rank (or take them over),
        leave the generation with everyone, then join the next one if it is a member (False: retired, leave
        the job)."""
        gen = self._rt.generation
        plan = self._read_plan(gen + 1)
        self._hand_over(plan)
        self._leave_together(gen)
        if self.member not in plan["members"]:
            logger.info("member %d: retired by a scale-in (generation %d)", self.member, gen + 1)
            return False
        self._form(plan)
        return True

    def _plan_handover(self, retire: list[int]) -> dict[str, int]:
        """Leader: for each attention rank that retires, the staying one that takes over its requests and KV
        blocks (the most free blocks, charged for what it takes) -> {str(leaving rank): taking rank}."""
        members, blocks = self._rt.members, self._rt.attention_blocks()
        staying = [r for r in range(len(blocks)) if members[r] not in retire]
        free = {r: blocks[r][0] for r in staying}
        out = {}
        for r, (num_free, num_blocks) in enumerate(blocks):
            if members[r] in retire:
                dst = max(staying, key=lambda k: (free[k], -k))
                free[dst] -= num_blocks - num_free
                out[str(r)] = dst
        return out

    def _hand_over(self, plan: dict) -> None:
        """Between steps, in the old generation: each retiring attention rank sends its live requests and their
        KV blocks to the rank the plan names, which takes them over; retiring expert ranks send the experts
        that only they hold to the staying ranks that take them (plan "staged"), which keep them for adopting
        the new placement."""
        rt = self._rt
        if not rt.topo.is_attention:
            rt.stage_experts(plan["staged"])
        for src, dst in sorted((int(s), d) for s, d in plan.get("handover", {}).items()):
            if rt.topo.rank == src:
                rt.send_requests(dst)
            elif rt.topo.rank == dst:
                rt.receive_requests(src)

    def _leave_together(self, gen: int) -> None:
        """Every rank at once, between steps: nobody is mid-exchange (flush: two_phase's last sends are taken), so
        the groups can go without a failure."""
        self._rt.dispatcher.flush()
        self._rt.barrier()
        self._rt.leave_generation()
        self._left_generation = gen
        gc.collect()
