"""Decode graphs: an attention rank's decode micro-batch replayed from captured graphs instead of launched op by op.

A forward leaves the rank at every MoE layer (the exchange with the expert ranks is host-driven), so a step is
captured piecewise, as the model's generator runs (`AttentionModel._layers`): per MoE layer one graph up to the
router (the dispatch's x, ids and weights), one for the shared expert (beside the experts' round trip), and one for
the tail after the last combine (the logits). The exchange runs between them, as in eager mode.

Graphs are captured per micro-batch slot and row bucket (`capture_sizes`), the first time a step needs them,
before that step's first exchange. Each capture owns static inputs: the ids, positions, KV slots, block tables
(the full `max_model_len` width) and context lengths of `bucket` decode rows; a step copies its rows in and pads
the rest with rows that write one sink block past the pool's (`SINK_BLOCKS`) and attend to it alone. The combine's
output is copied into a static buffer the next graph reads. Micro-batch slots get their own memory pools: their
graphs interleave within a step, so none may reuse another's memory; buckets of one slot never interleave.

On CUDA a graph is a `torch.cuda.CUDAGraph`. On the CPU, `RecordedGraph` stands in for tests: it records the aten
ops a capture runs and replays them on the same tensors, so it keeps what a CUDA graph keeps (every tensor's
storage, every Python value the capture saw) and refuses what a capture refuses (a host sync); a host value that
changes from step to step, frozen by the capture, gives wrong tokens there as it would on a GPU.
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from comm.sync_audit import caller_site, is_sync
from kernels.paged_attention import plan_dense

from .batch import DecodeMeta, ForwardBatch

log = logging.getLogger(__name__)
_HERE = os.path.abspath(__file__)

SINK_BLOCKS = 1          # KV blocks past the pool's that padding rows write and read
MAX_CAPTURE_SIZE = 512   # the largest row bucket captured; a bigger micro-batch runs eagerly


def capture_sizes(max_rows: int) -> list[int]:
    """The row buckets for micro-batches of up to max_rows decode rows: vLLM's (1, 2, 4, then every multiple of 8)
    below max_rows, and the first at or above it (none above MAX_CAPTURE_SIZE)."""
    if max_rows < 1:
        raise ValueError(f"max_rows={max_rows}: a decode graph holds at least one row")
    every = [1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)]
    return [b for b in every if b < max_rows] + [b for b in every if b >= max_rows][:1]


def bucket_for(rows: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding `rows` rows, None above the largest."""
    return next((b for b in sizes if b >= rows), None)


class GraphCaptureError(RuntimeError):
    """A capture ran something a graph cannot hold (a host sync)."""


