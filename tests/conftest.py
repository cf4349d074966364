"""Shared test fixtures: random-weight checkpoints saved with `transformers`, the oracle, and
level 6's server.

Every checkpoint goes through `save_pretrained` and our loader, so the real loading path
is the one exercised. Nothing is downloaded. The hypothesis profile `ci` bounds the
example counts so the whole suite stays within its time budget on 2 CPU cores, and is
derandomized (each test's examples seeded by the test itself, no example database): every
run of the suite tries the same examples, so a red run is a change's doing, not a draw's;
`HYPOTHESIS_PROFILE=thorough` draws 200 fresh ones per test to look for new failures. The
level-6 fixtures (`ckpt`, `llm`, `server`) are module-scoped: each level-6 test file that
asks for them gets its own, built from tests/level6_helpers.py (imported only then);
`slow_steps` slows `server`'s engine for one test, so a request surely outlasts its client,
and `long_ckpt` has room for answers that do in a server of a process of its own.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through Triton's interpreter. The switch is read when
    # triton is imported, and importing transformers' model classes imports triton, so
    # it must be set before any of that happens.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A CPU engine compiles its model by default (features/compilation: 3-40 s an engine); the suite builds
# hundreds, so its default is eager, and tests/test_compilation.py asks for compilation where it tests it.
# Set here, before any engine, so the demos' and servers' subprocesses inherit it too.
os.environ.setdefault("LADDER_COMPILE_LEVEL", "0")

from hypothesis import HealthCheck, settings  # noqa: E402

from ladder.models import train_tiny_module  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
    derandomize=True,
    database=None,
)
settings.register_profile("thorough", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The suite runs in parallel (pytest-xdist, `-n auto` in pyproject.toml): one process per core, at most
# MAX_WORKERS. Each takes its share of the cores for torch, so two workers on two cores run one thread each
# instead of four fighting for two. (Most tests are tiny models, where a second thread buys nothing.)
MAX_WORKERS = 4  # each worker holds its own torch, transformers and checkpoints: about 1-3 GB


@pytest.hookimpl(optionalhook=True)  # xdist's hook: without xdist (a GPU machine's bare pytest), not an error
def pytest_xdist_auto_num_workers(config):
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers)))


# Memory. An engine reaches its KV pool (1 GiB on a CPU by default) through reference cycles, so an engine a test
# dropped lives on until Python's cycle collector runs, and large tensors barely prompt it: one worker of `-m docs`
# grew to 7.9 GB. After a test that left the worker 512 MB larger than the last collection did, collect: a read of
# /proc per test, and a collection (a tenth of a second) only then.
COLLECT_AFTER_GROWTH = 512 << 20
_rss_after_collect = 0


def resident_bytes() -> int:
    """This process's resident memory now (0 where /proc is missing: then nothing is collected)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def collect_now() -> int:
    """Collect, and count the next growth from here: what a test that measures the teardown's collection calls
    first (its own collection would otherwise leave the worker below the point growth is counted from, and
    the growth it makes might not reach the threshold). Returns the resident bytes after it."""
    global _rss_after_collect
    import gc

    gc.collect()
    _rss_after_collect = resident_bytes()
    return _rss_after_collect


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    global _rss_after_collect
    yield  # the test's fixtures are gone: what they held is garbage now
    now = resident_bytes()
    if now - _rss_after_collect > COLLECT_AFTER_GROWTH:
        import gc
        import sys

        # FastAPI (0.165) keeps the endpoints it inspected in module-level lru_caches of 4096, and an endpoint
        # closes over its app's engine: without this every server a worker built would stay reachable.
        fastapi_models = sys.modules.get("fastapi.dependencies.models")
        for cached in vars(fastapi_models).values() if fastapi_models else ():
            if hasattr(cached, "cache_clear"):
                cached.cache_clear()
        gc.collect()
        _rss_after_collect = resident_bytes()  # what is left is held on purpose (a module's server, say)
    else:
        _rss_after_collect = min(_rss_after_collect, now)  # growth counts from the lowest point since


@pytest.fixture
def collect_before_each_engine(monkeypatch):
    """A test that builds engines one after another (a doc's code blocks, the README's loop over the levels):
    the cycle collector runs before each one is built, so the ones dropped before it give back their pools
    first (the README's loop held five at once: 5.8 GB)."""
    import gc

    from level0_naive.core import EngineBase

    init = EngineBase.__init__

    def collecting_init(self, *args, **kwargs):
        gc.collect()
        init(self, *args, **kwargs)

    monkeypatch.setattr(EngineBase, "__init__", collecting_init)


def pytest_collection_modifyitems(config, items):
    """A student edition (labs/student_edition.py) leaves out the teacher's material: planted bugs and
    `plant`, teacher notes, the full walk-through guidance. Its tests still run there with the references
    restored; the ones marked `teacher`, which read that material, are skipped, with the reason."""
    from labs.student_edition import is_student_edition

    if is_student_edition():
        skip = pytest.mark.skip(reason="reads the teacher's material, which a student edition leaves out")
        for item in items:
            if item.get_closest_marker("teacher"):
                item.add_marker(skip)


def pytest_configure(config):
    """Build the compiled CPU kernels (about a second each, once per machine) before any test
    runs, so no timed test or server start-up in a subprocess pays for the build."""
    from features.cpu_kernels import attention as cpu_attention
    from features.cpu_kernels import ops as cpu_ops
    from features.lora import cpu_ops as lora_ops

    cpu_attention.available()
    cpu_ops.LIBRARY.available()
    lora_ops.available()


