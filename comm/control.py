"""Control plane: msgpack messages over the gloo control group.

The leader (attention rank 0) broadcasts a `StepHeader` each step, without the new requests' contents; each
attention rank that gets new requests receives them from the leader point to point, so prompts never reach
expert ranks or other attention ranks. Attention ranks send their `StepReport` back over the attention group.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import msgpack
import torch
import torch.distributed as dist

HEADER_BYTES = 4096
GATHER_BYTES = 16384   # one gather slot per rank: a step's report at 64 sequences takes a few KiB


@dataclass(slots=True)
class StepHeader:
    """kind: one of the header kinds of launch/runtime/step_protocol.py (which says what each rank does with it);
    step: the leader's step counter (a header re-sent after the job re-formed keeps its step).
    new_requests / aborts are keyed by attention rank (str for msgpack).
    capacity: no attention rank runs more tokens than this in the step, so the data plane can size its
    messages without exchanging split sizes every layer.
    is_decode: the leader expects every attention rank to run one token per running sequence and nothing new
    (the sync audit's decode steps on expert ranks, which do not see the batches).
    micro_batches: how many ping-pong micro-batches every rank runs this step (1..the configured number; the
    leader's choice, attention_nodes/passes.py `micro_batches_for`), so that expert ranks expect as many
    dispatch rounds per layer as the attention ranks send.
    draft_passes: after the step's forward, every attention rank runs this many passes of the MTP layer
    (speculative decoding method "mtp", attention_nodes/mtp.py), each one more dispatch and combine.
    moves (PD): [prefill rank, decode rank, [request ids]] carried out before the forward (attention_nodes/pd.py);
    prefill_ranks: attention ranks below this number only prefill (0: every rank does both).
    decode_passes (PD): the forwards each decode rank runs in the step while each prefill rank runs one, its MoE
    layers spread over theirs (attention_nodes/passes.py); expert ranks serve decode_passes x the MoE layers'
    rounds.
    pushes (PD, streamed KV): [prefill rank, decode rank, [[request id, first block, end block], ...]] carried out
    after the moves: the full blocks of requests mid-prefill that went into the decode rank's prefix cache ahead
    of their move (attention_nodes/pd.py)."""

    kind: str
    step: int = 0
    capacity: int = 0
    new_requests: dict[str, list[dict]] = field(default_factory=dict)
    aborts: dict[str, list[str]] = field(default_factory=dict)
    is_decode: bool = False
    micro_batches: int = 1
    draft_passes: int = 0
    moves: list[list] = field(default_factory=list)
    prefill_ranks: int = 0
    decode_passes: int = 1
    request_ranks: list[int] = field(default_factory=list)   # on the wire: the ranks that get new requests
    pushes: list[list] = field(default_factory=list)

    def thin(self) -> StepHeader:
        """What crosses to every rank: this header without the requests' contents (prompts reach only the
        attention rank that owns them, ControlPlane.broadcast_header), naming the ranks that get some."""
        ranks = sorted(int(r) for r, reqs in self.new_requests.items() if reqs)
        return replace(self, new_requests={}, request_ranks=ranks)

    @classmethod
    def empty(cls, kind: str, step: int = 0) -> StepHeader:
        return cls(kind, step)

    def requests_for(self, rank: int) -> list[dict]:
        return self.new_requests.get(str(rank), [])

    def aborts_for(self, rank: int) -> list[str]:
        return self.aborts.get(str(rank), [])


@dataclass(slots=True)
class StepReport:
    """What one attention rank tells the leader after a step. outputs: [request_id, [new token ids],
    finish_reason or None, new prompt logprobs ((entry, rank) pairs) or None, new token logprobs or None, the prompt
    tokens found cached at the first admission (Sequence.num_cached_tokens; None for an abort)] per request that
    made progress."""

    rank: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    max_next_tokens: int = 0            # upper bound on the next step's tokens absent new requests
    num_preemptions: int = 0            # cumulative on this rank
    num_prefill_chunks: int = 0         # cumulative: multi-token forward chunks that did not end a prompt
    outputs: list[list] = field(default_factory=list)
    num_blocks: int = 0                 # KV blocks in this rank's pool
    prefix_queries: int = 0             # cumulative: tokens of admitted requests looked up in the prefix cache
    prefix_hits: int = 0                # cumulative: of those, tokens found cached (not computed)
    prompt_tokens_computed: int = 0     # cumulative: prompt positions run through the model
    offload_saved: int = 0              # cumulative: blocks copied to the host tier
    offload_restored: int = 0           # cumulative: blocks copied back from it instead of recomputed
    cache_added: list[int] = field(default_factory=list)    # prefix-cache keys registered since the last report
    cache_evicted: list[int] = field(default_factory=list)  # and those evicted from the device pool
    kv_blocks_received: int = 0         # cumulative: KV blocks taken over from attention ranks that left
    spec_decode: list[int] = field(default_factory=list)   # cumulative speculative decoding counts (SpecStats)
    num_draft_tokens: int = 0           # draft tokens the running sequences carry into the next step
    ready: list[list] = field(default_factory=list)      # PD, a prefill rank: [request id, blocks, samples] to move
    pd: list = field(default_factory=list)   # PD, cumulative: what this rank took over (attention_nodes/pd.py)
    wall_s: float = 0.0                 # this step's forwards and sampling, wall seconds (PD's PassPlanner),
    busy_s: float = 0.0                 # and those less their waits on the data plane
    passes: int = 1                     # the forwards this rank ran in the step (PD decode passes)
    work: list[int] = field(default_factory=list)   # the step's [tokens, attention pairs, logit rows, sequences]
    prefilling: list[list] = field(default_factory=list)   # PD, a prefill rank: [request id, full blocks] mid-prefill


def pack(obj) -> torch.Tensor:
    """A message dataclass (fields of plain msgpack types) or a plain object -> uint8 tensor."""
    if hasattr(obj, "__dataclass_fields__"):  # shallow: asdict() would deep-copy every request's prompt
        obj = {f: getattr(obj, f) for f in obj.__dataclass_fields__}
    data = msgpack.packb(obj, use_bin_type=True)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def unpack(t: torch.Tensor):
    return msgpack.unpackb(t.numpy().tobytes(), raw=False, strict_map_key=False)


class ControlPlane:
    """Bounded, CPU-only broadcasts and gathers of msgpack messages."""

    def __init__(self, control: dist.ProcessGroup, attention: dist.ProcessGroup | None, rank: int,
                 num_attention_ranks: int):
        self.control, self.attention = control, attention
        self.rank, self.num_attention_ranks = rank, num_attention_ranks
        self._sending = None    # the leader's header broadcast still in flight (settle_later)

    def broadcast_header(self, header: StepHeader | None, settle_later: bool = False) -> StepHeader:
        """Leader passes the header; everyone else passes None and gets it, with only its own new requests
        (`StepHeader.thin` crosses to every rank; then the leader sends each rank named in its request_ranks
        that rank's requests, in rank order, over the control group). The leader gets its header back whole.
        settle_later (leader): return while the broadcast is still going out (the gloo send on its own thread:
        ~0.1 ms of a step's host work on the 2-core dev VM); the next call on this control plane waits for it
        first (`settle`), and raises then if it failed. Only when the header fits one buffer and no rank gets
        requests; otherwise the broadcast completes before the call returns."""
        self.settle()
        thin = self._broadcast(None if header is None else header.thin(), settle_later)
        if self.rank == 0:
            for r in thin.request_ranks:
                if r != 0:
                    self.send_object(header.new_requests[str(r)], r)
            return header
        if self.rank in thin.request_ranks:
            thin.new_requests = {str(self.rank): self.recv_object(0)}
        return thin

    def settle(self) -> None:
        """Wait for the leader's header broadcast still in flight, if any (raises if it failed)."""
        if self._sending is not None:
            sending, self._sending = self._sending, None
            sending.wait()

    def _broadcast(self, header: StepHeader | None, settle_later: bool = False) -> StepHeader:
        """One broadcast of a fixed-size buffer (8-byte length, then msgpack); a header that does not fit sends
        its tail in a second one."""
        buf = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        if self.rank == 0:
            payload = pack(header)
            n = payload.numel()
            buf[:8] = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
            buf[8:8 + min(n, HEADER_BYTES - 8)] = payload[:HEADER_BYTES - 8]
            if settle_later and n <= HEADER_BYTES - 8 and not header.request_ranks:
                self._sending = dist.broadcast(buf, src=0, group=self.control, async_op=True)
                return header
        dist.broadcast(buf, src=0, group=self.control)
        n = int(buf[:8].view(torch.int64))
        if n > HEADER_BYTES - 8:
            tail = payload[HEADER_BYTES - 8:] if self.rank == 0 else torch.empty(n - (HEADER_BYTES - 8),
                                                                                dtype=torch.uint8)
            dist.broadcast(tail, src=0, group=self.control)
            if self.rank != 0:
                return StepHeader(**unpack(torch.cat([buf[8:], tail])))
        return header if self.rank == 0 else StepHeader(**unpack(buf[8:8 + n]))

    def gather_reports(self, report: StepReport) -> list[StepReport] | None:
        """Attention ranks only. Returns every rank's report on the leader, None elsewhere."""
        self.settle()
        if self.num_attention_ranks == 1:
            return [report]
        every = self._gather(pack(report), self.attention, self.num_attention_ranks)
        return None if every is None else [StepReport(**r) for r in every]

    def gather_objects(self, obj) -> list | None:
        """Every rank of the control group sends a msgpack-able object -> the list (rank order) on rank 0,
        None elsewhere."""
        self.settle()
        return self._gather(pack(obj), self.control, dist.get_world_size(self.control))

    def send_object(self, obj, dst: int) -> None:
        """A msgpack-able object to one rank of the control group (its length, then the bytes)."""
        self.settle()
        payload = pack(obj)
        dist.send(torch.tensor([payload.numel()]), dst, group=self.control)
        dist.send(payload, dst, group=self.control)

    def recv_object(self, src: int):
        """What send_object sent from src."""
        self.settle()
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, src, group=self.control)
        payload = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(payload, src, group=self.control)
        return unpack(payload)

    def _gather(self, payload: torch.Tensor, group, size: int) -> list | None:
        """Variable-size msgpack payloads to rank 0 in one collective: an all_gather of fixed GATHER_BYTES slots
        (8-byte length, then the payload's head), so that every rank sees every length; only when some payload
        does not fit, a second all_gather carries the tails, padded to the longest."""
        slot = torch.zeros(GATHER_BYTES, dtype=torch.uint8)
        n, room = payload.numel(), GATHER_BYTES - 8
        slot[:8] = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
        slot[8:8 + min(n, room)] = payload[:room]
        slots = [torch.empty(GATHER_BYTES, dtype=torch.uint8) for _ in range(size)]
        dist.all_gather(slots, slot, group=group)
        lengths = [int(s[:8].view(torch.int64)) for s in slots]
        heads = [s[8:8 + min(m, room)] for s, m in zip(slots, lengths)]
        longest_tail = max(lengths) - room
        if longest_tail > 0:
            tail = torch.zeros(longest_tail, dtype=torch.uint8)
            tail[:max(0, n - room)] = payload[room:]
            tails = [torch.empty(longest_tail, dtype=torch.uint8) for _ in range(size)]
            dist.all_gather(tails, tail, group=group)
            heads = [torch.cat([h, t[:max(0, m - room)]]) for h, t, m in zip(heads, tails, lengths)]
        if self.rank != 0:
            return None
        return [unpack(h) for h in heads]
