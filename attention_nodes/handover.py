"""Handing an attention rank's requests, with their KV blocks, to another rank: a graceful attention scale-in
(launch/runtime/step_protocol.py) moves the leaving rank's state instead of recomputing it.

Between steps the leaving rank packs every live sequence (tokens, progress, sampling state, its seeded
generator's state) and the KV blocks they hold, each block once even when forked samples share it; the
receiving rank allocates blocks for them, copies the KV in and schedules the sequences as if they had always
run there. What does not fit (KV blocks, or running seats: max_num_seqs) is taken as waiting and recomputed
from its tokens, like a preempted sequence; no request is lost either way.

Over a KVTransfer (comm/kv_transfer.py) the receiving rank first reads the description and asks only for the
blocks it needs (`receive_sequences`): with prefix caching on, a full computed block whose tokens its own cache
holds is taken from there instead (a PD decode rank chosen for its cached prefix gets only the rest), and
sequences that cannot keep their KV here need none.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.paged_attention import kv_bits

from .block_pool import chain_hashes
from .sampling_params import SamplingParams
from .scheduler import seats_of
from .sequence import Sequence, SequenceStatus


def pack_sequences(worker, chosen: list[Sequence] | None = None) -> tuple[dict, torch.Tensor]:
    """The worker's live sequences (running, then waiting, in scheduling order), or those `chosen` -> (msgpack-able
    meta, KV `[layers, c, n, block_size, heads, dim]` of the n distinct blocks they hold)."""
    sched = worker.scheduler
    blocks: dict[int, int] = {}       # block id -> index among the blocks sent
    seqs = []
    for seq in list(sched.running) + list(sched.waiting) if chosen is None else chosen:
        seqs.append({"request_id": seq.request_id, "token_ids": seq.token_ids,
                     "num_prompt_tokens": seq.num_prompt_tokens, "params": seq.params.to_dict(),
                     "num_computed_tokens": seq.num_computed_tokens, "running": seq.status is SequenceStatus.RUNNING,
                     "num_preemptions": seq.num_preemptions, "prompt_logprobs": seq.prompt_logprobs,
                     "num_prompt_logprobs_sent": seq.num_prompt_logprobs_sent, "group_id": seq.group_id,
                     "sample_index": seq.sample_index, "forked": seq.forked,
                     "num_cached_tokens": seq.num_cached_tokens,
                     "generator": None if seq.generator is None else bytes(seq.generator.get_state().numpy()),
                     "blocks": [blocks.setdefault(b, len(blocks)) for b in seq.block_table]})
    ids = torch.tensor(list(blocks), dtype=torch.int64, device=worker.kv.tensor.device)
    kv = worker.kv.tensor[:, :, ids].contiguous()
    return {"seqs": seqs, "num_blocks": len(blocks), "shape": list(kv.shape)}, kv


@dataclass(slots=True)
class TakeOver:
    """What a receiving rank does with a pack_sequences description: seqs (as they were there, holding nothing),
    keep_kv (the running ones keep their KV: their seats and blocks fit), have (packed block index -> this rank's
    cached block with the same tokens, reused), need (the packed block indices to receive, in order)."""

    seqs: list[Sequence]
    keep_kv: bool
    have: dict[int, int]
    need: list[int]


def plan_take_over(worker, meta: dict) -> TakeOver:
    """Which of meta's blocks this worker needs: with prefix caching on, the sequences' full computed blocks are
    looked up in this rank's prefix cache; the rest come over the transfer."""
    sched, pool = worker.scheduler, worker.block_pool
    seqs = [_sequence(d, worker.device) for d in meta["seqs"]]
    running = [(s, d) for s, d in zip(seqs, meta["seqs"]) if d["running"]]
    # a request still to fork takes a seat per sample (as the scheduler counts them)
    seats = sched.max_num_seqs - sum(map(seats_of, sched.running))
    have: dict[int, int] = {}
    if sched.enable_prefix_caching:
        for _, d in running:
            keys = chain_hashes(d["token_ids"], pool.block_size, limit=d["num_computed_tokens"] // pool.block_size,
                                salt=d["params"].get("cache_salt"))
            for i, b in zip(d["blocks"], pool.lookup(keys)):
                have.setdefault(i, b)
    need = [i for i in range(meta["num_blocks"]) if i not in have]
    keep_kv = bool(running) and sum(seats_of(s) for s, _ in running) <= seats and \
        pool.num_free_blocks - pool.num_revived(set(have.values())) >= len(need)
    return TakeOver(seqs, True, have, need) if keep_kv else TakeOver(seqs, False, {}, [])


