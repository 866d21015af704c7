"""What the MTP tests (tests/engine/test_mtp.py, tests/models/test_hybrid_speculative.py) run of
an engine's MTP proposer beside a reference of the layer's definition."""
from __future__ import annotations

import torch

from kvship.sampling_params import SamplingParams
from kvship.sequence import Batch, Sequence


@torch.no_grad()
def drafting_logits(llm, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """The drafting layer's logits at each position t of ``tokens[1:]``, given the target's
    hidden states ``hidden`` of ``tokens[:-1]`` (a shadow sequence in the proposer's own KV)."""
    proposer, runner = llm.engine.speculator.proposer, llm.engine.runner
    shadow = Sequence("ref", 0, tokens[1:], SamplingParams(temperature=0))
    assert proposer.kv.allocate(shadow, len(shadow.token_ids))
    batch = Batch()
    batch.add(shadow, len(shadow.token_ids))
    ids, positions, meta, _ = runner.prepare(batch, recurrent=False)
    out = proposer.layer.predict(positions, runner.model.model.embed_tokens(ids), hidden, meta)
    proposer.kv.free(shadow)
    return runner.model.compute_logits(proposer.layer.head_input(out)).float()


def first_drafts(llm, prompt: list[int]) -> tuple[list[int], list[int]]:
    """Generating ``prompt`` greedily: the tokens the proposer first proposes after, and its drafts."""
    proposer = llm.engine.speculator.proposer
    proposed, propose = [], proposer.propose

    def recording(seqs, ks):
        drafts = propose(seqs, ks)
        proposed.append((list(seqs[0].token_ids), drafts[0]))
        return drafts
    proposer.propose = recording
    try:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))
    finally:
        proposer.propose = propose
    return proposed[0]
