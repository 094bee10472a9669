"""The planner's model of one engine step, and a simulation of a workload through it.

A step's time on the attention pool is built from per-call costs that the runtime's own counters measure
(launch/plan/calibrate.py fits them on this machine):

- attention-side compute per MoE layer and micro-batch on one attention rank: a0 + a_tok * T + a_ctx * C, where T
  is the micro-batch's tokens and C the (query token, key) pairs its attention reads (a decode of a sequence of
  length n reads n; a prefill chunk of t tokens after p cached ones reads t * p + t * (t + 1) / 2); a shared
  expert, which the attention rank computes while the routed experts work, counts here too;
- expert compute per MoE layer and micro-batch on one expert rank: e0 + e_all / E + e_pair * P, P the (token,
  expert) pairs it serves (the micro-batch's tokens times top-k over the E expert ranks, balanced), e_all what
  the whole layer's experts cost once and the ranks share (their weights' read, at cluster scale; a calibration
  on one expert rank folds it into e0);
- dispatch and combine per MoE layer and micro-batch, beside the expert compute: c0 + c_tok * T, of which the
  attention rank's own sending (its dispatch calls) is cd0 + cd_tok * T and the rest the round trip's wait
  (the expert rank's receiving and sending, the flags' latency); each expert rank beyond one adds c_peer_e (of
  it cd_peer_e to the sending) and each attention rank beyond one c_peer_a: more messages a layer, and on a
  machine with fewer cores than ranks, the ranks' turns on a shared core;
- the tail after the last MoE layer (final norm, LM head) per micro-batch: l0 + l_row * R, R its logit rows;
- the step's host work outside those timers (scheduling, batch metadata, sampling, header, reports, and the
  forward's untimed glue): h0 + h_seq * S, S the sequences in the step.

Per MoE layer, M micro-batches go through as ping-pong (attention_nodes/model.py): with one, a layer costs
a + c + e; with M, the busier side sets the pace, M * max(a + cd, c - cd + e) (the attention rank sends while the
experts work on another micro-batch; over the collective transport both sides take part in the whole exchange:
M * max(a + c, c + e)),
and the pipeline fills once a step: a micro-batch's next layer starts as soon as its combine returns, so the
experts serve one micro-batch while the attention rank computes the next, across layers. A machine with fewer
cores than ranks (`cores`) runs no faster than the ranks' summed busy time over its cores, the same-host
exchanges counted as CPU work on both sides (cd on the attention ranks, c - cd on the expert ranks). A plan on
several nodes, or with comm='two_phase', prices its dispatch and combine with the network's alpha-beta model
instead (launch/plan/layout.py), and a workload's skewed expert load scales the expert compute by the busiest
expert rank's share under EPLB's placement of the plan's slots (num_experts + redundant_experts); without one
the load is taken as balanced. A request goes to the attention rank holding the fewest tokens (the leader's most
free KV blocks).

`simulate` plays a workload (prompt and output lengths, arrival all at once or at a rate) through the engine's
scheduling (continuous batching, chunked prefill within max_num_batched_tokens, max_num_seqs per attention rank,
the micro-batch split rule) and reports output tok/s, TPOT and TTFT percentiles and each pool's utilisation.
"""
from __future__ import annotations

import collections
import json
import math
from dataclasses import asdict, dataclass, field

from .layout import comm_layer_s, expert_imbalance

COMM_MODES = ("direct", "two_phase")
# StepCosts' per-call seconds (the rest of its fields say what they were measured or derived for)
COST_FIELDS = ("a0", "a_tok", "a_ctx", "e0", "e_all", "e_pair", "c0", "c_tok", "l0", "l_row", "h0", "h_seq", "cd0",
               "cd_tok", "c_peer_e", "cd_peer_e", "c_peer_a")


