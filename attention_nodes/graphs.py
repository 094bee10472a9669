"""Decode graphs: an attention rank's decode micro-batch replayed from captured graphs instead of launched op by op.

A forward leaves the rank at every MoE layer (the exchange with the expert ranks is host-driven), so a step is
captured piecewise, as the model's generator runs (`AttentionModel._layers`): per MoE layer one graph up to the
router (the dispatch's x, ids and weights), one for the shared expert (beside the experts' round trip), and one for
the tail after the last combine (the logits). The exchange runs between them, as in eager mode.

Graphs are captured per micro-batch slot and row bucket (`capture_sizes`), every bucket at start-up
(`capture_all`, largest first), so no step waits for a capture. A slot after the first is used only by a step split
in at least as many micro-batches, which holds fewer rows (`slot_rows`), so it captures fewer buckets. A slot's
buckets share its buffers, sized for its largest bucket (`_Slot`): the static inputs (ids, positions, KV slots,
block tables of the full `max_model_len` width, context lengths), the combine's output that the next graph reads,
what each dispatch sends and the logits; the graphs copy their results into them. A step copies its rows in; the
bucket's other rows are padding, which write one sink block past the pool's (`SINK_BLOCKS`) and attend to it alone.
Each slot has its own memory pool: two slots' graphs interleave within a step, so neither may reuse the other's
memory, while one slot's buckets never run in the same step and share theirs.

On CUDA a graph is a `torch.cuda.CUDAGraph`. On the CPU, `RecordedGraph` stands in for tests: it records the aten
ops a capture runs and replays them on the same tensors, so it keeps what a CUDA graph keeps (every tensor's
storage, every Python value the capture saw) and refuses what a capture refuses (a host sync or host read); a host
value that changes from step to step, frozen by the capture, gives wrong tokens there as it would on a GPU. What it
cannot show: Triton kernels (not aten ops) in a graph, a CUDA pool's reuse of what a capture freed (it keeps every
tensor alive), and host tensors a CUDA capture would bake in (on the CPU host and device are one).
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from comm.sync_audit import caller_site, hooked_host_reads, is_sync
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


def slot_rows(max_rows: int, j: int, drafts: int = 0) -> int:
    """The most decode rows micro-batch slot j holds when a step's decode rows are at most max_rows, each sequence
    with up to `drafts` speculative drafts. Slot 0 holds a whole step that is not split. Slot j >= 1 runs in a step
    split in m > j parts of equal token counts (attention_nodes/batch.py split_micro_batches; decode rows first, a
    sequence's drafts never cut): with T tokens in all, part j starts at a >= T * j // m and ends by
    T * (j + 1) // m + drafts, and it is all decode rows only if they reach its end (<= max_rows). More than
    c = ceil((max_rows + j * drafts) / (j + 1)) rows would need T / m > c - drafts, so a >= (c - drafts) * j, and
    max_rows - a > c, which together contradict c's definition. (A prompt chunk's last token, cut off alone into
    part j, samples like a decode row past the decode rows; the prompt's other pieces sort after it, so such a
    graphable part holds that one row, within c >= 1.)"""
    if j == 0:
        return max_rows
    return min(max_rows, -(-(max_rows + j * drafts) // (j + 1)))


def slot_sizes(max_rows: int, j: int, drafts: int = 0) -> list[int]:
    """Micro-batch slot j's row buckets (slot_rows' bound, in capture_sizes' buckets)."""
    return capture_sizes(slot_rows(max_rows, j, drafts))


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
        elif not _is_view(out, args, kwargs):
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


def _is_view(out, args, kwargs) -> bool:
    """Whether every tensor out shares storage with an input (a view, or `to` returning self): by the storages
    themselves, since ops like `aten.to` are annotated as aliasing but copy when they convert."""
    outs = _tensors(out if isinstance(out, (tuple, list)) else (out,))
    inputs = {t.untyped_storage().data_ptr() for t in _tensors((*args, *kwargs.values()))}
    return bool(outs) and all(t.untyped_storage().data_ptr() in inputs for t in outs)


