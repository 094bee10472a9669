"""The pool gauges of /metrics (launch/frontend/metrics.py) on hand-made leader stats and comm stats: no engine."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from attention_nodes.pd import TRANSFER_BUCKETS, TransferStats, summed
from launch.frontend.metrics import _EngineSeries


def make_stats(free_kv_blocks=(40, 10), kv_blocks=(100, 50), num_running=3, num_waiting=1, pd=None) -> dict:
    """The leader's stats() as the scrape sees them, for two attention ranks (pd: its "pd" entry; default: no PD,
    with the series' zero values)."""
    none = {"prefill_ranks": 0, "requests_transferred": 0, "kv_blocks_transferred": 0, "kv_bytes_transferred": 0,
            "kv_transfer_seconds": 0.0, "kv_blocks_reused": 0, "kv_transfer_buckets": [0] * (len(TRANSFER_BUCKETS) + 1),
            "requests_waiting_for_decode": 0, "multi_pass_steps": 0, "kv_blocks_streamed": 0, "kv_bytes_streamed": 0,
            "kv_stream_seconds": 0.0}
    return {"steps": 12, "micro_batches": 2, "num_micro_batched_steps": 9,
            "num_preemptions": 0, "num_running": num_running, "num_waiting": num_waiting,
            "free_kv_blocks": list(free_kv_blocks), "kv_blocks": list(kv_blocks),
            "prefix_cache_queries": 0, "prefix_cache_hits": 0, "pool_ranks": {"attention": 2, "expert": 2},
            "membership_changes": [{"generation": 1}], "num_moved_requests": 3, "num_handed_over_requests": 2,
            "kv_blocks_handed_over": 5,
            "spec_decode": {"num_drafts": 7, "num_draft_tokens": 20, "num_accepted_tokens": 9,
                            "num_accepted_tokens_per_pos": [6, 3]},
            "pd": pd or none}


def make_comm(pairs_per_rank=((40, 24), (10, 30)), steps=4) -> dict:
    """gather_stats()'s dict: one attention rank (0), two expert ranks (1, 2), one layer entry per pairs row."""
    phases = {"dispatch": {"calls": 2, "bytes_sent": 64, "time_s": 0.5},
              "combine": {"calls": 2, "bytes_sent": 64, "time_s": 0.25}}
    layers = {str(layer): phases for layer in range(len(pairs_per_rank))}
    return {"ranks": {"0": {"role": "attention", "layers": layers, "compute": {"0": {"calls": 2, "time_s": 0.1}}},
                      "1": {"role": "expert", "layers": layers, "compute": {"0": {"calls": 2, "time_s": 0.3}}},
                      "2": {"role": "expert", "layers": layers, "compute": {"0": {"calls": 2, "time_s": 0.2}}}},
            "expert_load": {"steps": steps, "layers": {str(layer): {"max_mean": 1.0, "pairs_per_rank": list(p)}
                                                       for layer, p in enumerate(pairs_per_rank)}}}


def scraped(stats: dict, comm: dict) -> dict[str, float]:
    """Name -> value of every single-valued series in the Prometheus text of one scrape."""
    reg = CollectorRegistry()
    reg.register(_EngineSeries(stats, comm))
    out = {}
    for line in generate_latest(reg).decode().splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split(" ")
            out[name] = float(value)
    return out


def test_attention_pool_kv_usage_weights_ranks_by_their_blocks():
    # (100 - 40 + 50 - 10) / (100 + 50) = 100 / 150; the mean of the per-rank ratios would be (0.6 + 0.8) / 2
    got = scraped(make_stats(), make_comm())["afserve_attention_pool_kv_usage_ratio"]
    assert got == pytest.approx(100 / 150)
    assert scraped(make_stats(free_kv_blocks=(100, 50)), make_comm())["afserve_attention_pool_kv_usage_ratio"] == 0
    assert scraped(make_stats(free_kv_blocks=(), kv_blocks=()), make_comm())[
        "afserve_attention_pool_kv_usage_ratio"] == 0   # no rank has reported yet


def test_expert_pool_load_is_the_busiest_rank_per_step_mean_over_layers():
    # layer 0: busiest rank 40 pairs over 4 steps = 10 per step; layer 1: 30 / 4 = 7.5; mean 8.75
    got = scraped(make_stats(), make_comm())["afserve_expert_pool_load_pairs_per_step"]
    assert got == pytest.approx(8.75)
    # with four times the steps the same pairs are a quarter of the load
    assert scraped(make_stats(), make_comm(steps=16))["afserve_expert_pool_load_pairs_per_step"] == pytest.approx(
        8.75 / 4)


