"""The shape of a step (its micro-batches, and PD's decode passes).

PD decode passes: in a step of a PD job the decode ranks may run several forwards while the prefill ranks run
one, over the one expert pool and its one data plane.

Every MoE layer's exchange is a round that every rank joins (launch/runtime/step_protocol.py): the expert ranks
serve, per step, `passes` x L rounds (L: the target's MoE layers), pass j's round l for MoE layer l. A decode
rank runs one forward per pass, sampling and committing between them. A prefill rank runs its one forward with
its MoE layers spread over the passes (`StretchedMoE`): layer l goes in pass l * passes // L, and in the
rounds in between it joins with no tokens. So a decode pass waits for about L / passes of the prefill's layers,
not all of them, and a long prompt's chunk no longer sets the decode ranks' time per token: the leader picks the
passes (`PassPlanner`) so that the prefill's forward and the decode ranks' passes take about as long.
"""
from __future__ import annotations

from comm.control import StepReport

EMA = 0.3     # weight of the newest step in the leader's per-token and per-pass estimates


def round_of(layer: int, num_layers: int, passes: int) -> int:
    """The round (0..passes * num_layers - 1) in which a prefill rank's MoE layer `layer` is exchanged."""
    return layer * passes // num_layers * num_layers + layer


class StretchedMoE:
    """A prefill rank's MoEContext for a step of `passes` decode passes: each MoE layer's dispatch goes in its
    round (`round_of`), and this rank joins every other round with no tokens (as `join_exchanges` does: the
    replica counts' gather over the attention group too). `close()` after the forward joins the rounds left.
    Everything else is the wrapped context's."""

    def __init__(self, moe, num_layers: int, passes: int):
        self.moe, self.num_layers, self.passes = moe, num_layers, passes
        self.next_round = 0
        self._empty = None    # (x, ids, weights) with no rows, shaped as this rank's last dispatch

    def __getattr__(self, name):
        return getattr(self.moe, name)

    def start(self, moe_layer: int, x, ids, weights):
        self._empty = (x[:0], ids[:0], weights[:0])
        self._join_until(round_of(moe_layer, self.num_layers, self.passes))
        self.next_round += 1
        return self.moe.start(moe_layer, x, ids, weights)

    def finish(self, pending):
        return self.moe.finish(pending)

    def close(self) -> None:
        """After the forward: join the rounds of the step this rank has not joined yet."""
        self._join_until(self.passes * self.num_layers)

    def _join_until(self, end: int) -> None:
        while self.next_round < end:
            self.moe.finish(self.moe.start(self.next_round % self.num_layers, *self._empty))
            self.next_round += 1


def merge_reports(reports: list[StepReport]) -> StepReport:
    """One report for a step's passes (each a full StepReport of one forward, in order): the outputs and prefix
    cache events of all of them, the rest (cumulative counts, state) as the last one says; wall seconds summed."""
    last = reports[-1]
    if len(reports) == 1:
        return last
    out = StepReport(**{f: getattr(last, f) for f in last.__dataclass_fields__})
    out.outputs = [o for r in reports for o in r.outputs]
    out.cache_added = [k for r in reports for k in r.cache_added]
    out.cache_evicted = [k for r in reports for k in r.cache_evicted]
    out.wall_s = sum(r.wall_s for r in reports)
    out.passes = sum(r.passes for r in reports)
    return out


