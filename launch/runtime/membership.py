"""Membership changes that nobody failed: ranks joining, scaling and draining, and how a leaving attention rank's
requests are handed over; built on generations.py (forming a generation, re-forming after a failure). This
rank's runtime is reached through `MemberRuntime` (changes.py) alone.

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
members of the next one form it (the retired ones exit). Joining expert ranks are not in the old generation's
groups: the experts only retiring ranks hold that go to a joiner travel over a side group of the retiring ranks
and the joiners ("handoff"), once the retiring ranks are out of the old generation and before the joiners form
the new one; a handoff that fails leaves the joiners to read those experts from the checkpoint.
A failure during a planned change (a rank lost in the old generation's exchanges, or before the new one forms)
gives the new generation up and re-forms from the old one's survivors (retiring ranks too); the requests stay
where the attention ranks say they hold them (a retiring rank drops what it hands over, so one lost on the way
resumes elsewhere), the joiners register again, and the leader asks the scale request again: it is carried out
if it still can be, else refused, saying a rank was lost.
"""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from datetime import timedelta

import msgpack
import torch.distributed as dist

from . import planning
from .changes import FormingFailed, MemberRuntime, MembershipChange, MembershipSettings
from .generations import Generations, failure_of
from .liveness import PREFIX
from .planning import MembershipError
from .step_protocol import fault_point

JOINS = f"{PREFIX}/joins"    # the store queue that ranks wanting to join register on
JOIN_POLL_S = 0.2    # how often the leader looks for ranks registering to join
REJOIN_GRACE_S = 5.0   # after a planned change failed, how long its retry waits for the joiners to register again

logger = logging.getLogger("afserve")


