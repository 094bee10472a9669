"""Token ids -> text for the HTTP front: incremental detokenisation with stop strings, and where each token's
text sits in it (for logprobs' text offsets and for keeping streamed logprobs beside their text)."""
from __future__ import annotations

import bisect


def tag_overlap(text: str, *tags: str) -> int:
    """How many of text's last characters begin one of the tags (at most its length - 1): what a stream holds back
    because the next piece may complete the tag."""
    return max((next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)
                for tag in tags), default=0)


class GrowingCounts:
    """A count over outputs that grow in place (a stream's token ids, whose usage each chunk carries under
    continuous_usage_stats): each output's counter goes on from where it stopped, so a stream of n tokens costs
    O(n) rather than O(n^2). start(ids): a fresh counter with `ids`, `pos` (the ids it has read) and `advance()`
    (reads the rest, returns the count)."""

    def __init__(self, start):
        self.start, self._counters = start, {}

    def total(self, outputs: list[list[int]]) -> int:
        n = 0
        for ids in outputs:
            counter = self._counters.get(id(ids))
            if counter is None or counter.ids is not ids or counter.pos > len(ids):
                self._counters[id(ids)] = counter = self.start(ids)
            n += counter.advance()
        return n


class Detokenizer:
    """Token ids -> their text, one token at a time, as vLLM's incremental detokeniser works: each token decodes a
    short window (the last whole-character run of tokens as left context, then the tokens since), never the whole
    prefix, so a stream of n tokens costs O(n) instead of a full decode per chunk (O(n^2): a decode of 8192 ids
    took 2 ms here against ~4 us for a window). `add` returns the text that the token completes; while a
    character is split over tokens (a byte-level token holding part of one) that is "", and `pending` holds what
    a full decode would show of the unfinished part (U+FFFD). The texts returned, then `pending`, add up to
    `tokenizer.decode(ids)` (tests/launch/frontend/test_text.py checks it for byte-level BPE and for
    SentencePiece's byte fallback), with one exception, which no stream can follow: a byte-fallback tokenizer's
    full decode replaces a whole run of byte tokens that is not valid UTF-8, including characters of it that
    had been valid (and streamed) before the run went on (vLLM's streams, through the same windows, do as this
    does). A tokenizer whose decode cleans up spaces around punctuation (`clean_up_tokenization_spaces`, off by
    default in transformers 5 and in every tokenizer here) cleans each window, which may differ from cleaning
    the whole text."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self._prefix = self._read = 0   # ids[prefix:read]: decoded whole already, the window's left context
        self.pending = ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self._prefix:self._read], skip_special_tokens=self.skip)
        after = self.tokenizer.decode(self.ids[self._prefix:], skip_special_tokens=self.skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read, self.pending = self._read, len(self.ids), ""
            return after[len(before):]
        self.pending = after[len(before):]
        return ""


class TokenSpans:
    """Where each token's text ends in the text of a growing token sequence: `ends[i]` is the length of the
    decoded text of tokens 0..i, where a trailing incomplete character (a byte-level token holding part of
    one) counts as the one character it decodes to (U+FFFD now, the character once completed). So a character
    split over tokens belongs to the token that starts it. Decodes through a `Detokenizer` (`detok`; None
    without a tokenizer)."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.detok = None if tokenizer is None else Detokenizer(tokenizer, skip_special_tokens)
        self.ends: list[int] = []
        self._length = 0                # the text's length up to the detokeniser's last whole character

    def add(self, toks: list[int]) -> str:
        """Append tokens; returns the text they complete (Detokenizer.add's, joined)."""
        new = []
        for t in toks:
            end = self.ends[-1] if self.ends else 0
            if self.detok is not None:
                new.append(self.detok.add(t))
                self._length += len(new[-1])
                end = max(end, self._length + len(self.detok.pending))
            self.ends.append(end)
        return "".join(new)

    def close(self, length: int, complete: bool) -> None:
        """The text is final and `length` characters long: no token ends past it. `complete` (the text was not
        cut short by a stop string): the last token ends it."""
        self.ends = [min(e, length) for e in self.ends]
        if complete and self.ends:
            self.ends[-1] = length

    def starts(self, lo: int, hi: int) -> list[int]:
        """Where tokens lo..hi-1 start."""
        return [self.ends[i - 1] if i else 0 for i in range(lo, hi)]


def prompt_text(tokenizer, prompt, ids: list[int]) -> tuple[str, bool]:
    """The prompt as echo returns it, and whether that text leaves out special tokens: a string prompt comes
    back as sent (its ids may start with a BOS the tokenizer added, which it does not show), token ids decoded
    with their special tokens."""
    if tokenizer is None:
        return "", False
    with_special = tokenizer.decode(ids, skip_special_tokens=False)
    if isinstance(prompt, str):
        return prompt, with_special != prompt
    return with_special, False