class _Recorder(TorchDispatchMode):
    """Records the aten ops run under it as (op, args, kwargs, outputs); raises on a host sync."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_sync(func, args, kwargs):
            raise GraphCaptureError(f"{func} waits on the host at {caller_site(skip=_HERE)}: a CUDA graph cannot "
                                    f"capture it")
        out = func(*args, **kwargs)
        schema = func._schema
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            self.ops.append((func, args, kwargs, None))     # in place (or out=): replay reruns it
        elif not _is_view(out, args):
            self.ops.append((func, args, kwargs, out))      # a new tensor: replay writes into this one
        return out                                          # (a view shares storage already recorded)


def _tensors(values) -> list[torch.Tensor]:
    flat = []
    for v in values:
        if isinstance(v, torch.Tensor):
            flat.append(v)
        elif isinstance(v, (tuple, list)):
            flat += _tensors(v)
    return flat


def _is_view(out, args) -> bool:
    """Whether every tensor out shares storage with an input (a view, or `to` returning self): by the storages
    themselves, since ops like `aten.to` are annotated as aliasing but copy when they convert."""
    outs = _tensors(out if isinstance(out, (tuple, list)) else (out,))
    inputs = {t.untyped_storage().data_ptr() for t in _tensors(args)}
    return bool(outs) and all(t.untyped_storage().data_ptr() in inputs for t in outs)


class RecordedGraph:
    """The CPU stand-in for a CUDA graph (see the module's docstring): `with g.capture(): ...`, then `g.replay()`
    reruns the recorded ops on the captured tensors, writing each op's result into its captured output."""

    def __init__(self):
        self.ops: list[tuple] = []

    @contextmanager
    def capture(self):
        rec = _Recorder()
        with rec:
            yield
        self.ops = rec.ops

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            result = func(*args, **kwargs)
            if out is None:
                continue
            for captured, new in zip(*(o if isinstance(o, (tuple, list)) else (o,) for o in (out, result))):
                if isinstance(captured, torch.Tensor):
                    if captured.shape != new.shape:
                        raise GraphCaptureError(f"{func} returned {tuple(new.shape)} on replay, {tuple(captured.shape)}"
                                                " at capture: a graph's shapes are fixed")
                    captured.copy_(new)


class CudaGraph:
    """torch.cuda.CUDAGraph captured on a side stream into a shared memory pool (without torch.cuda.graph's
    collect and cache flush before every capture: a decode step captures one graph per stretch between exchanges)."""

    def __init__(self, pool, stream):
        self.graph = torch.cuda.CUDAGraph()
        self.pool, self.stream = pool, stream

    @contextmanager
    def capture(self):
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                yield
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream().wait_stream(self.stream)

    def replay(self) -> None:
        self.graph.replay()


@dataclass(slots=True)
class _Captured:
    """One micro-batch slot's graphs at one bucket: static inputs, the dispatch requests per MoE layer (views of
    graph outputs), the combine buffer, and the logits."""

    batch: ForwardBatch
    out: torch.Tensor                                     # [bucket, H]: the combine's output, read by the next graph
    graphs: list = field(default_factory=list)            # per MoE layer (router, shared), then the tail
    requests: list = field(default_factory=list)          # per MoE layer (moe_layer, x, ids, weights)
    logits: torch.Tensor | None = None
    filled: int = 0                                       # rows the last replay filled (the rest are padding)


class DecodeGraphs:
    """Captured decode micro-batches of one attention model. emulate: RecordedGraph instead of CUDA graphs (the CPU
    tests). width: block-table columns a captured batch holds (max_model_len's blocks); sink_block: the KV block
    padding rows use (the pool's blocks end before it)."""

    def __init__(self, model, kv, max_rows: int, width: int, sink_block: int, emulate: bool = False):
        self.model, self.kv = model, kv
        self.sizes = capture_sizes(max_rows)
        self.width, self.sink_block, self.emulate = width, sink_block, emulate
        self.dense_plan = model.kernel_backend not in ("triton",)     # the torch path's gathers, built in the graph
        self._captured: dict[tuple[int, int], _Captured] = {}
        self._pools: dict[int, object] = {}
        self._stream = None
        self.replays = 0          # micro-batches run from graphs
        self.eager = 0            # decode micro-batches too big for the largest bucket
        self.failed: str | None = None   # why capture failed (graphs are then off for this rank)

    def stats(self) -> dict:
        return {"captured": [list(k) for k in sorted(self._captured)], "replays": self.replays, "eager": self.eager,
                "failed": self.failed}

    def takes(self, batch: ForwardBatch) -> bool:
        """Whether batch runs from graphs: decode rows only, each sampled once (no prompt logprobs), within the
        largest bucket and the tables' width, and no MTP layer reading the hidden states."""
        if not batch.graphable or self.failed is not None or self.model.keep_hidden:
            return False
        if batch.num_tokens > self.sizes[-1] or batch.decode.block_tables.shape[1] > self.width:
            self.eager += 1
            return False
        return True

    def layers(self, j: int, batch: ForwardBatch):
        """Micro-batch slot j's forward of batch, as `AttentionModel._layers` yields, from graphs (captured now
        when this slot has none at batch's bucket)."""
        bucket = bucket_for(batch.num_tokens, self.sizes)
        c = self._captured.get((j, bucket))
        if c is None:
            c = self._captured[(j, bucket)] = self._capture(j, bucket)
        self.replays += 1
        return self._replay(c, batch)

    def _static_batch(self, rows: int) -> ForwardBatch:
        """A batch of `rows` padding rows on the model's device (what every captured input holds between steps)."""
        dev, bs = self.model.device, self.kv.block_size
        tables = torch.full((rows, self.width), -1, dtype=torch.int32, device=dev)
        tables[:, 0] = self.sink_block
        z = torch.zeros(rows, dtype=torch.int64, device=dev)
        lens = torch.ones(rows, dtype=torch.int32, device=dev)
        return ForwardBatch(z.clone(), z.clone(), torch.full_like(z, self.sink_block * bs), rows,
                            DecodeMeta(tables, lens, self.width * bs, None), None,
                            torch.arange(rows, device=dev), graphable=True)

    def _new_graph(self, j: int):
        if self.emulate:
            return RecordedGraph()
        if j not in self._pools:
            self._pools[j] = torch.cuda.graph_pool_handle()
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return CudaGraph(self._pools[j], self._stream)

    def _capture(self, j: int, rows: int) -> _Captured:
        batch = self._static_batch(rows)
        c = _Captured(batch, torch.zeros(rows, self.model.spec.hidden_size, dtype=self.model.lm_head.dtype,
                                         device=self.model.device))
        if not self.emulate:      # compile and tune the kernels outside the capture, on these shapes
            self._drive(self.model._layers(self._with_plan(batch), self.kv), c.out)
        gen = self.model._layers(batch, self.kv)
        value = None
        while True:
            graph = self._new_graph(j)
            with graph.capture():
                if value is None and not c.graphs:
                    self._with_plan(batch)     # the torch path's gathers, inside the first graph
                try:
                    request = gen.send(value)
                except StopIteration as stop:
                    c.logits = stop.value[0]
                    request = None
            c.graphs.append(graph)
            if request is None:
                return c
            c.requests.append(request)
            graph = self._new_graph(j)
            with graph.capture():
                assert gen.send(None) is None     # the shared expert, beside the experts' round trip
            c.graphs.append(graph)
            value = c.out

    def _with_plan(self, batch: ForwardBatch) -> ForwardBatch:
        if self.dense_plan:
            d = batch.decode
            d.plan = plan_dense(d.block_tables, d.context_lens, self.kv.block_size)
        return batch

    @staticmethod
    def _drive(gen, out: torch.Tensor) -> None:
        """Run a forward generator through without experts (each routed output: `out`)."""
        value = None
        try:
            while True:
                if gen.send(value) is not None:
                    assert gen.send(None) is None
                    value = out
        except StopIteration:
            pass

    def _replay(self, c: _Captured, batch: ForwardBatch):
        T, s = batch.num_tokens, c.batch
        s.input_ids[:T].copy_(batch.input_ids)
        s.positions[:T].copy_(batch.positions)
        s.slot_mapping[:T].copy_(batch.slot_mapping)
        tables, d = s.decode.block_tables, batch.decode
        tables[:T, :d.block_tables.shape[1]].copy_(d.block_tables)   # (columns past a row's context are not read)
        s.decode.context_lens[:T].copy_(d.context_lens)
        if T < c.filled:                     # rows the last step filled beyond this one's: padding again
            s.slot_mapping[T:c.filled] = self.sink_block * self.kv.block_size
            s.decode.context_lens[T:c.filled] = 1
            tables[T:c.filled, 0] = self.sink_block
        c.filled = T
        graphs = iter(c.graphs)
        for k, (moe_layer, x, ids, weights) in enumerate(c.requests):
            next(graphs).replay()
            assert (yield moe_layer, x[:T], ids[:T], weights[:T]) is None
            next(graphs).replay()
            out = yield None
            c.out[:T].copy_(out)
        next(graphs).replay()
        return c.logits[:T], None


def capture_failed(graphs: DecodeGraphs, error: BaseException) -> None:
    """Graphs off for this rank after a failed capture (its steps run eagerly, as with enforce_eager), said once."""
    graphs.failed = f"{type(error).__name__}: {error}"
    log.warning("decode graph capture failed, running eagerly (set enforce_eager=True to skip the capture): %s",
                graphs.failed)
