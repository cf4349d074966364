"""Lab 6d: beam search behind a server, a loop of one-token requests.

What it is: the lab's definition (see `labs/spec.py`): in `level6_serving/beam_search.py`,
`next_token_logprobs` (one engine request that answers the k most likely next tokens) and
`beam_search` (the search's loop: every live beam a request of its own each step, level 3's rule
choosing); the checks (tests/test_level6_beam_search.py: enough logprobs on a stand-in engine, the
server's search against offline `LLM.beam_search`, both endpoints, cancel and abort); three
planted bugs; the experiment (labs/lab6d_experiment.py: what the prefix cache does for a search,
by the server's /metrics, per beam width).

What it is not: the beam rule (`level3_prefix/beam_search.py`'s `Search.advance`, lab 3b's
subject, read, not written), the request fields (`protocol.py`) or the handout
(docs/labs/lab6d_beam_search.md).
"""

from __future__ import annotations

from .spec import Bug, Check, Experiment, Lab, Module, Part

T = "tests/test_level6_beam_search.py::"

PARTS = (
    Part(
        "next_token_logprobs",
        """\
One engine request for `tokens` that generates one token and reports the k most likely next tokens:
SamplingParams(max_tokens=1, temperature=0.0, logprobs=k, ignore_eos=True), sent with
`engine.generate(tokens, params, request_id)` (an async generator of RequestOutputs: read it to its end, as
leaving it early aborts the request). The answer is the first logprobs entry of its outputs' completions
({token id: Logprob}): return {token id: its .logprob}. No logprobs entry at all means the request was aborted
before it answered: raise SearchAborted.""",
    ),
    Part(
        "beam_search",
        """\
The EOS tokens are engine.inputs.eos_token_ids (none with params.ignore_eos). Make a level-3 Search(prompt,
params, max_tokens, eos, new_id): max_tokens no more than engine.max_model_len - len(prompt) allows, new_id
a counter. Each step, for every live beam (search.live) at once: next_token_logprobs of prompt + the beam's
output_token_ids, each request with an id of its own (f"{request_id}-{step}-{j}"), all through
gather_or_cancel (cancelling the search must abort them). k is as many per beam as Search.advance looks at
in all (read it). Put the answers in a float64 [live beams, engine.inputs.vocab_size] tensor of -inf and call
search.advance(logprobs, SharedByHash()); stop when search.done. Each finished hypothesis's text is
`await engine.decode(its output_token_ids)`; return BeamSearchOutput(search.finished).""",
    ),
)

CHECKS = (
    Check("enough", "each beam's best k next tokens choose what whole rows choose",
          (T + "test_each_beams_best_k_are_enough_to_choose_as_with_whole_rows",),
          "k = min(max(2, 1 + len(eos)) * params.beam_width, vocab): Search.advance takes the best 2W (beam, "
          "token) pairs, and when a beam's best W hold an EOS its (W+1)-th can be a live child.",
          rule="Told only each beam's k best next tokens, the search must choose exactly what it would choose "
               "seeing every token's log-probability."),
    Check("offline", "the server's search finds offline LLM.beam_search's hypotheses, token for token",
          (T + "test_the_servers_search_finds_the_offline_hypotheses",
           T + "test_with_an_eos_the_beams_like_hypotheses_finish_early_as_offline"),
          "Each beam's request is the prompt followed by that beam's output_token_ids; the EOS set comes from "
          "engine.inputs.eos_token_ids unless params.ignore_eos; max_tokens capped by max_model_len.",
          rule="Asking the engine one token at a time, beam by beam, must find the hypotheses the offline "
               "fork finds, EOS and length penalty included."),
    Check("endpoints", "/v1/completions and /v1/chat/completions answer with the search's hypotheses",
          (T + "test_completions_with_use_beam_search", T + "test_chat_with_use_beam_search"),
          "If offline passes, look at the texts: each finished hypothesis's text is the decoded output tokens.",
          rule="The endpoints' choices are the hypotheses, best first, with their texts and finish reasons."),
    Check("cancel", "an aborted step is an error, and a cancelled search leaves no request behind",
          (T + "test_a_step_aborted_from_outside_ends_the_search_with_an_error",
           T + "test_a_cancelled_search_leaves_no_request_behind"),
          "next_token_logprobs: an answer with no logprobs entry raises SearchAborted. beam_search: send a "
          "step's requests through gather_or_cancel, which aborts the others when one fails or is cancelled.",
          rule="A search cannot choose from an answer that never came, and a search nobody waits for must "
               "not leave work in the engine."),
)  # fmt: skip

BUGS = (
    Bug("k-is-width", "level6_serving.beam_search",
        "    k = min(max(2, 1 + len(eos)) * params.beam_width, vocab)  # as many as Search.advance looks at\n",
        "    k = min(params.beam_width, vocab)\n", ("enough",)),
    Bug("eos-forgotten", "level6_serving.beam_search",
        "    eos = set() if params.ignore_eos else set(engine.inputs.eos_token_ids)\n",
        "    eos = set()\n", ("enough", "offline")),
    Bug("abort-unseen", "level6_serving.beam_search",
        "    if not entries:\n"
        '        raise SearchAborted(f"beam search step {request_id} was aborted before it answered")\n',
        "", ("cancel",)),
)  # fmt: skip

LAB = Lab(
    id="6d",
    topic="beam search behind a server: one-token requests and the prefix cache",
    handout="lab6d_beam_search.md",
    modules=(Module("level6_serving.beam_search", PARTS),),
    checks=CHECKS,
    bugs=BUGS,
    experiment=Experiment("labs.lab6d_experiment", (), ("--widths", "2", "--max-tokens", "4")),
    minutes=45,
)
