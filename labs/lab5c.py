"""Lab 5c: pipeline parallelism's batch queue: micro-batches of disjoint requests in flight.

What it is: the lab's definition (see `labs/spec.py`): in `level5_multigpu/scheduler.py`,
`PipelineScheduler.schedulable` (the running requests a schedule may use: not those in flight);
in `level5_multigpu/engine.py`, `ParallelEngine._step` with pipeline_parallel_size > 1 (fill the pipeline with up to pp
micro-batches, then take the oldest one's logits back, sample, update) and
`ParallelEngine._skip_aborted` (a request aborted while its micro-batch was in flight gets no
token). The checks are the level's own tests (`tests/test_level5.py`: disjoint micro-batches and
a full pipeline, admission order, an abort in flight; `tests/test_equivalence.py`: PP=2 with and
without speculation against the oracle). Then, in `benchmarks/sim/clock.py`,
`SimulatedExecutor.through_the_stages`: the GPU what-if's clock for a pipeline, each stage a
clock of its own, so your batch queue, run on a modelled GPU, shows what it buys there
(`tests/test_simulator.py`). Four planted bugs; the experiment (`labs/lab5c_experiment.py`: one
process against PP=2 with your engine, tokens/s and how busy each stage was).

What it is not: the ranks, the messages or the stage models (read, not written: executor.py,
rank.py, model.py), or the handout (docs/labs/lab5c_pipeline.md).
"""

from __future__ import annotations

from .spec import Bug, Check, Experiment, Lab, Module, Part

L5 = "tests/test_level5.py::"
SIM = "tests/test_simulator.py::"
EQ = "tests/test_equivalence.py::test_level5_greedy_output_equals_the_oracle"

SCHEDULER_PARTS = (
    Part(
        "PipelineScheduler.schedulable",
        """\
The running requests this step's schedule may schedule or preempt, in admission order (self.running's
order): every running request except those whose micro-batch is in flight (their seq ids are in
self.in_flight, which send_off and take_back keep). Leave self.running itself as it is.""",
    ),
)

PARTS = (
    Part(
        "ParallelEngine._step",
        """\
One step with pp > 1. Level 2's _step (level2_continuous/engine.py) runs one batch from start to end; here,
first keep up to self.pp micro-batches in flight (each: scheduled, its input prepared, self.worker.submit,
self.scheduler.send_off(sched) so its requests sit out the next schedules, and remembered in self.in_flight
with its scheduling seconds), then take back the micro-batch the stages answer first (the oldest:
self.scheduler.take_back(sched); self.worker.collect() gives its logits) and finish it as level 2 does,
timers and _record included, dropping what was aborted meanwhile (self._skip_aborted) before the
scheduler's update. Nothing scheduled and nothing in flight: end as level 2's step ends.""",
        keep_until="return super()._step()",
    ),
    Part(
        "ParallelEngine._skip_aborted",
        """\
A request aborted while its micro-batch was in flight is already finished (r.is_finished) and its blocks
are free. Drop it everywhere: from out.requests, out.token_ids and out.logprobs (the same positions in all
three), and from sched.scheduled, so update_from_output never sees it.""",
    ),
)

SIM_PARTS = (
    Part(
        "SimulatedExecutor.through_the_stages",
        """\
The what-if's clock for self.pp > 1 stages (submit calls this; collect later moves the engine's clock to what
it returns). First the driver pays cost.overhead on its own clock (self.clock.advance). Then the step goes
through the stages in order: stage s starts when the step has reached it and when it has finished what it was
given before (self.stage_free[s]), runs per_stage seconds (the last stage also cost.lm_head), and is then busy
until that time; between two stages the activations take one send (cost.send seconds; cost.comm holds the
pp - 1 sends and TP's all-reduces). With
    per_stage = (cost.linear + cost.attention + cost.comm - (self.pp - 1) * cost.send) / self.pp
return when the last stage is done.""",
    ),
)