def receive_sequences(worker, transfer, src: int, refuse: bool = False) -> tuple[dict, TakeOver | None, int]:
    """Take over what attention rank src sends through transfer, asking only for the blocks this rank needs ->
    (the description, the plan it followed, the KV bytes received). refuse: when the sequences cannot keep their
    KV here, refuse the move instead (src keeps them; the plan is then None)."""
    plan = []

    def wanted(meta: dict) -> list[int] | None:
        plan.append(plan_take_over(worker, meta))
        return None if refuse and not plan[0].keep_kv else plan[0].need
    meta, kv = transfer.recv(src, wanted)
    if kv is None:
        return meta, None, 0
    unpack_sequences(worker, meta, kv, plan[0])
    return meta, plan[0], kv.numel() * kv.element_size()


def unpack_sequences(worker, meta: dict, kv: torch.Tensor, take: TakeOver) -> int:
    """Take the sequences of pack_sequences into this worker's scheduler -> the number of KV blocks received into
    its pool. take: plan_take_over's plan, kv holding its `need` blocks in order. Running sequences keep their KV
    when every block fits and they fit max_num_seqs; the others wait and are recomputed. With prefix caching on,
    the full blocks received become this rank's cached blocks."""
    sched, pool = worker.scheduler, worker.block_pool
    running = [(s, d) for s, d in zip(take.seqs, meta["seqs"]) if d["running"]]
    moved = 0
    if take.keep_kv:
        holders = [0] * meta["num_blocks"]
        for _, d in running:
            for i in d["blocks"]:
                holders[i] += 1
        # one reference per holder; the reused blocks first, so that allocating cannot evict them
        pool.take([b for i, b in take.have.items() for _ in range(holders[i])])
        new_ids = write_new_blocks(worker, kv)
        local = {**take.have, **dict(zip(take.need, new_ids))}
        for seq, d in running:
            seq.replace_blocks([local[i] for i in d["blocks"]])
            seq.num_computed_tokens = d["num_computed_tokens"]
            seq.status = SequenceStatus.RUNNING
            if sched.enable_prefix_caching:
                sched.register_full_blocks(seq)
        # allocate gave each new block one reference; a block forked samples share gets one per holder
        pool.incref([b for i, b in zip(take.need, new_ids) for _ in range(holders[i] - 1)])
        moved = len(new_ids)
    sched.take_over([s for s in take.seqs if s.status is SequenceStatus.RUNNING],
                    [s for s in take.seqs if s.status is SequenceStatus.WAITING], worker.next_arrival)
    return moved


def write_new_blocks(worker, kv: torch.Tensor) -> list[int]:
    """Allocate a fresh block of this worker's pool for each of kv's blocks `[L, 2, n, ...]` and write them in
    -> the block ids, in kv's order, each with one reference. Blocks the caller holds stay; the allocation may
    evict cached ones, whose host-tier saves run before their contents are overwritten."""
    pool = worker.block_pool
    new = pool.allocate(kv.shape[2])
    if pool.host is not None:
        worker.kv.copy_blocks(pool.host.take_ops())
    cache = kv_bits(worker.kv.tensor)       # a float8 cache's blocks as bytes, as every block copy moves them
    cache[:, :, torch.tensor(new, dtype=torch.int64, device=cache.device)] = kv_bits(kv.to(cache.device))
    return new


def _sequence(d: dict, device: torch.device) -> Sequence:
    """A sequence as it was on the sending rank, waiting and holding no blocks (unpack_sequences may give it
    its KV back; Scheduler.take_over gives it its arrival). device: where this rank samples."""
    params = SamplingParams.from_dict(d["params"])
    generator = None
    if d["generator"] is not None:
        generator = torch.Generator(device=device)
        generator.set_state(torch.frombuffer(bytearray(d["generator"]), dtype=torch.uint8))
    return Sequence(request_id=d["request_id"], token_ids=list(d["token_ids"]),
                    num_prompt_tokens=d["num_prompt_tokens"], params=params, arrival=0,
                    num_preemptions=d["num_preemptions"], generator=generator,
                    prompt_logprobs=d["prompt_logprobs"], num_prompt_logprobs_sent=d["num_prompt_logprobs_sent"],
                    group_id=d["group_id"], sample_index=d["sample_index"], forked=d["forked"],
                    num_cached_tokens=d["num_cached_tokens"])
