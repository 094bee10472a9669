"""bench/chaos.py, two seeded trials (one of them two_phase, one a second kill while the job re-forms): each kills
ranks mid-generation and the script reports every request ending with transformers' tokens, none lost, no hang
(the soak itself runs the script with more trials; see docs/benchmarks.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "chaos.py")


def test_two_seeded_trials_lose_nothing(tmp_path):
    out = tmp_path / "chaos.json"
    # seed 207: 3+2 two_phase in two emulated nodes, expert rank 3 SIGKILLed 0.31 s in and attention rank 2 gone
    # once it has checked in for generation 1 ("second"); 2+2 direct over shm, least_loaded with 2 redundant slots,
    # 2 micro-batches, attention rank 1 SIGKILLed 0.19 s in ("time"). Both kills land early, well before the work
    # is done on a loaded machine too.
    done = subprocess.run([sys.executable, SCRIPT, "--trials", "2", "--seed", "207", "--watchdog", "90",
                           "--moments", "time,before_report,second", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    trials = json.loads(out.read_text())["trials"]
    assert sorted(t["moment"] for t in trials) == ["second", "time"], trials
    assert sorted(t["comm"] for t in trials) == ["direct", "two_phase"], trials
    for t in trials:
        assert t["outcome"] == "ok" and t["lost"] == 0 and t["landed"], t
        assert t["change"]["lost"] == sorted([t["victim"]] + ([t["second"]] if "second" in t else [])), t
    assert "| all | 2 | 2 | 24 | 0 | 0 | 0 |" in done.stdout, done.stdout[-2000:]
