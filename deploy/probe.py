"""Kubernetes exec probe for afserve pods (standard library only; the image puts it at /opt/afserve/probe.py).

    probe.py ready URL   exit 0 iff GET URL answers 200 (the leader's /health: 503 while loading or when the
                         engine is dead, no answer while it starts)
    probe.py alive       exit 0 iff this pod's ranks (the `launch.serve` processes torchrun started) are all
                         there and none is a zombie; on the leader pod also `ready` on its own /health
    probe.py drain URL   (a preStop hook) POST {"hosts": [this pod's hostname]} to the leader's /admin/drain
                         (URL), with AFSERVE_API_KEY as the bearer key when set: this pod's ranks leave the job
                         between steps (an attention rank hands its requests and KV blocks over) and exit, so
                         a scale-down loses nothing. Exit 0 once the leader has answered 200; on the leader pod
                         it does nothing (the leader cannot be drained)

Every pod but the leader has no HTTP server, so a pool's probes ask the leader (through the headless
afserve-leader Service, which publishes it before it is ready) whether the job its ranks belong to is serving.
Liveness stays local to the pod, so that a leader outage does not restart every pod of both pools at once.
Environment: AFSERVE_RANKS_PER_POD (torchrun's --nproc-per-node; default 1), AFSERVE_LEADER_POD (the pod
name that runs attention rank 0) and AFSERVE_HEALTH_URL (default http://127.0.0.1:8000/health).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import urllib.error
import urllib.request

ENTRY = "launch.serve"                           # what the ranks run: torchrun ... -m launch.serve
AGENTS = ("torchrun", "torch.distributed.run")   # the launcher's own command line names the module too


def check_ready(url: str, timeout_s: float) -> str | None:
    """None when GET url answers 200 within timeout_s, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return None if resp.status == 200 else f"{url} answered {resp.status}"
    except urllib.error.HTTPError as e:
        return f"{url} answered {e.code}: {e.read(200).decode(errors='replace')}"
    except (OSError, ValueError) as e:
        return f"{url} did not answer: {e}"


def rank_processes(proc: str = "/proc") -> list[tuple[int, str]]:
    """(pid, state) of every rank process under `proc`; state is /proc/PID/stat's letter (Z = zombie)."""
    found = []
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "cmdline"), "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            with open(os.path.join(proc, name, "stat")) as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue   # the process left while we looked
        if ENTRY in argv and not any(agent in arg for arg in argv for agent in AGENTS):
            found.append((int(name), state))
    return found


def check_alive(num_ranks: int, proc: str = "/proc") -> str | None:
    """None when at least num_ranks rank processes run and none is a zombie, else why not."""
    ranks = rank_processes(proc)
    dead = [pid for pid, state in ranks if state == "Z"]
    if dead:
        return f"rank processes {dead} are zombies"
    if len(ranks) < num_ranks:
        return f"{len(ranks)} rank processes run, {num_ranks} expected (AFSERVE_RANKS_PER_POD)"
    return None


def drain(url: str, timeout_s: float) -> str | None:
    """None when the leader at url (its /admin/drain) removed this host's ranks, else why not."""
    body = json.dumps({"hosts": [socket.gethostname()]}).encode()
    headers = {"Content-Type": "application/json"}
    if os.environ.get("AFSERVE_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['AFSERVE_API_KEY']}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=timeout_s) as resp:
            return None if resp.status == 200 else f"{url} answered {resp.status}"
    except urllib.error.HTTPError as e:
        return f"{url} answered {e.code}: {e.read(500).decode(errors='replace')}"
    except (OSError, ValueError) as e:
        return f"{url} did not answer: {e}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("check", choices=("ready", "alive", "drain"))
    p.add_argument("url", nargs="?", help="ready: the URL that must answer 200; drain: the leader's /admin/drain")
    p.add_argument("--timeout-s", type=float, default=4.0)
    args = p.parse_args(argv)
    if args.check in ("ready", "drain") and not args.url:
        p.error(f"{args.check} needs the URL to ask, e.g. http://afserve-leader:8000/health")
    if args.check == "ready":
        why = check_ready(args.url, args.timeout_s)
    elif args.check == "drain":
        leader = socket.gethostname() == os.environ.get("AFSERVE_LEADER_POD")
        why = None if leader else drain(args.url, args.timeout_s)
    else:
        why = check_alive(int(os.environ.get("AFSERVE_RANKS_PER_POD", "1")))
        if why is None and socket.gethostname() == os.environ.get("AFSERVE_LEADER_POD"):
            why = check_ready(os.environ.get("AFSERVE_HEALTH_URL", "http://127.0.0.1:8000/health"), args.timeout_s)
    if why:
        print(f"afserve probe {args.check}: {why}", file=sys.stderr)   # the kubelet puts this in the pod's events
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
