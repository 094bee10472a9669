"""`make eval` passes its eval venv as a relative path (.venv-eval), and bench/guidellm_load.py runs guidellm in a
temporary directory: the path must be resolved before that (issue 33: FileNotFoundError for
.venv-eval/bin/guidellm). A stand-in guidellm in a venv-shaped folder, named by a path relative to the caller's
directory, must be the program that runs."""
from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "guidellm_load.py")


def test_a_relative_eval_venv_is_found_from_another_working_directory(tmp_path):
    tool = tmp_path / "evalenv" / "bin" / "guidellm"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\necho \"stand-in guidellm ran in $PWD\"\nexit 3\n")
    tool.chmod(0o755)
    done = subprocess.run([sys.executable, os.path.abspath(SCRIPT), "--eval-venv", "evalenv", "--seconds", "1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "guidellm failed (3)" in done.stderr and "stand-in guidellm ran in" in done.stderr, done.stderr[-2000:]
    assert "FileNotFoundError" not in done.stderr
