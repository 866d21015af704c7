"""N-gram (prompt lookup) proposals: the tokens that followed the latest earlier occurrence of
the sequence's last n tokens, the longest n in [prompt_lookup_min, prompt_lookup_max] that
occurs. Copy-heavy work (edits, summaries, quoted sources) repeats its context verbatim, and
then the guess is right for several tokens at no model cost."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens to follow ``token_ids``; none when no suffix recurs."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            # windows starting at 0 .. L-n-1: each has at least one token after it
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[L - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []
