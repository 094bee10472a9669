"""The front's incremental detokenisation (launch/frontend/text.py) against the tokenizer's own full decode, which
it replaces per chunk: the texts it returns add up to `decode(ids)` after every token, for the shipped byte-level
BPE tokenizer and for a SentencePiece-style one with byte fallback (Llama's decoder); a TextStream sends, after
each chunk of any chunking, the full decode so far held back for stop strings and cut at the first; and each
token's text end is where the full decode of the tokens up to it ends."""
from __future__ import annotations

import itertools
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from launch.frontend.text import Detokenizer, TextStream, TokenSpans
from models import SHIPPED_MODEL

TEXT = "Wherefore art thou, Romeo? Café, naïve façade — 東京 😀 ¿qué? ∑x² … fin.\n\tEnd"


def shipped():
    return AutoTokenizer.from_pretrained(SHIPPED_MODEL)


def byte_level_mixed():
    """A byte-level BPE tokenizer whose merges join bytes across characters: every adjacent byte pair of TEXT
    with a byte of a multi-byte character in it, so tokens end inside characters that others start (b"f\\xc3"
    of "Café"), and a token can hold whole characters and part of the next."""
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    raw = TEXT.encode()
    merges = list(dict.fromkeys((b2u[x], b2u[y]) for x, y in zip(raw, raw[1:]) if max(x, y) >= 0x80))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tk = Tokenizer(models.BPE(vocab, merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="\u0100")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of bytes to printable characters (byte-level BPE's alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in bs]
    return {**{b: chr(b) for b in bs}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def sentencepiece_style():
    """A Llama-like tokenizer: BPE over "▁"-marked pieces, unknown characters as <0xNN> byte tokens, decoded by
    replacing "▁" with a space, fusing bytes and stripping the first space."""
    pieces = ["▁the", "▁a", "▁of", "▁and", "▁to", "th", "e", "a", "o", "n", "d", "▁", "s", "t", "r", "h", "i", ","]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({p: 259 + i for i, p in enumerate(pieces)})
    tk = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def sequences(tok, rng: random.Random, count: int) -> list[list[int]]:
    """Random ids (special ones among them) and pieces of the encoding of multi-byte text, mixed. Byte-level BPE:
    pieces cut anywhere. Byte fallback: pieces cut between runs of byte tokens and random ids that are not byte
    tokens, so every run of them is whole UTF-8 (Detokenizer's docstring: a full decode replaces an invalid run
    as a whole, also characters already streamed)."""
    text_ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    is_byte = [tok.convert_ids_to_tokens(t).startswith("<0x") for t in range(len(tok))]
    cuts = [i for i in range(len(text_ids) + 1) if not (0 < i < len(text_ids) and is_byte[text_ids[i - 1]]
                                                        and is_byte[text_ids[i]])]
    others = [t for t in range(len(tok)) if not is_byte[t]]
    out = []
    for _ in range(count):
        ids = []
        while len(ids) < 60:
            if rng.random() < 0.5:
                lo = rng.randrange(len(cuts) - 1)
                ids += text_ids[cuts[lo]:cuts[min(len(cuts) - 1, lo + rng.randrange(1, 6))]]
            else:
                ids += [rng.choice(others) for _ in range(rng.randrange(1, 4))]
        out.append(ids)
    return out


@pytest.mark.parametrize("make", [shipped, byte_level_mixed, sentencepiece_style])
@pytest.mark.parametrize("skip", [True, False])
def test_the_incremental_text_is_the_full_decode_after_every_token(make, skip):
    tok = make()
    assert len(set(tok(TEXT, add_special_tokens=False)["input_ids"])) > 10
    # Byte fallback: a prefix that ends inside a run of byte tokens decodes the whole run as U+FFFD (the run is
    # not yet valid), so the texts agree after tokens that end a run.
    byte = [tok.convert_ids_to_tokens(t).startswith("<0x") for t in range(len(tok))]
    unfinished = compared = 0
    for ids in sequences(tok, random.Random(1), 40):
        d, text = Detokenizer(tok, skip), ""
        for i, t in enumerate(ids):
            text += d.add(t)
            unfinished += bool(d.pending)
            if i + 1 < len(ids) and byte[t] and byte[ids[i + 1]]:
                continue
            assert text + d.pending == tok.decode(ids[:i + 1], skip_special_tokens=skip), (ids[:i + 1], text)
            compared += 1
    assert unfinished >= 20 and compared >= 1500    # characters split over tokens were exercised


@pytest.mark.parametrize("make", [shipped, byte_level_mixed])
@pytest.mark.parametrize("include_stop", [False, True])
def test_streamed_pieces_are_the_text_so_far_held_back_for_stop_strings_and_cut_at_the_first(make, include_stop):
    """Byte-level BPE (also with tokens that hold whole characters and part of the next), random chunkings and
    stop strings (some overlapping, some spanning chunks). What a chunk makes visible is the full decode of the
    tokens so far less its unfinished character (U+FFFD), all of it with the last chunk. After each chunk the
    text sent is the visible text less the last len(longest stop) - 1 characters (a stop string may still
    start there) and less a U+FFFD it would end in; the first chunk whose visible text holds a stop string
    (searched where the earlier chunks could not have seen it whole) ends the stream, cut before the hit that
    ends first, ties by list order (vLLM's rule; after it with include_stop, vLLM's include_stop_str_in_output),
    which is the stream's stop_reason."""
    tok = make()
    rng = random.Random(2)
    stopped = held = 0
    for ids in sequences(tok, rng, 80):
        full = tok.decode(ids, skip_special_tokens=True)
        stops = [full[k:k + rng.randrange(1, 5)] for k in (rng.randrange(max(1, len(full) - 4)) for _ in range(3))]
        stops = [st for st in stops if st and "\ufffd" not in st][:rng.randrange(0, 4)]
        hold = max((len(st) for st in stops), default=1) - 1
        stream, sent, i, want = TextStream(tok, stops, rng.random() < 0.5, 0, include_stop), "", 0, ""
        while i < len(ids) and not stream.stopped:
            n = rng.randrange(1, 5)
            last = i + n >= len(ids)
            sent += stream.add(ids[i:i + n], final=last)
            i += n
            seen = tok.decode(ids[:i], skip_special_tokens=True)
            seen = seen if last else seen.rstrip("\ufffd")
            hits = sorted((h + len(st), k, h, st) for k, (h, st) in enumerate((seen.find(st, max(0, len(want) - hold)),
                                                                                st) for st in stops) if h >= 0)
            if hits or last:
                _, _, at, first = hits[0] if hits else (0, 0, len(seen), None)
                want = seen[:at + (len(first) if first and include_stop else 0)]
                assert sent == want and stream.stopped == bool(hits), (ids[:i], stops, sent, want)
                assert stream.stop_reason == first, (ids[:i], stops, stream.stop_reason)
                break
            cut = max(len(want), len(seen) - hold)
            while cut > len(want) and seen[cut - 1] == "\ufffd":    # nor does a piece end in U+FFFD before the end
                cut -= 1
            want = seen[:cut]
            assert sent == want and not stream.stopped, (ids[:i], stops, sent, want)
            held += len(seen) > len(want)
            if stream.spans is not None:     # tokens whose text (as far as a full decode shows it) was all sent
                ends = itertools.accumulate((len(tok.decode(ids[:j + 1], skip_special_tokens=True))
                                             for j in range(i)), max)
                assert stream.num_sent_tokens == sum(e <= len(sent) for e in ends)
        stopped += stream.stopped
    assert stopped >= 20 and held >= 20, (stopped, held)


def test_a_sentencepiece_stream_is_the_full_decode_up_to_a_stop_string():
    """Byte fallback (runs of byte tokens whole), random chunkings and stop strings: what was sent is the full
    decode, or a prefix of it that a stop string follows and that holds none."""
    tok = sentencepiece_style()
    rng = random.Random(4)
    stopped = 0
    for ids in sequences(tok, rng, 60):
        full = tok.decode(ids, skip_special_tokens=True)
        stops = [full[k:k + rng.randrange(1, 5)] for k in (rng.randrange(max(1, len(full) - 4)) for _ in range(2))]
        stops = [st for st in stops if st][:rng.randrange(0, 3)]
        stream, sent, i = TextStream(tok, stops, spans=rng.random() < 0.5), "", 0
        while i < len(ids) and not stream.stopped:
            n = rng.randrange(1, 5)
            sent += stream.add(ids[i:i + n], final=i + n >= len(ids))
            i += n
        assert not any(st in sent for st in stops), (sent, stops)
        if stream.stopped:
            assert full.startswith(sent) and any(full.startswith(st, len(sent)) for st in stops), (sent, stops)
        else:
            assert sent == full
        stopped += stream.stopped
    assert stopped >= 15, stopped


@pytest.mark.parametrize("make", [shipped, byte_level_mixed])
def test_each_tokens_text_ends_where_the_full_decode_of_it_and_those_before_ends(make):
    """TokenSpans.ends[i]: the length of decode(ids[:i + 1]) (an unfinished character counts as the U+FFFD it
    shows), never less than the token before's."""
    tok = make()
    for ids in sequences(tok, random.Random(3), 30):
        spans, want = TokenSpans(tok, True), []
        for i in range(len(ids)):
            want.append(max([len(tok.decode(ids[:i + 1], skip_special_tokens=True)), *want[-1:]]))
        spans.add(ids[:7])
        spans.add(ids[7:])
        assert spans.ends == want



def test_growing_counts_go_on_from_where_they_stopped():
    """ChatAnswer's reasoning_tokens over a stream's output that grows in place (continuous_usage_stats asks after
    every token): each count equals ReasoningPlan.num_tokens of the whole prefix (the count written out by hand at
    the end), each id is read once, and an output replaced or cut short is counted again from its start."""
    from launch.frontend.answer import ChatAnswer
    from launch.frontend.reasoning import ReasoningPlan
    plan = ReasoningPlan(True, True, start_id=1, end_id=2, tool_start_id=3)
    answer = ChatAnswer(reasoning=plan)
    out, want = [], []
    for t in [1, 7, 7, 7, 2, 9, 9, 3, 2]:          # <think> a a a </think> b b <tool_call> </think>
        out.append(t)
        want.append(plan.num_tokens(list(out)))
        assert answer.usage_details([out]) == {"completion_tokens_details": {"reasoning_tokens": want[-1]}}
    assert want == [0, 1, 2, 3, 3, 3, 3, 3, 3]
    reads = answer.counted._counters[id(out)]
    assert reads.pos == len(out) and reads.end == 4
    del out[2:]                                      # cut short: counted again
    assert answer.usage_details([out]) == {"completion_tokens_details": {"reasoning_tokens": 1}}
    tool_first = [7, 3, 7]                           # a tool start ends the reasoning too
    assert answer.usage_details([tool_first, [1, 7]]) == {"completion_tokens_details": {"reasoning_tokens": 2}}


@pytest.mark.parametrize("per_call", [1, 2, 3, 4, 9])     # calls that end at the min_tokens boundary, or cross it
def test_a_stop_string_inside_the_min_tokens_text_does_not_match(per_call):
    """As vLLM's detokenizer: stop strings are looked for once more than min_tokens tokens are out, and only where
    they end in text the later tokens add, also when the longest stop string holds text back. "the cat" is the
    first 3 tokens; the "t" of "cat" lies in the held-back end of that text and must not end the stream: the "t"
    of "sat" does."""
    tok = shipped()
    ids = tok.encode("the cat sat on the mat", add_special_tokens=False)
    assert tok.decode(ids[:3]) == "the cat"
    stream, sent = TextStream(tok, ["zzzzqq", "t"], min_tokens=3), ""
    for i in range(0, len(ids), per_call):
        sent += stream.add(ids[i:i + per_call], final=i + per_call >= len(ids))
        if stream.stopped:
            break
    assert (sent, stream.stop_reason) == ("the cat sa", "t")


def test_of_two_stop_strings_in_one_call_the_one_that_ends_first_wins():
    """vLLM's rule (check_stop_strings): "abcd" and "c" both complete in one call; "c" ends first, as it would
    have with the tokens one at a time, so the text is "ab" whatever the list order; of two ending together
    ("cd", "d") the first listed."""
    tok = shipped()
    ids = tok.encode("xx abcd yy", add_special_tokens=False)
    text = tok.decode(ids)
    for stops, reason in ((["abcd", "c"], "c"), (["c", "abcd"], "c"), (["cd", "d"], "cd"), (["d", "cd"], "d")):
        stream = TextStream(tok, stops)
        sent = stream.add(ids, final=True)
        assert (sent, stream.stop_reason) == (text[:text.index(reason)], reason), stops