class TextStream:
    """Generated ids -> text pieces, with stop strings. A piece is held back while it could still become a stop
    string or while it ends in an incomplete UTF-8 sequence. The text is decoded incrementally (`Detokenizer`),
    and only its unsent end (plus the `hold` characters a stop string may start in) is kept for the stop
    search; the whole characters of a token that ends in part of one are searched and sent at once, as a full
    decode would show them (tokens that all end inside characters hold their text back until one does not, as
    vLLM's streams do). skip_special_tokens (vLLM's, default True) leaves special tokens' text out. With `spans`,
    it also tracks where each token's text ends (`spans.ends`) and how many tokens are wholly in the text sent so
    far. As vLLM's, the stop search starts once more than `min_tokens` tokens are out (the request's min_tokens),
    and a stop string must end in the text the later tokens add (it may start before)."""

    def __init__(self, tokenizer, stops: list[str], spans: bool = False, min_tokens: int = 0,
                 include_stop: bool = False, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stops = stops
        self.include_stop = include_stop      # vLLM's include_stop_str_in_output: the text ends after the stop string
        self.stop_reason: str | None = None   # the stop string that ended the text
        self.min_tokens = min_tokens
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False
        self.spans = TokenSpans(tokenizer, skip_special_tokens) if spans else None
        self._detok = self.spans.detok if spans else None if tokenizer is None else Detokenizer(tokenizer,
                                                                                               skip_special_tokens)
        self._tail = ""          # the text from `_tail_at` on (never later than sent - hold)
        self._tail_at = 0
        self._floor = 0          # where the text of the first min_tokens tokens ends: a stop string ends past it

    def add(self, toks: list[int], final: bool, hide_last: bool = False) -> str:
        """Append tokens; returns the new text to send. Sets `stopped` and `stop_reason` when a stop string
        appeared (the text ends before it, or with include_stop after it; of several, the one that ends first).
        hide_last: the last token (the EOS or stop token id that ended the request) is counted but adds no text,
        as vLLM's detokeniser leaves it out unless include_stop_str_in_output."""
        done = len(self.ids)
        if self.stops and done < self.min_tokens < done + len(toks):    # the min_tokens text ends inside the call
            head = self.add(toks[:self.min_tokens - done], final=False)
            return head + self.add(toks[self.min_tokens - done:], final, hide_last)
        self.ids.extend(toks)
        shown = toks[:-1] if hide_last else toks
        if self.spans is not None:
            new = self.spans.add(shown)
            if len(shown) < len(toks):
                self.spans.ends.append(self.spans.ends[-1] if self.spans.ends else 0)
        elif self._detok is not None:
            new = "".join([self._detok.add(t) for t in shown])
        if self.tokenizer is None:
            if final and self.spans is not None:
                self.spans.close(0, True)
            return ""
        at = self._tail_at
        whole = self._tail + new              # the text of whole characters, from `at`
        # and what a full decode shows of the tokens since: at the end all of it (an unfinished character as
        # U+FFFD), before then the whole characters that share a token with the unfinished one
        pending = self._detok.pending
        tail = whole + (pending if final else pending.rstrip("\ufffd"))
        if self.stops and len(self.ids) > self.min_tokens:
            start = max(0, self.sent - self.hold) - at
            hits = [(i, s) for i, s in ((tail.find(s, max(start, self._floor - at - len(s) + 1)), s)
                                        for s in self.stops) if i >= 0]
            if hits:     # as vLLM's: the one that ends first (as if the tokens came one at a time), then list order
                i, self.stop_reason = min(hits, key=lambda h: h[0] + len(h[1]))
                tail, final, self.stopped = tail[:i + (len(self.stop_reason) if self.include_stop else 0)], True, True
        else:     # whole characters only: a token ending inside one shows its start only once it completes
            self._floor = at + len(whole)
        end = at + len(tail)
        if not final:
            end -= self.hold
            while end > self.sent and tail[end - 1 - at] == "\ufffd":
                end -= 1
        piece = tail[self.sent - at:max(end, self.sent) - at]
        self.sent = max(end, self.sent)
        if final and self.spans is not None:
            self.spans.close(at + len(tail), complete=not self.stopped)
        keep = min(max(0, self.sent - self.hold), at + len(whole))
        self._tail, self._tail_at = whole[keep - at:], keep
        return piece

    @property
    def num_sent_tokens(self) -> int:
        """Tokens whose text is all in what was sent (needs `spans`). At the end: every token, also those after
        a stop string."""
        return bisect.bisect_right(self.spans.ends, self.sent)
