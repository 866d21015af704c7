"""Tensor parallelism on CPU (gloo, one process per rank): sharded logits equal single-rank
logits, greedy output of the bundled SmolLM2 is unchanged at TP=3, two "hosts" find each other
from the environment, and a dead or hung rank fails the engine (or the server) naming the rank."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from kvship.llm import LLM
from kvship.runner.tp.launch import TensorParallelError, resolve_placement
from kvship.sampling_params import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [7, 8, 9], [40, 41]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _run(folder, tp: int, prompts=PROMPTS, params=GREEDY, **kw):
    """(greedy token ids per prompt, logits of every step) with tp ranks; quantized weights on the
    float32 reference path unless ``kw`` says (the integer paths requantize each rank's shard)."""
    kw.setdefault("cpu_weight_format", "float32")
    llm = LLM(str(folder), device="cpu", tensor_parallel_size=tp, max_model_len=128, num_kv_blocks=64, **kw)
    try:
        steps: list[torch.Tensor] = []
        run = llm.engine.runner.run
        llm.engine.runner.run = lambda batch, *prev: steps.append(run(batch, *prev)) or steps[-1]
        outs = llm.generate(prompts, params)
        return [o.outputs[0].token_ids for o in outs], steps
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_models):
    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = _run(tiny_models[arch][0], 1)
        return cache[arch]
    return get


@pytest.mark.parametrize("arch,tp", [("llama-gqa-tied", 2), ("qwen2-bias", 2), ("qwen3-qknorm", 2), ("phi3", 2),
                                     ("llama-gqa-tied", 4),  # 4 ranks over 2 KV heads: KV heads replicated
                                     ("qwen3-moe", 2), ("qwen2-moe", 2), ("mixtral", 2)])  # experts' intermediate dims sharded
def test_sharded_logits_equal_single_rank(tiny_models, reference, arch, tp):
    ref_tokens, ref_steps = reference(arch)
    tokens, steps = _run(tiny_models[arch][0], tp)
    assert len(steps) == len(ref_steps)
    for a, b in zip(steps, ref_steps):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert tokens == ref_tokens


@pytest.mark.parametrize("kv", ["fp8", "int4"])
def test_quantized_kv_cache_sharded_equals_single_rank(tiny_models, kv):
    """A quantized cache over two ranks holds what one rank's holds. int4's groups lie within a
    head. The FP8 scales measured at start-up are each layer's largest over every rank's heads, as
    one rank measures them: layer 0's equal, later layers' within the few rounding flips their
    inputs went through in the measuring prefill (ranks stored it with their own scales), and
    the logits within such flips (with each rank's own scales they were 0.014 apart)."""
    folder = tiny_models["llama-gqa-tied"][0]
    scales = {}
    for tp in (1, 2):
        llm = LLM(str(folder), device="cpu", tensor_parallel_size=tp, max_model_len=128, num_kv_blocks=64,
                  kv_cache_dtype=kv)
        scales[tp] = torch.cat([torch.cat([a.fp8_k_scale, a.fp8_v_scale]) for a in llm.engine.runner.model.attention_layers()])
        llm.engine.shutdown()
    if kv == "fp8":  # (int4 has no layer scales: each group carries its own)
        torch.testing.assert_close(scales[2][:2], scales[1][:2], rtol=0, atol=0)
        torch.testing.assert_close(scales[2], scales[1], rtol=1e-3, atol=0)
    ref_tokens, ref_steps = _run(folder, 1, kv_cache_dtype=kv)
    tokens, steps = _run(folder, 2, kv_cache_dtype=kv)
    assert len(steps) == len(ref_steps)
    for a, b in zip(steps, ref_steps):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-3 if kv == "fp8" else 1e-5)
    assert tokens == ref_tokens


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen35moe-gguf", "qwen3_5_moe-dummy"])
def test_hybrid_sharded_equals_single_rank(tmp_path, arch):
    """Gated DeltaNet over two ranks (a key head each, with its value heads, conv channels and
    state) and the gated attention's heads: every step's logits and the greedy tokens as one
    rank's, prompts prefilled in chunks (the state carried in each rank's slots). The GGUF file's
    value heads, tiled by llama.cpp's converter, are put back before each rank takes its own;
    random weights (load_format="dummy") are the same whatever the ranks."""
    from test_models_qwen3_next import make_hybrid

    if arch.endswith("-gguf"):
        from test_loader_gguf_hybrid import interval_hybrid, write_gguf

        model = interval_hybrid("qwen3_5_moe", tmp_path / "hf")
        path = tmp_path / "tiny-qwen35moe.gguf"
        write_gguf(path, model, "qwen35moe")
    else:
        path = tmp_path / arch
        make_hybrid(path, arch.removesuffix("-dummy"))
    kw = dict(max_num_batched_tokens=16, load_format="dummy" if arch.endswith("-dummy") else "auto")
    prompts = PROMPTS + [list(range(50, 90))]
    ref_tokens, ref_steps = _run(path, 1, prompts, **kw)
    tokens, steps = _run(path, 2, prompts, **kw)
    assert len(steps) == len(ref_steps)
    for a, b in zip(steps, ref_steps):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert tokens == ref_tokens