@dataclass(slots=True)
class StepCosts:
    """Per-call costs in seconds (see the module docstring), and what they were measured or derived for."""

    a0: float
    a_tok: float
    a_ctx: float
    e0: float
    e_pair: float
    c0: float
    c_tok: float
    l0: float
    l_row: float
    h0: float
    h_seq: float
    moe_layers: int             # MoE layers of the model (the per-layer costs repeat this often)
    top_k: int
    e_all: float = 0.0
    cores: float = math.inf     # cores the ranks share (the CPU VM); inf: one device per rank
    source: str = ""            # how the costs were obtained (calibration command, hardware profile)
    meta: dict = field(default_factory=dict)
    num_experts: int = 0        # routed experts per MoE layer (0: unknown; redundant slots then cannot be priced)
    hidden: int = 0             # hidden size and bytes per dispatched element: what the network model prices
    dtype_bytes: int = 0
    network: dict | None = None     # alpha-beta comm model (CostModel.to_dict) for plans on the collective transport
    cd0: float = 0.0            # the attention rank's own sending within c0 + c_tok * T (0: all of c is the wait)
    cd_tok: float = 0.0
    c_peer_e: float = 0.0       # what each expert rank beyond one adds to an exchange (c), and to its sending (cd)
    cd_peer_e: float = 0.0
    c_peer_a: float = 0.0       # what each attention rank beyond one adds to an exchange (c)

    def __post_init__(self) -> None:
        for name in COST_FIELDS:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"step cost {name}={value!r}: give a finite number of seconds >= 0")
        if self.moe_layers < 1 or self.top_k < 1 or not self.cores > 0:
            raise ValueError(f"step costs moe_layers={self.moe_layers}, top_k={self.top_k}, cores={self.cores}: "
                             "each must be at least 1 (cores > 0)")

    def exchange(self, tokens: float, attention_ranks: int = 1, expert_ranks: int = 1) -> tuple[float, float]:
        """Direct dispatch + combine on one node for `tokens` per attention rank (a micro-batch's) -> (its seconds
        per MoE layer, c, and of it the attention rank's own sending, cd), ranks beyond one a side included."""
        c = self.c0 + self.c_tok * tokens + self.c_peer_e * (expert_ranks - 1) + self.c_peer_a * (attention_ranks - 1)
        return c, min(c, self.cd0 + self.cd_tok * tokens + self.cd_peer_e * (expert_ranks - 1))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cores"] = None if math.isinf(self.cores) else self.cores
        return d

    @classmethod
    def from_dict(cls, d: dict) -> StepCosts:
        d = dict(d)
        d["cores"] = math.inf if d.get("cores") is None else d["cores"]
        return cls(**d)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> StepCosts:
        """Step costs saved by save(); a file that is not one is refused, naming it."""
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"step-cost profile {path!r}: {e} (write one with `python -m launch.plan --calibrate "
                             "--save-profile FILE`)") from e


