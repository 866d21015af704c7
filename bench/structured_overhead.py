"""What grammar-constrained decoding costs: decode time per output token (TPOT) of the same batch
with and without a JSON-schema grammar, at batch 1 and 32, for a model shape with random
weights, next to the batch-1 roofline (weight bytes / measured copy bandwidth).

The shape's tokenizer is a byte-level vocabulary of the model's full size (every byte, then
letter strings with and without a leading space), so that the grammar engine's per-step work
(the token bitmask over the whole vocabulary) is what a real 128k-vocabulary model costs. The
schema asks for one long string, so both runs produce exactly --output tokens.

    python bench/structured_overhead.py [--shape llama3-8b] [--batches 1 32] [--output 128]
"""
from __future__ import annotations

import argparse
import itertools
import json
import string
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, header, measure_ceilings, param_count, table, write_shape_folder
from kvship.core.grammar import canonical_json
from kvship.llm import LLM
from kvship.sampling_params import SamplingParams, StructuredOutput

# One free-text string: with random weights and greedy sampling the closing quote (one token of
# 128k) practically never wins, so every run produces exactly --output tokens. (A "minLength":
# 100000 once forced that instead, and cost xgrammar ~1 ms per accepted token on the CPU against
# ~20 us for a plain string: the old batch-32 figures measured that bound, not the engine.)
SCHEMA = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}


def byte_level_tokenizer(folder: str, vocab_size: int) -> None:
    """tokenizer.json: <bos>, <eos>, the 256 byte symbols, then letter strings (with and
    without the byte-level space marker) up to vocab_size tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {"<bos>": 0, "<eos>": 1}
    for sym in ByteLevel.alphabet():
        vocab.setdefault(sym, len(vocab))
    letters = string.ascii_lowercase
    for n in itertools.count(2):
        for combo in itertools.product(letters, repeat=n):
            for word in ("".join(combo), "Ġ" + "".join(combo)):
                if len(vocab) >= vocab_size:
                    break
                vocab.setdefault(word, len(vocab))
        if len(vocab) >= vocab_size:
            break
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(Path(folder) / "tokenizer.json"))
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))


def tpot(llm: LLM, batch: int, prompt_len: int, out_len: int, structured: StructuredOutput | None) -> float:
    """Median seconds per decode step of `batch` requests of out_len tokens (3 runs after a warm-up)."""
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=structured is None, structured=structured)
    prompts = lambda: [torch.randint(300, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]  # noqa: E731
    llm.generate(prompts(), params)  # warm-up (and the grammar's compilation)
    times = []
    for _ in range(3):
        outs = llm.generate(prompts(), params)
        assert all(len(o.outputs[0].token_ids) == out_len for o in outs), [len(o.outputs[0].token_ids) for o in outs]
        first = max(o.first_token_time for o in outs)
        last = max(o.finished_time for o in outs)
        times.append((last - first) / (out_len - 1))
    return sorted(times)[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--device", default="auto", help="cpu for a quick check of the script with a small shape")
    args = ap.parse_args()

    bw, _ = measure_ceilings() if torch.cuda.is_available() else (None, None)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_shape_folder(args.shape, tmp)
        byte_level_tokenizer(folder, SHAPES[args.shape]["vocab_size"])
        llm = LLM(folder, load_format="dummy", dtype="bfloat16", max_model_len=args.prompt + args.output + 16,
                  max_num_seqs=max(args.batches), device=args.device)
        grammar = StructuredOutput("json", canonical_json(SCHEMA))
        rows = []
        for b in args.batches:
            t0 = time.monotonic()
            free = tpot(llm, b, args.prompt, args.output, None)
            constrained = tpot(llm, b, args.prompt, args.output, grammar)
            roof = 2 * param_count(args.shape) / bw if bw and b == 1 else None  # bf16 weight bytes / copy BW
            rows.append([b, f"{free * 1e3:.2f}", f"{constrained * 1e3:.2f}", f"{(constrained / free - 1) * 100:+.1f}%",
                         f"{roof * 1e3:.2f}" if roof else "-", f"{time.monotonic() - t0:.0f}"])
    print(header(f"Grammar-constrained decoding overhead ({args.shape}, random weights, {args.prompt}-token "
                 f"prompts, {args.output} output tokens)"))
    print(table(rows, ["batch", "TPOT free (ms)", "TPOT json_schema (ms)", "overhead", "batch-1 roofline (ms)",
                       "bench s"]))
    print(f"\nroofline: bf16 weight bytes / measured copy bandwidth ({bw / 1e12:.2f} TB/s), as bench/latency.py "
          "counts it (KV bytes left out: 256 tokens of context add <1%)." if bw else "")


if __name__ == "__main__":
    main()
