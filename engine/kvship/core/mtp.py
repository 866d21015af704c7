"""MTP proposals: the checkpoint's multi-token-prediction layer (models/mtp.py; a hybrid model's
block, models/hybrid_mtp.py) guesses k tokens, greedily, batched over the sequences. At position t it takes the target's hidden state of t and
token t + 1 and guesses token t + 2; the guesses after the first take its own output at the
position before in place of the target's hidden state (as vLLM drafts k > 1 with one layer).

Its attention keeps its own paged KV (a second KVCacheManager, as many blocks as the target's)
through a shadow sequence per target sequence whose token p is the target's token p + 1. The
target's hidden states come from every step (ModelRunner.take_hidden) for the positions it kept
and wait here until the layer has consumed them; the layer's KV of its own guesses is dropped
after proposing, so a shadow holds only positions the target has computed."""
from __future__ import annotations

import logging

import torch

from kvship.core.kv_cache_manager import KVCacheManager
from kvship.kernels.argmax import argmax
from kvship.models.hybrid_mtp import HybridMTP
from kvship.models.mtp import NextTokenLayer
from kvship.sampling_params import SamplingParams
from kvship.sequence import Batch, Sequence

log = logging.getLogger(__name__)

_SHADOW_PARAMS = SamplingParams(temperature=0.0)


class _Track:
    """A target sequence's shadow and the target hidden states its layer has not consumed yet
    (positions shadow.num_computed_tokens on)."""

    def __init__(self, seq: Sequence):
        self.shadow = Sequence(seq.request_id, seq.index, [], _SHADOW_PARAMS)
        self.pending: list[torch.Tensor] = []
        self.num_pending = 0

    @property
    def end(self) -> int:
        """The first target position without a hidden state here."""
        return self.shadow.num_computed_tokens + self.num_pending


def drafting_layer(model) -> NextTokenLayer | HybridMTP | None:
    """What drafts: a family's first NextTokenLayer, or a hybrid model's MTP block (both have
    predict, head_input and drafting_attention); None for a model without MTP layers."""
    mtp = getattr(model.model, "mtp", None)
    if isinstance(mtp, HybridMTP):
        return mtp
    return mtp[0] if mtp and isinstance(mtp[0], NextTokenLayer) else None


class MTPDrafts:
    def __init__(self, runner, block_size: int):
        layer = drafting_layer(runner.model)
        if layer is None:
            raise ValueError(f"speculative_config method 'mtp': the checkpoint of {runner.model_config.architecture} "
                             "has no multi-token-prediction layers (num_nextn_predict_layers) that kvship runs")
        self.runner, self.layer = runner, layer  # one layer drafts every position, as vLLM does
        self.model = runner.model
        assert runner.keep_hidden, "the runner keeps hidden states when speculative_config's method is mtp"
        runner._bind_kv_cache(runner.num_blocks, [self.layer.drafting_attention()])
        self.kv = KVCacheManager(runner.num_blocks, block_size, False, None)
        self.budget = runner.config.max_num_batched_tokens
        self.tracks: dict[Sequence, _Track] = {}
        log.info("MTP drafts: %d KV blocks for the layer", runner.num_blocks)

    def observe(self, layout: list[tuple[Sequence, int, int]]) -> None:
        """After a step (rolled back): keep the target's hidden states of the positions each
        sequence kept. ``layout``: (sequence, its first position in the step, its rows)."""
        hidden = self.runner.take_hidden()
        if hidden is None:
            return
        offset = 0
        for seq, start, rows in layout:
            kept = min(rows, seq.num_computed_tokens - start)
            if not seq.finished and kept > 0:
                self._add(seq, start, hidden[offset:offset + kept])
            offset += rows

    def _add(self, seq: Sequence, start: int, rows: torch.Tensor) -> None:
        track = self.tracks.get(seq)
        if track is None:
            if start:  # its earlier states are lost (it was not tracked): no proposals for it
                return
            track = self.tracks[seq] = _Track(seq)
        if start < track.shadow.num_computed_tokens:  # recomputed (preempted): the layer starts there again
            track.shadow.num_computed_tokens = start
            self.kv.drop_tail(track.shadow)
            track.pending, track.num_pending = [], 0
        elif start < track.end:  # recomputed past what the layer consumed
            keep = start - track.shadow.num_computed_tokens
            track.pending, track.num_pending = [torch.cat(track.pending)[:keep]], keep
        elif start > track.end:
            self.forget([seq])
            return
        track.pending.append(rows)
        track.num_pending += len(rows)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        self.forget([s for s in self.tracks if s.finished])
        batch, inputs, want, budget = Batch(), {}, {}, self.budget
        for seq, k in zip(seqs, ks):
            track = self.tracks.get(seq)
            # the hidden states of every position up to the last computed one, the next token known
            if track is None or track.end != seq.num_tokens - 1:
                continue
            shadow = track.shadow
            shadow.token_ids = seq.token_ids[1:]
            if not self._catch_up(track, budget):
                continue
            n = track.num_pending
            if n > budget or not self.kv.allocate(shadow, n + k - 1):
                continue
            batch.add(shadow, n)
            budget -= n
            inputs[shadow] = torch.cat(track.pending)
            track.pending, track.num_pending = [], 0
            want[shadow] = k
        drafts: dict[Sequence, list[int]] = {s: [] for s in want}
        real = {s: s.num_tokens for s in want}  # the positions the target computed
        while batch:
            batch = batch.decodes_first()
            ids, positions, meta, _ = self.runner.prepare(batch, recurrent=False)
            hidden = torch.cat([inputs[s] for s in batch.seqs])
            out = self.layer.predict(positions, self.model.model.embed_tokens(ids), hidden, meta)
            last = out[meta.logits_indices]
            tokens = argmax(self.model.compute_logits(self.layer.head_input(last)).float()).tolist()
            following = Batch()
            for i, (shadow, n, token) in enumerate(zip(batch.seqs, batch.num_new_tokens, tokens)):
                shadow.num_computed_tokens += n
                shadow.token_ids.append(token)
                drafts[shadow].append(token)
                inputs[shadow] = last[i:i + 1]
                if len(drafts[shadow]) < want[shadow]:
                    following.add(shadow, 1)
            batch = following
        for shadow, n in real.items():  # its own guesses' KV goes: the target's states replace them
            shadow.num_computed_tokens = n
            del shadow.token_ids[n:]
            self.kv.drop_tail(shadow)
        return [drafts.get(self.tracks[seq].shadow, []) if seq in self.tracks else [] for seq in seqs]

    def _catch_up(self, track: _Track, budget: int) -> bool:
        """Run the layer over all but the last ``budget`` pending positions (a long prompt's), in
        forwards of at most ``budget`` tokens, for their KV; False if the cache is full, or if
        the sequences before it in the step took the whole budget (no forward could progress)."""
        shadow = track.shadow
        if budget < 1:
            return False
        while track.num_pending > budget:
            n = min(budget, track.num_pending - budget)
            if not self.kv.allocate(shadow, n):
                return False
            hidden = torch.cat(track.pending)
            batch = Batch()
            batch.add(shadow, n)
            ids, positions, meta, _ = self.runner.prepare(batch, recurrent=False)
            self.layer.predict(positions, self.model.model.embed_tokens(ids), hidden[:n], meta)
            shadow.num_computed_tokens += n
            track.pending, track.num_pending = [hidden[n:]], len(hidden) - n
        return True

    def forget(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            track = self.tracks.pop(seq, None)
            if track is not None:
                self.kv.free(track.shadow)

    def release(self) -> None:
        self.tracks.clear()
