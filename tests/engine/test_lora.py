"""Multi-LoRA in the engine: a batch mixing adapters of different ranks (one rsLoRA) and the base
model gives, for each request, the greedy tokens of transformers on the model with that adapter
merged into its weights; with chunked prefill, prefix-cache hits (never across adapters), and
an adapter loaded into a device slot once whatever number of requests use it."""
import pytest
import torch

from conftest import make_tiny_model
from kvship.kernels._triton import HAS_TRITON
from kvship.llm import LLM
from kvship.lora_request import LoRARequest
from kvship.sampling_params import InvalidParamsError, SamplingParams
from lora_adapters import greedy, make_adapter

PROMPTS = [[1, 5, 9, 13, 21, 34, 55, 89, 144, 233, 7, 3, 2, 17, 19, 23, 29, 31, 37, 41, 43, 47], [2, 4, 8, 16, 32, 64],
           [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170, 180]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_lora(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model(root / "base", "llama-gqa-tied")
    adapters = {
        "r4": (make_adapter(root / "r4", base, rank=4, alpha=8, seed=1), LoRARequest("r4", 1, str(root / "r4"))),
        "r8-attn": (make_adapter(root / "r8", base, rank=8, alpha=16, seed=2, targets=("q_proj", "v_proj", "o_proj")),
                    LoRARequest("r8-attn", 2, str(root / "r8"))),
        "r16-rs": (make_adapter(root / "r16", base, rank=16, alpha=4, seed=3, rslora=True),
                   LoRARequest("r16-rs", 3, str(root / "r16"))),
    }
    return root, base, adapters


def _llm(root, **kw):
    kw = {"max_lora_rank": 16, "max_num_batched_tokens": 16} | kw
    return LLM(str(root / "base"), device="cpu", dtype="float32", num_kv_blocks=128, block_size=4,
               max_model_len=128, enable_lora=True, **kw)


@pytest.mark.timeout(300)
def test_mixed_batch_matches_merged_models(tiny_lora):
    root, base, adapters = tiny_lora
    llm = _llm(root, max_loras=3)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    jobs = [(p, name) for p in PROMPTS for name in [None, *adapters]]
    outs = llm.generate([p for p, _ in jobs], params,
                        lora_request=[adapters[n][1] if n else None for _, n in jobs])
    base_tokens = {}
    for (prompt, name), out in zip(jobs, outs):
        want = greedy(adapters[name][0] if name else base, prompt, MAX_TOKENS)
        assert out.outputs[0].token_ids == want, (name, prompt)
        if name is None:
            base_tokens[tuple(prompt)] = want
    assert any(out.outputs[0].token_ids != base_tokens[tuple(p)] for (p, n), out in zip(jobs, outs) if n)
    assert llm.engine.runner.lora.loads == 3  # one load per adapter for all their requests
    # the same prompt again: a prefix hit under its own adapter only
    again = llm.generate([PROMPTS[0]] * 2, params, lora_request=[adapters["r4"][1], None])
    assert again[0].num_cached_tokens > 0 and again[0].outputs[0].token_ids == greedy(adapters["r4"][0], PROMPTS[0], MAX_TOKENS)
    fresh = LoRARequest("r4-again", 9, adapters["r4"][1].lora_path)  # same files, another adapter id: no hit
    third = llm.generate([PROMPTS[0]], params, lora_request=fresh)[0]
    assert third.num_cached_tokens == 0 and third.outputs[0].token_ids == again[0].outputs[0].token_ids


@pytest.mark.timeout(300)
def test_more_adapters_than_slots_take_turns(tiny_lora):
    """One device slot, three adapters in one call: they run in turns (the scheduler holds back
    a request whose adapter has no slot) and each still matches its merged model."""
    root, base, adapters = tiny_lora
    llm = _llm(root, max_loras=1, max_cpu_loras=2)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    names = list(adapters)
    outs = llm.generate([PROMPTS[1]] * 3, params, lora_request=[adapters[n][1] for n in names])
    for name, out in zip(names, outs):
        assert out.outputs[0].token_ids == greedy(adapters[name][0], PROMPTS[1], 4), name
    assert len(llm.engine.runner.lora.cpu) == 2


def test_bad_adapters_are_refused_by_name(tiny_lora, tmp_path):
    root, base, _ = tiny_lora
    llm = _llm(root, max_lora_rank=8)
    params = SamplingParams(max_tokens=1)
    make_adapter(tmp_path / "big", base, rank=16, alpha=16, seed=4)
    with pytest.raises(InvalidParamsError, match="rank r=16 exceeds --max-lora-rank 8"):
        llm.generate([[1, 2]], params, lora_request=LoRARequest("big", 1, str(tmp_path / "big")))
    make_adapter(tmp_path / "head", base, rank=4, alpha=8, seed=5, targets=("q_proj", "lm_head"))
    with pytest.raises(InvalidParamsError, match="lm_head"):
        llm.generate([[1, 2]], params, lora_request=LoRARequest("head", 2, str(tmp_path / "head")))
    with pytest.raises(InvalidParamsError, match="adapter_config.json"):
        llm.generate([[1, 2]], params, lora_request=LoRARequest("none", 3, str(tmp_path)))
    plain = LLM(str(root / "base"), device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=64)
    with pytest.raises(InvalidParamsError, match="--enable-lora"):
        plain.generate([[1, 2]], params, lora_request=LoRARequest("r", 1, str(tmp_path / "big")))


def test_lora_layers_add_only_the_adapters_rows():
    """The wrapped layer leaves rows without an adapter exactly as the base layer computes them."""
    from kvship.layers.linear import QKVParallelLinear
    from kvship.layers.lora import LoRABatch, LoRALinear
    from kvship.parallel import SINGLE

    base = QKVParallelLinear(16, 4, 2, 1, False, SINGLE)
    base.weight.data.normal_()
    batch = LoRABatch(8, 2, torch.device("cpu"))
    layer = LoRALinear(base, 16, [("q", 8), ("k", 4), ("v", 4)], 2, 4, batch, torch.float32, torch.device("cpu"))
    a, b = torch.randn(2, 16), torch.randn(4, 2)
    layer.write_slot(1, layer.slot_image({"k": (a, b)}, *map(torch.zeros, layer.image_shapes())))
    x = torch.randn(3, 16)
    batch.token_slots[:3] = torch.tensor([1, -1, 0])
    batch.active = True
    y = layer(x)
    want = base(x)
    torch.testing.assert_close(y[1:], want[1:])  # slot 0 is empty, -1 has none
    want[0, 8:12] += b @ a @ x[0]
    torch.testing.assert_close(y[0], want[0])


@pytest.mark.timeout(300)
def test_preempted_requests_resume_on_their_adapter(tiny_lora):
    """A KV cache too small for every request at once: preempted sequences are recomputed with
    the adapter they started with."""
    root, base, adapters = tiny_lora
    llm = LLM(str(root / "base"), device="cpu", dtype="float32", num_kv_blocks=14, block_size=4,
              max_num_batched_tokens=16, max_model_len=64, enable_lora=True, max_loras=3, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    names = list(adapters)
    outs = llm.generate([PROMPTS[2]] * 3, params, lora_request=[adapters[n][1] for n in names])
    assert llm.engine.scheduler.num_preemptions > 0
    for name, out in zip(names, outs):
        assert out.outputs[0].token_ids == greedy(adapters[name][0], PROMPTS[2], MAX_TOKENS), name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_adapters_on_quantized_base_weights(tiny_lora, method):
    """In-situ quantized base weights take adapters: the delta is added to whatever the base
    layer computes. Reference: transformers with each projection's weight quantized and
    dequantized as the engine holds it, plus the adapter's delta."""
    from kvship.quant import quantize

    root, base, adapters = tiny_lora
    merged_r4 = adapters["r4"][0]
    want = {}
    for name, model in (("base", base), ("r4", merged_r4)):
        ref = type(model)(model.config).eval()
        ref.load_state_dict(model.state_dict())
        with torch.no_grad():
            for mod_name, module in ref.named_modules():
                if mod_name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"):
                    w0 = base.get_submodule(mod_name).weight
                    module.weight.copy_(quantize(w0, method).dequantize(torch.float32) + (module.weight - w0))
        want[name] = greedy(ref, PROMPTS[2], MAX_TOKENS)
    assert want["base"] != want["r4"]
    llm = _llm(root, quantization=method, max_loras=2)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([PROMPTS[2]] * 2, params, lora_request=[None, adapters["r4"][1]])
    assert [o.outputs[0].token_ids for o in outs] == [want["base"], want["r4"]]


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.timeout(900)
def test_triton_kernels_in_the_engine(tiny_lora, monkeypatch):
    """The engine's LoRA path through the Triton kernels (the interpreter on a CPU): rows
    grouped by adapter on the host, by 32 for prompt chunks and by 16 for decode steps (of 5
    rows: grouped from 5 here), the down projection's input activated by the shrink. Greedy
    tokens equal the merged models'."""
    from kvship.kernels import lora as lora_kernels
    from kvship.runner import lora_manager

    if not torch.cuda.is_available():
        monkeypatch.setattr(lora_kernels, "use_triton", lambda t: True)
        monkeypatch.setattr(lora_manager, "use_triton", lambda t: True)
    monkeypatch.setattr(lora_kernels, "GROUPED_MIN_ROWS", 5)
    monkeypatch.setattr(lora_kernels, "GROUPED_SHRINK_MIN_ROWS", 5)
    block_sizes = []
    grouped = lora_kernels.lora_shrink_grouped
    monkeypatch.setattr(lora_kernels, "lora_shrink_grouped",
                        lambda x, a, groups, act=None: block_sizes.append(groups.block_m) or grouped(x, a, groups, act))
    root, base, adapters = tiny_lora
    llm = _llm(root, max_loras=3, max_num_batched_tokens=32)
    jobs = [(PROMPTS[1], None), (PROMPTS[1], "r4"), (PROMPTS[2], "r8-attn"), (PROMPTS[0], "r16-rs"),
            (PROMPTS[0], "r4")]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([p for p, _ in jobs], params, lora_request=[adapters[n][1] if n else None for _, n in jobs])
    for (prompt, name), out in zip(jobs, outs):
        assert out.outputs[0].token_ids == greedy(adapters[name][0] if name else base, prompt, 4), (name, prompt)
    assert set(block_sizes) == {16, 32}


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("quantization", [None, "int4", "fp8"])
def test_gpu_mixed_adapters_with_graphs(tiny_lora, quantization):
    """On a GPU: Triton LoRA kernels inside the decode graphs, the base weights 16-bit or
    quantized. A decode step replayed from a graph equals the same step run eagerly, and in
    float32 the greedy tokens of each adapter equal its merged model's (nearly all: tf32 dots
    may flip a near-tie)."""
    root, base, adapters = tiny_lora
    jobs = [(p, n) for p in PROMPTS for n in [None, *adapters]]
    llm = LLM(str(root / "base"), device="cuda", dtype="float32" if quantization is None else "bfloat16",
              max_model_len=128, max_num_seqs=48, num_kv_blocks=160, enable_lora=True, max_loras=3,
              quantization=quantization)
    runner = llm.engine.runner
    assert runner.graphs is not None
    # the captures ran with no adapter rows: start-up's LoRA prefills (up to 128 rows) leave a
    # grouping that the 32- and 48-row graphs' warm-ups would have followed past their rows
    assert not runner.lora.batch.groups.blocks[:, 1].any()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([p for p, _ in jobs], params, lora_request=[adapters[n][1] if n else None for _, n in jobs])
    if quantization is None:
        agree = sum(o.outputs[0].token_ids == greedy(adapters[n][0] if n else base, p, MAX_TOKENS)
                    for (p, n), o in zip(jobs, outs))
        assert agree >= len(jobs) - 1
    # graph vs eager on a decode step mixing adapters and the base model (the graphs with the
    # LoRA kernels), on one of the base model alone (the graphs without them), and on 40 rows
    # mixing them (the graph's grouped LoRA kernels against the per-row ones)
    graphs = runner.graphs
    assert set(graphs.graphs) == set(graphs.lora_graphs) == set(graphs.sizes)
    many = [jobs[i % len(jobs)] for i in range(40)]
    for tag, group in [("mixed", jobs[:8]), ("base", [(p, None) for p, _ in jobs[:5]]), ("many", many)]:
        other = "lora_graphs" if tag == "base" else "graphs"
        with_graph, eager = _decode_step_graph_and_eager(llm, [p for p, _ in group],
                                                          [adapters[n][1] if n else None for _, n in group], tag, other)
        torch.testing.assert_close(with_graph, eager, atol=2e-2, rtol=2e-2)


class _EveryShape(dict):
    """GEMV_SHAPES listing every weight shape (the default settings): the tiny model's layers
    take the one-row GEMV in the graphs, as the 8B shape's do."""

    def get(self, key, default=None):
        from kvship.kernels.tuning.gemv import DEFAULT_CONFIG
        return DEFAULT_CONFIG


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_one_row_gemv_takes_the_shrink(tiny_lora, monkeypatch):
    """At one token in a decode graph a 16-bit layer's GEMV also takes LoRA's shrink (more
    programs, the adapter's A rows): captured so, each adapter's greedy tokens, one request at a
    time, equal its merged model's in float32."""
    from kvship.kernels import gemv

    root, base, adapters = tiny_lora
    monkeypatch.setattr(gemv, "GEMV_SHAPES", _EveryShape())
    fused, inner = [], gemv.gemv_triton

    def spy(*args, lora=None, **kwargs):
        fused.append(lora is not None)
        return inner(*args, lora=lora, **kwargs)

    monkeypatch.setattr(gemv, "gemv_triton", spy)
    llm = LLM(str(root / "base"), device="cuda", dtype="float32", max_model_len=128, max_num_seqs=4,
              num_kv_blocks=64, enable_lora=True, max_loras=3)
    assert any(fused)  # captured into the one-row LoRA graph
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    jobs = [(p, n) for p in PROMPTS for n in adapters]
    agree = sum(llm.generate([p], params, lora_request=adapters[n][1])[0].outputs[0].token_ids
                == greedy(adapters[n][0], p, MAX_TOKENS) for p, n in jobs)
    assert agree >= len(jobs) - 1  # a near-tie may flip between summation orders
    llm.shutdown()


def _decode_step_graph_and_eager(llm, prompts, loras, tag, not_replayed):
    """The logits of one decode step of these requests replayed from a graph and run eagerly
    with the per-row LoRA kernels; the graph set ``not_replayed`` is emptied meanwhile (a replay
    from it would fail)."""
    from kvship.kernels import lora as lora_kernels

    eng, runner = llm.engine, llm.engine.runner
    for i, (p, lora) in enumerate(zip(prompts, loras)):
        eng.add_request(f"{tag}{i}", p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        lora_request=lora)
    eng.step()
    sched = eng.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        eng.step()  # the prompts may take more than one step (the scheduler's join limit)
    prev = eng.in_flight
    batch = eng.scheduler.schedule(prev.rows)
    assert set(batch.num_new_tokens) == {1} and len(batch.seqs) == len(prompts)
    graphs = runner.graphs
    kept = getattr(graphs, not_replayed)
    setattr(graphs, not_replayed, {})
    try:
        with_graph = runner.run(batch, prev).clone()
    finally:
        setattr(graphs, not_replayed, kept)
    runner.graphs, grouped_from = None, (lora_kernels.GROUPED_MIN_ROWS, lora_kernels.GROUPED_SHRINK_MIN_ROWS)
    lora_kernels.GROUPED_MIN_ROWS = lora_kernels.GROUPED_SHRINK_MIN_ROWS = 1 << 30
    try:
        eager = runner.run(batch, prev)
    finally:
        runner.graphs = graphs
        lora_kernels.GROUPED_MIN_ROWS, lora_kernels.GROUPED_SHRINK_MIN_ROWS = grouped_from
    for i in range(len(prompts)):  # leave the engine empty for the next case
        eng.abort(f"{tag}{i}")
    while eng.has_work():
        eng.step()
    return with_graph, eager


@pytest.mark.timeout(600)
def test_tensor_parallel_shards_adapters(tiny_lora):
    """Two ranks (gloo, CPU): each holds its share of every adapter, cut as the projection's
    weight is (B by output rows for q/k/v and gate/up, A by input features for o and down, whose
    deltas join the partial sums before the reduction); the greedy tokens equal the merged models'."""
    root, base, adapters = tiny_lora
    llm = LLM(str(root / "base"), device="cpu", dtype="float32", tensor_parallel_size=2, num_kv_blocks=64,
              block_size=4, max_num_batched_tokens=16, max_model_len=128, enable_lora=True, max_loras=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        names = [None, "r4", "r8-attn", "r16-rs"]  # three adapters, two slots: one waits for a slot
        outs = llm.generate([PROMPTS[0]] * 4, params, lora_request=[adapters[n][1] if n else None for n in names])
        for name, out in zip(names, outs):
            assert out.outputs[0].token_ids == greedy(adapters[name][0] if name else base, PROMPTS[0], MAX_TOKENS), name
    finally:
        llm.shutdown()


@pytest.mark.timeout(300)
def test_gemma_layers_that_reduce_their_own_output(tmp_path):
    """Gemma's o and down projections reduce their own output (it is normalized before the
    residual add): the delta joins their partial sums before the reduction, the bias after."""
    from test_models_gemma import GEMMA

    base = make_tiny_model(tmp_path / "g2", "gemma2", spec=GEMMA["gemma2"])
    base.set_attn_implementation("eager")  # transformers' SDPA path drops Gemma 2's score cap
    merged = make_adapter(tmp_path / "a", base, rank=4, alpha=8, seed=7)
    llm = LLM(str(tmp_path / "g2"), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=16, max_model_len=128, enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([PROMPTS[1]] * 2, params, lora_request=[None, LoRARequest("a", 1, str(tmp_path / "a"))])
    assert outs[0].outputs[0].token_ids == greedy(base, PROMPTS[1], MAX_TOKENS)
    assert outs[1].outputs[0].token_ids == greedy(merged, PROMPTS[1], MAX_TOKENS) != outs[0].outputs[0].token_ids


@pytest.mark.timeout(300)
def test_start_up_prefills_run_the_adapters_kernels_and_change_nothing(tiny_lora, monkeypatch):
    """Start-up's prefill of each query-tile length (on a GPU: what compiles before any request)
    runs a second time through the LoRA kernels, on slot 0 while it is still zeros; afterwards
    no row has an adapter, every slot is still zeros, and adapters' requests match PEFT."""
    from kvship.layers import lora as lora_layers

    root, base, adapters = tiny_lora
    llm = _llm(root, max_loras=2)
    runner = llm.engine.runner
    rows = []
    shrink = lora_layers.lora_shrink
    monkeypatch.setattr(lora_layers, "lora_shrink",
                        lambda x, a, slots, *args: rows.append(slots.tolist()) or shrink(x, a, slots, *args))
    runner._compile_prefill_tiles()
    assert rows and {s for r in rows for s in r} == {0} and {len(r) for r in rows} == {16, 32, 64, 128}
    assert not runner.lora.batch.active
    assert all(not layer.lora_a.any() and not layer.lora_b.any() for layer in runner.lora.layers.values())
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate([PROMPTS[0]], params, lora_request=adapters["r4"][1])[0]
    assert out.outputs[0].token_ids == greedy(adapters["r4"][0], PROMPTS[0], MAX_TOKENS)


def test_graph_capture_warm_ups_see_no_rows_of_start_up_prefills():
    """Each decode graph's capture runs the LoRA kernels once eagerly on the shared buffers. On a
    GPU, start-up's prefills leave there a grouping of up to 128 rows on slot 0, which a 32-row
    warm-up would follow past its own rows (an illegal address at 8B): capture_state clears it."""
    from kvship.kernels.lora_segments import DECODE_BLOCK_M, PREFILL_BLOCK_M, group_rows
    from kvship.layers.lora import LoRABatch

    batch = LoRABatch(256, 2, torch.device("cpu"))
    order, blocks = group_rows([0] * 128, PREFILL_BLOCK_M, batch.groups.blocks.shape[0])
    batch.groups.blocks.copy_(torch.from_numpy(blocks))
    batch.groups.order[:128].copy_(torch.from_numpy(order))
    batch.slots(128).fill_(0)
    assert batch.groups.blocks[:, 1].sum() == 128  # the prefill's rows, as start-up leaves them
    batch.capture_state(True)
    assert batch.active and batch.groups.block_m == DECODE_BLOCK_M
    assert not batch.groups.blocks[:, 1].any()  # no block holds a row
    assert (batch.slots(256) == -1).all()
