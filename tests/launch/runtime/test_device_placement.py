"""The CUDA path's decisions, checked on CPU: which GPU a rank takes and when ranks may share one, which
transport a device may use, that seeded requests draw on the rank's device, and that device-synchronised
timers synchronise before reading the clock; on CPU, how many threads the C decode borrows; and where the
leader's micro_batches=0 (auto) ping-pongs."""
from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest
import torch

from comm.topology import Topology
from launch.procs import free_slot, joiner_slot, rank_env
from launch.runtime.planning import gpu_room_refusal
from launch.runtime.sizing import DeviceSettings, auto_micro_batches, check_fp8_kernels, gpu_placement


def test_one_gpu_per_rank_when_the_node_has_enough():
    assert [gpu_placement(r, 4, 8, "auto", "two_phase", False) for r in range(4)] == [(r, 1) for r in range(4)]
    assert gpu_placement(3, 4, 4, "collective", "direct", True) == (3, 1)


def test_ranks_share_gpus_round_robin_only_through_cuda_ipc():
    # 4 ranks on 1 GPU (the gpu_check topology 1+3), 5 ranks on 2 GPUs: 3 on GPU 0, 2 on GPU 1
    assert [gpu_placement(r, 4, 1, "auto", "direct", True) for r in range(4)] == [(0, 4)] * 4
    assert [gpu_placement(r, 5, 2, "cuda_ipc", "direct", True) for r in range(5)] == \
        [(0, 3), (1, 2), (0, 3), (1, 2), (0, 3)]


@pytest.mark.parametrize("transport,comm,one_node,match", [
    ("collective", "direct", True, r"4 ranks on this node but 1 GPU\(s\).*transport='cuda_ipc'.*at most 1 ranks"),
    ("shm", "direct", True, r"only with transport='cuda_ipc' \(transport='shm'\)"),
    ("auto", "two_phase", True, r"comm='direct' on one node only \(comm='two_phase'"),
    ("cuda_ipc", "direct", False, r"one node: False"),
])
def test_sharing_a_gpu_is_refused_where_nccl_would_have_to_carry_it(transport, comm, one_node, match):
    with pytest.raises(ValueError, match=match):
        gpu_placement(0, 4, 1, transport, comm, one_node)