REPO = Path(__file__).resolve().parent.parent
VOCAB = 97  # deliberately not a power of two

ARCHS = {
    # name: (transformers config class name, model class name, config overrides)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 2}),
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "num_key_value_heads": 1,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"num_key_value_heads": 2, "sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"num_key_value_heads": 2}),
    # Mixtures of experts: 4 experts, 2 per token (features/moe/layer.py)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_key_value_heads": 2, "num_local_experts": 4,
                                                        "num_experts_per_tok": 2, "sliding_window": None}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {  # a shared expert; layer 1 kept dense
        "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 80, "decoder_sparse_step": 1, "mlp_only_layers": [1]}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}),
}  # fmt: skip


def build_checkpoint(path: Path, arch: str = "llama", seed: int = 0, tokenizer: bool = False, **overrides) -> Path:
    """Save a small random-weight `arch` model (float64) with `save_pretrained`.

    With `tokenizer=True` the vocabulary is the built-in models' byte-level one (256
    bytes + <bos>, <eos>, <pad>), saved beside the weights by `models/train_tiny.py`'s
    own code, so text prompts, chat and stop strings work.
    """
    import transformers

    cfg_name, model_name, arch_overrides = ARCHS[arch]
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, head_dim=16, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    kwargs.update(arch_overrides)
    if tokenizer:
        kwargs["vocab_size"] = 259
    kwargs.update(overrides)
    config = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float64)
    # Random init gives near-uniform logits; widen them so greedy choices are not near-ties
    # and a wrong cache entry changes the output (tests must be able to fail).
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0) if p.dim() > 1 else None
    model.generation_config.eos_token_id = kwargs["eos_token_id"]
    model.save_pretrained(path)
    if tokenizer:
        train_tiny_module().save_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """`checkpoint_factory(arch, seed=..., **overrides) -> Path`, built once per argument set."""
    cache: dict = {}

    def make(arch: str = "llama", seed: int = 0, tokenizer: bool = False, **overrides) -> Path:
        key = (arch, seed, tokenizer, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            cache[key] = build_checkpoint(tmp_path_factory.mktemp(arch), arch, seed, tokenizer, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_dir(checkpoint_factory) -> Path:
    return checkpoint_factory("llama")


class Oracle:
    """Hugging Face greedy decoding with no KV cache at all: every step recomputes the
    whole sequence, so no caching idea of ours (or of HF's) can be shared with the oracle.
    Memoised per (model, prompt); a longer request extends a shorter one's answer."""

    def __init__(self):
        self.models: dict = {}
        self.memo: dict = {}

    def model(self, path: Path):
        from transformers import AutoModelForCausalLM

        if path not in self.models:
            # The experts' "eager" loop: transformers' default grouped matmul has no float64 kernel.
            # Loaded outside inference mode whoever asks first (greedy runs in it): weights made there are
            # inference tensors, which a later caller's forward under autograd refuses (Mixtral's experts).
            with torch.inference_mode(False):
                self.models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                                         experts_implementation="eager").eval()  # fmt: skip
        return self.models[path]

    @torch.inference_mode()
    def greedy(self, path: Path, prompt: list[int], max_tokens: int) -> list[int]:
        key = (path, tuple(prompt))
        tokens = self.memo.get(key, [])
        m = self.model(path)
        while len(tokens) < max_tokens:
            logits = m(torch.tensor([prompt + tokens]), use_cache=False).logits[0, -1]
            tokens = tokens + [int(logits.argmax())]
        self.memo[key] = tokens
        return tokens[:max_tokens]


@pytest.fixture(scope="session")
def oracle() -> Oracle:
    return Oracle()


# --- level 6: the checkpoint, the offline LLM and the server the level-6 test files share ---
@pytest.fixture(scope="module")
def ckpt(checkpoint_factory) -> Path:
    """A small random llama with the built-in byte-level tokenizer: text prompts, chat and stop strings work."""
    return checkpoint_factory("llama", tokenizer=True)


@pytest.fixture(scope="module")
def llm(ckpt):
    """The offline `LLM` on `ckpt`, with the server's settings: what the server's answers must equal."""
    from level6_helpers import ENGINE

    from level6_serving import LLM

    return LLM(str(ckpt), **ENGINE)


@pytest.fixture(scope="module")
def server(ckpt):
    """A uvicorn serving `ckpt` as level6_helpers.NAME, a thread of this process (`url`, `engine`, `client`)."""
    from level6_helpers import ENGINE, serve

    with serve(ckpt, ENGINE) as s:
        yield s


@pytest.fixture(scope="session")
def long_ckpt(checkpoint_factory) -> Path:
    """`ckpt` with room for level6_helpers.LONG_CONTEXT (8,192) positions, for a server in a process of its
    own whose answer must still be running when the test acts (its client leaves, or a process is killed).
    On this checkpoint 400 tokens stream in about 0.3 s here, less than a busy CI machine can hold up the
    test's client, which then finds the answer ended whole; 8,000 take about 8 s (1 KB of cache a token)."""
    from level6_helpers import LONG_CONTEXT

    return checkpoint_factory("llama", tokenizer=True, max_position_embeddings=LONG_CONTEXT)


@pytest.fixture
def slow_steps(server, monkeypatch):
    """Every step of `server`'s engine takes 20 ms more, for one test: a request of 150 tokens then
    runs for 3 s at least, so a client that leaves after its first chunks surely leaves before the
    request ends, however fast the machine and however long this process is held up (a few hundred
    tokens at full speed take a quarter of a second, less than a busy CI machine can pause a client)."""
    engine = server.engine.engine
    step = engine.step

    def slow_step():
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
