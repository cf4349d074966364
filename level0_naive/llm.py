"""`LLM`: vLLM's offline entry point. It validates, generates and chats; an engine does the work.

What it is: the front end every level shares. `LLM(model, **engine_kwargs)` builds
`self.llm_engine` (an `engine_class`: here the static-batching `NaiveEngine`) and offers:

    generate(prompts, sampling_params)   prompts: strings or token-id lists; outputs in order
    chat(messages, sampling_params)      renders with the checkpoint's chat template
    get_metrics()                        vLLM's offline metrics (counters, histograms)

A level changes the engine, never this file: `class LLM(level0_naive.LLM): engine_class
= ...` is all it writes (level 1: its paged engine; level 2 on: the continuous `LLMEngine`).

What it is not: an engine (no batching, no cache); `generate` returns once every output is done.

Reference: vLLM `vllm/entrypoints/llm.py`.
"""

from __future__ import annotations

from ladder.metrics import Metric
from ladder.progress import GenerateProgress

from .engine import NaiveEngine
from .inputs import Prompt
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .stats import EngineStats, Timer


class LLM:
    """The offline engine: load once, call `generate` or `chat` many times."""

    engine_class = NaiveEngine

    def __init__(self, model: str, **kwargs):
        self.llm_engine = self.engine_class(model, **kwargs)

    @property
    def stats(self) -> EngineStats:
        return self.llm_engine.stats

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, progress: bool = True, use_tqdm: bool | None = None, lora_request=None) -> list[RequestOutput]:  # fmt: skip
        """Generate for every prompt (a string or a list of token ids); outputs in prompt order.
        `use_tqdm` is vLLM's name for `progress` (the bar here is rich's), accepted as-is.
        `lora_request`: a LoRARequest for every prompt, or a list of one per prompt (None: the base
        model), at the levels built with `enable_lora=True` (2-5)."""
        progress = progress if use_tqdm is None else use_tqdm
        engine = self.llm_engine
        groups = engine.inputs.make_requests(prompts, sampling_params, lora_request)  # validates everything first
        seqs = [s for g in groups for s in g]
        with Timer() as t, GenerateProgress(len(seqs), enabled=progress) as bar:
            engine.run(seqs, bar)
        engine.stats.busy_time += t.seconds
        return [engine.outputs.final(g) for g in groups]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        *,
        progress: bool = False,
        lora_request=None,
    ) -> list[RequestOutput]:
        """Render conversation(s) with the checkpoint's chat template, then generate (`lora_request`: as generate's)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.apply_chat_template(c) for c in conversations], sampling_params, progress=progress,
                             lora_request=lora_request)  # fmt: skip

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.llm_engine.inputs.apply_chat_template(messages)

    def get_metrics(self) -> list[Metric]:
        return self.llm_engine.get_metrics()
