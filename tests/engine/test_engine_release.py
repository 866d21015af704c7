"""An engine gives its memory back: on shutdown(), on leaving a `with` block, and when its last
reference is dropped (without waiting for the cycle collector). On the CPU the model's and the
KV cache's tensors must be dead; on a GPU, torch.cuda.memory_allocated() must come back to where
it started, engine after engine, in one process."""
import asyncio
import gc
import weakref
from contextlib import contextmanager

import pytest
import torch

from conftest import make_tiny_model
from kvship.config import EngineConfig
from kvship.core.async_engine import AsyncEngine
from kvship.llm import LLM
from kvship.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # Wide KV heads: a GPU cache of most of the memory in fewer blocks (an engine's start-up
    # takes time per block), so that three engines in a row stay quick.
    path = tmp_path_factory.mktemp("release") / "llama"
    make_tiny_model(path, "llama-wide-kv", spec=("LlamaConfig", dict(num_key_value_heads=4, head_dim=128,
                                                                       tie_word_embeddings=True)))
    return str(path)


def device_tensors(runner) -> list[weakref.ref]:
    """Weak references to the weights, the KV cache and the other tensors the model holds."""
    model = runner.model
    tensors = list(model.parameters()) + [b for b in model.buffers() if b is not None]
    for attn in model.attention_layers():
        tensors += [t for t in (attn.k_cache, attn.v_cache) if t is not None]
    assert len(tensors) > 10
    return [weakref.ref(t) for t in tensors]


def alive(refs: list[weakref.ref]) -> int:
    return sum(r() is not None for r in refs)


@contextmanager
def no_cycle_collector():
    """What refcounting alone frees, as between two collections."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_shutdown_frees_the_model_and_cache_even_if_the_model_is_still_referenced(folder):
    llm = LLM(folder, device="cpu", max_model_len=128, max_num_seqs=4)
    llm.generate([[1, 2, 3]], GREEDY)
    kept = llm.engine.runner.model  # a caller's reference must not keep its memory
    caches = [weakref.ref(t) for attn in kept.attention_layers() for t in (attn.k_cache, attn.v_cache)]
    with no_cycle_collector():
        llm.shutdown()
        assert alive(caches) == 0
    assert all(p.numel() == 0 for p in kept.parameters())  # emptied in place: the layers hold nothing
    assert all(attn.k_cache is None for attn in kept.attention_layers())
    llm.shutdown()  # twice is fine
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2, 3]], GREEDY)


def test_with_block_and_dropping_the_last_reference_free_everything(folder):
    with LLM(folder, device="cpu", max_model_len=128, max_num_seqs=4) as llm:
        out = llm.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids
        refs = device_tensors(llm.engine.runner)
    assert len(out) == 4 and alive(refs) == 0

    with no_cycle_collector():  # weights hold no reference cycle (their loaders are dropped)
        llm = LLM(folder, device="cpu", max_model_len=128, max_num_seqs=4)
        assert llm.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids == out
        refs = device_tensors(llm.engine.runner)
        del llm
        assert alive(refs) == 0


def test_async_engine_frees_on_shutdown_and_when_dropped(folder):
    def serve(engine: AsyncEngine) -> list[int]:
        async def go():
            async for o in engine.generate([1, 2, 3], GREEDY, "r"):
                last = o
            return last.outputs[0].token_ids
        return asyncio.run(asyncio.wait_for(go(), timeout=60))

    config = dict(device="cpu", max_model_len=128, max_num_seqs=4)
    with AsyncEngine.from_config(EngineConfig(model=folder, **config)) as engine:
        assert len(serve(engine)) == 4
        refs, thread = device_tensors(engine.engine.runner), engine._thread
    thread.join(10)
    assert not thread.is_alive() and alive(refs) == 0

    engine = AsyncEngine.from_config(EngineConfig(model=folder, **config))
    serve(engine)
    refs, thread = device_tensors(engine.engine.runner), engine._thread
    del engine  # the thread holds it weakly: its loop ends, and the model goes with it
    thread.join(10)
    assert not thread.is_alive()
    gc.collect()  # the asyncio loop's leftovers may hold frames; the engine itself holds no cycle
    assert alive(refs) == 0


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_three_engines_in_a_row_give_their_gpu_memory_back(folder, kv_cache_dtype):
    """Each engine takes most of the GPU (default --gpu-memory-utilization): a second one could
    not start if the first kept its cache. After each, memory_allocated is back at its start
    (measured after a first engine, whose library workspaces stay for the process)."""
    config = dict(device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=16, kv_cache_dtype=kv_cache_dtype)

    def one(how: str) -> list[int]:
        llm = LLM(folder, **config)
        assert llm.engine.runner.graphs is not None
        assert torch.cuda.memory_allocated() > 0.5 * torch.cuda.get_device_properties(0).total_memory * 0.9
        out = llm.generate([[1, 2, 3], [4, 5]], GREEDY)[0].outputs[0].token_ids
        if how == "shutdown":
            llm.shutdown()
        elif how == "with":
            with llm:
                pass
        else:
            del llm
        return out

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    first = one("shutdown")
    start = torch.cuda.memory_allocated()
    assert start - before < 256 << 20, f"the first engine left {(start - before) / 2**20:.0f} MiB"
    for how in ("shutdown", "with", "del"):
        assert one(how) == first
        torch.cuda.synchronize()
        left = torch.cuda.memory_allocated() - start
        assert left <= 1 << 20, f"after {how}: {left / 2**20:.1f} MiB still allocated"
