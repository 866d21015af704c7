"""Shared by the routed families' model tests (DeepSeek, GLM-4 MoE, Llama 4, MiniMax-M2): tiny
random checkpoints made to stress attention, their prompts, and the engine's greedy checks
(batched with chunked prefill and a prefix hit; under preemption) against transformers."""
from __future__ import annotations

import torch

from kvship.sampling_params import SamplingParams
from test_models import assert_greedy_matches


def sharpen_and_save(ref, folder) -> None:
    """Attention weights scaled up (transformers draws them with std 0.02) so that attention, and
    with it the rotary layout and the scales, moves the logits well past the tolerance; a
    router's correction bias drawn (transformers makes it zeros); saved to ``folder``."""
    with torch.no_grad():
        for pname, p in ref.named_parameters():
            if ".self_attn." in pname and "norm" not in pname:
                p.mul_(8.0)
        for pname, b in ref.named_buffers():
            if pname.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(pname)))
    ref.save_pretrained(folder)


def make_routed_models(root, specs: dict) -> dict:
    """{name: (folder, transformers model)} for each ``specs`` entry (name -> (config class, fields)),
    a tiny random checkpoint under root/name made by conftest.make_tiny_model and sharpened."""
    from conftest import make_tiny_model

    out = {}
    for name, spec in specs.items():
        ref = make_tiny_model(root / name, name, spec=spec)
        sharpen_and_save(ref, root / name)
        out[name] = (root / name, ref)
    return out


def prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 319, (n,), generator=g).tolist() for n in (5, 17, 45)]


def assert_greedy_batched_chunked_cached(folder, ref) -> None:
    """assert_greedy_matches over three prompts and a fourth sharing 24 tokens with the third
    (prefix-cache blocks)."""
    ps = prompts(2)
    ps.append(ps[2][:24] + [5, 6, 7])
    assert_greedy_matches(folder, ref, ps, 10)


def assert_preemption_changes_nothing(folder, ref) -> None:
    """Too few KV blocks for three sequences' decodes: some are preempted and recomputed, and
    every sequence still gives transformers' greedy tokens."""
    from kvship.llm import LLM

    ps = prompts(3)[1:] + [prompts(4)[2][:30]]
    llm = LLM(str(folder), device="cpu", dtype="float32", cpu_weight_format="float32", num_kv_blocks=30, block_size=4,
              max_num_batched_tokens=64, max_model_len=96)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(ps, params)]
    assert llm.engine.scheduler.num_preemptions > 0
    for p, got in zip(ps, ours):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
        assert got == want[0, len(p):].tolist()
