"""Structured outputs (SamplingParams.structured_outputs, attention_nodes/structured.py): greedy outputs equal
transformers' greedy generate under the same grammar (masked by an xgrammar matcher of the test's own, compiled from
grammars the test writes) for a JSON schema, any JSON object, a regex, a choice and an EBNF grammar, on 1+1 and 2+2
ranks with a chunked prompt; seeded samples (n = 2) follow their regex; a matcher rebuilt from a sequence's output
(how a moved sequence gets one) allows what the one that followed it allows; bad specs are refused by name."""
from __future__ import annotations

import json
import re
import time

import pytest
import torch

from attention_nodes.sampling_params import SamplingParams
from attention_nodes.sequence import Sequence
from attention_nodes.structured import Grammars
from comm.control import pack, unpack
from launch import LLM
from tests.conftest import hf_model, make_prompts

xgr = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer"}},
          "required": ["answer", "n"], "additionalProperties": False}
# (the request's spec, the same grammar as the test compiles it for transformers' side)
CASES = [
    ({"json": SCHEMA, "disable_any_whitespace": True},
     lambda c: c.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)),
    ({"json_object": True, "disable_any_whitespace": True},
     lambda c: c.compile_json_schema('{"type": "object"}', any_whitespace=False)),
    ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda c: c.compile_regex(r"[0-9]{3}-[a-z]{2}")),
    ({"choice": ["red", "green", 'blue "x"']}, lambda c: c.compile_regex(r'red|green|blue "x"')),
    ({"grammar": 'root ::= "(" [a-z]+ ")" | "none"'}, lambda c: c.compile_grammar('root ::= "(" [a-z]+ ")" | "none"')),
]
MAX_NEW = 24


