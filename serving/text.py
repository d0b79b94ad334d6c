"""Incremental detokenization with stop strings: what text of a growing token list is safe
to send now."""


class TextStream:
    """Feed generated token ids one at a time; `add` returns the text that can go out.

    Text is held back while it ends in a cut multi-byte character (U+FFFD from a partial
    UTF-8 sequence) or in a prefix of a stop string; a stop string ends the stream, and
    neither it nor anything after it is sent.
    """

    def __init__(self, tokenizer, stop=()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids = []
        self.text = ""
        self.sent = 0  # characters of self.text already returned
        self.stopped = False

    def add(self, token):
        if self.stopped:
            return ""
        self.ids.append(int(token))
        self.text = self.tokenizer.decode(self.ids)
        search_from = max(0, self.sent - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._emit(min(hits))
        end = len(self.text.rstrip("\ufffd"))
        hold = 0  # a suffix that may still grow into a stop string
        for s in self.stop:
            for k in range(min(len(s) - 1, end), 0, -1):
                if self.text.endswith(s[:k], 0, end):
                    hold = max(hold, k)
                    break
        return self._emit(max(end - hold, self.sent))

    def flush(self):
        """The held-back rest, at the end of generation (unless a stop string ended it)."""
        return "" if self.stopped else self._emit(len(self.text))

    @property
    def output(self):
        """Everything returned so far."""
        return self.text[:self.sent]

    def _emit(self, end):
        piece = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return piece
