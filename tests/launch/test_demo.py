"""`make demo`'s entry point runs the shipped model and prints verse-like text and a throughput line."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from models import SHIPPED_MODEL

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(not os.path.isdir(SHIPPED_MODEL), reason="models/shakespeare-moe is not built")
def test_demo_prints_words_and_a_throughput_line():
    r = subprocess.run([sys.executable, "-m", "launch.demo", "--num-requests", "4", "--max-tokens", "32"],
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "8 experts, top-2, 5 layers" in out
    texts = re.split(r"----- prompt .*\n", out)[1:]
    assert len(texts) == 4
    for text in texts:
        body = text.split("\n\n4 requests")[0]
        assert sum(c.isalpha() or c.isspace() for c in body) / len(body) > 0.85, body
        assert "\n" in body.strip() and len(body.split()) >= 10, body
    assert re.search(r"4 requests, 128 output tokens in [0-9.]+ s: [0-9.]+ tokens/s", out), out
