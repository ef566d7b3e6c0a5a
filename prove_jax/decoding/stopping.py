"""Stop strings: cut a completion before the first occurrence of any of them, found on the
decoded text as tokens arrive (a block at a time), so a stop string split across two committed
blocks, or inside one token, is found where it starts."""

from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"  # what decoding gives for the bytes of an unfinished UTF-8 character


class StopStrings:
    """Feed a completion's tokens as they are committed; `stopped` tells when a stop string has
    appeared. Then `text` is the completion before it and `ids` the tokens up to the one that
    completed it (the text of the kept tokens may run past the cut: the cut is on text)."""

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.ids: list[int] = []
        self.text = ""
        self.stopped_by: str | None = None  # the stop string found

    @property
    def stopped(self) -> bool:
        return self.stopped_by is not None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _first(self, text: str, start: int) -> tuple[int, str] | None:
        """(index, string) of the earliest stop string in text[start:] (ties: the longest)."""
        hits = [(i, -len(s), s) for s in self.stops if (i := text.find(s, start)) >= 0]
        return (min(hits)[0], min(hits)[2]) if hits else None

    def feed(self, block: Sequence[int]) -> bool:
        """Append committed tokens; True once a stop string has appeared (later feeds are
        ignored)."""
        if self.stopped or not block:
            return self.stopped
        longest = max((len(s) for s in self.stops), default=0)
        # a match may begin in earlier text: search from where the longest stop could start. The
        # text so far may end in replacement characters (a multi-byte character cut between
        # tokens) that become one character once its last byte arrives: count from before them.
        settled = len(self.text.rstrip(REPLACEMENT))
        start = max(0, settled - longest + 1)
        text = self._decode(self.ids + list(block))
        hit = self._first(text, start) if self.stops else None
        if hit is None:
            self.ids += list(block)
            self.text = text
            return False
        # the first of the block's tokens whose text holds a stop string, and the cut there: the
        # same as feeding one token at a time, wherever the blocks end
        for n in range(1, len(block) + 1):
            text = self._decode(self.ids + list(block[:n]))
            hit = self._first(text, start)
            if hit is not None:
                break
        index, self.stopped_by = hit
        self.ids += list(block[:n])
        self.text = text[:index]
        return True