@dataclass(frozen=True, slots=True)
class Plan:
    """A deployment: pool sizes, ping-pong micro-batches (a count: the planner compares 1 and 2 where the
    engine's default, auto, picks one by the cores or GPUs) and the scheduler's limits (the engine's defaults)."""

    attention_ranks: int
    expert_ranks: int
    micro_batches: int = 2
    comm: str = "direct"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    micro_batch_min_tokens: int = 16
    ranks_per_node: int = 0         # 0: every rank on one node
    redundant_experts: int = 0

    def __post_init__(self) -> None:
        for name in ("attention_ranks", "expert_ranks", "micro_batches", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"plan {name}={getattr(self, name)}: must be at least 1")
        for name in ("ranks_per_node", "redundant_experts"):
            if getattr(self, name) < 0:
                raise ValueError(f"plan {name}={getattr(self, name)}: must be at least 0")
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(f"plan max_num_seqs={self.max_num_seqs} > max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}: every running sequence needs its decode token a step")
        if self.comm not in COMM_MODES:
            raise ValueError(f"plan comm={self.comm!r}: the planner models {', '.join(COMM_MODES)} only")

    @property
    def nodes(self) -> int:
        W = self.attention_ranks + self.expert_ranks
        return -(-W // self.ranks_per_node) if self.ranks_per_node else 1

    @property
    def collective(self) -> bool:
        """Its dispatch and combine run over the collective transport (priced by the network model), not the
        same-host inboxes that the step-cost calibration measured."""
        return self.comm != "direct" or self.nodes > 1

    def label(self) -> str:
        where = f" {self.nodes}x{self.ranks_per_node}" if self.nodes > 1 else ""
        spare = f" +{self.redundant_experts}r" if self.redundant_experts else ""
        return f"{self.attention_ranks}A+{self.expert_ranks}E mb{self.micro_batches} {self.comm}{where}{spare}"


@dataclass(slots=True)
class RankWork:
    """One attention rank's share of a step: tokens, attention pairs, logit rows, sequences."""

    tokens: int = 0
    pairs: int = 0
    rows: int = 0
    seqs: int = 0


@dataclass(frozen=True, slots=True)
class StepTime:
    seconds: float
    attention_busy: float       # the busiest attention rank's compute and host seconds in the step
    expert_busy: float          # one expert rank's compute seconds in the step


def step_time(costs: StepCosts, plan: Plan, work: list[RankWork], imbalance: float = 1.0,
              admits: bool = False) -> StepTime:
    """The model's time for a step in which attention rank j does work[j]; imbalance: the busiest expert rank's
    pairs over the mean (layout.expert_imbalance); admits: the step takes new requests (its header's capacity is
    then the token budget, which the collective transport's padded messages are sized by)."""
    if not any(w.tokens for w in work):
        return StepTime(0.0, 0.0, 0.0)
    # the engine splits a step only when the least busy attention rank that runs any token reaches the minimum
    # (passes.micro_batches_for; an idle rank joins the exchanges empty)
    least = min(w.tokens for w in work if w.tokens)
    M = plan.micro_batches if plan.micro_batches > 1 and least >= plan.micro_batches * plan.micro_batch_min_tokens \
        else 1
    E = plan.expert_ranks
    total_tokens, most = sum(w.tokens for w in work), max(w.tokens for w in work)
    # each attention rank's per-layer compute (one micro-batch), its tail and its host work
    attn = [costs.a0 + costs.a_tok * w.tokens / M + costs.a_ctx * w.pairs / M for w in work]
    tails = [M * costs.l0 + costs.l_row * w.rows for w in work]
    hosts = [costs.h0 + costs.h_seq * w.seqs for w in work]
    a, tail, host = max(attn), max(tails), max(hosts)
    slots = (costs.num_experts + plan.redundant_experts) / costs.num_experts if costs.num_experts else 1.0
    e = costs.e0 + costs.e_all * slots / E + costs.e_pair * total_tokens * costs.top_k / M / E * imbalance
    if plan.collective:     # every micro-batch's messages padded to the step's capacity, as the engine sends them
        capacity = plan.max_num_batched_tokens if admits else most
        c = comm_layer_s(costs.network, plan.comm, plan.attention_ranks, E, plan.ranks_per_node or
                         plan.attention_ranks + E, costs.hidden, costs.top_k, costs.dtype_bytes, capacity)
        sent, rest = c, c          # both sides take part in every collective, for its whole length
    else:
        c, sent = costs.exchange(most / M, plan.attention_ranks, E)
        rest = c - sent
    if M == 1:
        t = costs.moe_layers * (a + c + e) + tail + host
    else:
        sides = (a + sent, rest + e)
        t = costs.moe_layers * M * max(sides) + min(sides) + tail + host
    attn_busy = costs.moe_layers * M * a + tail + host
    expert_busy = costs.moe_layers * M * e
    if plan.attention_ranks + E > costs.cores:
        # the same-host exchanges' copies take CPU too: the attention ranks' sending, the rest on the expert side
        # (not counted over the collective transport)
        if plan.collective:
            sent = rest = 0.0
        busy = sum(costs.moe_layers * M * (aj + sent) + tj + hj for aj, tj, hj in zip(attn, tails, hosts))
        t = max(t, (busy + E * (expert_busy + costs.moe_layers * M * rest)) / costs.cores)
    return StepTime(t, attn_busy, expert_busy)


@dataclass(slots=True)
class _Request:
    prompt: int
    output: int
    arrival: float
    computed: int = 0           # prompt tokens computed
    generated: int = 0
    first_token: float = -1.0


@dataclass(slots=True)
class _Rank:
    """One attention rank's requests: waiting, mid-prefill (oldest first), and decoding. Decoding requests are
    kept as totals, since each takes one token a step: their count and the keys their next tokens read."""

    queue: collections.deque = field(default_factory=collections.deque)
    prefilling: list = field(default_factory=list)
    decoders: int = 0
    decode_keys: int = 0        # sum over decoding requests of prompt + generated
    held: int = 0               # tokens its requests hold (the leader's free-block estimate, inverted)
    chunks: list = field(default_factory=list)      # this step's prefill chunks: (request, tokens)


@dataclass(frozen=True, slots=True)
class Prediction:
    tok_s: float                # output tokens per second over the whole workload
    seconds: float
    steps: int
    tpot_p50_ms: float          # gaps between a request's consecutive output tokens
    tpot_p99_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    attention_util: float       # busy share of the busiest attention rank
    expert_util: float          # busy share of an expert rank

    def to_dict(self) -> dict:
        return asdict(self)


def simulate(costs: StepCosts, plan: Plan, prompts: list[int], outputs: list[int],
             rate: float | None = None, max_steps: int = 1_000_000, decode_only: bool = False,
             expert_load: list[list[float]] | None = None) -> Prediction:
    """Play requests (prompt lengths, output lengths; all at t=0, or evenly spaced arrivals at `rate` per
    second) through the plan. Each attention rank schedules as the engine does: running sequences first (a
    decode token each, or the next prefill chunk), then waiting requests, within max_num_batched_tokens tokens
    and max_num_seqs sequences; a new request goes to the attention rank holding the fewest tokens (the leader's
    most free KV blocks). decode_only: the prompts were prefilled elsewhere (PD): each request arrives with its
    prompt's KV and first token, and every step only decodes. expert_load: per-expert load `[L][E]` (None:
    balanced), see layout.expert_imbalance."""
    if len(prompts) != len(outputs) or not prompts or min(prompts) < 1 or min(outputs) < 1:
        raise ValueError(f"workload of {len(prompts)} prompt and {len(outputs)} output lengths: give as many of "
                         "each, at least one request, every length at least 1")
    if rate is not None and not rate > 0:
        raise ValueError(f"rate={rate}: arrivals per second must be > 0 (None: all at once)")
    if plan.collective and costs.network is None:
        raise ValueError(f"plan {plan.label()} runs its comm over the collective transport, which these step costs "
                         "do not price: give a network model (python -m launch.plan --network FILE, or --network "
                         "links with --hardware)")
    if (plan.redundant_experts or expert_load is not None) and not costs.num_experts:
        raise ValueError(f"plan {plan.label()}: redundant experts and an expert load need the model's expert count, "
                         "which these step costs lack: re-run --calibrate")
    imbalance = expert_imbalance(expert_load, costs.num_experts, plan.expert_ranks, plan.redundant_experts)
    A = plan.attention_ranks
    reqs = [_Request(p, o, 0.0 if not rate else i / rate) for i, (p, o) in enumerate(zip(prompts, outputs))]
    pending = collections.deque(reqs)
    ranks = [_Rank() for _ in range(A)]
    finish_at: dict[int, list] = collections.defaultdict(list)     # step -> [(rank, request)] that end in it
    gaps: list[tuple[float, int]] = []                              # (a step's seconds, decode tokens in it)
    now, steps, attn_busy, expert_busy, done = 0.0, 0, 0.0, 0.0, 0

    def start_decoding(rank: _Rank, r: _Request) -> None:
        """r has its first token at the end of step `steps`: it decodes a token in each step until its last."""
        nonlocal done
        if r.generated >= r.output:
            rank.held -= r.prompt + r.generated
            done += 1
            return
        rank.decoders += 1
        rank.decode_keys += r.prompt + r.generated
        finish_at[steps + r.output - r.generated].append((rank, r))

    while done < len(reqs) and steps < max_steps:
        admits = bool(pending) and pending[0].arrival <= now
        while pending and pending[0].arrival <= now:
            r = pending.popleft()
            rank = min(ranks, key=lambda k: k.held)
            rank.queue.append(r)
            rank.held += r.prompt
        work = []
        for rank in ranks:
            while rank.queue and rank.decoders + len(rank.prefilling) < plan.max_num_seqs:
                r = rank.queue.popleft()
                if decode_only:
                    r.computed, r.generated, r.first_token = r.prompt, 1, now - r.arrival
                    rank.held += 1
                    start_decoding(rank, r)
                else:
                    rank.prefilling.append(r)
            w = RankWork(rank.decoders, rank.decode_keys, rank.decoders, rank.decoders)
            budget, rank.chunks = plan.max_num_batched_tokens - rank.decoders, []
            for r in rank.prefilling:
                if budget <= 0:
                    break
                t = min(r.prompt - r.computed, budget)
                w.tokens, w.pairs, w.seqs = w.tokens + t, w.pairs + t * r.computed + t * (t + 1) // 2, w.seqs + 1
                w.rows += r.computed + t >= r.prompt
                budget -= t
                rank.chunks.append((r, t))
            work.append(w)
        if not any(w.tokens for w in work):
            if not pending:
                break
            now = max(now, pending[0].arrival)      # idle until the next arrival
            continue
        st = step_time(costs, plan, work, imbalance, admits)
        now += st.seconds
        steps += 1
        attn_busy += st.attention_busy
        expert_busy += st.expert_busy
        if decoding := sum(rank.decoders for rank in ranks):
            gaps.append((st.seconds, decoding))
        for rank in ranks:
            rank.decode_keys += rank.decoders
            rank.held += rank.decoders
        for rank, r in finish_at.pop(steps, ()):
            rank.decoders -= 1
            rank.decode_keys -= r.prompt + r.output
            rank.held -= r.prompt + r.output
            done += 1
        for rank in ranks:
            for r, t in rank.chunks:
                r.computed += t
                if r.computed == r.prompt:
                    rank.prefilling.remove(r)
                    r.generated, r.first_token = 1, now - r.arrival
                    rank.held += 1
                    start_decoding(rank, r)
    if done < len(reqs):
        raise RuntimeError(f"the simulation stopped after {steps} steps with {len(reqs) - done} of {len(reqs)} "
                           "requests unfinished: raise max_steps")
    ttfts = sorted(r.first_token for r in reqs)
    produced = sum(outputs) - (len(reqs) if decode_only else 0)
    return Prediction(tok_s=produced / now if now else 0.0, seconds=now, steps=steps,
                      tpot_p50_ms=1e3 * _weighted_pct(gaps, 50), tpot_p99_ms=1e3 * _weighted_pct(gaps, 99),
                      ttft_p50_ms=1e3 * _pct(ttfts, 50), ttft_p99_ms=1e3 * _pct(ttfts, 99),
                      attention_util=attn_busy / now if now else 0.0,
                      expert_util=expert_busy / now if now else 0.0)


def _weighted_pct(values: list[tuple[float, int]], q: float) -> float:
    """The q-th percentile of values, each (value, how many times it occurs)."""
    total = sum(n for _, n in values)
    if not total:
        return 0.0
    rank = min(total - 1, int(round(q / 100 * (total - 1))))
    for value, n in sorted(values):
        if rank < n:
            return value
        rank -= n
    return values[-1][0]


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(round(q / 100 * (len(sorted_values) - 1))))]
