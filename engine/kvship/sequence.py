"""A sequence (one choice of one request, with its tokens and KV blocks) and a batch (what
the scheduler hands the model runner for one step)."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from kvship.lora_request import LoRARequest
from kvship.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One choice of one request. Each group of fields has one writer: the engine creates it and
    appends the tokens it reads; the scheduler moves it between queues and commits
    ``num_computed_tokens``; the KV cache manager keeps its blocks; the model runner fills
    ``prompt_logprobs``; ``finish()`` alone records why it ended."""

    request_id: str
    index: int  # choice index within the request (0..n-1)
    token_ids: list[int]  # prompt + generated tokens whose values are known on the host
    params: SamplingParams
    num_prompt_tokens: int = 0
    seq_id: int = field(default_factory=lambda: next(_ids))
    leader: "Sequence | None" = None  # n > 1: wait until the leader's prompt is cached, then share it
    generator: torch.Generator | None = None
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    grammar: object | None = None  # an xgrammar GrammarMatcher when the output is constrained (core/grammar.py)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    # the scheduler's
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (or being computed by a launched step)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    first_scheduled_time: float | None = None
    # the KV cache manager's
    # the blocks it holds, in order of position; a new list at every change, never one changed in
    # place: the model runner keeps an array of each list it has seen (block_row)
    block_table: list[int] = field(default_factory=list)
    num_released_blocks: int = 0  # blocks given back before block_table[0] (out of a window model's window)
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of its full blocks, grown as they fill
    num_cached_upto: int = 0  # blocks of block_table already offered to the prefix cache
    state_slot: int | None = None  # its recurrent-state slot while it holds blocks (core/kv_cache_manager.py)
    # the speculator's (core/speculative.py): tokens proposed after token_ids, for the next step
    # to verify; the scheduler cuts them to what that step has room for
    draft_token_ids: list[int] = field(default_factory=list)
    # the model runner's
    prompt_logprobs: list = field(default_factory=list)
    block_row: tuple | None = None  # (block_table, num_released_blocks, their int32 row for the kernels)
    # finish()'s
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def lora_id(self) -> int | None:
        return None if self.lora is None else self.lora.lora_int_id

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        """Record why the sequence ended: "stop", "length", "abort" or "error". "length" is
        decided when the last token is launched, before its value is known: any reason found
        on that token, or an abort, replaces it; "length" never replaces another reason."""
        if reason != "length" or self.finish_reason is None:
            self.finish_reason, self.stop_reason = reason, stop_reason

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def gated(self) -> bool:
        """A sibling waits until its leader has computed (and cached) the prompt."""
        lead = self.leader
        return lead is not None and not lead.finished and lead.num_computed_tokens < lead.num_prompt_tokens


@dataclass
class Batch:
    """One step's work: each sequence with the number of its tokens to compute. A decode's one
    new token may still be in flight (sampled by the step before, not read yet): the runner then
    takes it from that step's tokens on the device."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # a hybrid model's recurrent-state copies (core/state_checkpoints.py), (from slot, to slot):
    # checkpoints into the slots of sequences resuming after a prefix hit, before the forward;
    # sequences' slots into checkpoints, after it
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_checkpoints: list[tuple[int, int]] = field(default_factory=list)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_decodes(self) -> int:
        """How many entries, from the first, compute one token each (``decodes_first``)."""
        return next((i for i, n in enumerate(self.num_new_tokens) if n != 1), len(self.seqs))

    def decodes_first(self) -> Batch:
        """The same work with the one-token entries first, each part in its order: a step that
        mixes prompt chunks with decodes then runs the decodes' attention through the decode
        kernel, which reads a KV head once for its query heads, and only the chunks through the
        prefill kernel (AttentionMetadata.num_decodes). Most steps are in that order already (all
        decodes, or decodes then the chunks admitted after them) and come back as they are."""
        if 1 not in self.num_new_tokens[self.num_decodes:]:
            return self
        order = sorted(range(len(self.seqs)), key=lambda i: self.num_new_tokens[i] != 1)
        return Batch([self.seqs[i] for i in order], [self.num_new_tokens[i] for i in order], self.state_restores,
                     self.state_checkpoints)

    def __len__(self) -> int:
        return len(self.seqs)