CHECKS = (
    Check("disjoint", "micro-batches hold disjoint requests, the pipeline fills, the answers are exact",
          (L5 + "test_micro_batches_are_disjoint_and_fill_the_pipeline",),
          "schedulable: [r for r in self.running if r.seq_id not in self.in_flight]. _step: send_off each "
          "micro-batch as it is submitted, `while len(self.in_flight) < self.pp:` before taking the oldest out "
          "(self.in_flight.popleft(), then take_back).",
          rule="A request in flight can be scheduled again only after its micro-batch comes back; while one "
               "micro-batch runs on the last stage, the next one runs on the first."),
    Check("order", "each micro-batch takes the idle requests in admission order; FCFS still preempts the latest",
          (L5 + "test_micro_batches_keep_admission_order_and_fill_from_the_front",),
          "Let level 2's scheduler choose: schedulable keeps self.running's order and leaves the list itself "
          "alone (no reordering, no requeueing).",
          rule="Each micro-batch is level 2's schedule over the requests not in flight: the same order, the "
               "same preemption victim."),
    Check("abort", "a request aborted while in flight frees its blocks at once and gets no token",
          (L5 + "test_an_abort_in_flight_frees_its_blocks_at_once_and_is_skipped",),
          "_skip_aborted: keep = [i for i, r in enumerate(out.requests) if not r.is_finished]; filter "
          "out.requests, out.token_ids, out.logprobs by keep, and sched.scheduled by `not r.is_finished`.",
          rule="An aborted request is finished the moment it is aborted: what its micro-batch computed for it "
               "afterwards is thrown away."),
    Check("oracle", "PP=2, with and without a draft model, gives the oracle's greedy tokens",
          (EQ + "[llama-pp2]", EQ + "[llama-pp2-spec]"),
          "If the other checks pass: each micro-batch's logits must be sampled for that micro-batch's "
          "SchedulerOutput (the oldest in flight), and post_step must run for it after update_from_output.",
          rule="Splitting the model into stages and the batch into micro-batches changes when a token is "
               "computed, never which token."),
    Check("stages", "on the simulator your batch queue makes the micro-batches it makes on ranks; its stages overlap",
          (SIM + "test_a_simulated_pipeline_makes_level5s_micro_batches",
           SIM + "test_pipeline_stages_overlap_their_micro_batches_as_gpipe_draws_them"),
          "through_the_stages: t = max(t, self.stage_free[s]) + per_stage (+ cost.lm_head on the last stage); "
          "self.stage_free[s] = t; t += send between stages. A stage waits for itself and for the step, "
          "not for the other stages.",
          rule="N micro-batches in flight through pp stages take N + pp - 1 stage times, not N x pp: a stage "
               "is busy only with its own share, and the next micro-batch starts there as soon as it is free."),
)  # fmt: skip

BUGS = (
    Bug("rescheduled", "level5_multigpu.scheduler",
        "        return [r for r in self.running if r.seq_id not in self.in_flight]\n",
        "        return list(self.running)\n", ("disjoint",)),
    Bug("fills-only-when-empty", "level5_multigpu.engine",
        "            while len(self.in_flight) < self.pp:  # fill the pipeline with disjoint micro-batches\n",
        "            while not self.in_flight:  # fill the pipeline with disjoint micro-batches\n", ("disjoint", "abort")),
    Bug("aborted-sampled", "level5_multigpu.engine",
        "        keep = [i for i, r in enumerate(out.requests) if not r.is_finished]\n",
        "        keep = list(range(len(out.requests)))\n", ("abort",)),
    Bug("stages-wait-for-all", "benchmarks.sim.clock",
        "            t = max(t, self.stage_free[s]) + per_stage + (cost.lm_head if s == self.pp - 1 else 0.0)\n",
        "            t = max(t, *self.stage_free) + per_stage + (cost.lm_head if s == self.pp - 1 else 0.0)\n",
        ("stages",)),
)  # fmt: skip

LAB = Lab(
    id="5c",
    topic="pipeline parallelism's batch queue: micro-batches of disjoint requests in flight",
    handout="lab5c_pipeline.md",
    modules=(Module("level5_multigpu.scheduler", SCHEDULER_PARTS), Module("level5_multigpu.engine", PARTS),
             Module("benchmarks.sim.clock", SIM_PARTS)),
    checks=CHECKS,
    bugs=BUGS,
    experiment=Experiment("labs.lab5c_experiment", (),
                          ("--model", "tiny-shakespeare", "--batch", "4", "--max-tokens", "4")),  # fmt: skip
    minutes=60,
)