class RecordedGraph:
    """The CPU stand-in for a CUDA graph (see the module's docstring): `with g.capture(): ...`, then `g.replay()`
    reruns the recorded ops on the captured tensors, writing each op's result into its captured output."""

    def __init__(self):
        self.ops: list[tuple] = []

    @contextmanager
    def capture(self):
        """Records this thread's aten ops; a host sync, or a host read of a tensor (`tolist`, `numpy`, `cpu`, which a
        CPU tensor serves below the dispatcher), raises GraphCaptureError, as a CUDA capture fails on one."""
        def refuse(name: str, site: str) -> None:
            raise GraphCaptureError(f"Tensor.{name}() reads tensor data on the host at {site}: a CUDA graph cannot "
                                    f"capture it")
        rec = _Recorder()
        with hooked_host_reads(refuse), rec:
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
        with _on(self.stream):
            self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                yield
            except BaseException:
                try:
                    self.graph.capture_end()
                except Exception:    # noqa: BLE001 (the capture is invalid already: the first error says why)
                    pass
                raise
            self.graph.capture_end()

    def replay(self) -> None:
        self.graph.replay()


@contextmanager
def _on(stream):
    """Run on a side stream (None: where we are), after the current stream's work so far and before its work from
    here on."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        torch.cuda.current_stream().wait_stream(stream)


@dataclass(slots=True)
class _Slot:
    """One micro-batch slot's buffers, at the largest bucket's rows, shared by its buckets' graphs (they never run
    within one step of each other): static inputs, the combine's output, what each MoE layer's dispatch sends, the
    logits. Only these outlive a capture; what a graph computes for the next one of its step lives in the pool."""

    batch: ForwardBatch
    out: torch.Tensor                   # [rows, H] the combine's output, read by the next graph
    sends: list | None = None           # per MoE layer (x, ids, weights) `[rows, ...]`, made at the first capture
    logits: torch.Tensor | None = None  # [rows, V]
    dirty: int = 0                      # rows [0, dirty) may hold a past step's rows; the rest are padding


@dataclass(slots=True)
class _Captured:
    """One slot's graphs at one bucket: per MoE layer (router, shared expert or None without one), then the tail."""

    graphs: list = field(default_factory=list)
    layers: list = field(default_factory=list)      # the MoE layer of each dispatch


