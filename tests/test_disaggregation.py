"""Disaggregated prefill and decode (features/kv_connectors/tcp.py, level6_serving/disagg.py): the
decode instance's tokens are the single engine's whatever arrives, a fault only costs a recompute
(counted), a request waiting for its KV holds nobody up, and the proxy gives clients one endpoint.

The producer (prefill) and the consumer (decode) are two engines of this process, trading blocks
over TCP on loopback exactly as two machines would.
"""

from __future__ import annotations

import logging
import random
import socket
import threading

import pytest
from conftest import VOCAB
from hypothesis import given
from hypothesis import strategies as st
from test_equivalence import kv_bytes, workloads

import level3_prefix
from features.kv_connectors.tcp import Outbox, Parcel
from level0_naive import SamplingParams
from level2_continuous.request import RequestStatus

pytestmark = pytest.mark.level3


def tcp(role: str, **extra) -> dict:
    return {"kv_connector": "TCPConnector", "kv_role": role, "kv_port": 0, "kv_connector_extra_config": extra}


def run(engine, prompts, params, arrivals=None) -> list[list[int]]:
    """Each request added at its arrival step (default 0), stepped to the end -> each one's tokens."""
    arrivals = arrivals or [0] * len(prompts)
    order, finals, step = sorted(range(len(prompts)), key=lambda i: arrivals[i]), {}, 0
    while order or engine.has_unfinished_requests():
        while order and arrivals[order[0]] <= step:
            i = order.pop(0)
            engine.add_request(str(i), prompts[i], params[i])
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, "a request finished twice"
                finals[out.request_id] = out.outputs[0].token_ids
        step += 1
    return [finals[str(i)] for i in range(len(prompts))]


def prefill(producer, prompts, ids) -> list[dict]:
    """The proxy's first half: each prompt computed by the producer (one token), its answer's params."""
    asked = [{"do_remote_decode": True, "transfer_id": t} for t in ids]
    run(producer, prompts, [SamplingParams(max_tokens=1, temperature=0, extra_args={"kv_transfer_params": a})
                            for a in asked])  # fmt: skip
    return [producer.connector.response_params(a, "") for a in asked]


def decode_params(n: int, kv: dict | None) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                          extra_args=None if kv is None else {"kv_transfer_params": kv})  # fmt: skip


def hang_up(wire: bytes) -> bytes:
    raise ConnectionAbortedError("the test's producer hangs up")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nobody listens there once this returns


# --- the tokens never change ----------------------------------------------------------------------


