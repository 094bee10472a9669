"""Handing an attention rank's requests, with their KV blocks, to another rank: a graceful attention scale-in
(launch/runtime/step_protocol.py) moves the leaving rank's state instead of recomputing it.

Between steps the leaving rank packs every live sequence (tokens, progress, sampling state, its seeded
generator's state) and the KV blocks they hold, each block once even when forked samples share it; the
receiving rank allocates blocks for them, copies the KV in and schedules the sequences as if they had always
run there. What does not fit (KV blocks, or running seats: max_num_seqs) is taken as waiting and recomputed
from its tokens, like a preempted sequence; no request is lost either way.
"""
from __future__ import annotations

import torch

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
                     "generator": None if seq.generator is None else bytes(seq.generator.get_state().numpy()),
                     "blocks": [blocks.setdefault(b, len(blocks)) for b in seq.block_table]})
    ids = torch.tensor(list(blocks), dtype=torch.int64, device=worker.kv.tensor.device)
    kv = worker.kv.tensor[:, :, ids].contiguous()
    return {"seqs": seqs, "num_blocks": len(blocks), "shape": list(kv.shape)}, kv


def unpack_sequences(worker, meta: dict, kv: torch.Tensor) -> int:
    """Take the sequences of pack_sequences into this worker's scheduler -> the number of KV blocks taken
    over. Running sequences keep their KV when every block fits and they fit max_num_seqs; the others wait
    and are recomputed. With prefix caching on, the full blocks received become this rank's cached blocks."""
    sched, pool = worker.scheduler, worker.block_pool
    seqs = [_sequence(d, worker.device) for d in meta["seqs"]]
    running = [(s, d) for s, d in zip(seqs, meta["seqs"]) if d["running"]]
    # a request still to fork takes a seat per sample (as the scheduler counts them)
    seats = sched.max_num_seqs - sum(map(seats_of, sched.running))
    keep_kv = bool(running) and sum(seats_of(s) for s, _ in running) <= seats and \
        pool.can_allocate(meta["num_blocks"])
    moved = 0
    if keep_kv:
        new_ids = pool.allocate(meta["num_blocks"])
        if pool.host is not None:    # evictions queue saves of the old contents: run them before overwriting
            worker.kv.copy_blocks(pool.host.take_ops())
        dst = torch.tensor(new_ids, dtype=torch.int64, device=worker.kv.tensor.device)
        worker.kv.tensor[:, :, dst] = kv.to(worker.kv.tensor.device)
        holders = [0] * len(new_ids)
        for seq, d in running:
            seq.replace_blocks([new_ids[i] for i in d["blocks"]])
            seq.num_computed_tokens = d["num_computed_tokens"]
            seq.status = SequenceStatus.RUNNING
            if sched.enable_prefix_caching:
                sched.register_full_blocks(seq)
            for i in d["blocks"]:
                holders[i] += 1
        # allocate gave each block one reference; a block forked samples share gets one per holder
        pool.incref([b for b, n in zip(new_ids, holders) for _ in range(n - 1)])
        moved = len(new_ids)
    sched.take_over([s for s in seqs if s.status is SequenceStatus.RUNNING],
                    [s for s in seqs if s.status is SequenceStatus.WAITING], worker.next_arrival)
    return moved


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
                    group_id=d["group_id"], sample_index=d["sample_index"], forked=d["forked"])
