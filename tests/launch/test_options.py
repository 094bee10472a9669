"""Every engine option is declared once (the config fields of launch/config.py, read by launch/options.py) and is
reachable both ways with the same result: as an LLM(...) keyword (EngineConfig.from_options) and as a flag of
the entry points (launch/cli.py's add_engine_args -> engine_options)."""
from __future__ import annotations

import argparse
import inspect
import json
from dataclasses import MISSING, asdict

import pytest

from launch import LLM, cli
from launch.cli import add_engine_args, engine_options
from launch.config import EngineConfig
from launch.options import NAMED, all_options, markdown_table
from models import SHIPPED_MODEL

# A value other than the default for every option (the flag's argv is "--" + name with "_" -> "-", then the value,
# but for the booleans below). A new option must be added here: test_every_option_has_a_test_value.
VALUES = {
    "model": "/checkpoints/other", "attention_ranks": 3, "prefill_ranks": 1, "max_decode_passes": 3, "stream_kv": False,
    "expert_ranks": 5, "ranks_per_node": 4,
    "comm": "two_phase", "balancer": "least_loaded", "micro_batches": 3, "micro_batch_min_tokens": 4,
    "transport": "shm", "in_band_counts": "on", "cuda_ipc_events": True,
    "redundant_experts": 4, "rebalance_interval": 16, "rebalance_max_slots": 2,
    "autoscale": "/tmp/profile.json", "autoscale_window": 16, "autoscale_margin": 0.3,
    "comm_calibration": "/tmp/calibration.json",
    "expert_memory": 1 << 30, "block_size": 32, "kv_cache_memory": 1 << 28,
    "gpu_memory_utilization": 0.75, "num_kv_blocks": 100,
    "enable_prefix_caching": False, "kv_offload_memory": 1 << 20, "kv_cache_dtype": "fp8_e5m2", "max_num_seqs": 8,
    "max_num_batched_tokens": 1024, "scheduling_policy": "priority", "max_model_len": 2048,
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
    "dtype": "bfloat16", "device": "cpu",
    "kernel_backend": "torch", "enforce_eager": True, "generation_config": "vllm", "threads_per_rank": 2, "decode_threads": 3,
    "chat_template": "{{ messages[0]['content'] }}",
    "collective_timeout_s": 1200.5,
    "heartbeat_s": 2.5,
    "rank_failure_s": 7.5, "startup_timeout_s": 60.5, "load_progress": False, "sync_audit": True, "timing_sync": True,
    "role": "expert",
    "pool_addr": "10.0.0.5:29400", "leader_host": "node-0",
}
BOOL_FLAGS = {"enable_prefix_caching": ["--no-prefix-caching"], "load_progress": ["--no-load-progress"],
              "sync_audit": ["--sync-audit"], "timing_sync": ["--timing-sync"],
              "enforce_eager": ["--enforce-eager"], "stream_kv": ["--no-stream-kv"],
              "cuda_ipc_events": ["--cuda-ipc-events"]}
# valid only together (prefill_ranks needs more attention ranks than its value)
COMPANIONS = {"role": ["pool_addr"], "pool_addr": ["role"], "prefill_ranks": ["attention_ranks"]}
NAMES = [o.name for o in all_options()]


def argv_of(name: str) -> list[str]:
    value = VALUES[name]
    return BOOL_FLAGS.get(name) or ["--" + name.replace("_", "-"),
                                    json.dumps(value) if isinstance(value, dict) else str(value)]


def from_keywords(options: dict) -> EngineConfig:
    """LLM(model, attention_ranks, expert_ranks, **options) -> its config."""
    options = {"model": "m", "attention_ranks": 1, "expert_ranks": 1, **options}
    named = [options.pop(n) for n in NAMED]
    return EngineConfig.from_options(*named, **options)


def from_flags(argv: list[str]) -> EngineConfig:
    """An entry point's flags -> the config its LLM(...) gets (model and the rank counts as serve.py would pass
    them when given; expert ranks 1 when not)."""
    args = add_engine_args(argparse.ArgumentParser()).parse_args(["--model", "m", "--expert-ranks", "1", *argv])
    return EngineConfig.from_options(args.model, args.attention_ranks, args.expert_ranks, **engine_options(args))


