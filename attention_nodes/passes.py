"""The shape of a step (its micro-batches, and PD's decode passes).

PD decode passes: in a step of a PD job the decode ranks may run several forwards while the prefill ranks run
one, over the one expert pool and its one data plane.

Every MoE layer's exchange is a round that every rank joins (launch/runtime/step_protocol.py): the expert ranks
serve, per step, `passes` x L rounds (L: the target's MoE layers), pass j's round l for MoE layer l. A decode
rank runs one forward per pass, sampling and committing between them. A prefill rank runs its one forward with
its MoE layers spread over the passes (`StretchedMoE`): layer l goes in pass l * passes // L, and it joins the
rounds in between with no tokens, on a helper thread while it computes its next layer. So the decode ranks'
passes go on while the prefill computes, waiting for it only in the rounds that carry its layers, and a long
prompt's chunk no longer sets the decode ranks' time per token: the leader picks the passes (`PassPlanner`) so
that the prefill's forward and the decode ranks' passes take about as long.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from comm.control import StepReport

EMA = 0.3     # weight of the newest step in the leader's per-token and per-pass estimates


def round_of(layer: int, num_layers: int, passes: int) -> int:
    """The round (0..passes * num_layers - 1) in which a prefill rank's MoE layer `layer` is exchanged."""
    return layer * passes // num_layers * num_layers + layer


class StretchedMoE:
    """A prefill rank's MoEContext for a step of `passes` decode passes: each MoE layer's dispatch goes in its
    round (`round_of`), and this rank joins every other round with no tokens (as `join_exchanges` does: the
    replica counts' gather over the attention group too). It joins them on a helper thread while it computes: the
    rounds between a layer's combine and the next layer's dispatch are joined while the next layer's attention
    runs, so the decode ranks' passes go on beside it (the thread and this one never use the data plane at the same
    time: the next dispatch waits for the thread). `close()` after the forward joins the rounds left.
    Everything else is the wrapped context's."""

    def __init__(self, moe, num_layers: int, passes: int):
        self.moe, self.num_layers, self.passes = moe, num_layers, passes
        self.next_round = 0
        self._layer = -1
        self._empty = None    # (x, ids, weights) with no rows, shaped as this rank's last dispatch
        self._joiner = ThreadPoolExecutor(1, thread_name_prefix="afserve-passes")
        self._joining = None  # the helper thread's joins in flight (a Future)

    def __getattr__(self, name):
        return getattr(self.moe, name)

    def start(self, moe_layer: int, x, ids, weights):
        self._wait()
        self._empty, self._layer = (x[:0], ids[:0], weights[:0]), moe_layer
        self._join_until(round_of(moe_layer, self.num_layers, self.passes))
        self.next_round += 1
        return self.moe.start(moe_layer, x, ids, weights)

    def finish(self, pending):
        out = self.moe.finish(pending)
        if self._layer + 1 < self.num_layers:     # the rounds before the next layer's, joined while it computes
            end = round_of(self._layer + 1, self.num_layers, self.passes)
            if end > self.next_round:
                self._joining = self._joiner.submit(self._join_in_background, end)
        return out

    def close(self) -> None:
        """After the forward: join the rounds of the step this rank has not joined yet."""
        try:
            self._wait()
            self._join_until(self.passes * self.num_layers)
        finally:
            self._joiner.shutdown(wait=False)

    def abandon(self) -> None:
        """The forward failed (a lost peer): leave the helper thread to end on its own (the job re-forms with a new
        data plane; its waits on this one end with the peer's loss or the generation's abort)."""
        self._joiner.shutdown(wait=False)

    def _wait(self) -> None:
        if self._joining is not None:
            joining, self._joining = self._joining, None
            t0 = self.moe.dispatcher.stats.now()
            joining.result()      # raises what the thread raised (a lost peer)
            self.moe.waited_s += self.moe.dispatcher.stats.now() - t0

    def _join_in_background(self, end: int) -> None:
        with torch.inference_mode():
            self._join_until(end, timed=False)

    def _join_until(self, end: int, timed: bool = True) -> None:
        while self.next_round < end:
            self.moe.finish(self.moe.start(self.next_round % self.num_layers, *self._empty), timed)
            self.next_round += 1


def merge_reports(reports: list[StepReport]) -> StepReport:
    """One report for a step's passes (each a full StepReport of one forward, in order): the outputs and prefix
    cache events of all of them, the rest (cumulative counts, state) as the last one says; seconds summed."""
    if len(reports) == 1:
        return reports[0]
    # The leader applies a report's evictions, then its additions: a key added in one pass and evicted in a later
    # one must not stay added, one evicted and added again must.
    added: dict[int, bool] = {}     # key -> whether its last event was an addition
    for r in reports:
        added.update((k, False) for k in r.cache_evicted)
        added.update((k, True) for k in r.cache_added)
    return replace(reports[-1], outputs=[o for r in reports for o in r.outputs],
                   cache_added=[k for k, a in added.items() if a],
                   cache_evicted=sorted({k for r in reports for k in r.cache_evicted}),
                   busy_s=sum(r.busy_s for r in reports), wall_s=sum(r.wall_s for r in reports),
                   passes=sum(r.passes for r in reports))


class PassPlanner:
    """The leader's choice of a step's decode passes: about as many as the prefill's compute takes decode passes,
    so that the decode ranks go on while it runs, without the passes outlasting it. Two exponential averages,
    neither depending on the passes chosen: a prompt token's compute (the prefill ranks' busy seconds, their
    waits on the data plane left out, per prompt token computed) and a decode pass's wall time alone (the decode
    ranks' steps of one pass in which no prefill rank computed). One pass when either side has no work, before
    both have been measured, or with max_passes 1."""

    def __init__(self, max_passes: int):
        self.max_passes = max_passes
        self.s_per_prompt_token = self.s_per_decode_pass = None
        self.prompt_tokens: list[int] = []    # each rank's prompt_tokens_computed at its last report
        self.num_multi_pass_steps = 0

    def observe(self, reports: list[StepReport], prefill_ranks: int) -> None:
        """A step's reports (in rank order; after a membership change the ranks' counts start over)."""
        if len(self.prompt_tokens) != len(reports):
            self.prompt_tokens = [r.prompt_tokens_computed for r in reports]
            return
        tokens = [r.prompt_tokens_computed - before for r, before in zip(reports, self.prompt_tokens)]
        self.prompt_tokens = [r.prompt_tokens_computed for r in reports]
        for r, n in zip(reports[:prefill_ranks], tokens):
            if n > 0 and r.busy_s > 0:
                self.s_per_prompt_token = _ema(self.s_per_prompt_token, r.busy_s / n)
        if not any(n > 0 for n in tokens[:prefill_ranks]):
            for r in reports[prefill_ranks:]:
                if r.num_running and r.passes == 1 and r.wall_s > 0:
                    self.s_per_decode_pass = _ema(self.s_per_decode_pass, r.wall_s)

    def choose(self, prefill_tokens: int, decoding: bool) -> int:
        """The passes of a step whose busiest prefill rank computes about prefill_tokens prompt tokens
        (decoding: some decode rank has sequences to run)."""
        if self.max_passes <= 1 or not prefill_tokens or not decoding or not self.s_per_decode_pass or \
                self.s_per_prompt_token is None:
            return 1
        passes = round(prefill_tokens * self.s_per_prompt_token / self.s_per_decode_pass)
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
