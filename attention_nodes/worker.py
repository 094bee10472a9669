"""One attention rank's step: admit requests, schedule, run the forward (joining every layer's
dispatch/combine), sample, and report progress to the leader."""
from __future__ import annotations

import torch

from comm.control import StepReport

from .batch import ForwardBatch, order_for_batch, split_micro_batches
from .block_pool import BlockPool
from .kv_cache import KVCache
from .model import AttentionModel, MoEContext
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence


class AttentionWorker:
    def __init__(self, rank: int, model: AttentionModel, kv: KVCache, scheduler: Scheduler, moe: MoEContext,
                 max_model_len: int, device: torch.device, micro_batches: int = 1):
        self.rank = rank
        self.micro_batches = micro_batches
        self.model, self.kv, self.scheduler, self.moe = model, kv, scheduler, moe
        self.sampler = Sampler()
        self.eos = frozenset(model.spec.eos_token_ids)
        self.max_model_len = max_model_len
        self.device = device
        self._arrivals = 0
        self._aborted: list[list] = []
        self.num_partial_chunks = 0
        self.num_preemptions = 0

    @property
    def block_pool(self) -> BlockPool:
        return self.scheduler.block_pool

    def add_requests(self, requests: list[dict]) -> None:
        """requests: {"id": str, "prompt": [int], "params": SamplingParams.to_dict()} (validated by the front)."""
        for r in requests:
            self._arrivals += 1
            seq = Sequence.from_request(r["id"], r["prompt"], SamplingParams.from_dict(r["params"]), self._arrivals)
            self.scheduler.add(seq)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self.scheduler.abort(rid) is not None:
                self._aborted.append([rid, [], "abort"])

    def step(self, capacity: int) -> StepReport:
        """One forward. capacity: the header's bound on this step's tokens (sizes the dispatch messages)."""
        out = order_for_batch(self.scheduler.schedule())
        assert out.num_tokens <= capacity, f"rank {self.rank}: {out.num_tokens} tokens > step capacity {capacity}"
        self.moe.dispatcher.set_capacity(capacity)
        batches = [ForwardBatch.from_scheduled(part, self.kv.block_size, self.device, self.model.kernel_backend)
                   for part in split_micro_batches(out.scheduled, self.micro_batches)]
        logits = self.model.forward(batches, self.kv, self.moe)
        to_sample = [s for s in out.scheduled if s.needs_sample]
        tokens = iter(self.sampler.sample(logits, [s.seq.params for s in to_sample],
                                          [s.seq.generator for s in to_sample]) if to_sample else [])
        sampled = [next(tokens) if s.needs_sample else None for s in out.scheduled]
        self.num_partial_chunks += sum(not s.needs_sample for s in out.scheduled)
        self.num_preemptions += len(out.preempted)
        produced = self.scheduler.update(out, sampled, self.eos, self.max_model_len)
        outputs, self._aborted = self._aborted, []
        outputs += [[seq.request_id, [tok], seq.finish_reason] for seq, tok in produced]
        return self.report(outputs)

    def report(self, outputs: list[list] | None = None) -> StepReport:
        s = self.scheduler
        return StepReport(self.rank, self.block_pool.num_free_blocks, s.num_running, s.num_waiting,
                          s.max_next_tokens(), self.num_preemptions, self.num_partial_chunks, outputs or [],
                          self.block_pool.num_blocks)