@pytest.mark.parametrize("stats, comm", [
    (make_stats(num_running=0, num_waiting=0), make_comm()),        # idle: the window holds old busy steps
    (make_stats(num_running=0, num_waiting=2), make_comm(steps=0)),  # no step recorded yet (a rank just joined)
    (make_stats(), {"ranks": {}}),                                   # no expert_load in comm stats
])
def test_expert_pool_load_is_zero_without_recent_work(stats, comm):
    assert scraped(stats, comm)["afserve_expert_pool_load_pairs_per_step"] == 0


def test_waiting_requests_alone_keep_the_expert_load():
    got = scraped(make_stats(num_running=0, num_waiting=2), make_comm())["afserve_expert_pool_load_pairs_per_step"]
    assert got == pytest.approx(8.75)


def test_membership_series_come_from_the_leader_stats():
    got = scraped(make_stats(), make_comm())
    assert (got["afserve_membership_changes_total"], got["afserve_requests_moved_total"],
            got["afserve_requests_handed_over_total"], got["afserve_kv_blocks_handed_over_total"]) == (1, 3, 2, 5)
    reg = CollectorRegistry()
    reg.register(_EngineSeries(make_stats(), make_comm()))
    text = generate_latest(reg).decode()
    assert 'afserve_pool_ranks{pool="attention"} 2.0' in text and 'afserve_pool_ranks{pool="expert"} 2.0' in text


def test_spec_decode_series_carry_vllms_names():
    got = scraped(make_stats(), make_comm())
    assert (got["afserve_spec_decode_num_drafts_total"], got["afserve_spec_decode_num_draft_tokens_total"],
            got["afserve_spec_decode_num_accepted_tokens_total"]) == (7, 20, 9)
    reg = CollectorRegistry()
    reg.register(_EngineSeries(make_stats(), make_comm()))
    text = generate_latest(reg).decode()
    assert 'afserve_spec_decode_num_accepted_tokens_per_pos_total{position="0"} 6.0' in text
    assert 'afserve_spec_decode_num_accepted_tokens_per_pos_total{position="1"} 3.0' in text


def test_pd_series_sum_the_ranks_moves_into_a_histogram():
    """Two decode ranks' TransferStats (moves of 0.3 ms, 0.3 ms and 3 s; 3 s is past the last bucket, 2.5 s) summed by
    the leader: the counters, the histogram's cumulative buckets, count and sum, the waiting gauge and each
    role's KV usage (rank 0 prefill: 60 of 100 used; rank 1 decode: 40 of 50)."""
    a, b = TransferStats(), TransferStats()
    a.add(2, 5, 4096, 0.0003)
    a.add(1, 3, 2048, 0.0003, reused=4)
    b.add(1, 2, 1024, 3.0, reused=1)
    a.add_streamed(3, 1536, 0.001)
    b.add_streamed(4, 2048, 0.002)
    pd = {"prefill_ranks": 1, **summed([[], a.to_list(), b.to_list()]), "requests_waiting_for_decode": 2,
          "multi_pass_steps": 6}
    got = scraped(make_stats(pd=pd), make_comm())
    assert (got["afserve_pd_requests_transferred_total"], got["afserve_pd_kv_blocks_transferred_total"],
            got["afserve_pd_kv_transfer_bytes_total"], got["afserve_pd_kv_blocks_reused_total"],
            got["afserve_pd_requests_waiting_for_decode"], got["afserve_pd_multi_pass_steps_total"]) == (4, 10, 7168, 5,
                                                                                                       2, 6)
    assert (got["afserve_pd_kv_blocks_streamed_total"], got["afserve_pd_kv_stream_bytes_total"]) == (7, 3584)
    assert got["afserve_pd_kv_transfer_seconds_count"] == 3
    assert got["afserve_pd_kv_transfer_seconds_sum"] == pytest.approx(3.0006)
    reg = CollectorRegistry()
    reg.register(_EngineSeries(make_stats(pd=pd), make_comm()))
    text = generate_latest(reg).decode()
    assert 'afserve_pd_kv_transfer_seconds_bucket{le="0.00025"} 0.0' in text
    assert 'afserve_pd_kv_transfer_seconds_bucket{le="0.0005"} 2.0' in text
    assert 'afserve_pd_kv_transfer_seconds_bucket{le="2.5"} 2.0' in text
    assert 'afserve_pd_kv_transfer_seconds_bucket{le="+Inf"} 3.0' in text
    assert 'afserve_pd_pool_kv_usage_ratio{pool="prefill"} 0.6' in text
    assert 'afserve_pd_pool_kv_usage_ratio{pool="decode"} 0.8' in text
