"""The distributed runtime of one rank: start-up, the steady-state step protocol, membership, sizing.

- runtime.py: `Runtime`, one rank of the job (its groups, data plane, worker and expert placement)
- startup.py: what a rank builds at start-up (the job's store, its attention model and KV cache)
- sizing.py: the device, threads, and memory sizing (KV blocks, host tier, expert budget)
- dataplane.py: the dispatcher a generation's dispatch/combine runs on
- planning.py: the placement and plan of a generation (pure functions over the job's state)
- collectives.py: the between-step collectives (live re-placement, stats gathering)
- step_protocol.py: the steady-state step loops of the leader and every other rank
- generations.py: forming a generation, re-forming after a loss
- membership.py: joining, scaling, draining, the handover's orchestration, a failure during one of them
- liveness.py: heartbeats, and where each member's process runs
"""
from .runtime import RankInfo, Runtime
from .step_protocol import follow, lead

__all__ = ["RankInfo", "Runtime", "follow", "lead"]