def _hf_constrained(model, tok, prompt: list[int], compile_fn, max_new: int, bias: dict[int, float] | None = None,
                    after: int | None = None) -> list[int]:
    """transformers' greedy generate with every token the grammar does not allow next at -inf (the test's own
    matcher), stopping at EOS; bias: added to those tokens' logits first (a request's logit_bias); after: the
    grammar binds only the tokens after this one's first appearance in the output (reasoning_end_token_id)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    vocab = model.config.vocab_size
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab,
                                                                      stop_token_ids=[tok.eos_token_id]))
    matcher = xgr.GrammarMatcher(compile_fn(compiler))
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    class Mask(LogitsProcessor):
        def __call__(self, input_ids, scores):
            for t, v in (bias or {}).items():
                scores[:, t] += v
            out = input_ids[0, len(prompt):].tolist()
            if after is not None:
                if after not in out:
                    return scores
                out = out[out.index(after) + 1:]
            if out:
                assert matcher.accept_token(out[-1])
            matcher.fill_next_token_bitmask(bitmask, 0)
            allowed = torch.tensor([bool(int(bitmask[0, t // 32]) >> (t % 32) & 1) for t in range(vocab)])
            return scores.masked_fill(~allowed, float("-inf"))

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, pad_token_id=0,
                             eos_token_id=tok.eos_token_id, logits_processor=LogitsProcessorList([Mask()]))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("attention_ranks,expert_ranks", [(1, 1), (2, 2)])
def test_greedy_structured_outputs_equal_transformers_under_the_same_grammar(tiny_checkpoint, attention_ranks,
                                                                            expert_ranks):
    from transformers import AutoTokenizer
    path = tiny_checkpoint("qwen3_moe")
    tok = AutoTokenizer.from_pretrained(path)
    # the first prompt is longer than the 32-token budget: its prefill comes in chunks
    prompts = [make_prompts(1, 256, 45, 45, seed=31)[0]] + make_prompts(len(CASES) - 1, 256, 4, 12, seed=32)
    with LLM(path, attention_ranks=attention_ranks, expert_ranks=expert_ranks, max_num_batched_tokens=32) as llm:
        outs = llm.generate(prompts, [SamplingParams(max_tokens=MAX_NEW, structured_outputs=spec)
                                      for spec, _ in CASES])
        free = llm.generate(prompts[2:3], SamplingParams(max_tokens=MAX_NEW))[0]
    model = hf_model(path)
    for prompt, (spec, compile_fn), out in zip(prompts, CASES, outs):
        assert out.token_ids == _hf_constrained(model, tok, prompt, compile_fn, MAX_NEW), spec
    assert outs[2].finish_reason == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[2].text), outs[2].text
    assert not re.fullmatch(r"[0-9]{3}-[a-z]{2}", free.text)       # unconstrained, the model writes otherwise
    assert outs[3].text in ("red", "green", 'blue "x"')
    if outs[0].finish_reason == "stop":
        got = json.loads(outs[0].text)
        assert set(got) == {"answer", "n"} and got["answer"] in ("yes", "no") and isinstance(got["n"], int)


def test_greedy_structured_outputs_with_ngram_drafts_equal_transformers(tiny_checkpoint):
    """Speculative verification masks each draft position with the grammar after the drafts before it: greedy
    outputs under ngram drafts equal transformers' under the same grammar, with drafts both accepted and rejected
    (the prompts hold text in the grammars' shapes, for prompt lookup to propose)."""
    from transformers import AutoTokenizer
    path = tiny_checkpoint("qwen3_moe")
    tok = AutoTokenizer.from_pretrained(path)
    texts = ['{"answer": "no", "n": 0} {"answer": "yes", "n": 12}', '{"a": {"b": []}} {"c": 1}',
             "123-ab 404-zz 123-ab", "green red blue \"x\" red", "(abc) (def) none (abc)"]
    prompts = [tok.encode(t) for t in texts]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with LLM(path, attention_ranks=1, expert_ranks=1, speculative_config=ngram) as llm:
        outs = llm.generate(prompts, [SamplingParams(max_tokens=MAX_NEW, structured_outputs=spec) for spec, _ in CASES])
        spec_stats = llm.stats()["spec_decode"]
        # gated by reasoning_end_token_id (a token each free output draws third): free, then the grammar
        gates = [o.token_ids[2] for o in llm.generate(prompts, SamplingParams(max_tokens=4))]
        gated = llm.generate(prompts, [SamplingParams(max_tokens=MAX_NEW, structured_outputs=spec,
                                                      reasoning_end_token_id=g) for (spec, _), g in zip(CASES, gates)])
    model = hf_model(path)
    for prompt, (spec, compile_fn), out, g, gout in zip(prompts, CASES, outs, gates, gated):
        assert out.token_ids == _hf_constrained(model, tok, prompt, compile_fn, MAX_NEW), spec
        assert gout.token_ids == _hf_constrained(model, tok, prompt, compile_fn, MAX_NEW, after=g), spec
    assert 0 < spec_stats["num_accepted_tokens"] < spec_stats["num_draft_tokens"], spec_stats


def test_a_grammar_binds_after_the_reasoning_end_token(tiny_checkpoint):
    """reasoning_end_token_id: the output is free up to that token (the greedy tokens without a grammar), the grammar
    binds after it; greedy outputs equal transformers' under the same gated grammar, at 1+1 and 2+2 ranks."""
    from transformers import AutoTokenizer

    from tests.conftest import hf_greedy
    path = tiny_checkpoint("qwen3_moe")
    tok = AutoTokenizer.from_pretrained(path)
    prompts = make_prompts(3, 256, 6, 12, seed=51)
    free = hf_greedy(path, prompts, 8)
    gates = [f[2] for f in free]            # a token each free greedy output draws third (or before)
    spec, compile_fn = CASES[2]             # the regex
    model = hf_model(path)
    want = [_hf_constrained(model, tok, p, compile_fn, MAX_NEW, after=g) for p, g in zip(prompts, gates)]
    for w, f, g in zip(want, free, gates):
        k = f.index(g) + 1
        assert w[:k] == f[:k] and re.fullmatch(r"[0-9]{3}-[a-z]{2}", tok.decode(w[k:], skip_special_tokens=True))
    for ranks in (1, 2):
        with LLM(path, attention_ranks=ranks, expert_ranks=ranks) as llm:
            outs = llm.generate(prompts, [SamplingParams(max_tokens=MAX_NEW, structured_outputs=spec,
                                                         reasoning_end_token_id=g) for g in gates])
        assert [o.token_ids for o in outs] == want, ranks
    with pytest.raises(ValueError, match="reasoning_end_token_id"):
        SamplingParams(reasoning_end_token_id=3)          # without structured_outputs it means nothing


def _raw_mask(tok, vocab: int, grammar, tokens: list[int]) -> torch.Tensor | None:
    """The test's own xgrammar matcher of `grammar` after `tokens`: `[V]` bool, True = masked (None: it refuses a
    token)."""
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab,
                                                                      stop_token_ids=[tok.eos_token_id]))
    m = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
    if not all(m.accept_token(t) for t in tokens):
        return None
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    m.fill_next_token_bitmask(bitmask, 0)
    return torch.tensor([not (int(bitmask[0, t // 32]) >> (t % 32) & 1) for t in range(vocab)])


def test_draft_rows_after_a_drafted_reasoning_end_token_follow_a_fresh_grammar(tiny_checkpoint):
    """mask_drafts for a sequence still reasoning: the rows up to and at its drafted reasoning_end_token_id are not
    masked; the rows after it are the grammar's from its start, through the drafts after the gate (a second gate
    among them is a grammar token; one the grammar refuses ends the masking); the sequence stays waiting (the
    drafts may be rejected). Oracle: the test's own matcher of the same grammar."""
    from transformers import AutoTokenizer

    from attention_nodes.structured import WAITING
    path = tiny_checkpoint("qwen3_moe")
    tok = AutoTokenizer.from_pretrained(path)
    vocab = hf_model(path).config.vocab_size
    grammars = Grammars(tok, vocab, [tok.eos_token_id])
    ab, z = tok.encode("ab", add_special_tokens=False), tok.encode("z", add_special_tokens=False)[0]
    gate = ab[0]                      # the gate is also a token of the grammar's words
    grammar = 'root ::= "ab" | "abab"'
    params = SamplingParams(max_tokens=16, structured_outputs={"grammar": grammar}, reasoning_end_token_id=gate)
    seq = Sequence.from_request("a", [5, 6], params, 0)
    for drafts, masked in (([7, gate, *ab], 3), ([gate, *ab, *ab], 5), ([7, gate, z, *ab], 1)):
        rows = torch.zeros(1 + len(drafts), vocab)
        grammars.mask_drafts(rows, [seq], [drafts])
        k = drafts.index(gate) + 1
        assert seq.grammar is WAITING and not torch.isinf(rows[:k]).any(), drafts
        for j in range(masked):       # row k + j: the grammar after the first j drafts past the gate
            assert torch.equal(torch.isinf(rows[k + j]), _raw_mask(tok, vocab, grammar, drafts[k:k + j])), (drafts, j)
        assert not torch.isinf(rows[k + masked:]).any(), drafts
    # the gate drawn: the next mask binds the grammar to what follows it
    seq.token_ids += [7, gate]
    Grammars.accept(seq, [7, gate])
    row = torch.zeros(1, vocab)
    grammars.mask(row, [seq])
    assert torch.equal(torch.isinf(row[0]), _raw_mask(tok, vocab, grammar, []))


def test_a_rebuilt_matcher_follows_the_output_after_the_first_reasoning_end_token(tiny_checkpoint):
    """How a moved, resumed or forked sequence gets its matcher under a gate: replaying its output after the gate's
    first appearance (a later one is a grammar token); an output without the gate stays unconstrained."""
    from transformers import AutoTokenizer

    from attention_nodes.structured import WAITING
    path = tiny_checkpoint("qwen3_moe")
    tok = AutoTokenizer.from_pretrained(path)
    vocab = hf_model(path).config.vocab_size
    grammars = Grammars(tok, vocab, [tok.eos_token_id])
    ab, z = tok.encode("ab", add_special_tokens=False), tok.encode("z", add_special_tokens=False)
    grammar = 'root ::= "ab" | "abzq"'         # the gate "z" is a token of the grammar too
    params = SamplingParams(max_tokens=16, structured_outputs={"grammar": grammar}, reasoning_end_token_id=z[0])
    moved = Sequence.from_request("a", [5, 6], params, 0)
    moved.token_ids += [7, *z, *ab, *z]          # reasoning 7, the gate, then "abz" under the grammar
    row = torch.zeros(1, vocab)
    grammars.mask(row, [moved])
    want = _raw_mask(tok, vocab, grammar, [*ab, *z])
    assert want is not None and torch.equal(torch.isinf(row[0]), want)
    assert not torch.equal(want, _raw_mask(tok, vocab, grammar, []))    # (after the last gate it would differ)
    thinking = Sequence.from_request("b", [5, 6], params, 1)
    thinking.token_ids += [7, 8, 9]
    row = torch.zeros(1, vocab)
    grammars.mask(row, [thinking])
    assert thinking.grammar is WAITING and not torch.isinf(row).any()
    with pytest.raises(ValueError, match="reasoning_end_token_id"):
        SamplingParams(structured_outputs={"grammar": grammar}, reasoning_end_token_id=9, stop_token_ids=[9])
    from launch.admission import Admission
    admit = Admission(tok, vocab, 4, 64, 64, (tok.eos_token_id,))
    with pytest.raises(ValueError, match="is an EOS id"):
        admit.check_tokens(SamplingParams(structured_outputs={"grammar": grammar},
                                          reasoning_end_token_id=tok.eos_token_id))


def test_seeded_samples_follow_their_grammar_and_bad_specs_are_refused(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    pattern = r"[0-9]{2,4}-[a-z]{2}"
    with LLM(path, attention_ranks=1, expert_ranks=1) as llm:
        out = llm.generate(["Hello experts"], SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=5, n=2,
                                                             structured_outputs={"regex": pattern}))[0]
        assert len(out.samples) == 2
        for s in out.samples:
            assert s.finish_reason == "stop" and re.fullmatch(pattern, s.text), s.text
        with pytest.raises(ValueError, match=r"structured_outputs=.*regex does not compile"):
            llm.generate(["x"], SamplingParams(structured_outputs={"regex": "[a-"}))
        with pytest.raises(ValueError, match=r"structured_outputs=.*json does not compile"):
            llm.generate(["x"], SamplingParams(structured_outputs={"json": "{not json"}))
        assert llm.generate(["x"], SamplingParams(max_tokens=2))[0].token_ids     # still serving
    for bad in ({"regex": ""}, {"choice": []}, {"json": 5}, {"regex": "a", "choice": ["a"]}, {"yaml": "a"},
                {"json_object": True, "disable_any_whitespace": "yes"}):
        with pytest.raises(ValueError, match=r"SamplingParams\.structured_outputs="):
            SamplingParams(structured_outputs=bad)
    with pytest.raises(ValueError, match=r"SamplingParams\.ignore_eos=True.*structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a+"}, ignore_eos=True)
    # a schema travels as JSON text: msgpack (the step header to other attention ranks) takes no integer >= 2**64
    big = SamplingParams(structured_outputs={"json": {"enum": ["a"], "default": 10**20}})
    assert json.loads(big.structured_outputs["json"])["default"] == 10**20
    assert unpack(pack(big.to_dict())) == big.to_dict()
    for clash in ({"min_tokens": 2}, {"allowed_token_ids": [5]}, {"bad_words_token_ids": [[5]]}):
        with pytest.raises(ValueError, match=rf"SamplingParams\.{next(iter(clash))}=.*structured_outputs"):
            SamplingParams(structured_outputs={"regex": "a+"}, **clash)


def test_a_matcher_rebuilt_from_the_output_allows_what_the_followed_one_allows(tiny_checkpoint):
    """How a sequence that arrives on another rank (a handover, PD, a resumed or forked sample) gets its matcher:
    replaying its output; it must allow exactly the tokens the matcher that followed the output token by token
    allows (the test fails if the replay is skipped)."""
    from transformers import AutoTokenizer
    path = tiny_checkpoint("qwen3_moe")
    tok = AutoTokenizer.from_pretrained(path)
    vocab = hf_model(path).config.vocab_size
    spec = {"regex": r"\(([a-z]+, )*[a-z]+\)"}
    grammars = Grammars(tok, vocab, [tok.eos_token_id])
    params = SamplingParams(max_tokens=16, structured_outputs=spec)
    followed = Sequence.from_request("a", [5, 6], params, 0)
    logits = torch.zeros(1, vocab)
    grammars.mask(logits, [followed])
    for text in ("(", "ab", ", ", "c"):
        for t in tok.encode(text, add_special_tokens=False):
            assert logits[0, t] == 0, (text, t)      # allowed here
            followed.token_ids.append(t)
            Grammars.accept(followed, [t])
            logits = torch.zeros(1, vocab)
            grammars.mask(logits, [followed])
    moved = Sequence.from_request("b", [5, 6], params, 1)
    moved.token_ids = list(followed.token_ids)
    again = torch.zeros(1, vocab)
    grammars.mask(again, [moved])
    assert torch.equal(torch.isinf(again), torch.isinf(logits))
    fresh = torch.zeros(1, vocab)
    grammars.mask(fresh, [Sequence.from_request("c", [5, 6], params, 2)])
    assert not torch.equal(torch.isinf(fresh), torch.isinf(logits))     # so the replay is what made them equal
    # an output the grammar does not allow (cannot be drawn; handed over, say): the row goes on unconstrained
    astray = Sequence.from_request("d", [5, 6], params, 3)
    astray.token_ids += tok.encode("x)", add_special_tokens=False)
    rows = torch.zeros(2, vocab)
    grammars.mask(rows, [astray, moved])
    assert not torch.isinf(rows[0]).any() and torch.equal(torch.isinf(rows[1]), torch.isinf(logits[0]))


def test_a_rank_that_cannot_compile_a_grammar_aborts_that_request_alone():
    """A rank whose model directory has no tokenizer (a pool launched from another copy, say) cannot make the
    grammar the front compiled: that request's samples end "abort" as it arrives, the rank and the other requests
    go on (before, it was added, and its first sampled step raised out of the rank)."""
    from types import SimpleNamespace

    from attention_nodes.block_pool import BlockPool
    from attention_nodes.scheduler import Scheduler
    from attention_nodes.worker import AttentionWorker

    sched = Scheduler(BlockPool(8, 4), 4, 16, enable_prefix_caching=False)
    model = SimpleNamespace(spec=SimpleNamespace(eos_token_ids=(2,)))
    worker = AttentionWorker(0, model, SimpleNamespace(block_size=4, num_blocks=8), sched, None, 64,
                             torch.device("cpu"), grammars=lambda: Grammars(None, 320, [2]))
    structured = SamplingParams(n=2, structured_outputs={"regex": "a+"})
    worker.add_requests([{"id": "s", "prompt": [5, 6], "params": structured.to_dict()},
                         {"id": "p", "prompt": [5, 6], "params": SamplingParams().to_dict()}])
    assert worker._aborted == [["s#0", [], "abort", None, None, None], ["s#1", [], "abort", None, None, None]]
    assert [s.request_id for s in sched.waiting] == ["p"]


class SlowCompiler:
    """A grammar compiler that waits for `go` before each compile: the test decides when a compile ends."""

    def __init__(self, compiler):
        import threading
        self.inner, self.go, self.started = compiler, threading.Event(), threading.Event()
        self.num_compiles = 0

    def __getattr__(self, name):
        def compile_(*args, **kwargs):
            self.num_compiles += 1
            self.started.set()
            assert self.go.wait(60), "the test never let the compile end"
            return getattr(self.inner, name)(*args, **kwargs)
        return compile_


def test_a_rank_compiles_grammars_off_its_steps_and_aborts_a_request_whose_grammar_fails(tiny_checkpoint):
    """A request's grammar compiles on a worker thread as it arrives: add_requests returns while it compiles (before,
    it compiled there, holding up the step), the request is not scheduled until it has compiled while the others
    go ahead of it (vLLM's WAITING_FOR_FSM), and one whose grammar fails is aborted alone before it ever ran."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from attention_nodes.block_pool import BlockPool
    from attention_nodes.scheduler import Scheduler
    from attention_nodes.worker import AttentionWorker

    path = tiny_checkpoint("qwen3_moe")
    tok = AutoTokenizer.from_pretrained(path)
    grammars = Grammars(tok, hf_model(path).config.vocab_size, [tok.eos_token_id])
    grammars.compiler = slow = SlowCompiler(grammars.compiler)
    sched = Scheduler(BlockPool(16, 4), 8, 64, enable_prefix_caching=False)
    model = SimpleNamespace(spec=SimpleNamespace(eos_token_ids=(tok.eos_token_id,)))
    worker = AttentionWorker(0, model, SimpleNamespace(block_size=4, num_blocks=16), sched, None, 64,
                             torch.device("cpu"), grammars=lambda: grammars)
    good, bad = SamplingParams(structured_outputs={"regex": "a+"}), SamplingParams(n=2, structured_outputs={
        "regex": "(unclosed"})
    worker.add_requests([{"id": "g", "prompt": [5, 6], "params": good.to_dict()},
                         {"id": "b", "prompt": [5, 6], "params": bad.to_dict()},
                         {"id": "p", "prompt": [5, 6], "params": SamplingParams().to_dict()}])
    assert slow.started.wait(60) and not any(f.done() for _, f, _ in worker._compiling)     # returned mid-compile
    worker._reap()           # nothing has compiled yet: nothing is aborted, and only the plain request runs
    assert worker._aborted == []
    assert [s.seq.request_id for s in sched.schedule(64).scheduled] == ["p"]
    slow.go.set()
    for _, f, _ in worker._compiling:
        f.exception(timeout=60)
    worker._reap()
    assert worker._aborted == [["b#0", [], "abort", None, None, None], ["b#1", [], "abort", None, None, None]]
    assert [s.seq.request_id for s in sched.schedule(64).scheduled] == ["p", "g"] and worker._compiling == []
    assert grammars.matcher(next(s for s in sched.running if s.request_id == "g")) is not None
    with pytest.raises(ValueError, match="does not compile"):     # a failure is not kept: compiled anew, it fails
        grammars.compile(bad.structured_outputs)


def test_requests_with_one_new_grammar_at_once_compile_it_once(tiny_checkpoint):
    """Several front threads compiling one new spec share one compile (each used to compile it), and its failure
    too; a failure is not kept."""
    import threading

    from transformers import AutoTokenizer
    path = tiny_checkpoint("qwen3_moe")
    tok = AutoTokenizer.from_pretrained(path)
    grammars = Grammars(tok, hf_model(path).config.vocab_size, [tok.eos_token_id])
    grammars.compiler = slow = SlowCompiler(grammars.compiler)
    for spec, ok in (({"regex": "a+b"}, True), ({"regex": "(unclosed"}, False)):
        slow.num_compiles, slow.go, got = 0, threading.Event(), []

        def one():
            try:
                got.append(grammars.compile(spec))
            except ValueError as e:
                got.append(e)
        threads = [threading.Thread(target=one) for _ in range(4)]
        for t in threads:
            t.start()
        assert slow.started.wait(60)
        time.sleep(0.2)          # the others reach compile while the first one's compile is held
        slow.go.set()
        for t in threads:
            t.join(60)
        assert slow.num_compiles == 1 and len(got) == 4, (slow.num_compiles, got)
        assert all(g is got[0] for g in got) if ok else all(isinstance(g, ValueError) for g in got)
        slow.started.clear()
    with pytest.raises(ValueError, match="does not compile"):
        grammars.compile({"regex": "(unclosed"})
    assert slow.num_compiles == 2


def test_draft_rows_follow_the_drafts_and_leave_the_matcher_as_it_was(tiny_checkpoint):
    """mask_drafts: row j is the grammar's mask after the first j drafts; a draft the grammar refuses ends the
    masking there; a draft EOS that completes the output ends it too (xgrammar refuses a mask after it: the step
    used to raise); the matcher is where it was before."""
    from transformers import AutoTokenizer
    path = tiny_checkpoint("qwen3_moe")
    tok = AutoTokenizer.from_pretrained(path)
    vocab = hf_model(path).config.vocab_size
    grammars = Grammars(tok, vocab, [tok.eos_token_id])
    params = SamplingParams(max_tokens=16, structured_outputs={"choice": ["ab", "abc"]})
    word = tok.encode("abc", add_special_tokens=False)

    def alone(seq) -> torch.Tensor:      # the one-row mask of seq as it stands
        row = torch.zeros(1, vocab)
        grammars.mask(row, [seq])
        return torch.isinf(row[0])

    seq = Sequence.from_request("a", [5, 6], params, 0)
    before = alone(seq)
    drafts = [*word, tok.eos_token_id, 7]
    rows = torch.zeros(1 + len(drafts), vocab)
    grammars.mask_drafts(rows, [seq], [drafts])
    ahead = Sequence.from_request("b", [5, 6], params, 1)
    for j in range(len(word) + 1):
        ahead.token_ids = [5, 6] + word[:j]
        ahead.grammar = None
        assert torch.equal(torch.isinf(rows[j]), alone(ahead)), j
    assert not torch.isinf(rows[len(word) + 1:]).any()      # past the EOS: not masked, never read
    assert torch.equal(alone(seq), before)
    refused = torch.zeros(3, vocab)
    grammars.mask_drafts(refused, [seq], [[tok.encode("z", add_special_tokens=False)[0], word[0]]])
    assert torch.isinf(refused[0]).any() and not torch.isinf(refused[1:]).any()
    assert torch.equal(alone(seq), before)