class PassPlanner:
    """The leader's choice of a step's decode passes: about as many as the prefill's forward takes decode passes,
    so that the decode ranks go on while it runs, without the passes outlasting it. Exponential averages of:
    - a decode pass's wall time alone, from the decode ranks' steps of one pass in which no prefill rank
      computed (the fixed cost of a forward through every layer's exchange);
    - a prompt token's, from the prefill ranks' steps of one pass: their wall time beyond that fixed cost, per
      prompt token; so a prefill's forward is predicted at the fixed cost plus its tokens';
    - a decode pass's wall time in steps of several (where the prefill runs beside it: slower when the two share
      the machine's cores, or when a pass waits for the prefill layers it holds).
    The passes: the predicted prefill forward over the last (the alone one until a step of several has run). One
    pass when either side has no work, before both have been measured, or with max_passes 1."""

    def __init__(self, max_passes: int):
        self.max_passes = max_passes
        self.s_per_prompt_token = self.s_per_decode_pass = self.s_per_shared_pass = None
        self.prompt_tokens: list[int] = []    # each rank's prompt_tokens_computed at its last report
        self.num_multi_pass_steps = 0

    def observe(self, reports: list[StepReport], prefill_ranks: int) -> None:
        """A step's reports (in rank order; after a membership change the ranks' counts start over)."""
        if len(self.prompt_tokens) != len(reports):
            self.prompt_tokens = [r.prompt_tokens_computed for r in reports]
            return
        tokens = [r.prompt_tokens_computed - before for r, before in zip(reports, self.prompt_tokens)]
        self.prompt_tokens = [r.prompt_tokens_computed for r in reports]
        for r in reports[prefill_ranks:]:
            if r.num_running and r.passes > 1 and r.wall_s > 0:
                self.s_per_shared_pass = _ema(self.s_per_shared_pass, r.wall_s / r.passes)
        if not any(tokens[:prefill_ranks]):
            for r in reports[prefill_ranks:]:
                if r.num_running and r.passes == 1 and r.wall_s > 0:
                    self.s_per_decode_pass = _ema(self.s_per_decode_pass, r.wall_s)
        elif self.s_per_decode_pass is not None:
            for r, n in zip(reports[:prefill_ranks], tokens):
                if n > 0 and r.passes == 1:     # (a stretched forward's wall is the passes')
                    self.s_per_prompt_token = _ema(self.s_per_prompt_token,
                                                   max(0.0, r.wall_s - self.s_per_decode_pass) / n)

    def choose(self, prefill_tokens: int, decoding: bool) -> int:
        """The passes of a step whose busiest prefill rank computes about prefill_tokens prompt tokens
        (decoding: some decode rank has sequences to run)."""
        if self.max_passes <= 1 or not prefill_tokens or not decoding or not self.s_per_decode_pass or \
                self.s_per_prompt_token is None:
            return 1
        prefill_s = self.s_per_decode_pass + prefill_tokens * self.s_per_prompt_token
        passes = round(prefill_s / (self.s_per_shared_pass or self.s_per_decode_pass))
        passes = max(1, min(self.max_passes, passes))
        self.num_multi_pass_steps += passes > 1
        return passes


def micro_batches_for(tokens: int, configured: int, min_tokens: int) -> int:
    """The micro-batches a step runs: the configured number when the least busy attention rank that runs any
    token carries at least min_tokens per micro-batch, else 1 (below that, two small forwards cost more per op
    than their overlap saves). An idle rank joins each micro-batch's exchanges empty: it does not count."""
    return configured if configured > 1 and tokens >= configured * min_tokens else 1


def step_shape(reports: list[StepReport], prompt_tokens: dict[int, int], budget: int, prefill_ranks: int,
               planner: PassPlanner, micro_batches: int, min_tokens: int) -> tuple[int, int]:
    """The leader's (micro-batches, decode passes) for a step, from the ranks' last reports (as this step's moves
    left them) and the prompt tokens its new requests bring each rank. Several decode passes run one micro-batch
    each (a prefill rank's stretched forward is one)."""
    tokens = [min(budget, r.max_next_tokens + prompt_tokens.get(i, 0)) for i, r in enumerate(reports)]
    P = prefill_ranks
    passes = planner.choose(max(tokens[:P] or [0]), any(r.num_running for r in reports[P:])) if P else 1
    if passes > 1:
        return 1, passes
    running = min([t for i, (t, r) in enumerate(zip(tokens, reports)) if r.max_next_tokens or i in prompt_tokens]
                  or [0])
    return micro_batches_for(running, micro_batches, min_tokens), 1


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new
