"""Batched token sampling: penalties, logit bias, temperature, top-k / top-p / min-p, logprobs.

Everything runs on the logits' device as whole-batch tensor operations; per-row values
(temperature, top_k, ...) become [B, 1] tensors so that rows with a feature disabled are left
untouched. The only per-row Python loop draws the exponential noise of seeded rows from their
own generator, so a seeded row's token depends only on its own logits and its own generator,
never on what else shares the batch.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks index i with
probability p_i, without a cumulative sum or a host round trip.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import torch

from kvship.kernels.argmax import argmax
from kvship.outputs import TokenLogprob
from kvship.sampling_params import SamplingParams


@dataclass
class SamplerRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Set when params.seed is not None: created by the caller on the logits' device and seeded
    # once per sequence. None -> the default RNG (one batched draw for all such rows).
    generator: torch.Generator | None = None
    # Optional stable identity of the sequence (e.g. (request_id, index)): lets the sampler
    # cache the prompt's token set for the repetition penalty across steps. None: no caching.
    cache_key: Hashable | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: (sampled token's logprob, top-k alternatives sorted descending), or None when the
    # row did not ask (params.logprobs is None).
    logprobs: list[tuple[TokenLogprob, list[TokenLogprob]] | None]


def _token_counts(seqs: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, V] float32 counts of each token id per row. The ids of all rows go to the device as
    one flat tensor (converted through numpy: far cheaper than torch.tensor on lists) and are
    counted by a single index_add; ids outside [0, vocab) land in a dump slot that is dropped."""
    B = len(seqs)
    counts = torch.zeros(B * vocab + 1, dtype=torch.float32, device=device)
    lens = [len(s) for s in seqs]
    if sum(lens):
        ids = np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs if s])
        flat = np.repeat(np.arange(B, dtype=np.int64) * vocab, lens) + ids
        flat[(ids < 0) | (ids >= vocab)] = B * vocab
        index = torch.from_numpy(flat).to(device, non_blocking=True)
        counts.index_add_(0, index, torch.ones(index.shape[0], dtype=torch.float32, device=device))
    return counts[:-1].view(B, vocab)


class PromptMaskCache:
    """Per-sequence [V] bool masks of the prompt's tokens, for the repetition penalty, keyed by
    SamplerRow.cache_key (validated by prompt length and device), least recently used evicted.
    Rebuilding a long prompt's set every step would dominate the sampler's host time."""

    def __init__(self, capacity: int = 512):
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, tuple[int, torch.Tensor]] = OrderedDict()

    def masks(self, rows: list[SamplerRow], use: list[bool], vocab: int, device: torch.device) -> torch.Tensor:
        """[B, V] bool: row i's prompt tokens where use[i], else all False."""
        B = len(rows)
        got: list[torch.Tensor | None] = [None] * B
        missing = []
        for i, r in enumerate(rows):
            if not use[i]:
                continue
            hit = self._entries.get(r.cache_key) if r.cache_key is not None else None
            if hit is not None and hit[0] == len(r.prompt_token_ids) and hit[1].device == device \
                    and hit[1].shape[0] == vocab:
                self._entries.move_to_end(r.cache_key)
                got[i] = hit[1]
            else:
                missing.append(i)
        if missing:
            fresh = _token_counts([rows[i].prompt_token_ids for i in missing], vocab, device) > 0
            for j, i in enumerate(missing):
                got[i] = fresh[j]
                key = rows[i].cache_key
                if key is not None:
                    self._entries[key] = (len(rows[i].prompt_token_ids), fresh[j].clone())
                    self._entries.move_to_end(key)
            while len(self._entries) > max(self.capacity, 2 * B):
                self._entries.popitem(last=False)
        none = torch.zeros(vocab, dtype=torch.bool, device=device)
        return torch.stack([m if m is not None else none for m in got])


