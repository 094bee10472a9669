"""The expert handoff of a planned change that retires and adds expert ranks: the experts that only retiring ranks
hold and that go to joining ranks (the plan's "handoff", planning.staged_moves). The joiners are not in the old
generation's groups and the retiring ranks not in the new one's, so these travel over a side group of the two
(comm/p2p.py SideGroup, on the job's store under "afserve/g{g}/handoff"): the retiring ranks once they are out of
the old generation, the joiners before they form the new one. Best effort: what does not arrive is read from the
checkpoint, as before the handoff existed.

A handoff entry is [layer, joiner's new expert index, its slot, donor's old expert index, its slot]. Side ranks:
the donors by old index, then the joiners by new index."""
from __future__ import annotations

import logging

from comm import p2p
from expert_nodes.slots import ExpertSlots

from .liveness import PREFIX

logger = logging.getLogger("afserve")


def side_ranks(handoff: list[list[int]]) -> tuple[list[int], list[int]]:
    """(donors' old expert indices, joiners' new ones), each sorted: donor i is side rank i, joiner j side rank
    len(donors) + j."""
    return sorted({m[3] for m in handoff}), sorted({m[1] for m in handoff})


def side_moves(handoff: list[list[int]]) -> list[tuple[int, int, int, int, int]]:
    """The handoff's moves in side ranks: (layer, joiner's side rank, its slot, donor's side rank, its slot)."""
    donors, joiners = side_ranks(handoff)
    return [(layer, len(donors) + joiners.index(j), dslot, donors.index(d), sslot)
            for layer, j, dslot, d, sslot in handoff]


def exchange(store, slots: ExpertSlots, plan: dict, side_rank: int, member: int, timeout_s: float) -> dict:
    """This rank's part of the plan's handoff as side rank side_rank: a donor sends from `slots`, a joiner receives
    -> what landed here ((layer, slot) -> the expert's tensors; empty on a donor, and when the handoff failed).
    Forming the side group waits at most timeout_s for the others."""
    donors, joiners = side_ranks(plan["handoff"])
    failed = None
    try:
        group = p2p.SideGroup(store, f"{PREFIX}/g{plan['gen']}/handoff", side_rank, len(donors) + len(joiners),
                              timeout_s)
        landed, received, _ = slots.exchange(side_moves(plan["handoff"]), side_rank, lambda r: r, group)
        logger.info("member %d: handoff of generation %d: %d experts received", member, plan["gen"], received)
        return landed
    except RuntimeError as e:    # a side that died or never came: the checkpoint has every expert
        failed = str(e).splitlines()[0][:200]
    logger.warning("member %d: the expert handoff of generation %d failed (%s); the joiners read those experts "
                   "from the checkpoint", member, plan["gen"], failed)
    return {}
