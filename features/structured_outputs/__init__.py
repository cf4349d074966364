"""Room: structured outputs. A grammar decides which tokens may come next, and the sampler obeys it.

What it is: vLLM's `SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))`
(or `regex`, `choice`, `grammar`, `json_object`): before each token, every token that would
leave the grammar is masked out, so even the built-in Shakespeare model writes JSON that
parses. Its parts, and the seam each plugs into:

    params.py    `StructuredOutputsParams`: what a request asks for (SamplingParams' field;
                 every level exports the class)
    manager.py   `StructuredOutputManager`: compiles a spec once, gives each sample a grammar:
                 level 0's request preparer (InputProcessor), the sample's constraint
                 (Sequence.constraint: accepted tokens, and "complete" for the stop rules)
    grammar.py   `Grammar`: one sample's state, and its three engines (xgrammar, llguidance,
                 a plain-Python reference)
    mask.py      `GrammarMask`: a logits processor in level 0's sampler chain

The levels reach it only through `ladder/rooms.py`. Level 4's drafts ask for masks past the
accepted tokens (`Grammar.mask_after`) through the same constraint; level 6 turns OpenAI's
`response_format`, vLLM's `guided_*` fields and a forced `tool_choice` into the params.

What it is not: a grammar engine (xgrammar and llguidance are), structural tags or tool parsers.

Reference: vLLM `v1/structured_output/`; docs/structured_outputs.md explains the mask and its cost.
"""

from .grammar import BitmaskGrammar, Grammar, LLGuidance, ReferenceGrammar, XGrammar
from .manager import BACKENDS, StructuredOutputManager
from .mask import GrammarMask
from .params import KINDS, StructuredOutputsParams

__all__ = ["StructuredOutputsParams", "StructuredOutputManager", "GrammarMask", "Grammar", "BitmaskGrammar",
           "XGrammar", "LLGuidance", "ReferenceGrammar", "KINDS", "BACKENDS"]  # fmt: skip
