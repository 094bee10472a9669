"""Token ids -> text for the HTTP front: incremental detokenisation with stop strings, and where each token's
text sits in it (for logprobs' text offsets and for keeping streamed logprobs beside their text)."""
from __future__ import annotations

import bisect


class TokenSpans:
    """Where each token's text ends in the text of a growing token sequence: `ends[i]` is the length of the
    decoded text of tokens 0..i, where a trailing incomplete character (a byte-level token holding part of
    one) counts as the one character it decodes to (U+FFFD now, the character once completed). So a character
    split over tokens belongs to the token that starts it. Built as vLLM's incremental detokeniser works, by
    decoding a short window of tokens (not the whole prefix) per token."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.ends: list[int] = []
        self._prefix = self._read = 0   # ids[prefix:read]: decoded whole already, the window's left context
        self._length = 0                # the text's length up to ids[read]

    def add(self, toks: list[int]) -> None:
        for t in toks:
            self.ids.append(t)
            end = self.ends[-1] if self.ends else 0
            if self.tokenizer is not None:
                before = self.tokenizer.decode(self.ids[self._prefix:self._read], skip_special_tokens=self.skip)
                after = self.tokenizer.decode(self.ids[self._prefix:], skip_special_tokens=self.skip)
                end = max(end, self._length + len(after) - len(before))
                if len(after) > len(before) and not after.endswith("\ufffd"):
                    self._length += len(after) - len(before)
                    self._prefix, self._read = self._read, len(self.ids)
            self.ends.append(end)

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
    string or while it ends in an incomplete UTF-8 sequence (decoded as U+FFFD). With `spans`, it also tracks
    where each token's text ends (`spans.ends`) and how many tokens are wholly in the text sent so far."""

    def __init__(self, tokenizer, stops: list[str], spans: bool = False):
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False
        self.spans = TokenSpans(tokenizer, skip_special_tokens=True) if spans else None

    def add(self, toks: list[int], final: bool) -> str:
        """Append tokens; returns the new text to send. Sets `stopped` when a stop string appeared (the text
        ends before it)."""
        self.ids.extend(toks)
        if self.spans is not None:
            self.spans.add(toks)
        if self.tokenizer is None:
            if final and self.spans is not None:
                self.spans.close(0, True)
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if self.stops:
            start = max(0, self.sent - self.hold)
            hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                text, final, self.stopped = text[:min(hits)], True, True
        end = len(text)
        if not final:
            end -= self.hold
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        piece = text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        if final and self.spans is not None:
            self.spans.close(len(text), complete=not self.stopped)
        return piece

    @property
    def num_sent_tokens(self) -> int:
        """Tokens whose text is all in what was sent (needs `spans`). At the end: every token, also those after
        a stop string."""
        return bisect.bisect_right(self.spans.ends, self.sent)