class DecodeGraphs:
    """Captured decode micro-batches of one attention model. emulate: RecordedGraph instead of CUDA graphs (the CPU
    tests). width: block-table columns a captured batch holds (max_model_len's blocks); sink_block: the KV block
    padding rows use (the pool's blocks end before it); drafts: speculative drafts per sequence (slot_rows)."""

    def __init__(self, model, kv, max_rows: int, width: int, sink_block: int, emulate: bool = False,
                 drafts: int = 0):
        self.model, self.kv = model, kv
        self.max_rows, self.drafts = max_rows, drafts
        self._sizes: dict[int, list[int]] = {}
        self.width, self.sink_block, self.emulate = width, sink_block, emulate
        self.dense_plan = model.kernel_backend != "triton"     # the torch path's gathers, built in the first graph
        self._slots: dict[int, _Slot] = {}
        self._captured: dict[tuple[int, int], _Captured] = {}
        self._pools: dict[int, object] = {}
        self._stream = None if emulate else torch.cuda.Stream(device=model.device)
        self.replays = 0          # micro-batches run from graphs
        self.eager = 0            # decode micro-batches too big for the largest bucket
        self.capture_s = 0.0      # seconds spent capturing
        self.failed: str | None = None   # why capture failed (graphs are then off for this rank)

    def stats(self) -> dict:
        return {"captured": [list(k) for k in sorted(self._captured)], "replays": self.replays, "eager": self.eager,
                "capture_s": round(self.capture_s, 3), "failed": self.failed}

    @torch.inference_mode()
    def capture_all(self, slots: int) -> None:
        """Capture every bucket of micro-batch slots 0 .. slots-1, largest first (at start-up, so that no step waits
        for a capture). A failure turns graphs off for this rank (capture_failed)."""
        try:
            for j in range(slots):
                for rows in reversed(self.sizes(j)):
                    if (j, rows) not in self._captured:
                        self._captured[(j, rows)] = self._capture(j, rows)
        except Exception as e:     # noqa: BLE001 (graphs off, said once: steps run eagerly)
            capture_failed(self, e)
        else:
            log.info("decode graphs: %d slot(s), %d graphs (buckets up to %s rows) captured in %.1f s", slots,
                     len(self._captured), [self.sizes(j)[-1] for j in range(slots)], self.capture_s)

    def sizes(self, j: int) -> list[int]:
        """Micro-batch slot j's row buckets."""
        got = self._sizes.get(j)
        if got is None:
            got = self._sizes[j] = slot_sizes(self.max_rows, j, self.drafts)
        return got

    def takes(self, j: int, batch: ForwardBatch) -> bool:
        """Whether batch runs from graphs in slot j: decode rows only, each sampled once (no prompt logprobs), within
        the slot's largest bucket and the tables' width, and no MTP layer reading the hidden states."""
        if not batch.graphable or self.failed is not None or self.model.keep_hidden:
            return False
        if batch.num_tokens > self.sizes(j)[-1] or batch.decode.block_tables.shape[1] > self.width:
            self.eager += 1
            return False
        return True

    def layers(self, j: int, batch: ForwardBatch):
        """Micro-batch slot j's forward of batch, as `AttentionModel._layers` yields, from graphs (captured now
        when this slot has none at batch's bucket)."""
        rows = bucket_for(batch.num_tokens, self.sizes(j))
        c = self._captured.get((j, rows))
        if c is None:
            c = self._captured[(j, rows)] = self._capture(j, rows)
        self.replays += 1
        return self._replay(self._slots[j], c, batch, rows)

    def _slot(self, j: int) -> _Slot:
        s = self._slots.get(j)
        if s is None:
            dev, bs, rows = self.model.device, self.kv.block_size, self.sizes(j)[-1]
            tables = torch.full((rows, self.width), -1, dtype=torch.int32, device=dev)
            z = torch.zeros(rows, dtype=torch.int64, device=dev)
            batch = ForwardBatch(z.clone(), z.clone(), z.clone(), rows,
                                 DecodeMeta(tables, torch.ones(rows, dtype=torch.int32, device=dev), self.width * bs,
                                            None), None, torch.arange(rows, device=dev), graphable=True)
            s = self._slots[j] = _Slot(batch, torch.zeros(rows, self.model.spec.hidden_size,
                                                          dtype=self.model.lm_head.dtype, device=dev))
            self._pad(s, 0, rows)
        return s

    def _pad(self, s: _Slot, lo: int, hi: int) -> None:
        """Rows lo .. hi-1 of a slot's inputs become padding: one token in the sink block, read alone."""
        b = s.batch
        b.slot_mapping[lo:hi] = self.sink_block * self.kv.block_size
        b.decode.context_lens[lo:hi] = 1
        b.decode.block_tables[lo:hi, 0] = self.sink_block

    @staticmethod
    def _view(s: _Slot, rows: int) -> ForwardBatch:
        """The first `rows` rows of a slot's static batch."""
        b, d = s.batch, s.batch.decode
        return ForwardBatch(b.input_ids[:rows], b.positions[:rows], b.slot_mapping[:rows], rows,
                            DecodeMeta(d.block_tables[:rows], d.context_lens[:rows], d.max_context_len, None), None,
                            b.logit_rows[:rows], graphable=True)

    def _new_graph(self, j: int):
        if self.emulate:
            return RecordedGraph()
        if j not in self._pools:
            self._pools[j] = torch.cuda.graph_pool_handle()
        return CudaGraph(self._pools[j], self._stream)

    def _capture(self, j: int, rows: int) -> _Captured:
        t0 = time.perf_counter()
        s = self._slot(j)
        if s.dirty:            # a capture after steps: it runs the forward on its rows, which must be padding
            self._pad(s, 0, s.dirty)
            s.dirty = 0
        batch = self._view(s, rows)
        with _on(self._stream):        # warm-up: Triton compiles, cuBLAS sets up, on the capture stream
            sends, logits = self._drive(self.model._layers(self._with_plan(batch), self.kv), s.out[:rows])
        if s.sends is None:
            top = self.sizes(j)[-1]
            s.sends = [tuple(t.new_empty(top, *t.shape[1:]) for t in send) for send in sends]
            s.logits = logits.new_empty(top, *logits.shape[1:])
        c, gen, value = _Captured(), self.model._layers(batch, self.kv), None
        shared = bool(self.model.spec.shared_expert_size)
        while True:
            graph = self._new_graph(j)
            with graph.capture():
                if not c.graphs:
                    self._with_plan(batch)     # the torch path's gathers, inside the first graph
                try:
                    request = gen.send(value)
                except StopIteration as stop:
                    s.logits[:rows].copy_(stop.value[0])
                    request = None
                else:
                    for buf, t in zip(s.sends[len(c.layers)], request[1:]):
                        buf[:rows].copy_(t)
            c.graphs.append(graph)
            if request is None:
                self.capture_s += time.perf_counter() - t0
                return c
            c.layers.append(request[0])
            graph = self._new_graph(j) if shared else None
            with graph.capture() if shared else nullcontext():
                assert gen.send(None) is None     # the shared expert, beside the experts' round trip
            c.graphs.append(graph)
            value = s.out[:rows]

    def _with_plan(self, batch: ForwardBatch) -> ForwardBatch:
        if self.dense_plan:
            d = batch.decode
            d.plan = plan_dense(d.block_tables, d.context_lens, self.kv.block_size)
        return batch

    @staticmethod
    def _drive(gen, out: torch.Tensor) -> tuple[list, torch.Tensor]:
        """Run a forward generator through, each routed output `out` -> (each MoE layer's (x, ids, weights), the
        logits)."""
        sends, value = [], None
        while True:
            try:
                request = gen.send(value)
            except StopIteration as stop:
                return sends, stop.value[0]
            sends.append(request[1:])
            assert gen.send(None) is None
            value = out

    def _replay(self, s: _Slot, c: _Captured, batch: ForwardBatch, rows: int):
        T, b, d = batch.num_tokens, s.batch, batch.decode
        b.input_ids[:T].copy_(batch.input_ids)
        b.positions[:T].copy_(batch.positions)
        b.slot_mapping[:T].copy_(batch.slot_mapping)
        b.decode.block_tables[:T, :d.block_tables.shape[1]].copy_(d.block_tables)  # (columns past a context: unread)
        b.decode.context_lens[:T].copy_(d.context_lens)
        if T < min(s.dirty, rows):          # rows a past step filled, within this bucket: padding again
            self._pad(s, T, min(s.dirty, rows))
        s.dirty = s.dirty if s.dirty > rows else T
        graphs = iter(c.graphs)
        for k, moe_layer in enumerate(c.layers):
            next(graphs).replay()
            x, ids, weights = s.sends[k]
            assert (yield moe_layer, x[:T], ids[:T], weights[:T]) is None
            shared = next(graphs)
            if shared is not None:
                shared.replay()
            out = yield None
            s.out[:T].copy_(out)
        next(graphs).replay()
        return s.logits[:T], None


def capture_failed(graphs: DecodeGraphs, error: BaseException) -> None:
    """Graphs off for this rank after a failed capture (its steps run eagerly, as with enforce_eager), said once;
    what they held is let go (a capture that ran out of memory leaves the eager steps theirs)."""
    graphs.failed = f"{type(error).__name__}: {error}"
    graphs._captured.clear()
    graphs._slots.clear()
    graphs._pools.clear()
    if not graphs.emulate:
        torch.cuda.empty_cache()
    log.warning("decode graph capture failed, running eagerly (set enforce_eager=True to skip the capture): %s",
                graphs.failed)
