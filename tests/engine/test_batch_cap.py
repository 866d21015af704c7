"""The batch cap (max_num_seqs) left to the engine follows what its KV cache holds: a cache of
more tokens (an FP8 one in the same bytes, say) runs more sequences at once."""
import pytest

from conftest import make_tiny_model
from kvship.llm import LLM
from kvship.runner.model_runner import AUTO_MAX_SEQS, AUTO_MIN_SEQS, auto_max_num_seqs
from kvship.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("cap") / "llama"
    make_tiny_model(path, "llama-gqa-tied")
    return str(path)


def test_the_cap_is_the_cache_at_2048_tokens_a_sequence_within_its_bounds():
    assert auto_max_num_seqs(0, 4096) == AUTO_MIN_SEQS
    assert auto_max_num_seqs(400_000, 4096) == AUTO_MIN_SEQS  # 195 sequences of 2048: the floor
    assert auto_max_num_seqs(800_000, 4096) == 384  # 390, down to a multiple of 16 (graph sizes)
    assert auto_max_num_seqs(800_000, 1024) == 768  # a shorter context: its length a sequence
    assert auto_max_num_seqs(10**9, 4096) == AUTO_MAX_SEQS


def test_an_fp8_cache_in_the_same_bytes_runs_more_sequences_at_once(folder):
    caps, running = {}, {}
    for dtype in ("auto", "fp8"):
        with LLM(folder, device="cpu", dtype="bfloat16", kv_cache_dtype=dtype, max_model_len=128,
                 kv_cache_memory=10 << 20, max_num_batched_tokens=8192, prefill_join_tokens=8192) as llm:
            eng = llm.engine
            caps[dtype] = eng.config.max_num_seqs
            assert eng.scheduler.max_num_seqs == caps[dtype]
            params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            for i in range(AUTO_MAX_SEQS + 16):
                eng.add_request(f"r{i}", [1 + i % 300, 2], params)
            eng.step()
            running[dtype] = len(eng.scheduler.running)
            while eng.has_work():
                eng.step()
    assert caps["fp8"] > caps["auto"] > AUTO_MIN_SEQS
    assert running == caps  # one step admits up to the cap: the cache and the token budget allow it


def test_an_explicit_cap_is_kept(folder):
    with LLM(folder, device="cpu", max_model_len=128, num_kv_blocks=4096, max_num_seqs=8) as llm:
        assert llm.engine.config.max_num_seqs == 8 == llm.engine.scheduler.max_num_seqs