def test_a_joiner_spawned_by_scale_places_itself_among_the_nodes_ranks():
    """LLM.scale spawns joiners whose rank is their member id, past the first launch's world (seen on an H100:
    'LOCAL_RANK=5 is outside LOCAL_WORLD_SIZE=3'). The node then counts them in, and on one GPU they share it
    through cuda_ipc like the first ranks."""
    first = rank_env(2, 3, 1234, join=False)
    assert (first["LOCAL_RANK"], first["LOCAL_WORLD_SIZE"]) == ("2", "3") and "AFSERVE_MEMBER" not in first
    env = rank_env(5, 3, 1234, join=True, slot=3)
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["AFSERVE_MEMBER"]) == ("3", "4", "5")
    assert gpu_placement(int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"]), 1, "auto", "direct", True) == (0, 4)


def test_a_joiner_takes_the_gpu_a_departed_rank_left_not_one_past_the_machines():
    """4 GPUs, a 1+1 job (GPUs 0 and 1); rank 1 died, members 2 and 3 joined (slots 1 and 2), member 2 left:
    member 4 takes slot 1 and GPU 1, with a GPU of its own (NCCL like the rest). By member id it would have
    been LOCAL_RANK 4 of 5 > 4 GPUs: a GPU shared over gloo in a job whose other ranks talk NCCL."""
    assert free_slot([0, 2]) == 1 and free_slot([0, 1, 2]) == 3 and free_slot([]) == 0
    env = rank_env(4, 2, 1234, join=True, slot=free_slot([0, 2]))
    assert gpu_placement(int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"]), 4, "auto", "two_phase", True) == \
        (1, 1)


class _Proc:
    def __init__(self, alive: bool = True):
        self.alive = alive

    def is_alive(self) -> bool:
        return self.alive


def test_a_joiner_waits_for_a_retired_rank_to_free_its_gpu_and_is_refused_past_the_gpus():
    """4 GPUs, 4 live ranks each with its own (NCCL): a joiner would take slot 4, past the GPUs. It waits for a
    retired rank to exit and takes its slot; if none exits in time, the spawn fails naming the GPUs. A CPU job
    (no GPUs counted) or ranks launched sharing GPUs take the next slot at once."""
    procs = [_Proc() for _ in range(4)]
    with pytest.raises(RuntimeError, match=r"the 4 GPU\(s\) each hold a live rank of this job"):
        joiner_slot([0, 1, 2, 3], procs, 4, 2, wait_s=0.1)
    timer = threading.Timer(0.1, lambda: setattr(procs[2], "alive", False))
    timer.start()
    assert joiner_slot([0, 1, 2, 3], procs, 4, 2, wait_s=5) == 2
    procs[2].alive = True
    assert joiner_slot([0, 1, 2, 3], procs, 0, 2, wait_s=5) == 4
    assert joiner_slot([0, 1, 2, 3], procs, 2, 4, wait_s=5) == 4
    assert joiner_slot([4], [procs[0]], 0, 2, held=range(3)) == 3     # a torchrun launch's three slots: held


def test_a_scale_that_needs_more_gpus_than_the_machine_has_is_refused_with_the_numbers():
    """Ranks with a GPU each: the joiners need free GPUs while the retiring ranks still hold theirs. Ranks that
    share GPUs (gloo) and CPU jobs are never refused for it."""
    assert gpu_room_refusal("nccl", 4, 2, 2) is None
    why = gpu_room_refusal("nccl", 4, 3, 2)
    assert "2 more rank(s) beside the job's 3 need 5 GPUs" in why and "shows 4" in why and "cuda_ipc" in why
    assert gpu_room_refusal("gloo", 1, 4, 3) is None and gpu_room_refusal("gloo", 0, 2, 5) is None


def test_no_gpu_and_a_bad_local_rank_are_named():
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        gpu_placement(0, 2, 0, "auto", "direct", True)
    with pytest.raises(ValueError, match="LOCAL_RANK=2 is outside LOCAL_WORLD_SIZE=2"):
        gpu_placement(2, 2, 4, "auto", "direct", True)


@pytest.mark.parametrize("transport,device,match", [
    ("cuda_ipc", "cpu", "transport='cuda_ipc' cannot carry CPU ranks: use transport='shm'"),
    ("shm", "cuda", "transport='shm' cannot carry CUDA ranks: use transport='cuda_ipc'"),
])
def test_a_transport_for_the_other_device_is_refused(transport, device, match):
    from launch.config import EngineConfig
    from launch.runtime.dataplane import use_shm

    cfg = EngineConfig.from_options("/m", 1, 1, transport=transport, device="cpu")
    with pytest.raises(ValueError, match=match):
        use_shm(cfg, None, None, torch.device(device))


def test_seeded_requests_draw_on_the_ranks_device(monkeypatch):
    """A CPU generator cannot draw into CUDA probabilities: each seeded stream is created on the device."""
    from attention_nodes.sampling_params import SamplingParams
    from attention_nodes.sequence import Sequence

    made = []
    real = torch.Generator

    def generator(device="cpu"):
        made.append(torch.device(device))
        return real()      # this CPU build has no CUDA generator; the device asked for is what counts

    monkeypatch.setattr(torch, "Generator", generator)
    params = SamplingParams(seed=7, temperature=1.0)
    Sequence.from_request("a", [1, 2], params, 1, torch.device("cuda", 1))
    Sequence.resumed("b", 0, [1, 2], [3], params, 2, torch.device("cuda", 1))
    Sequence.from_request("c", [1, 2], SamplingParams(), 3, torch.device("cuda", 1))   # unseeded: none
    assert made == [torch.device("cuda", 1)] * 2


def test_synchronised_timers_wait_for_the_device_before_the_clock():
    from comm.stats import CommStats

    stats, calls = CommStats(), []
    assert stats.sync is None
    stats.now()
    stats.sync = lambda: calls.append("sync")
    stats.now()
    assert calls == ["sync"]


@pytest.mark.parametrize("cores,attention_ranks,want", [(2, 1, 2), (2, 2, 1), (3, 2, 1), (8, 2, 4), (64, 1, 16)])
def test_decode_threads_default_shares_the_cores_among_attention_ranks(monkeypatch, tmp_path, cores,
                                                                        attention_ranks, want):
    from launch.config import EngineConfig
    from launch.runtime.sizing import decode_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    config = EngineConfig.from_options(str(tmp_path), attention_ranks, 1, device="cpu")
    assert decode_threads(config) == want
    config = EngineConfig.from_options(str(tmp_path), attention_ranks, 1, device="cpu", decode_threads=3)
    assert decode_threads(config) == 3


def test_every_rank_of_a_node_sharing_gpus_unevenly_picks_the_same_backend(monkeypatch):
    """3 ranks on 2 GPUs: GPU 1's rank has its GPU alone but must talk gloo like the two sharing GPU 0, or the
    node's process groups would mix nccl and gloo and never form. Through set_device, as each rank runs it."""
    from launch.config import EngineConfig
    from launch.runtime.sizing import set_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    config = EngineConfig.from_options("/m", 1, 2, device="cuda", transport="cuda_ipc", kernel_backend="torch")
    placed = []
    for r in range(3):
        monkeypatch.setenv("LOCAL_RANK", str(r))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
        dev = set_device(config, 3)
        placed.append((dev.device.index, dev.gpu_sharers, dev.backend, dev.node_shares_gpus))
    assert placed == [(0, 2, "gloo", True), (1, 1, "gloo", True), (0, 2, "gloo", True)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)   # a GPU each: NCCL everywhere
    assert {(set_device(config, 3).backend, set_device(config, 3).node_shares_gpus)} == {("nccl", False)}


def test_a_torchrun_joiner_counts_its_node_as_the_first_launch_did():
    """Two nodes of 3 torchrun ranks on 4 GPUs each (nccl: a GPU per rank). A joiner spawned beside the leader
    takes the free GPU 3; counting the job's 6 ranks as its node's it would have picked gloo against its node's
    nccl, and its groups could not form."""
    from launch.runtime.sizing import gpu_backend

    assert gpu_backend(3, 4) == "nccl"
    assert joiner_slot([], [], 4, 3, held=range(3)) == 3
    env = rank_env(6, 6, 1234, join=True, slot=3, local_world=3)
    local, world = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    assert (local, world) == (3, 4)
    assert gpu_placement(local, world, 4, "auto", "two_phase", False) == (3, 1) and gpu_backend(world, 4) == "nccl"
    assert rank_env(6, 6, 1234, join=True, slot=3)["LOCAL_WORLD_SIZE"] == "6"    # the job's count: gloo


def test_start_joiner_hands_the_first_launchs_local_world_to_the_joiner(monkeypatch):
    """What start_joiner gives the joiner's process: slot 3 and the node's first 3 ranks, so rank_env counts 4."""
    from types import SimpleNamespace

    import launch.procs as procs
    from launch.config import EngineConfig

    made = []

    class Ctx:
        def Process(self, target, name, daemon, args):
            made.append(args)
            return SimpleNamespace(start=lambda: None)

    monkeypatch.setattr(procs, "visible_gpus", lambda config: 4)
    config = EngineConfig.from_options("/m", 1, 1, device="cpu")
    procs.start_joiner(Ctx(), 6, "expert", 1234, "h:1", config, (None, None, None), [], [], 3, held=range(3))
    (args,) = made
    rank, world, port, join, slot, local_world = args[0], args[1], args[2], args[7], args[8], args[10]
    assert (rank, join, slot, local_world) == (6, True, 3, 3)
    assert procs.rank_env(rank, world, port, join, slot, local_world)["LOCAL_WORLD_SIZE"] == "4"


def _device(kind: str, backend: str = "gloo") -> DeviceSettings:
    return DeviceSettings(torch.device(kind, 0) if kind == "cuda" else torch.device(kind), torch.float32, "torch",
                          backend)


@pytest.mark.parametrize("ranks,cores,want", [
    (2, 2, 2),     # 1+1 on 2 cores: a core each (measured 12-28% faster with 2)
    (3, 2, 1),     # 1+2 or 2+1 on 2 cores (measured up to 16% faster with 1)
    (4, 4, 2), (5, 4, 1), (2, 1, 1), (8, 64, 2)])
def test_auto_micro_batches_ping_pong_only_with_a_core_per_rank(ranks, cores, want):
    assert auto_micro_batches(_device("cpu"), ranks, cores) == want


def test_auto_micro_batches_on_cuda_follows_gpu_sharing_not_cores():
    # a GPU per rank: nccl; ranks sharing a GPU talk gloo + cuda_ipc (1+1 on one GPU: 1 was 13-30% faster)
    assert auto_micro_batches(_device("cuda", "nccl"), 8, 1) == 2
    assert auto_micro_batches(_device("cuda", "gloo"), 2, 64) == 1


def test_every_rank_sizes_for_the_most_the_leader_may_pick():
    """Buffers, graph slots and their memory: an explicit count as given; auto 2, or 1 where the node's ranks share
    GPUs (they then form a job of one node, so every rank sizes alike), never below what auto picks."""
    from launch.runtime.sizing import micro_batch_capacity
    cpu, own, shared = _device("cpu"), _device("cuda", "nccl"), _device("cuda", "gloo")
    assert [micro_batch_capacity(0, d) for d in (cpu, own, shared)] == [2, 2, 1]
    assert [micro_batch_capacity(3, d) for d in (cpu, own, shared)] == [3, 3, 3]
    for dev in (cpu, own, shared):
        for ranks in range(1, 6):
            for cores in (1, 2, 4, 8):
                assert auto_micro_batches(dev, ranks, cores) <= micro_batch_capacity(0, dev)


def test_peers_count_the_members_on_this_machine():
    """Each member records its host identity (hostname and boot id) in the store; the count compares them, so a
    member elsewhere, or on a machine of the same name booted apart, is not counted."""
    import msgpack
    import torch.distributed as dist

    from comm.shm import host_identity
    from launch.runtime.liveness import PREFIX, Peers

    store = dist.HashStore()
    peers = [Peers(store, m) for m in (0, 2, 5)]        # three processes here (this one, registered three times)
    name = host_identity().partition("/")[0]
    store.set(f"{PREFIX}/proc/3", msgpack.packb(["other-host/boot", 1]))
    store.set(f"{PREFIX}/proc/4", msgpack.packb([f"{name}/another-boot", 1]))
    assert peers[0].count_here([0, 2, 3, 4, 5]) == 3
    assert peers[1].count_here([3, 4]) == 0


def _rank0(tmp_path, micro_batches, launched, now, membership=None):
    from launch.config import EngineConfig

    config = EngineConfig.from_options(str(tmp_path), 1, launched - 1, device="cpu", micro_batches=micro_batches)
    return SimpleNamespace(config=config, topo=Topology(0, now, 1, now), dev=_device("cpu"), membership=membership)


@pytest.mark.parametrize("micro_batches,here,want", [
    (0, 3, 1),     # LLM's 1+2 on this 2-core host, or 1+1 grown by a joiner spawned here
    (0, 2, 2),     # its 1+1, or 1+2 after a rank left
    (0, 4, 1),     # a 1+1 pool launched beside another (--role) on this host
    (3, 4, 3)])    # an explicit count is kept
def test_the_leader_counts_the_ranks_its_members_record_on_its_host(monkeypatch, tmp_path, micro_batches, here,
                                                                   want):
    from launch.runtime.runtime import Runtime

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")     # not read: the members' records say where they run
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    rank0 = _rank0(tmp_path, micro_batches, 2, 2, SimpleNamespace(ranks_here=lambda: here))
    assert Runtime.micro_batches(rank0) == want


@pytest.mark.parametrize("local_world,launched,want", [
    (3, 3, 1),     # groups formed by the caller, every rank on this 2-core host
    (2, 2, 2),
    (2, 4, 2)])    # two hosts of 2 ranks: only this host's count
def test_without_a_store_the_leader_counts_from_local_world_size(monkeypatch, tmp_path, local_world, launched, want):
    from launch.runtime.runtime import Runtime

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert Runtime.micro_batches(_rank0(tmp_path, 0, launched, launched)) == want


def test_e4m3_on_triton_is_refused_before_compute_capability_8_9():
    """Triton converts e4m3 only from sm_89 (Ada, Hopper): an A100 is refused with the option's value, its
    capability and what to use instead; e5m2, a later GPU and the other backends pass."""
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' \(float8 e4m3\) needs a GPU of compute capability "
                                         r"8\.9 or later .*this one: 8\.0.*'fp8_e5m2' or 'auto', or "
                                         r"kernel_backend='sdpa'"):
        check_fp8_kernels(torch.float8_e4m3fn, "triton", (8, 0), "fp8")
    for args in ((torch.float8_e5m2, "triton", (8, 0)), (torch.float8_e4m3fn, "triton", (8, 9)),
                 (torch.float8_e4m3fn, "triton", (9, 0)), (torch.float8_e4m3fn, "torch", (7, 5)),
                 (torch.bfloat16, "triton", (7, 0))):
        check_fp8_kernels(*args, "x")