def apply_penalties(logits: torch.Tensor, rows: list[SamplerRow],
                    prompt_cache: PromptMaskCache | None = None) -> torch.Tensor:
    """Repetition (HF style, over prompt + output), then frequency and presence (OpenAI style,
    over output). `logits` is float32 [B, V]; returns a new tensor (or `logits` when no row
    uses a penalty)."""
    if not any(r.params.uses_penalties for r in rows):
        return logits
    B, V = logits.shape
    dev = logits.device
    rep = [r.params.repetition_penalty for r in rows]
    freq = [r.params.frequency_penalty for r in rows]
    pres = [r.params.presence_penalty for r in rows]
    use_rep = [p != 1.0 for p in rep]
    use_fp = any(f != 0.0 for f in freq) or any(p != 0.0 for p in pres)

    out_counts = _token_counts([r.output_token_ids if r.params.uses_penalties else [] for r in rows], V, dev)
    if any(use_rep):
        # Only rows that use the penalty pay for their prompt's token set.
        if prompt_cache is not None:
            prompt_seen = prompt_cache.masks(rows, use_rep, V, dev)
        else:
            prompt_seen = _token_counts([r.prompt_token_ids if u else [] for r, u in zip(rows, use_rep)], V, dev) > 0
        seen = prompt_seen | (out_counts > 0)
        p = torch.tensor(rep, dtype=torch.float32, device=dev).unsqueeze(1)
        penalised = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(seen, penalised, logits)
    if use_fp:
        f = torch.tensor(freq, dtype=torch.float32, device=dev).unsqueeze(1)
        pr = torch.tensor(pres, dtype=torch.float32, device=dev).unsqueeze(1)
        logits = logits - f * out_counts - pr * (out_counts > 0).to(torch.float32)
    return logits


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
    """OpenAI's logit_bias: each row's {token id: value} added to its logits, before temperature
    and truncation (so that -100 bans a token from greedy rows too). All rows' entries go to
    the device as one flat index and are added by a single scatter; ids past the logits' width
    are dropped. Returns a new tensor (or `logits` when no row has a bias)."""
    if not any(r.params.logit_bias for r in rows):
        return logits
    B, V = logits.shape
    flat, values = [], []
    for i, r in enumerate(rows):
        for token_id, bias in r.params.logit_bias.items():
            if 0 <= token_id < V:
                flat.append(i * V + token_id)
                values.append(bias)
    out = logits.clone()
    index = torch.from_numpy(np.asarray(flat, dtype=np.int64)).to(logits.device, non_blocking=True)
    out.view(-1).index_add_(0, index, torch.tensor(values, dtype=logits.dtype).to(logits.device, non_blocking=True))
    return out


def apply_top_k_top_p_min_p(logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
    """Mask (to -inf) the tokens that top_k, top_p and min_p exclude, row by row via per-row
    tensors. `logits` are already divided by the temperature. Returns a new tensor."""
    B, V = logits.shape
    dev = logits.device
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=dev)
    top_k = [r.params.top_k if 0 < r.params.top_k < V else 0 for r in rows]  # 0: off
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]

    if any(top_k):
        kmax = max(top_k)
        k = torch.tensor([kk if kk else kmax for kk in top_k], dtype=torch.int64, device=dev).unsqueeze(1)
        top_vals = torch.topk(logits, kmax, dim=-1).values
        kth = top_vals.gather(1, k - 1)  # [B, 1]: the k-th largest value per row
        on = torch.tensor([kk > 0 for kk in top_k], dtype=torch.bool, device=dev).unsqueeze(1)
        logits = torch.where((logits < kth) & on, neg_inf, logits)

    if any(p < 1.0 for p in top_p):
        p = torch.tensor(top_p, dtype=torch.float32, device=dev).unsqueeze(1)
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly above
        # Keep the smallest prefix whose mass reaches top_p; the first token always survives,
        # and rows with top_p == 1 are left alone (no float round-off trimming the tail).
        drop_sorted = (before >= p) & (p < 1.0)
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        logits = torch.where(drop, neg_inf, logits)

    if any(m > 0.0 for m in min_p):
        m = torch.tensor(min_p, dtype=torch.float32, device=dev).unsqueeze(1)
        probs = torch.softmax(logits, dim=-1)
        threshold = m * probs.max(dim=-1, keepdim=True).values
        logits = torch.where(probs < threshold, neg_inf, logits)
    return logits


class PendingSample:
    """A launched sample. On CUDA its results are copied to pinned host memory behind the
    sampling kernels; result() waits only for those copies."""

    def __init__(self, tokens: torch.Tensor, device_side: list[torch.Tensor], lp_rows: list[int], lp_k: list[int]):
        self.tokens = tokens  # [B] int64 on the logits' device
        self._lp_rows, self._lp_k = lp_rows, lp_k
        self._event = None
        if tokens.is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for t in device_side]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = device_side
        self._result: SamplerOutput | None = None

    def result(self) -> SamplerOutput:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            host = [t.tolist() for t in self._host]
            token_ids = host[0]
            logprobs: list[tuple[TokenLogprob, list[TokenLogprob]] | None] = [None] * len(token_ids)
            for j, (i, k) in enumerate(zip(self._lp_rows, self._lp_k)):
                alts = [TokenLogprob(t, v) for t, v in zip(host[3][j][:k], host[2][j][:k])] if k > 0 else []
                logprobs[i] = (TokenLogprob(token_ids[i], host[1][j]), alts)
            self._result = SamplerOutput(token_ids=token_ids, logprobs=logprobs)
        return self._result