class Membership(Generations):
    """This rank's side of membership changes: failures (Generations) and planned changes."""

    poll_s = JOIN_POLL_S

    def __init__(self, runtime: MemberRuntime, store: dist.Store, host: str, port: int,
                 settings: MembershipSettings):
        super().__init__(runtime, store, host, port, settings)
        self._waiting: list[tuple[int, dict]] = []   # leader: registered joiners not admitted yet
        self._last_poll = 0.0

    @property
    def has_joiners(self) -> bool:
        """Leader: ranks have registered to join and wait for admission."""
        return bool(self._waiting)

    def _admit(self, members, answer: str) -> None:
        """Answer ranks waiting to join: the generation that admits them, or why they are refused."""
        for m in members:
            self.store.set(f"{PREFIX}/admit/{m}", answer)
    # ----- planned changes: scaling, joining, draining ------------------------------------------------------
    def between_steps(self, scales: list[dict], outbox, guard: Callable) -> bool:
        """Leader, between steps: carry out the scale requests whose joiners are here (answering ("scale",
        record) on the outbox), in order; with none waiting, admit any rank that registered to join (a pool
        launched against the job's pool address grows it). guard(action) runs an exchange, re-forming the job
        if a peer is lost. Returns whether the job changed."""
        gen = self._rt.generation
        while scales:
            record = guard(lambda: self.scale_as_leader(scales[0], outbox))
            if record is None:
                return self._rt.generation != gen
            request = scales.pop(0)
            outbox.put((request.get("reply", "scale"), record))
            if request.get("cause") == "autoscale" and "error" in record:
                self._rt.leader.autoscaler.refused(record["error"])
        now = time.monotonic()
        if now - self._last_poll >= JOIN_POLL_S:
            self._last_poll = now
            joiners = self.joiners()
            pd = self._rt.config.parallel.prefill_ranks > 0
            refused = [(m, why) for m, info in joiners if (why := planning.joiner_refusal(m, info, pd))]
            for m, why in refused:        # refused by name; the others still join
                logger.error("rank %s cannot join: %s", m, why)
                self._admit([m], why)
            gone = {m for m, _ in refused}
            self._waiting = [j for j in self._waiting if j[0] not in gone]
            joiners = [j for j in joiners if j[0] not in gone]
            if joiners:
                record = guard(lambda: self.change_as_leader([], joiners, "join"))
                if record is not None and "error" in record:   # tell them, so they exit instead of waiting
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

    def scale_as_leader(self, request: dict, outbox=None) -> dict | None:
        """Leader, between steps: carry out a scale request {"attention_ranks": n or None, "expert_ranks": n
        or None, PD's "prefill_ranks" and "decode_ranks" (n or None) instead of attention_ranks, "retire":
        [ranks] or None, "retire_hosts": [hostnames] or None, "deadline": monotonic time, optionally "cause" for
        the record, "spawn": True when the asker starts the joiners}: retire the given ranks, then the last ranks
        of a pool above its target; admit registered joiners up to a pool's target (with "spawn", first answer
        ("spawn", [the role of each joiner missing], deadline) on outbox, once). Returns the change's record,
        {"error": why} (nothing changes then), or None while joiners it needs have not registered yet (the caller
        asks again; past the deadline the request fails)."""
        rt = self._rt
        A, W = rt.topo.num_attention_ranks, rt.topo.world_size
        if "retire_members" not in request:   # ranks are renumbered if the job re-forms before the request is done
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
            request["retire_members"] = [rt.members[r] for r in retire]
        retire = [r for r, m in enumerate(rt.members) if m in request["retire_members"]]
        pools = self._pools(request, A, W)
        if isinstance(pools, str):
            return {"error": pools}
        waiting, join, needs = self.joiners(), [], []
        for name, ranks, want, roles in pools:
            staying = [r for r in ranks if r not in retire]
            if want is not None:
                retire += staying[want:]        # rank 0 is the first pool's first rank, and want >= 1
            need = max(0, (want or len(staying)) - len(staying))
            fits = [j for j in waiting if j[1]["role"] in roles and j not in join][:need]
            join += fits
            needs.append((name, want or len(staying), need, len(fits)))
        if request.get("spawn") and not request.get("spawned") and (outbox is not None or rt.launcher):
            spawn = [name for name, _, need, got in needs for _ in range(need - got)]
            # this host's ranks and the registered joiners (admitted or not) each hold a GPU already
            here = self.ranks_here()
            if why := planning.gpu_room_refusal(rt.dev.backend, rt.dev.gpus, here + len(waiting), len(spawn)):
                return {"error": why}
            request["spawned"] = True     # from the pools as they are now, which only the leader knows
            if rt.launcher is None:   # the front that spawned the job starts them (LLM._poll skips a stale one)
                outbox.put(("spawn", spawn, request.get("deadline"), rt.new_member_ids(len(spawn))))
            elif spawn:
                try:
                    rt.launcher.start(spawn, request.get("deadline"))
                except Exception as e:    # no free GPU on this host, or no process could start: refused
                    logger.error("the joiners %s could not start: %s", spawn, e)
                    return {"error": f"the joining rank(s) {spawn} could not start: {type(e).__name__}: {e}"}
        if needs[-1][1] < 1:     # the expert pool's target
            return {"error": f"retiring ranks {sorted(retire)} would leave no expert rank; one must stay"}
        if any(got < need for _, _, need, got in needs):
            want = " + ".join(f"{n} {name}" for name, n, _, _ in needs)
            missing = ", ".join(f"{need} {name}" for name, _, need, got in needs if got < need)
            got = sum(got for *_, got in needs)
            if time.monotonic() < request["deadline"]:
                return None
            if request.get("interrupted"):
                return {"error": f"a rank was lost while the job changed (it went on with {A} + {W - A} ranks): "
                                 f"scaling to {want} ranks now needs {missing} rank(s) to join, but {got} "
                                 f"registered; scale again"}
            return {"error": f"scaling to {want} ranks needs {missing} rank(s) to join, but {got} registered in "
                             f"time; launch them against the job's pool address (serve.py --role ... --pool-addr)"}
        if not retire and not join:
            return {"unchanged": True, "attention_ranks": A, "expert_ranks": W - A,
                    "prefill_ranks": rt.leader.prefill_ranks}
        record = self.change_as_leader([rt.members[r] for r in sorted(set(retire))], join,
                                       request.get("cause", "scale"))
        if record is None and rt.generation >= 0:   # the job re-formed: ask again once the joiners are back
            request.update(interrupted=True, deadline=min(request["deadline"], time.monotonic() + REJOIN_GRACE_S))
        return record

    def _pools(self, request: dict, A: int, W: int) -> list[tuple[str, range, int | None, tuple[str, ...]]] | str:
        """A scale request's pools: (name, their ranks now, the target or None to keep, the joiner roles that
        fill it), or why the request is refused. A PD job's attention pool is two, prefill_ranks and decode_ranks
        (one left without decode ranks has every rank in its prefill pool until one joins)."""
        pd = self._rt.config.parallel.prefill_ranks > 0
        if why := planning.pools_refusal(request, pd):
            return why
        experts = ("expert", range(A, W), request.get("expert_ranks"), ("expert",))
        if not pd:
            return [("attention", range(A), request.get("attention_ranks"), ("attention", "decode")), experts]
        cut = min(self._rt.leader.prefill_ranks, A) or A    # the pool leader alone at start-up: min
        return [("prefill", range(cut), request.get("prefill_ranks"), ("prefill", "attention")),
                ("decode", range(cut, A), request.get("decode_ranks"), ("decode",)), experts]

    def ranks_on(self, hosts: list[str]) -> list[int]:
        """The ranks whose process runs on one of hosts (hostnames, as the process's host sees its own)."""
        return [r for r, m in enumerate(self._rt.members) if self._peers.hostname(m) in hosts]

    def ranks_here(self) -> int:
        """How many of the generation's ranks run on this rank's machine, whichever launch started them."""
        return self._peers.count_here(self._rt.members)

    def change_as_leader(self, retire: list[int], join: list[tuple[int, dict]], cause: str) -> dict | None:
        """Leader, between steps: a planned change (nobody failed): the members in retire leave (they exit),
        the joiners (member, info) join. Plan and publish the next generation, admit the joiners, tell every
        rank (RESHAPE), leave together, form it. Returns the change's record, {"error": why} when the plan
        is refused (nothing changes then), or None when a rank was lost on the way and the job re-formed without
        it (_recover_change): the caller asks again."""
        rt, gen = self._rt, self._rt.generation
        nxt = max(gen, self._given_up) + 1     # separate pool launches: one that failed to form is not reused
        budget = self.settings.expert_memory or 2**62
        infos = {m: {"expert_budget": budget} for m in rt.members}
        try:
            plan = rt.plan_generation(nxt, infos, retire, join, retiring=True)
        except MembershipError as e:
            return {"error": str(e)}
        plan["handover"] = self._plan_handover(retire)
        t0 = time.monotonic()
        self._publish_plan(nxt, plan)
        self._admit(plan["joined"], str(nxt))
        self._waiting = [j for j in self._waiting if j[0] not in plan["joined"]]
        change = MembershipChange(nxt, [rt.members.index(m) for m in retire], cause, sorted(retire),
                                  joined_members=list(plan["joined"]), started=t0)
        failed = None if gen < 0 else failure_of(lambda: (rt.start_reshape(), self._hand_over(plan),
                                                        self._leave_together(gen)))
        change.detect_s = time.monotonic() - t0
        if failed is None:
            failed = failure_of(lambda: self._adopt(plan, change), forming_only=True)
        if failed is not None:
            return self._recover_change(plan, failed, t0)
        logger.warning("generation %d: retired %s, joined %s; %d + %d ranks; groups %.2fs, weights %.2fs", nxt,
                       change.lost_members, change.joined_members, change.attention_ranks, change.expert_ranks,
                       change.groups_s, change.weights_s)
        return change.to_dict()

    def form_pool(self, attention_ranks: int, expert_ranks: int) -> None:
        """The leader of separate pool launches, alone at start-up: a scale request to this many ranks of each
        pool, waited for until its ranks have registered (within startup_timeout_s): generation 0. With PD the
        attention ranks are prefill_ranks prefill ranks (the leader's own launch, then --role prefill or attention
        launches) and the rest decode ranks (--role decode launches)."""
        P = self._rt.config.parallel.prefill_ranks
        pools = {"prefill_ranks": P, "decode_ranks": attention_ranks - P} if P else {"attention_ranks": attention_ranks}
        request = {**pools, "expert_ranks": expert_ranks, "cause": "start",
                   "deadline": time.monotonic() + self.settings.startup_timeout_s}
        while (record := self.scale_as_leader(request)) is None:
            time.sleep(0.05)
        if "error" in record:
            raise MembershipError(record["error"])

    def _recover_change(self, plan: dict, cause: str, t0: float) -> dict | None:
        """Leader: a planned change to plan's generation g failed (a peer lost in the old generation's exchanges,
        or before g formed). Nobody formed g (every member waits until all are ready, and one that fails never
        is). Give g up, leave the old generation if still in it, check in under g, and re-form as after a
        failure: g + 1 is the old members that live (retiring ones too; those already gone count as lost), the
        joiners register again, and the requests stay where the attention ranks say they are (a handover may
        have moved them; those nobody holds resume elsewhere). -> None: the caller asks again."""
        rt, g = self._rt, plan["gen"]
        self._give_up(g)
        logger.warning("generation %d (a planned change) did not form: %s; re-forming without the lost", g, cause)
        rt.abandon_change()
        if rt.generation < 0:   # separate pool launches starting: no old generation; the joiners register again
            return None
        if rt.left:
            self._check_in(g)
        else:
            self._leave(cause, check_in=g)
        self._reform(g, f"{cause} (during a planned change)", t0, held=True)
        return None

    def join(self, role: str, info: dict) -> None:
        """A rank that is not a member yet: register (role and info) and wait until a generation admits it, then
        form that generation (one that fails to form: register again, within startup_timeout_s)."""
        key = f"{PREFIX}/admit/{self.member}"
        deadline = time.monotonic() + self.settings.startup_timeout_s
        while True:
            self.store.queue_push(JOINS, msgpack.packb([self.member, {**info, "role": role}]))
            self.store.wait([key], timedelta(seconds=max(1.0, deadline - time.monotonic())))
            answer = self.store.get(key).decode()
            if not answer.isdigit():
                raise MembershipError(f"member {self.member} ({role}) was refused: {answer}")
            fault_point("admitted", self.member, int(answer))
            plan = self._read_plan(int(answer))
            self._rt.take_handoff(plan)
            try:
                self._form(plan)
                return
            except FormingFailed as e:
                logger.warning("member %d (%s): %s; registering again", self.member, role, e)
                self._rt.abandon_change()
            self.store.delete_key(key)

    def reshape(self) -> bool:
        """A follower got RESHAPE: hand over its requests if it is a leaving attention rank (or take them over),
        leave the generation with everyone, then join the next one if it is a member (False: retired, leave
        the job)."""
        rt, gen = self._rt, self._rt.generation
        plan = self._read_plan(gen + 1)
        fault_point("reshape", self.member, gen + 1)
        failed = failure_of(lambda: (self._hand_over(plan), fault_point("handed_over", self.member, gen + 1),
                                   self._leave_together(gen)))
        member = self.member in plan["members"]
        if failed is None and not member:
            logger.info("member %d: retired by a scale-in (generation %d)", self.member, gen + 1)
            self.store.set(self._key(gen + 1, f"alive/{self.member}"), msgpack.packb({"retired": True}))
            rt.hand_off_experts(plan)    # to the joiners, which are not in the old generation
            return False
        if failed is None:
            failed = failure_of(lambda: self._form(plan), forming_only=True)
            if failed is None:
                return True
        # The change failed (see _recover_change): re-form as after a failure, under the failed plan's number.
        logger.warning("rank %d (member %d): generation %d did not form (%s); re-forming", rt.topo.rank,
                       self.member, gen + 1, failed)
        if member and not self._ready(gen + 1):
            self._give_up(gen + 1)
        rt.abandon_change()
        if rt.left:
            self._check_in(gen + 1)
        else:
            self._leave(failed, check_in=gen + 1)
        return self._follow_plans(gen + 2)

    def _plan_handover(self, retire: list[int]) -> dict[str, int]:
        members = self._rt.members
        return planning.plan_handover(self._rt.attention_blocks(),
                                      [r for r in range(len(members)) if members[r] in retire],
                                      self._rt.leader.prefill_ranks)

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
