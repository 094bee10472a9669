"""Every command the README and docs/ show exists (issue 33): each `make` target is one the Makefile has; each
script or module a command runs (python, .venv/bin/python, python -m, torchrun, bash) is there, its `--help`
works, and every flag the command passes is one its `--help` lists. The Makefile's own recipes are held to the
same rule. Commands come from the docs' fenced blocks and inline code spans; `[...]` marks optional flags (they
are checked too) and `...` an elided rest. The full runs of the benches stay in `make bench`, `make eval` and
`make peers`: here a command only has to resolve."""
from __future__ import annotations

import functools
import glob
import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))),
        "deploy/README.md"]
PYTHONS = {"python", "python3", ".venv/bin/python", "$(PY)", "sudo"}
FIRST_WORDS = PYTHONS | {"make", "torchrun", "bash"}
INLINE = re.compile(r"`([^`\n]+)`")


def _lines(text: str) -> list[str]:
    """Shell lines of a text: continuation backslashes joined, comments and prompts dropped."""
    out, cur = [], ""
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
        line = line.removeprefix("$ ")
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        out.append((cur + line).strip())
        cur = ""
    return [line for line in out if line]


def documented() -> list[tuple[str, str]]:
    """(where, command) for every command line of the docs (fenced blocks and inline spans) and the Makefile's
    recipes that run a script."""
    found = []
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc)).read()
        blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.S | re.M)
        for block in blocks:
            found += [(doc, line) for line in _lines(block)]
        prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        found += [(doc, span.strip()) for span in INLINE.findall(prose)]
    for line in open(os.path.join(ROOT, "Makefile")):
        if line.startswith("\t$(PY) "):
            found.append(("Makefile", line.strip()))
    return [(where, cmd) for where, cmd in found if _words(cmd) and _words(cmd)[0] in FIRST_WORDS]


def _words(cmd: str) -> list[str]:
    try:
        return shlex.split(cmd.replace("[", " ").replace("]", " ").replace("|", " | "))
    except ValueError:
        return []


def make_targets() -> set[str]:
    """The Makefile's targets, its `NAME := value` variables expanded (`$(EVAL_VENV)/.installed`)."""
    text = open(os.path.join(ROOT, "Makefile")).read()
    variables = dict(re.findall(r"^(\w+)\s*:=\s*(\S+)", text, flags=re.M))
    targets = re.findall(r"^([$(\w.)/-]+):(?!=)", text, flags=re.M)
    for _ in range(3):    # variables made of variables
        targets = [re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), t) for t in targets]
    return set(targets)


def resolve(cmd: str) -> tuple[str, list[str], str | list[str]]:
    """A command -> ("make", [], targets) | ("script" or "module", flags, path or module name) | ("bash", [], path)
    | ("skip", [], why)."""
    words = [w for w in _words(cmd) if w != "..."]
    head = words[0]
    if head == "make":
        return "make", [], [w for w in words[1:] if not w.startswith("-")]
    if head == "bash":
        return "bash", [], words[1]
    if head == "sudo":
        words = words[1:]
    if words[0] == "torchrun":    # its own options come first, then the script (or -m module) and its flags
        i = 1
        while i < len(words) and words[i].startswith("-") and words[i] != "-m":
            i += 1 if "=" in words[i] or words[i] == "--standalone" else 2
        words = ["python"] + words[i:]
    if len(words) < 2:
        return "skip", [], "no script named"
    flags = sorted({w.split("=", 1)[0] for w in words[2:] if w.startswith("--")})
    if words[1] == "-m":
        return "module", flags, words[2]
    return "script", flags, words[1]