@given(workload=workloads(), data=st.data())
def test_disaggregated_greedy_output_equals_the_oracle(workload, data, checkpoint_factory, oracle):
    """Each request's KV computed by the producer and fetched, or its transfer missing (never
    prefilled), or its producer unreachable; with a consumer pool from the largest request alone up
    (preemption, also while others wait for their KV), a drawn token budget (chunked prefill),
    prefix hits in the consumer's own pool, arrivals at drawn steps."""
    path = checkpoint_factory("llama")
    bs = data.draw(st.sampled_from([1, 2, 4, 16]), label="block_size")
    need = max(len(p) + n for p, n in workload)
    blocks = -(-need // bs) * data.draw(st.sampled_from([1, 2, 4]), label="kv budget (x largest request)")
    producer = level3_prefix.LLMEngine(path, dtype="float64", block_size=bs, kv_cache_memory=kv_bytes(path, 4096),
                                       kv_transfer_config=tcp("kv_producer"))  # fmt: skip
    consumer = level3_prefix.LLMEngine(path, dtype="float64", block_size=bs, kv_cache_memory=kv_bytes(path, blocks * bs),
                                       max_num_seqs=data.draw(st.integers(1, 8), label="max_num_seqs"),
                                       max_num_batched_tokens=data.draw(st.sampled_from([1, 3, 8, 2048]), label="budget"),
                                       kv_transfer_config=tcp("kv_consumer", timeout_s=30))  # fmt: skip
    fates = data.draw(st.lists(st.sampled_from(["fetched", "fetched", "missing", "unreachable", "local"]),
                               min_size=len(workload), max_size=len(workload)), label="fates")  # fmt: skip
    prompts = [p for p, _ in workload]
    sent = [i for i, f in enumerate(fates) if f in ("fetched", "unreachable")]
    kv = dict(zip(sent, prefill(producer, [prompts[i] for i in sent], [f"t{i}" for i in sent])))
    port = closed_port()
    for i, fate in enumerate(fates):
        if fate == "missing":
            kv[i] = {**producer.connector.response_params({"do_remote_decode": True}, ""), "transfer_id": "never"}
        elif fate == "unreachable":
            kv[i] = {**kv[i], "remote_port": port}
    arrivals = data.draw(st.lists(st.integers(0, 6), min_size=len(workload), max_size=len(workload)), label="arrivals")
    got = run(consumer, prompts, [decode_params(n, kv.get(i)) for i, (_, n) in enumerate(workload)], arrivals)
    for (prompt, n), tokens in zip(workload, got):
        assert tokens == oracle.greedy(path, prompt, n)
    stats = consumer.kv_connector_stats()
    assert stats["transfers_received"] == fates.count("fetched"), (fates, stats)
    assert stats["transfers_missing"] == fates.count("missing") and stats["transfers_unreachable"] == fates.count(
        "unreachable")
    assert not consumer.connector.fetches and not consumer.connector.pending and not consumer.connector.fetched
    assert len(producer.connector.outbox) == fates.count("unreachable")  # the fetched ones are gone from it
    producer.connector.close()


# --- faults ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [[rng.randrange(VOCAB) for _ in range(11 + 5 * i)] for i in range(3)]


def test_each_fault_costs_a_recompute_and_is_counted(checkpoint_factory, prompts, caplog):
    """A damaged block (its CRC), a transfer cut off halfway, a producer that never answers (the consumer's timeout), one whose
    port is closed, a transfer nobody made, a prompt the producer computed for another request:
    each request's tokens are the plain engine's, each outcome counted once, the log says why."""
    path, bs = checkpoint_factory("llama"), 4
    plain = run(level3_prefix.LLMEngine(path, dtype="float64", block_size=bs), prompts,
                [decode_params(5, None)] * len(prompts))  # fmt: skip
    producer = level3_prefix.LLMEngine(path, dtype="float64", block_size=bs, kv_transfer_config=tcp("kv_producer"))
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel does), never answers
    cases = {"corrupt": None, "cut": None, "timeout": silent.getsockname()[1], "unreachable": closed_port(),
             "missing": None, "refused": None}  # fmt: skip
    for outcome, port in cases.items():
        consumer = level3_prefix.LLMEngine(path, dtype="float64", block_size=bs,
                                           kv_transfer_config=tcp("kv_consumer", timeout_s=0.5))  # fmt: skip
        kv = prefill(producer, prompts, [f"{outcome}{i}" for i in range(len(prompts))])
        if outcome == "corrupt":
            producer.connector.server.on_the_way = lambda w: w[:-1] + bytes([w[-1] ^ 1])  # one bit flipped
        if outcome == "cut":
            producer.connector.server.on_the_way = hang_up  # after the tokens, before the first block
        if port is not None:
            kv = [{**k, "remote_port": port} for k in kv]
        if outcome == "missing":
            kv = [{**k, "transfer_id": "nobody-made-this"} for k in kv]
        if outcome == "refused":  # each request fetches another's transfer: the tokens give it away
            kv = kv[1:] + kv[:1]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ladder.kv_transfer"):
            assert run(consumer, prompts, [decode_params(5, k) for k in kv]) == plain, outcome
        stats = consumer.kv_connector_stats()
        assert stats[f"transfers_{outcome}"] == len(prompts) and stats["tokens_loaded"] == 0, (outcome, stats)
        assert any("computed here" in r.getMessage() for r in caplog.records), outcome
        producer.connector.server.on_the_way = lambda w: w
    silent.close()
    producer.connector.close()


