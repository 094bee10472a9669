"""bench/comm_emulated.py outside the emulated cluster: without root it stops at once with a message that
says why and how to run it, and it reads tc rate spellings or names the bad one."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "comm_emulated.py")


def _load():
    spec = importlib.util.spec_from_file_location("comm_emulated", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rates_are_read_in_tc_spelling():
    mod = _load()
    assert mod.parse_rate("1gbit") == 1e9 and mod.parse_rate("10Gbit") == 1e10 and mod.parse_rate("500mbit") == 5e8
    with pytest.raises(SystemExit, match="2gbps"):
        mod.parse_rate("2gbps")


@pytest.mark.skipif(shutil.which("setpriv") is None and os.geteuid() == 0, reason="no way to drop root here")
def test_without_root_it_exits_with_a_clear_message():
    cmd = [sys.executable, SCRIPT]
    if os.geteuid() == 0:
        cmd = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "needs root" in r.stderr and "namespaces" in r.stderr
