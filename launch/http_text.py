"""Generated token ids -> text for the HTTP front: incremental detokenisation with stop strings."""
from __future__ import annotations


class TextStream:
    """Generated ids -> text pieces, with stop strings. A piece is held back while it could still become a stop
    string or while it ends in an incomplete UTF-8 sequence (decoded as U+FFFD)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False

    def add(self, toks: list[int], final: bool) -> str:
        """Append tokens; returns the new text to send. Sets `stopped` when a stop string appeared (the text
        ends before it)."""
        self.ids.extend(toks)
        if self.tokenizer is None:
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
        return piece