@pytest.mark.parametrize("change", ["block_size", "model"])
def test_instances_that_disagree_are_refused_at_the_hello_in_one_line_naming_both(change, checkpoint_factory,
                                                                                   prompts, caplog):  # fmt: skip
    path = checkpoint_factory("llama")
    other = checkpoint_factory("llama", seed=1) if change == "model" else path  # another folder, another name
    producer = level3_prefix.LLMEngine(other, dtype="float64", block_size=8 if change == "block_size" else 4,
                                       kv_transfer_config=tcp("kv_producer"))  # fmt: skip
    consumer = level3_prefix.LLMEngine(path, dtype="float64", block_size=4, kv_transfer_config=tcp("kv_consumer"))
    kv = prefill(producer, prompts[:1], ["x"])
    with caplog.at_level(logging.WARNING, logger="ladder.kv_transfer"):
        run(consumer, prompts[:1], [decode_params(3, kv[0])])
    assert consumer.kv_connector_stats()["transfers_refused"] == 1
    line = next(r.getMessage() for r in caplog.records if "KV layouts differ" in r.getMessage())
    mine, theirs = (4, 8) if change == "block_size" else (path.name, other.name)
    assert f"{change} {theirs!r} (producer" in line and f"against {mine!r} (this consumer)" in line, line
    assert "\n" not in line
    producer.connector.close()


def test_a_request_waiting_for_its_kv_holds_nobody_up(checkpoint_factory, prompts):
    """The producer's send is held until the test lets it go: meanwhile the consumer admits and
    finishes a local request, and the remote one waits (WAITING, not admitted); then it loads."""
    path = checkpoint_factory("llama")
    producer = level3_prefix.LLMEngine(path, dtype="float64", block_size=4, kv_transfer_config=tcp("kv_producer"))
    consumer = level3_prefix.LLMEngine(path, dtype="float64", block_size=4, kv_transfer_config=tcp("kv_consumer"))
    kv = prefill(producer, prompts[2:], ["held"])[0]
    go = threading.Event()
    producer.connector.server.on_the_way = lambda w: (go.wait(60), w)[1]  # (held, not changed)
    consumer.add_request("remote", prompts[2], decode_params(4, kv))
    consumer.add_request("local", prompts[0], decode_params(4, None))
    done = {}
    while "local" not in done:
        done.update((o.request_id, o.outputs[0].token_ids) for o in consumer.step() if o.finished)
        remote = consumer.requests["remote"][0]
        assert remote.status is RequestStatus.WAITING and remote.num_computed_tokens == 0
    go.set()
    while consumer.has_unfinished_requests():
        done.update((o.request_id, o.outputs[0].token_ids) for o in consumer.step() if o.finished)
    plain = level3_prefix.LLMEngine(path, dtype="float64", block_size=4)
    assert [done["remote"], done["local"]] == run(plain, [prompts[2], prompts[0]], [decode_params(4, None)] * 2)
    assert consumer.kv_connector_stats()["tokens_loaded"] == (len(prompts[2]) - 1) // 4 * 4
    producer.connector.close()


def test_a_closed_producer_leaves_nothing_running(checkpoint_factory):
    path = checkpoint_factory("llama")
    producer = level3_prefix.LLMEngine(path, dtype="float64", kv_transfer_config=tcp("kv_producer"))
    host, port = producer.connector.address
    serving = producer.connector.thread
    assert serving.is_alive()
    producer.connector.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, port), timeout=5).close()
    serving.join(5)
    assert not serving.is_alive()


@given(sizes=st.lists(st.integers(0, 50), min_size=1, max_size=30), bound=st.integers(1, 200))
def test_the_outbox_never_holds_more_than_its_bytes(sizes, bound):
    box = Outbox(bound, ttl_s=60)
    for i, n in enumerate(sizes):
        kept = box.put(str(i), Parcel([], [b"x" * n]))
        assert kept == (n <= bound)
        assert sum(p.nbytes for p in box.parcels.values()) <= bound
    assert box.dropped == len(sizes) - len(box)
