"""The A:E autoscaler (option `autoscale`, a step-cost profile): the leader moves ranks between the attention and
expert pools, keeping their total (the rank budget: the pools' total now), when a window of steps predicts a
split at least `margin` faster.

Signal. Each step's reports give, per attention rank, what it computed (tokens, the attention pairs they read,
logit rows, sequences: `StepReport.work`, counted by its scheduler on the host) and its wall and busy seconds
(wall less its waits on the data plane). The leader has these reports every step anyway: nothing is read from a
device or asked of another rank.

Model. The planner's step model (launch/plan/model.py `step_time`, with the profile's per-call costs) gives the
shape; the window's measurements give the scale. For each split (A', E') of the budget the model prices the
window's steps with their summed work spread evenly over A' attention ranks (a share over a rank's
max_num_seqs or max_num_batched_tokens takes as many steps as it needs), with the job's micro-batches: the
busiest attention rank's busy time a' and one expert rank's e'. The window measured, per step, the busiest
attention rank's busy time B and the longest wall W, which the model prices as a and e on the current split.
The split is predicted at B * a' / a + (W - B) * e' / e: the attention side's measured time scaled as the model
scales attention work, and the rest (what the attention side waited on: the experts and the exchange) scaled as
it scales the expert work. The fastest split wins when it is predicted at least `margin` below W. (The profile's
own step times were 3-5x below the measured ones on this VM: `bench/autoscale.py`, docs/planning.md; the ratios
are what the model is trusted for.)

Hysteresis. Nothing is measured or asked while any scale request waits (the autoscaler's own or a user's); the
first `window` steps after any change of the pools are not measured (dwell: new ranks warm up, and requests moved
with their KV settle), so the pools change at most once every two windows. A split the leader refused (its
record's error: e.g. no GPU room for the joiner, or joiners that never came) is measured afresh after a back-off
that doubles with each refusal (up to 16 windows) until the job changes. A move is an ordinary
scale request (`LLM.scale`'s path: a retired attention rank hands its requests over with their KV blocks, the
experts are re-placed over the new expert pool), so no request is lost.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..plan.model import Plan, RankWork, StepCosts, step_time

HISTORY = 32     # decisions kept for stats()


@dataclass
class Autoscaler:
    """Decides, from the steps' reports, when to move ranks between the pools; `observe` returns the scale
    request to make, or None. max_expert_ranks: the model's experts; plan: the job's micro-batches and scheduler
    limits (its pool sizes are ignored)."""

    costs: StepCosts
    plan: Plan
    max_expert_ranks: int
    window: int = 64
    margin: float = 0.15
    decisions: list[dict] = field(default_factory=list)
    budget: int = 0                         # the pools' total, set by the first step observed
    _steps: list[RankWork] = field(default_factory=list)    # the window's steps: their work summed over ranks
    _busy: float = 0.0
    _wall: float = 0.0
    _job: tuple[int, int, int] | None = None   # (generation, attention, expert) last seen
    _skip: int = 0                          # steps still to skip (dwell after a change, back-off after a refusal)
    _asked: tuple[int, int] | None = None   # the split asked for, until the job changes or it is refused
    _refusals: int = 0                      # refused requests since the job last changed

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"autoscale_window={self.window!r} is invalid: pass a number of steps >= 1")
        if not 0 <= self.margin < 1:
            raise ValueError(f"autoscale_margin={self.margin!r} is invalid: pass a fraction in [0, 1), the least "
                             "predicted gain a move needs")

    def splits(self) -> list[tuple[int, int]]:
        """The splits of the budget: at least one rank per pool, at most one expert rank per expert."""
        return [(a, self.budget - a) for a in range(1, self.budget) if self.budget - a <= self.max_expert_ranks]

    def model(self, attention: int, expert: int) -> tuple[float, float]:
        """The model's mean (busiest attention rank's busy s, one expert rank's busy s) per window step, its work
        on attention + expert ranks."""
        plan = replace(self.plan, attention_ranks=attention, expert_ranks=expert)
        a = e = 0.0
        for w in self._steps:
            share = [-(-x // attention) for x in (w.tokens, w.pairs, w.rows, w.seqs)]
            n = max(1, -(-share[3] // plan.max_num_seqs), -(-share[0] // plan.max_num_batched_tokens))
            t = step_time(self.costs, plan, [RankWork(*(-(-x // n) for x in share))] * attention)
            a, e = a + n * t.attention_busy, e + n * t.expert_busy
        return a / len(self._steps), e / len(self._steps)

    def refused(self, why: str) -> None:
        """The leader refused the split asked for (its record's error): measure afresh after a back-off of a window
        times 2 ** (refusals since the job last changed, at most 4)."""
        back_off = self.window * 2 ** min(self._refusals, 4)
        if self._asked is not None:
            self._note({"refused": list(self._asked), "why": why, "back_off_steps": back_off})
        self._asked, self._refusals = None, self._refusals + 1
        self._reset(back_off)

    def _note(self, record: dict) -> None:
        self.decisions.append(record)
        del self.decisions[:-HISTORY]

    def _reset(self, skip: int) -> None:
        self._steps, self._busy, self._wall, self._skip = [], 0.0, 0.0, skip

    def observe(self, attention: int, expert: int, work: list[list[int]], busy: list[float], wall: list[float],
                pending: bool = False, generation: int = 0) -> dict | None:
        """One step on `attention` + `expert` ranks of the job's `generation`: each attention rank's work [tokens,
        pairs, rows, seqs] and busy and wall seconds; pending: a scale request waits at the leader. Returns a scale
        request {"attention_ranks", "expert_ranks", "cause": "autoscale"} when a window ends predicting a split at
        least margin faster, else None."""
        if pending:
            return None
        if (generation, attention, expert) != self._job:     # the job re-formed: a move, a user's scale, a loss
            self._job, self.budget, self._asked, self._refusals = (generation, attention, expert), attention + expert, \
                None, 0
            self._reset(self.window)
        elif self._asked is not None:      # no longer pending, pools unchanged, no error heard: dropped
            self.refused("the request ended without changing the pools")
        tokens = sum(w[0] for w in work if w)
        if not tokens or not wall or max(wall) <= 0:
            return None
        if self._skip > 0:
            self._skip -= 1
            return None
        self._steps.append(RankWork(*(sum(w[i] for w in work if w) for i in range(4))))
        self._busy, self._wall = self._busy + max(busy), self._wall + max(wall)
        if len(self._steps) < self.window:
            return None
        n = len(self._steps)
        B, W = self._busy / n, self._wall / n
        a0, e0 = self.model(attention, expert)
        predicted = {}
        for s in self.splits():
            a, e = self.model(*s)
            predicted[s] = B * _ratio(a, a0) + (W - B) * _ratio(e, e0)
        options = [s for s in predicted if s != (attention, expert)]
        best = min(options, key=lambda s: (predicted[s], abs(s[0] - attention)), default=None)
        record = {"pools": [attention, expert], "steps": n, "step_s": W, "attention_util": B / W if W > 0 else 0.0,
                  "model_attention_s": a0, "model_expert_s": e0, "best": None if best is None else list(best),
                  "predicted_s": None if best is None else predicted[best]}
        record["moved"] = best is not None and predicted[best] <= (1 - self.margin) * W and predicted[best] < W
        self._note(record)
        self._reset(0)
        if not record["moved"]:
            return None
        self._asked = best
        return {"attention_ranks": best[0], "expert_ranks": best[1], "cause": "autoscale"}

    def summary(self) -> dict:
        return {"budget": self.budget, "window": self.window, "margin": self.margin, "profile": self.costs.source,
                "decisions": list(self.decisions)}


def _ratio(new: float, old: float) -> float:
    """How the model scales a side's time: new / old (1 where it prices the side at nothing)."""
    return new / old if old > 0 and math.isfinite(new / old) else 1.0