class Sampler:
    """Everything per sequence (its tokens, its generator) comes in `rows`; the only state kept
    is a cache of prompt token sets for rows that carry a cache_key."""

    def __init__(self, prompt_cache_capacity: int = 512):
        self.prompt_cache = PromptMaskCache(prompt_cache_capacity)

    def __call__(self, logits: torch.Tensor, rows: list[SamplerRow], allowed: torch.Tensor | None = None
                 ) -> SamplerOutput:
        return self.launch(logits, rows, allowed).result()

    def launch(self, logits: torch.Tensor, rows: list[SamplerRow], allowed: torch.Tensor | None = None
               ) -> PendingSample:
        """Queue the sampling of each row on the logits' device without waiting for it: the
        tokens stay on the device (the next step's input reads them there) and their copies to
        the host are already under way when this returns. `allowed`: a grammar's token bitmask
        ([B, ceil(V / 32)] int32, xgrammar's layout; kvship.core.grammar), applied after
        penalties and bias, so that neither can bring back a token the grammar forbids."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows), V], got {tuple(logits.shape)} for {len(rows)} rows")
        B, V = logits.shape
        dev = logits.device
        greedy = [r.params.greedy for r in rows]
        lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        raw = logits.to(torch.float32)  # never modified in place below (no copy when already fp32)

        x = apply_logit_bias(apply_penalties(raw, rows, self.prompt_cache), rows)
        if allowed is not None:
            import xgrammar  # here, not at the top: importing it (and transformers) slows start-up

            x = x.clone() if x is raw else x
            # From pinned memory the copy is queued behind the forward pass; from pageable
            # memory it would hold the host until the forward is done, and the engine would lose
            # its run-ahead.
            allowed = allowed.pin_memory() if dev.type == "cuda" else allowed
            xgrammar.apply_token_bitmask_inplace(x, allowed.to(dev, non_blocking=True))
        if all(greedy):
            tokens = argmax(x)
        else:
            temps = [1.0 if g else r.params.temperature for g, r in zip(greedy, rows)]
            greedy_tokens = argmax(x) if any(greedy) else None
            if any(t != 1.0 for t in temps):
                x = x / torch.tensor(temps, dtype=torch.float32, device=dev).unsqueeze(1)
            x = apply_top_k_top_p_min_p(x, rows)
            probs = torch.softmax(x, dim=-1)
            noise = self._exponential_noise(rows, greedy, V, dev)
            tokens = (probs / noise).argmax(dim=-1)
            if greedy_tokens is not None:
                g = torch.tensor(greedy, dtype=torch.bool, device=dev)
                tokens = torch.where(g, greedy_tokens, tokens)

        # Logprobs come from the raw model distribution (as vLLM / OpenAI report them).
        lp_k = [min(rows[i].params.logprobs, V) for i in lp_rows]
        device_side = [tokens]
        if lp_rows:
            sel = torch.tensor(lp_rows, dtype=torch.int64, device=dev)
            lp = torch.log_softmax(raw.index_select(0, sel), dim=-1)
            device_side.append(lp.gather(1, tokens.index_select(0, sel).unsqueeze(1)).squeeze(1))
            if max(lp_k) > 0:
                top = torch.topk(lp, max(lp_k), dim=-1)
                device_side += [top.values, top.indices]
        return PendingSample(tokens, device_side, lp_rows, lp_k)

    @staticmethod
    def _exponential_noise(rows: list[SamplerRow], greedy: list[bool], V: int, dev: torch.device) -> torch.Tensor:
        """[B, V] i.i.d. Exp(1) noise: one draw per seeded row from its own generator, one batched
        draw for all unseeded sampling rows; greedy rows get ones (unused)."""
        noise = torch.ones(len(rows), V, dtype=torch.float32, device=dev)
        unseeded = [i for i, r in enumerate(rows) if not greedy[i] and r.generator is None]
        if unseeded:
            sel = torch.tensor(unseeded, dtype=torch.int64, device=dev)
            noise.index_copy_(0, sel, torch.empty(len(unseeded), V, dtype=torch.float32, device=dev).exponential_())
        for i, r in enumerate(rows):
            if not greedy[i] and r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        # Exp(1) draws of exactly 0 would turn p/0 into inf (or nan for p == 0).
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)