def leaves(cfg: EngineConfig) -> dict:
    """The config tree flattened to {option: value}."""
    out = {}
    for k, v in asdict(cfg).items():
        out.update(v if isinstance(v, dict) else {k: v})
    return out


def test_every_option_has_a_test_value():
    assert len(set(NAMES)) == len(NAMES), "two options share a name"
    assert sorted(NAMES) == sorted(VALUES), "VALUES must name every declared option, and only those"
    assert set(leaves(from_keywords({}))) == set(NAMES), "every config field is an option"
    for o in all_options():
        assert VALUES[o.name] not in (o.default, o.flag_default), f"{o.name}: pick a non-default test value"
        assert o.help, f"{o.name} has no help"


@pytest.mark.parametrize("name", NAMES)
def test_option_reaches_its_field_as_keyword_and_as_flag(name):
    given = {n: VALUES[n] for n in [name, *COMPANIONS.get(name, [])]}
    baseline = leaves(from_keywords({}))
    by_keyword = leaves(from_keywords(given))
    assert {k: by_keyword[k] for k in given} == given
    assert {k: v for k, v in by_keyword.items() if k not in given} == \
        {k: v for k, v in baseline.items() if k not in given}, f"{name}={VALUES[name]!r} changed another option"
    by_flag = leaves(from_flags([a for n in given for a in argv_of(n)]))
    assert by_flag == by_keyword, f"{argv_of(name)} and {name}={VALUES[name]!r} give different configs"


def test_flag_defaults_are_the_llm_defaults():
    args = add_engine_args(argparse.ArgumentParser()).parse_args([])
    assert args.model == SHIPPED_MODEL and args.expert_ranks is None   # the entry points resolve these two
    cfg = EngineConfig.from_options(args.model, args.attention_ranks, 1, **engine_options(args))
    assert cfg == EngineConfig.from_options(SHIPPED_MODEL, 1, 1)
    assert cfg == EngineConfig.from_options(SHIPPED_MODEL, 1, 1, **{
        o.name: o.default for o in all_options() if o.name not in NAMED})


def test_llm_names_model_and_ranks_with_the_declared_defaults():
    params = inspect.signature(LLM).parameters
    assert tuple(params)[:len(NAMED)] == NAMED == ("model", "attention_ranks", "expert_ranks")
    declared = {o.name: o.default for o in all_options()}
    for n in NAMED:
        assert params[n].default == (inspect.Parameter.empty if declared[n] is MISSING else declared[n]), n


def test_existing_flags_keep_their_names():
    parser = add_engine_args(argparse.ArgumentParser())
    flags = {s for a in parser._actions for s in a.option_strings}
    assert {"--model", "--attention-ranks", "--expert-ranks", "--comm", "--balancer", "--redundant-experts",
            "--rebalance-interval", "--ranks-per-node", "--comm-calibration", "--transport", "--micro-batches",
            "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--kv-cache-memory", "--block-size",
            "--no-prefix-caching", "--kv-offload-memory", "--dtype", "--device", "--kernel-backend",
            "--threads-per-rank", "--collective-timeout-s", "--heartbeat-s", "--role", "--pool-addr",
            "--leader-host"} <= flags
    assert "--prefix-caching" not in flags   # prefix caching keeps its one flag, --no-prefix-caching
    help_text = parser.format_help()    # renders: argparse expands % in help strings
    assert all(f in help_text for f in flags)


def test_options_table_lists_every_option(capsys):
    table = markdown_table()
    rows = table.splitlines()[2:]
    assert [r.split(" | ")[0].strip("|` ") for r in rows] == NAMES
    assert "`--no-prefix-caching`" in table and "`--load-progress`, `--no-load-progress`" in table
    assert cli.main(["--options-table"]) == 0
    assert capsys.readouterr().out == table
