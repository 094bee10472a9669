"""The HTTP front's Prometheus metrics: series the front records itself (`Metrics`) and the engine-side series
read through the leader at scrape time (`scrape`)."""
from __future__ import annotations

import asyncio
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from attention_nodes.pd import TRANSFER_BUCKETS

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 20.0, 40.0, 80.0)


class StatsSource(Protocol):
    """What a scrape needs of the engine: `EngineClient` (engine_client.py, which records into `Metrics`, so
    this module does not import it back) is one."""

    dead: str | None

    async def query(self, kind: str) -> dict: ...


class Metrics:
    """Prometheus series the front records itself; engine-side series are read at scrape time."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("afserve_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("afserve_time_per_output_token_seconds",
                              "Mean time between generated tokens of a finished request (TPOT / ITL)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("afserve_e2e_request_latency_seconds", "Arrival to finish", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.generated = Counter("afserve_generation_tokens", "Generated tokens", registry=r)
        self.prompt = Counter("afserve_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.finished = Counter("afserve_requests_finished", "Finished requests by reason", ["finish_reason"],
                                registry=r)


def attention_pool_kv_usage(stats: dict) -> float:
    """Used / total KV blocks summed over every attention rank (a block is used while a sequence holds it;
    cached blocks no one holds count as free, as in afserve_kv_blocks_used); 0.0 before any rank reports."""
    return _kv_usage(stats, slice(None))


def _kv_usage(stats: dict, ranks: slice) -> float:
    """Used / total KV blocks of the attention ranks in `ranks` (0.0 when they have none)."""
    total = sum(stats["kv_blocks"][ranks])
    return (total - sum(stats["free_kv_blocks"][ranks])) / total if total else 0.0


def _counters(values: dict, specs: list[tuple[str, str, str]]):
    """One counter per (name, help, key of values)."""
    for name, text, key in specs:
        yield CounterMetricFamily(name, text, value=values[key])


def pd_pool_kv_usage(stats: dict) -> dict[str, float]:
    """PD: used / total KV blocks of the prefill ranks and of the decode ranks ({} without PD)."""
    p = stats["pd"]["prefill_ranks"]
    if not p:
        return {}
    return {"prefill": _kv_usage(stats, slice(0, p)), "decode": _kv_usage(stats, slice(p, None))}


def pd_series(stats: dict):
    """PD on AF's series: moves and their KV (bytes; seconds per move, a histogram), the KV streamed ahead of them,
    requests waiting for a decode seat, and each role's KV usage (an autoscaling signal per pool)."""
    pd = stats["pd"]
    yield from _counters(pd, [
        ("afserve_pd_requests_transferred", "Requests moved from a prefill rank to a decode rank with their KV",
         "requests_transferred"),
        ("afserve_pd_kv_blocks_transferred", "KV blocks those moves carried", "kv_blocks_transferred"),
        ("afserve_pd_kv_transfer_bytes", "KV bytes those moves carried", "kv_bytes_transferred"),
        ("afserve_pd_kv_blocks_reused", "KV blocks of moved requests that the decode rank's prefix cache held (not "
         "sent)", "kv_blocks_reused"),
        ("afserve_pd_kv_blocks_streamed", "KV blocks sent to decode ranks while their requests were still "
         "prefilling (ahead of the moves)", "kv_blocks_streamed"),
        ("afserve_pd_kv_stream_bytes", "KV bytes of those blocks", "kv_bytes_streamed"),
        ("afserve_pd_multi_pass_steps", "Steps in which the decode ranks ran several forwards beside a prefill "
         "(decode passes)", "multi_pass_steps")])
    counts, cumulative, buckets = pd["kv_transfer_buckets"], 0, []
    for bound, n in zip([*map(str, TRANSFER_BUCKETS), "+Inf"], counts):
        cumulative += n
        buckets.append((bound, cumulative))
    yield HistogramMetricFamily("afserve_pd_kv_transfer_seconds", "One move's transfer on its decode rank, from the "
                                "receive's start to the blocks in place", buckets=buckets,
                                sum_value=pd["kv_transfer_seconds"])
    yield GaugeMetricFamily("afserve_pd_requests_waiting_for_decode", "Prefilled requests that no decode rank had "
                            "room for at the last step (they wait at their prefill rank)",
                            value=pd["requests_waiting_for_decode"])
    usage = GaugeMetricFamily("afserve_pd_pool_kv_usage_ratio", "Used / total KV blocks of the prefill ranks and of "
                              "the decode ranks (each pool's autoscaling signal)", labels=["pool"])
    for pool, v in pd_pool_kv_usage(stats).items():
        usage.add_metric([pool], v)
    yield usage


