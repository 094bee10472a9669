from __future__ import annotations

import argparse

from launch.cli import add_engine_args, engine_options


def test_balancer_flags_reach_the_engine_options():
    args = add_engine_args(argparse.ArgumentParser()).parse_args(
        ["--balancer", "least_loaded", "--redundant-experts", "4", "--rebalance-interval", "16"])
    opts = engine_options(args)
    assert (opts["balancer"], opts["redundant_experts"], opts["rebalance_interval"]) == ("least_loaded", 4, 16)


def test_kernel_backend_flag_reaches_the_engine_options():
    parser = add_engine_args(argparse.ArgumentParser())
    assert engine_options(parser.parse_args([]))["kernel_backend"] == "auto"
    assert engine_options(parser.parse_args(["--kernel-backend", "torch"]))["kernel_backend"] == "torch"