@functools.lru_cache(maxsize=None)
def help_text(kind: str, target: str) -> str:
    """The `--help` output of a script or module, run from the repository root with this interpreter."""
    argv = [sys.executable, "-m", target] if kind == "module" else [sys.executable, os.path.join(ROOT, target)]
    done = subprocess.run(argv + ["--help"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{' '.join(argv)} --help failed:\n{done.stderr[-2000:]}"
    return done.stdout


PROJECT = ("attention_nodes", "balancer", "bench", "comm", "expert_nodes", "kernels", "launch", "models", "scripts")
# the project's own commands (pip and pytest, which the Makefile runs too, have their own docs)
COMMANDS = [(w, c) for w, c in documented() if resolve(c)[0] != "skip" and
            (resolve(c)[0] != "module" or resolve(c)[2].startswith(PROJECT))]


def test_the_docs_show_commands():
    """The extraction itself: the README's make demo / make test and the serve command are among them."""
    cmds = {c for _, c in COMMANDS}
    assert "make demo" in cmds and "make test" in cmds
    assert any(c.startswith("torchrun --nproc-per-node 3 launch/serve.py") for c in cmds), sorted(cmds)
    assert len({resolve(c)[2] if isinstance(resolve(c)[2], str) else "make" for c in cmds}) >= 15


@pytest.mark.parametrize("where,cmd", COMMANDS, ids=[f"{w}:{c[:60]}" for w, c in COMMANDS])
def test_a_documented_command_resolves(where, cmd):
    kind, flags, target = resolve(cmd)
    if kind == "make":
        missing = [t for t in target if t not in make_targets()]
        assert not missing, f"{where}: `{cmd}`: no Makefile target {missing}"
    elif kind == "bash":
        assert os.path.isfile(os.path.join(ROOT, target)), f"{where}: `{cmd}`: no file {target}"
    elif kind == "module":
        assert importlib.util.find_spec(target) is not None, f"{where}: `{cmd}`: no module {target}"
    elif kind == "script":
        assert os.path.isfile(os.path.join(ROOT, target)), f"{where}: `{cmd}`: no script {target}"
    if kind in ("script", "module") and (flags or target.startswith(("bench/", "launch/"))):
        text = help_text(kind, target)
        unknown = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]
        assert not unknown, f"{where}: `{cmd}`: {target} --help lists no {unknown}"


# Where each script or module the docs name is run (its command, small), or why a test only resolves it.
RUN_BY = {
    "bench/throughput.py": "tests/bench/test_bench_smoke.py (--smoke)",
    "bench/step_breakdown.py": "tests/bench/test_bench_smoke.py (--smoke, make test-full)",
    "bench/balancer.py": "tests/bench/test_bench_smoke.py (--smoke)",
    "bench/balancer_engine.py": "tests/bench/test_bench_smoke.py (--smoke)",
    "bench/sync_audit.py": "tests/bench/test_bench_smoke.py (--smoke)",
    "bench/serve_load.py": "tests/bench/test_bench_smoke.py (--smoke, make test-full; --peer vllm needs "
                           ".venv-vllm: make peers)",
    "bench/elastic.py": "tests/bench/test_bench_smoke.py (--smoke, make test-full)",
    "bench/spec_decode.py": "tests/bench/test_bench_smoke.py (--smoke, make test-full)",
    "bench/pd.py": "tests/bench/test_bench_smoke.py (--smoke, make test-full)",
    "bench/chaos.py": "tests/bench/test_chaos.py (the handover and scale-out kills; seeded trials in make test-full)",
    "bench/kernels.py": "tests/bench/test_kernels_bench.py (--smoke)",
    "bench/deepspeed_moe.py": "tests/bench/test_deepspeed_moe.py (needs the bench extra: make bench)",
    "bench/comm_emulated.py": "tests/bench/test_comm_emulated.py (needs root for its network namespaces)",
    "bench/guidellm_load.py": "tests/bench/test_eval_paths.py (its paths; guidellm itself needs .venv-eval: make eval)",
    "bench/lm_eval_compare.py": "resolved only: lm-eval needs .venv-eval (make eval)",
    "bench/peers.py": "resolved only: vLLM's CPU build needs .venv-vllm (make peers)",
    "launch/serve.py": "tests/launch/frontend (the server under torchrun, every route)",
    "launch.serve": "tests/launch/frontend (the server under torchrun, every route)",
    "launch/comm_profile.py": "tests/launch/test_comm_profile.py",
    "launch.plan": "tests/launch/test_plan.py (--profile and --hardware; --calibrate's windows in make test-full)",
    "bench/plan_validation.py": "tests/launch/test_plan.py (--smoke, make test-full)",
    "bench/autoscale.py": "tests/bench/test_bench_smoke.py (--smoke, make test-full)",
    "bench/startup.py": "tests/bench/test_bench_smoke.py (--smoke, make test-full)",
    "bench/plan_published.py": "tests/launch/test_plan.py (a smaller search)",
    "launch.demo": "tests/launch/test_demo.py",
    "kernels.aot": "tests/kernels/test_triton_compile.py",
    "scripts/model_sizes.py": "test_model_sizes_prints_the_table_in_the_docs, below",
    "scripts/train_tiny_moe.py": "resolved only: it trains the shipped model for minutes on a corpus it fetches",
    "scripts/train_draft.py": "resolved only: it trains the shipped draft for minutes on the corpus it fetches",
    "scripts/gpu_check.sh": "resolved only: it needs a GPU (the device tool)",
    ".ci/run": "CI itself",
}


def test_every_documented_script_is_run_somewhere():
    """A script or module the docs or the Makefile name must be in RUN_BY: where a test runs it, or why it is only
    resolved here. A new command in the docs without either fails."""
    named = {resolve(c)[2] for _, c in COMMANDS if resolve(c)[0] in ("script", "module", "bash")}
    missing = sorted(named - set(RUN_BY))
    assert not missing, f"documented but neither run by a test nor explained: {missing}; add them to RUN_BY"
    for target, where in RUN_BY.items():
        path = where.split(" ")[0]
        if path.startswith("tests/"):
            assert os.path.exists(os.path.join(ROOT, path)), (target, where)


def test_model_sizes_prints_the_table_in_the_docs():
    """`python scripts/model_sizes.py` prints the table docs/models.md shows, row for row."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "model_sizes.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("|")]
    doc = open(os.path.join(ROOT, "docs", "models.md")).read()
    assert len(rows) >= 10 and [r for r in rows if r not in doc] == [], done.stdout
