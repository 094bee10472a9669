"""Structured outputs (vLLM's `structured_outputs`): the output follows a JSON schema, any JSON object, a regular
expression, one of a list of strings, or an EBNF grammar. xgrammar does the grammar work: it compiles a request's
grammar against the tokenizer's vocabulary (once per rank and spec, cached), and a matcher per sequence follows its
output and says which tokens may come next. Each step masks the others to -inf (after the other logits processors,
which leave -inf as it is: the same as vLLM's mask before them), and the tokens drawn advance the matchers.

A sequence's matcher is made the first time this rank samples for it, by replaying its output so far, so a sequence
that arrives from elsewhere (a handover, PD, a resumed request, a fork) carries nothing. The grammar ends the
output: once it is complete only EOS may follow, so a request with structured outputs may not ignore EOS.

A rank starts compiling a request's grammar on a worker thread as the request arrives (`prefetch`; xgrammar
releases the GIL), so the steps go on meanwhile: the request is not scheduled until it has compiled (vLLM's
WAITING_FOR_FSM), and one whose grammar fails is aborted before it runs.

Under a reasoning model (SamplingParams.reasoning_end_token_id, its "</think>"), the grammar binds only the tokens
after that token's first appearance in the output (vLLM's rule): until it comes the sequence's matcher is WAITING
and its rows are not masked; a speculative draft that holds it gets the masks of a fresh matcher for the draft
rows after it.

R = rows to sample, V = vocabulary size.
"""
from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

logger = logging.getLogger("afserve")

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_COMPILED = 256                 # grammars kept compiled per process (least recently used dropped)
COMPILER_CACHE_BYTES = 256 << 20   # xgrammar's own cache of compiled pieces
LOST = "lost"    # Sequence.grammar of a sequence whose output left its grammar (see Grammars.accept)
WAITING = "waiting"   # Sequence.grammar while its reasoning_end_token_id has not come (the grammar binds after it)


def check_spec(spec) -> str | None:
    """What is wrong with a structured_outputs spec (None: nothing): a dict with exactly one of KINDS, "json" a JSON
    schema (a dict, or its text), "json_object" true, "regex" and "grammar" text, "choice" a non-empty list of
    strings; and optionally vLLM's "disable_any_whitespace" (bool: JSON without whitespace between its tokens). The
    grammar itself is checked when it is compiled (`Grammars.compile`)."""
    kinds = [k for k in spec if k in KINDS] if isinstance(spec, dict) else []
    if len(kinds) != 1:
        return f"pass a dict with exactly one of {', '.join(KINDS)} (and optionally disable_any_whitespace)"
    if other := sorted(set(spec) - {kinds[0], "disable_any_whitespace"}):
        return f"{other[0]!r} is not served: pass only {kinds[0]} (and optionally disable_any_whitespace)"
    if not isinstance(spec.get("disable_any_whitespace", False), bool):
        return "disable_any_whitespace must be true or false"
    kind, value = kinds[0], spec[kinds[0]]
    ok = {"json": isinstance(value, (dict, str)), "json_object": value is True,
          "regex": isinstance(value, str) and value != "", "grammar": isinstance(value, str) and value != "",
          "choice": isinstance(value, list) and bool(value) and all(isinstance(c, str) and c for c in value)}[kind]
    if not ok:
        want = {"json": "a JSON schema (a dict or its JSON text)", "json_object": "true",
                "regex": "a non-empty regular expression", "grammar": "a non-empty EBNF grammar",
                "choice": "a non-empty list of non-empty strings"}[kind]
        return f"{kind} must be {want}"
    return None


def _key(spec: dict) -> str:
    return json.dumps(spec, sort_keys=True)


def _ebnf_literal(text: str) -> str:
    return '"' + re.sub(r'(["\\])', r"\\\1", text) + '"'