@pytest.mark.parametrize("arch", ["qwen2-bias", "qwen2-moe"])
def test_dummy_weights_do_not_depend_on_tp(tiny_models, arch):
    folder = tiny_models[arch][0]
    t1, s1 = _run(folder, 1, load_format="dummy")
    t2, s2 = _run(folder, 2, load_format="dummy")
    for a, b in zip(s1, s2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert t1 == t2


def test_smollm2_greedy_tp3_equals_tp1(smollm2_gguf):
    # 9 query / 3 KV heads, intermediate 1536, vocab 49152: divisible by 3, not by 2.
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = {}
    for tp in (1, 3):
        # float32: with int8 weights each rank's slice of a row-parallel matrix has scales of its own
        llm = LLM(str(smollm2_gguf), device="cpu", cpu_weight_format="float32", tensor_parallel_size=tp,
                  max_model_len=256, num_kv_blocks=64)
        try:
            out[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.engine.shutdown()
    assert out[3] == out[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_hosts_from_environment(tiny_models, reference, monkeypatch):
    """Host 1 runs `kvship serve` with the operator's variables and serves only its rank; host 0
    (this process) runs the engine. Same output as one rank; host 1 exits 0 when host 0 stops."""
    folder = tiny_models["llama-gqa-tied"][0]
    port = str(_free_port())
    env = dict(os.environ, KVSHIP_NNODES="2", KVSHIP_NODE_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    host1 = subprocess.Popen([sys.executable, "-m", "kvship.cli", "serve", str(folder), "--device", "cpu",
                              "--tensor-parallel-size", "2", "--max-model-len", "128", "--num-kv-blocks", "64"],
                             env=env, stderr=subprocess.PIPE, text=True)
    try:
        for k, v in dict(KVSHIP_NNODES="2", KVSHIP_NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port).items():
            monkeypatch.setenv(k, v)
        tokens, steps = _run(folder, 2)
        ref_tokens, ref_steps = reference("llama-gqa-tied")
        assert tokens == ref_tokens
        for a, b in zip(steps, ref_steps):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert host1.wait(30) == 0
        assert "serving ranks 1..1" in host1.stderr.read()
    finally:
        if host1.poll() is None:
            host1.kill()
            host1.wait()


def _engine_failure(folder, kill) -> tuple[TensorParallelError, float]:
    llm = LLM(str(folder), device="cpu", tensor_parallel_size=2, max_model_len=128, num_kv_blocks=64)
    eng = llm.engine
    try:
        eng.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        for _ in range(3):
            eng.step()
        kill(eng.tp_runtime.children[1].pid)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError) as err:
            while time.monotonic() - t0 < 60:
                eng.step()
        return err.value, time.monotonic() - t0
    finally:
        eng.shutdown()


def test_killed_worker_fails_the_engine_naming_the_rank(tiny_models):
    err, took = _engine_failure(tiny_models["llama-gqa-tied"][0], lambda pid: os.kill(pid, signal.SIGKILL))
    assert "rank 1" in str(err) and "SIGKILL" in str(err)
    assert took < 30


def test_hung_worker_fails_the_engine_naming_the_rank(tiny_models, monkeypatch):
    monkeypatch.setenv("KVSHIP_TP_HEARTBEAT_TIMEOUT", "3")
    err, took = _engine_failure(tiny_models["llama-gqa-tied"][0], lambda pid: os.kill(pid, signal.SIGSTOP))
    assert "rank 1 stopped responding" in str(err)
    assert took < 30


def test_server_exits_nonzero_when_a_rank_dies(tiny_models):
    folder = tiny_models["llama-gqa-tied"][0]
    proc = subprocess.Popen([sys.executable, "-m", "kvship.cli", "serve", str(folder), "--device", "cpu",
                             "--tensor-parallel-size", "2", "--max-model-len", "128", "--num-kv-blocks", "64",
                             "--host", "127.0.0.1", "--port", str(_free_port())],
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        pid = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"started tensor-parallel rank 1 \(pid (\d+)\)", line)
            pid = int(m.group(1)) if m else pid
            if "listening on" in line:
                break
        assert pid is not None and "listening on" in lines[-1], "".join(lines)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        code = proc.wait(40)
        took = time.monotonic() - t0
        lines.append(proc.stderr.read())
        log = "".join(lines)
        assert code != 0, log
        assert re.search(r"tensor-parallel rank 1 \(pid \d+\) was killed by SIGKILL", log), log
        assert took < 30, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_placement_from_environment():
    p = resolve_placement(4, env={})
    assert (p.nnodes, p.node_rank, p.rank, p.nproc_per_node, p.master_port) == (1, 0, 0, 4, None)
    env = {"KVSHIP_NNODES": "2", "MASTER_ADDR": "llm-0.llm", "MASTER_PORT": "29501"}
    p = resolve_placement(4, env=env, hostname="llm-1")  # StatefulSet pod ordinal
    assert (p.nnodes, p.node_rank, p.rank, p.nproc_per_node, p.master_addr, p.master_port) == (2, 1, 2, 2, "llm-0.llm", 29501)
    assert resolve_placement(4, env={**env, "KVSHIP_NODE_RANK": "0"}, hostname="x-1").is_driver
    p = resolve_placement(2, env={"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})  # one process per rank
    assert (p.rank, p.nnodes, p.master_port) == (1, 2, 29500)
    with pytest.raises(ValueError, match="KVSHIP_NODE_RANK"):
        resolve_placement(4, env=env, hostname="nohost")
    with pytest.raises(ValueError, match="multiple"):
        resolve_placement(3, env=env, hostname="llm-0")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        resolve_placement(2, env={"KVSHIP_NNODES": "2", "KVSHIP_NODE_RANK": "1"})