def expert_pool_load(stats: dict, comm: dict) -> float:
    """(token, expert) pairs per step that the busiest expert rank serves, averaged over MoE layers, over the
    recent steps of comm["expert_load"] (at most 1024, so it follows the load and a resize of the pool; the
    cumulative compute timings would not). An expert rank's FFN time grows with these pairs, so the pool is
    the bottleneck once they pass what one rank does in the attention ranks' compute time per layer.
    0.0 while no request is running or waiting (the window keeps the last busy steps) or before any step."""
    load = comm.get("expert_load", {})
    layers, steps = load.get("layers", {}), load.get("steps", 0)
    if not (stats["num_running"] or stats["num_waiting"]) or not steps or not layers:
        return 0.0
    return sum(max(v["pairs_per_rank"], default=0) for v in layers.values()) / (steps * len(layers))


class _EngineSeries:
    """The engine-side series of one scrape: queue sizes, KV blocks per attention rank and prefix-cache tokens
    (leader stats), per-layer dispatch/combine totals per rank plus expert-rank balance (comm stats), and one
    gauge per pool for its autoscaler (deploy/README.md)."""

    def __init__(self, stats: dict, comm: dict):
        self.stats, self.comm = stats, comm

    def collect(self):
        s = self.stats
        yield GaugeMetricFamily("afserve_requests_running", "Requests in the running batch", value=s["num_running"])
        yield GaugeMetricFamily("afserve_requests_waiting", "Requests waiting for admission",
                                value=s["num_waiting"])
        total = GaugeMetricFamily("afserve_kv_blocks_total", "KV blocks in the pool", labels=["rank"])
        used = GaugeMetricFamily("afserve_kv_blocks_used", "KV blocks in use", labels=["rank"])
        ratio = GaugeMetricFamily("afserve_kv_cache_usage_ratio", "Share of KV blocks in use", labels=["rank"])
        for r, (free, n) in enumerate(zip(s["free_kv_blocks"], s["kv_blocks"])):
            total.add_metric([str(r)], n)
            used.add_metric([str(r)], n - free)
            ratio.add_metric([str(r)], (n - free) / n if n else 0.0)
        yield from (total, used, ratio)
        yield CounterMetricFamily("afserve_engine_steps", "Engine steps", value=s["steps"])
        yield GaugeMetricFamily("afserve_micro_batches", "Ping-pong micro-batches a step may split into "
                                "(micro_batches, or the leader's pick with 0, auto)", value=s["micro_batches"])
        yield CounterMetricFamily("afserve_micro_batched_steps", "Engine steps split into micro-batches",
                                  value=s["num_micro_batched_steps"])
        yield CounterMetricFamily("afserve_preemptions", "Preempted requests", value=s["num_preemptions"])
        yield CounterMetricFamily("afserve_prefix_cache_queries", "Prompt tokens of admitted requests looked up in "
                                  "the prefix cache", value=s["prefix_cache_queries"])
        yield CounterMetricFamily("afserve_prefix_cache_hits", "Of those, tokens found cached (not computed)",
                                  value=s["prefix_cache_hits"])
        pools = GaugeMetricFamily("afserve_pool_ranks", "Ranks in each pool now", labels=["pool"])
        for pool, n in s["pool_ranks"].items():
            pools.add_metric([pool], n)
        yield pools
        yield CounterMetricFamily("afserve_membership_changes", "Times the job re-formed (a rank lost, retired or "
                                  "joined)", value=len(s["membership_changes"]))
        yield CounterMetricFamily("afserve_requests_moved", "Requests re-queued from a lost attention rank and "
                                  "recomputed from what they had streamed", value=s["num_moved_requests"])
        yield CounterMetricFamily("afserve_requests_handed_over", "Requests a retiring attention rank handed "
                                  "to another with their KV blocks", value=s["num_handed_over_requests"])
        yield CounterMetricFamily("afserve_kv_blocks_handed_over", "KV blocks those requests brought along",
                                  value=s["kv_blocks_handed_over"])
        spec = s["spec_decode"]
        yield from _counters(spec, [
            ("afserve_spec_decode_num_drafts", "Speculative steps: a request verified with at least one draft token",
             "num_drafts"),
            ("afserve_spec_decode_num_draft_tokens", "Draft tokens verified", "num_draft_tokens"),
            ("afserve_spec_decode_num_accepted_tokens", "Draft tokens accepted", "num_accepted_tokens")])
        per_pos = CounterMetricFamily("afserve_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at "
                                      "each draft position", labels=["position"])
        for pos, n in enumerate(spec["num_accepted_tokens_per_pos"]):
            per_pos.add_metric([str(pos)], n)
        yield per_pos
        yield from pd_series(s)
        secs = CounterMetricFamily("afserve_layer_comm_seconds", "Wall time in dispatch/combine per layer",
                                   labels=["rank", "role", "layer", "phase"])
        sent = CounterMetricFamily("afserve_layer_comm_bytes_sent", "Bytes sent in dispatch/combine per layer",
                                   labels=["rank", "role", "layer", "phase"])
        calls = CounterMetricFamily("afserve_layer_comm_calls", "Dispatch/combine calls per layer",
                                    labels=["rank", "role", "layer", "phase"])
        for rank, r in self.comm.get("ranks", {}).items():
            for layer, phases in r["layers"].items():
                for phase, v in phases.items():
                    labels = [rank, r["role"], layer, phase]
                    secs.add_metric(labels, v["time_s"])
                    sent.add_metric(labels, v["bytes_sent"])
                    calls.add_metric(labels, v["calls"])
        yield from (secs, sent, calls)
        balance = GaugeMetricFamily("afserve_expert_load_max_mean",
                                    "Max over mean expert-rank load per layer (recent steps)", labels=["layer"])
        for layer, v in self.comm.get("expert_load", {}).get("layers", {}).items():
            balance.add_metric([layer], v["max_mean"])
        yield balance
        yield GaugeMetricFamily("afserve_attention_pool_kv_usage_ratio",
                                "Used / total KV blocks over all attention ranks (the attention pool's autoscaling "
                                "signal)", value=attention_pool_kv_usage(s))
        yield GaugeMetricFamily("afserve_expert_pool_load_pairs_per_step",
                                "(token, expert) pairs per step served by the busiest expert rank, mean over MoE "
                                "layers, over the recent steps (at most 1024); 0 while no request runs or waits. "
                                "Above what one expert rank serves in the attention ranks' compute time, the "
                                "expert pool is the bottleneck (the expert pool's autoscaling signal)",
                                value=expert_pool_load(s, self.comm))


async def scrape(metrics: Metrics, engine: StatsSource | None, lock: asyncio.Lock) -> str:
    """The Prometheus text of one scrape; `lock` keeps to one stats collective at a time."""
    text = generate_latest(metrics.registry).decode()
    if engine is None or engine.dead:
        return text
    async with lock:
        stats = await engine.query("stats")
        comm = await engine.query("comm_stats")
    reg = CollectorRegistry()
    reg.register(_EngineSeries(stats, comm))
    return text + generate_latest(reg).decode()