class Grammars:
    """One tokenizer's grammar compiler and the grammars compiled so far. vocab_size: the model's (its logits'
    width, which may exceed the tokenizer's); eos_token_ids: the tokens that may end a complete output."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        import xgrammar as xgr
        self._xgr = xgr
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and its directory here holds none")
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(eos_token_ids) or None)  # None: the tokenizer's
        self.compiler = xgr.GrammarCompiler(info, cache_limit_bytes=COMPILER_CACHE_BYTES)
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._pending: dict[str, Future] = {}       # compiling on the worker thread (failed ones until read)
        self._lock = threading.Lock()               # the two dicts: the front compiles from several threads
        self._pool: ThreadPoolExecutor | None = None

    def compile(self, spec: dict):
        """The compiled grammar of a spec (`check_spec`'s shape), cached (waiting for it when `prefetch` or another
        thread's `compile` started it: concurrent requests with one new schema compile it once); ValueError naming
        the spec when xgrammar cannot compile it (a bad schema, regex or grammar). Safe from several threads at
        once."""
        key = _key(spec)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
            pending = self._pending.get(key)
            if pending is None:
                self._pending[key] = mine = Future()
        if pending is not None:
            return pending.result()
        try:
            mine.set_result(self._background(key, spec))
        except BaseException as e:
            mine.set_exception(e)
        return mine.result()

    def prefetch(self, spec: dict) -> Future:
        """Start compiling spec on this object's worker thread unless it is compiled or compiling, and return
        immediately: a future of the compiled grammar (its exception the ValueError `compile` would raise)."""
        key = _key(spec)
        with self._lock:
            if key in self._compiled:
                done = Future()
                done.set_result(self._compiled[key])
                return done
            if key not in self._pending:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="afserve-grammar")
                self._pending[key] = self._pool.submit(self._background, key, spec)
            return self._pending[key]

    def _background(self, key: str, spec: dict):
        try:
            return self._store(key, self._build(spec))
        except BaseException:
            with self._lock:
                self._pending.pop(key, None)     # a later request compiles it anew
            raise

    def _store(self, key: str, compiled):
        with self._lock:
            self._pending.pop(key, None)
            self._compiled[key] = compiled
            self._compiled.move_to_end(key)
            if len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return compiled

    def _build(self, spec: dict):
        kind = next(k for k in spec if k in KINDS)
        value, spaces = spec[kind], not spec.get("disable_any_whitespace", False)
        c = self.compiler
        try:
            if kind == "json":
                return c.compile_json_schema(value, any_whitespace=spaces)     # its text, or a dict
            if kind == "json_object":      # any JSON object (vLLM's json_object, and OpenAI's JSON mode)
                return c.compile_json_schema('{"type": "object"}', any_whitespace=spaces)
            if kind == "regex":
                return c.compile_regex(value)
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(map(_ebnf_literal, value)))
            return c.compile_grammar(value)
        except Exception as e:   # xgrammar raises its own error types for bad input
            raise ValueError(f"SamplingParams.structured_outputs={spec!r} is invalid: {kind} does not compile "
                             f"({type(e).__name__}: {e}); fix the {kind}") from e

    def matcher(self, seq):
        """seq's matcher, made (by replaying its output so far, after its reasoning_end_token_id when it has one)
        when this rank has none yet; LOST if its output does not follow its grammar; WAITING while its
        reasoning_end_token_id has not come."""
        if seq.grammar is None:
            out, gate = seq.output_token_ids, seq.params.reasoning_end_token_id
            if gate is not None:
                if gate not in out:
                    seq.grammar = WAITING
                    return WAITING
                out = out[out.index(gate) + 1:]
            compiled = self._compiled_for(seq)
            if compiled is None:
                return LOST
            seq.grammar = self._xgr.GrammarMatcher(compiled)
            self.accept(seq, out)
        return seq.grammar

    def _compiled_for(self, seq):
        """seq's compiled grammar, or None (seq LOST, unconstrained, and the log says so) when it does not compile
        here: only a sequence that came without add_requests (moved, handed over) can get here with such a grammar,
        as add_requests holds a request back until its grammar has compiled and aborts it if it fails."""
        try:
            return self.compile(seq.params.structured_outputs)
        except ValueError as e:
            logger.error("request %r: its structured_outputs do not compile here (%s); the rest of its output is not "
                         "constrained", seq.request_id, e)
            seq.grammar = LOST
            return None

    def mask(self, logits: torch.Tensor, seqs: list) -> None:
        """logits `[R, V]` (row i samples seqs[i]): the tokens each structured row's grammar does not allow next
        become -inf, in place (`mask_drafts` without drafts)."""
        self.mask_drafts(logits, seqs, [[]] * len(seqs))

    def mask_drafts(self, logits: torch.Tensor, seqs: list, drafts: list[list[int]]) -> None:
        """Speculative verification's rows `[R, V]`, per sequence 1 + len(its drafts) (host lists): row j of a
        structured sequence gets the mask of its grammar after its first j drafts, in place; one host-built bitmask,
        copied to the logits' device. The matcher goes through the drafts and back; a draft the grammar refuses ends
        its rows there (verification rejects it at the row before, which excludes it, so the rows after are never
        read)."""
        rows, at = [], 0     # (matcher, the drafts it goes through, its first row, whether to roll it back)
        for s, d in zip(seqs, drafts):
            m = self.matcher(s) if s.params.structured_outputs else LOST
            if m is WAITING and s.params.reasoning_end_token_id in d:     # the grammar binds from a draft on
                k = d.index(s.params.reasoning_end_token_id) + 1
                if (compiled := self._compiled_for(s)) is not None:
                    rows.append((self._xgr.GrammarMatcher(compiled), d[k:], at + k, False))
            elif m is not LOST and m is not WAITING:
                rows.append((m, d, at, True))
            at += 1 + len(d)
        if not rows:
            return
        xgr = self._xgr
        bitmask = xgr.allocate_token_bitmask(at, self.vocab_size)
        filled = []
        for m, d, first, restore in rows:
            m.fill_next_token_bitmask(bitmask, first)
            filled.append(first)
            taken = 0
            for j, t in enumerate(d, start=1):
                if not m.accept_token(t):
                    break
                taken += 1
                if m.is_terminated():    # a draft EOS that ends the output: nothing follows it to mask
                    break
                m.fill_next_token_bitmask(bitmask, first + j)
                filled.append(first + j)
            if taken and restore:
                m.rollback(taken)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=self.vocab_size, indices=filled)

    @staticmethod
    def accept(seq, tokens: list[int]) -> None:
        """Advance seq's matcher (if this rank made one) over the tokens it emitted. A token the grammar does not
        allow cannot be drawn unless every token was masked (SamplingParams refuses the options that could mask
        what the grammar allows); should one come, the sequence goes on unconstrained, and the log says so,
        rather than the rank failing. A WAITING sequence whose reasoning_end_token_id comes among them gets its
        matcher at its next mask (`matcher` replays the output after that token)."""
        if seq.grammar is WAITING and seq.params.reasoning_end_token_id in tokens:
            seq.grammar = None
        if seq.grammar is None or seq.grammar is LOST or seq.grammar is WAITING:
            return
        for t in tokens:
            if not seq.grammar.accept_token(t):
                logger.error("request %r: token %d does not follow its structured_outputs grammar; the rest of its "
                             "output is not constrained", seq.request_id, t)
                seq.grammar = LOST
                return
