"""The A:E autoscaler (option `autoscale`, a step-cost profile): the leader moves ranks between the attention and
expert pools, keeping their total (the rank budget the job started with), when the planner's model predicts a
faster split for the work the last window of steps did.

Signal. Each step's reports give, per attention rank, what it computed (tokens, the attention pairs they read,
logit rows, sequences: `StepReport.work`, counted by its scheduler on the host) and its wall and busy seconds
(wall less its waits on the data plane). The leader has these reports every step anyway: nothing is read from a
device or asked of another rank.

Model. The planner's (launch/plan/model.py `step_time`), with the profile's per-call costs (`python -m launch.plan
--calibrate --save-profile FILE` on this machine, or `--hardware`): for each split (A', E') of the budget it
predicts the window's steps with their summed work spread evenly over A' attention ranks, with the job's
micro-batches, and its core cap where the profile has one. The split with the least predicted time wins; a move
needs it at least `margin` below the current split's predicted time (both from the model, so that its bias
cancels). The measured step time and attention utilisation (busy / wall) go in each decision's record beside the
prediction, so `stats()["autoscale"]` shows how far the model is off.

Hysteresis. After a window that asked for a move, nothing more is asked until the pools have changed (or the
leader gave up the request); the first `window` steps after any change are not measured (dwell: new ranks warm
up, and requests moved with their KV settle), so the pools change at most once every two windows. A move is an
ordinary scale request (`LLM.scale`'s path: retired attention ranks hand their requests over with their KV
blocks, the experts are re-placed over the new expert pool), so no request is lost.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..plan.model import Plan, RankWork, StepCosts, step_time

HISTORY = 32     # decisions kept for stats()


@dataclass
class Autoscaler:
    """Decides, from the steps' reports, when to move ranks between the pools; `observe` returns the scale
    request to make, or None. budget: attention + expert ranks (kept); max_expert_ranks: the model's experts;
    plan: the job's scheduler limits and micro-batches (its pool sizes are ignored)."""

    costs: StepCosts
    plan: Plan
    budget: int
    max_expert_ranks: int
    window: int = 64
    margin: float = 0.15
    decisions: list[dict] = field(default_factory=list)
    _steps: list[RankWork] = field(default_factory=list)    # the window's steps: their work summed over ranks
    _busy: float = 0.0
    _wall: float = 0.0
    _pools: tuple[int, int] | None = None
    _skip: int = 0            # steps still to skip (dwell after a change)
    _asked: tuple[int, int] | None = None   # the split asked for, until the pools change or it is given up

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"autoscale_window={self.window!r} is invalid: pass a number of steps >= 1")
        if not 0 <= self.margin < 1:
            raise ValueError(f"autoscale_margin={self.margin!r} is invalid: pass a fraction in [0, 1), the least "
                             "predicted gain a move needs")

    def splits(self) -> list[tuple[int, int]]:
        """The splits of the budget: at least one rank per pool, at most one expert rank per expert."""
        return [(a, self.budget - a) for a in range(1, self.budget) if self.budget - a <= self.max_expert_ranks]

    def predict(self, attention: int, expert: int) -> float:
        """Mean seconds per step of the window's work on attention + expert ranks."""
        plan = replace(self.plan, attention_ranks=attention, expert_ranks=expert)
        total = 0.0
        for w in self._steps:
            share = RankWork(-(-w.tokens // attention), -(-w.pairs // attention), -(-w.rows // attention),
                             -(-w.seqs // attention))
            total += step_time(self.costs, plan, [share] * attention).seconds
        return total / len(self._steps)

    def _reset(self, skip: int) -> None:
        self._steps, self._busy, self._wall, self._skip = [], 0.0, 0.0, skip

    def observe(self, attention: int, expert: int, work: list[list[int]], busy: list[float], wall: list[float],
                pending: bool = False) -> dict | None:
        """One step on `attention` + `expert` ranks: each attention rank's work [tokens, pairs, rows, seqs] and
        busy and wall seconds; pending: the leader still holds the request asked for. Returns a scale request
        {"attention_ranks", "expert_ranks", "cause": "autoscale"} when a window ends predicting a split at least
        margin faster, else None."""
        if (attention, expert) != self._pools:
            self._pools, self._asked = (attention, expert), None
            self._reset(self.window)
        elif self._asked is not None and not pending:
            self.decisions.append({"gave_up": list(self._asked)})
            self._asked = None
            self._reset(self.window)
        tokens = sum(w[0] for w in work if w)
        if self._asked is not None or not tokens:
            return None
        if self._skip > 0:
            self._skip -= 1
            return None
        self._steps.append(RankWork(*(sum(w[i] for w in work if w) for i in range(4))))
        self._busy, self._wall = self._busy + max(busy), self._wall + max(wall)
        if len(self._steps) < self.window:
            return None
        now = self.predict(attention, expert)
        best = min(self.splits(), key=lambda s: (self.predict(*s), abs(s[0] - attention)))
        predicted = self.predict(*best)
        n = len(self._steps)
        record = {"pools": [attention, expert], "steps": n, "step_s": self._wall / n,
                  "attention_util": self._busy / self._wall if self._wall > 0 else 0.0,
                  "model_s": now, "best": list(best), "predicted_s": predicted,
                  "moved": best != (attention, expert) and predicted <= (1 - self.margin) * now}
        self.decisions.append(record)
        del self.decisions[:-HISTORY]
        self._reset(0)
        if not record["moved"]:
            return None
        self._asked = best
        return {"attention_ranks": best[0], "expert_ranks": best[1], "cause": "autoscale"}

    def summary(self) -> dict:
        return {"budget": self.budget, "window": self.window, "margin": self.margin, "profile": self.costs.source,
                "decisions": list(self.decisions)}
