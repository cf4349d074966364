"""Level 5 on GPUs, checked without one: a GPU per rank, timings that wait for the device, launches on the
tensors' GPU.

What it is
  - more ranks than visible GPUs is a one-line ValueError naming both numbers, raised before any rank
    starts, unless `oversubscribe_gpus=True` asks for several ranks on one GPU;
  - `Comm`'s counters and the alpha-beta calibration synchronise the device around each timed call
    (an NCCL call returns once queued) and calibrate with the device's tensors (under
    `cpu:gloo,cuda:nccl` a CPU tensor would time gloo, not NCCL);
  - the Triton kernels launch inside the tensors' GPU (`torch.cuda.device(t.device)`): with
    `device="cuda:1"` the current device is still GPU 0.
  CUDA is stood in for by tests/virtual_gpu.py (tensors labelled with their device) and by recording
  what `torch.cuda` and `torch.distributed` are asked.

What it is not: a multi-GPU run (benchmarks/sim/gpu_check.sh, on a lent GPU machine, is one GPU).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from virtual_gpu import REAL_CUDA, on_cuda, virtual_gpu

import level5_multigpu
from level5_multigpu.parallel_state import Comm, Topology, alpha_beta

pytestmark = pytest.mark.level5


def test_more_ranks_than_gpus_is_one_line_naming_both(llama_dir, monkeypatch):
    with virtual_gpu(monkeypatch):  # one GPU
        with pytest.raises(ValueError, match=r"^2 ranks .* need 2 GPUs, but 1 are visible") as err:
            level5_multigpu.LLM(str(llama_dir), device="cuda", tensor_parallel_size=2)
    assert "\n" not in str(err.value)
    from level5_multigpu.parallel_state import check_gpus

    with virtual_gpu(monkeypatch):
        check_gpus(torch.device("cuda"), 2, oversubscribe=True)  # asked for: allowed
        check_gpus(torch.device("cuda"), 4, oversubscribe=False, executor="ray")  # Ray places them on the cluster
        check_gpus(torch.device("cpu"), 8, oversubscribe=False)  # CPU ranks need no GPU
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # torchrun, two machines of one rank each
        check_gpus(torch.device("cuda"), 2, oversubscribe=False)


def test_oversubscribed_gpus_take_gloo(llama_dir):
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): `auto` is gloo when oversubscribing."""
    from level0_naive.config import EngineConfig
    from level5_multigpu.engine import ParallelEngine
    from level5_multigpu.rank import ParallelSpec

    def backend(**kw):
        config = EngineConfig(str(llama_dir), ParallelEngine.config_parts, tensor_parallel_size=2, **kw)
        return ParallelSpec.from_config(config, model=str(llama_dir), dtype=torch.float32, device_type="cuda").backend

    assert backend() == "nccl" and backend(oversubscribe_gpus=True) == "gloo"


def recorded_syncs(monkeypatch, events: list) -> None:
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", str(device))))


def test_comm_times_a_gpu_call_on_the_devices_clock_without_waiting(monkeypatch):
    """An NCCL call returns once queued: `Comm` records CUDA events around it (on the device's clock) and
    reads them when the counters are read, so the forward never waits for the GPU to time a message."""
    log = []

    class Event:  # stands in for torch.cuda.Event: says when it was recorded, and what it measured
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = len(log)
            log.append("record")

        def synchronize(self):
            log.append("wait")

        def elapsed_time(self, end):
            return 2.0 * (end.at - self.at)  # milliseconds

    recorded_syncs(monkeypatch, log)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    comm = Comm(Topology(1, 1, 0))
    comm.device = torch.device("cuda", 0)
    comm._timed("all_reduce", 4, lambda: log.append("call"))
    assert log == ["record", "call", "record"]  # no wait on the way
    assert comm.stats.by_kind == {}  # not read yet
    assert comm.stats.settle().by_kind["all_reduce"] == [1, 4, 0.004]  # 2 ms a step of the log, in seconds
    assert log[-1] == "wait" and not comm.stats.pending
    log.clear()
    Comm(Topology(1, 1, 0))._timed("all_reduce", 4, lambda: log.append("call"))
    assert log == ["call"]  # a CPU rank: the host's clock


def test_calibration_sends_the_devices_tensors_and_waits_for_them(monkeypatch):
    events, devices = [], set()
    monkeypatch.setattr(dist, "new_group", lambda ranks: None)  # tp 2, its calls stood in for: no process group
    comm = Comm(Topology(2, 1, 0))
    comm.device = torch.device("cuda", 0)

    def all_reduce(x, group=None):
        devices.add(str(x.device))
        events.append(("call", None))

    def all_gather(outs, x, group=None):  # the timings' exchange (CPU, gloo): every rank as fast as this one
        for o in outs:
            o.copy_(x)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    with virtual_gpu(monkeypatch):
        recorded_syncs(monkeypatch, events)
        fit = alpha_beta(comm, sizes=(1, 256), repeats=2, kind="all_reduce")
    assert devices == {"cuda:0"}, "the calibration must time the device's collective (NCCL), not gloo's"
    timed = events[-3:]  # the last call, as timed
    assert timed == [("sync", "cuda:0"), ("call", None), ("sync", "cuda:0")]
    assert fit["alpha_s"] >= 0 and fit["beta_s_per_byte"] >= 0


@pytest.mark.skipif(REAL_CUDA, reason="compiled Triton (a real GPU here) cannot launch on the virtual GPU's CPU memory")
def test_triton_launches_on_the_tensors_gpu(monkeypatch):
    pytest.importorskip("triton")
    from level1_paged.triton_attention import paged_attention_triton, write_kv_cache_triton

    entered = []

    @contextlib.contextmanager
    def device(d):
        entered.append(str(d))
        yield

    with virtual_gpu(monkeypatch) as mode:
        monkeypatch.setattr(torch.cuda, "device", device)
        k_cache, v_cache = (on_cuda(mode, torch.zeros(2, 4, 1, 16)).to("cuda:1") for _ in range(2))  # [N, bs, Hkv, D]
        q = torch.randn(1, 2, 16).to("cuda:1")  # [T, Hq, D]: one decode
        k = v = torch.randn(1, 1, 16).to("cuda:1")  # [T, Hkv, D]
        slots = torch.tensor([0], device="cuda:1")
        write_kv_cache_triton(k, v, k_cache, v_cache, slots)
        ints = dict(dtype=torch.int32, device="cuda:1")
        out = paged_attention_triton(q, k_cache, v_cache, torch.tensor([0, 1], **ints), torch.tensor([1], **ints),
                                     torch.tensor([[0]], **ints), 0.25)  # fmt: skip
    assert entered == ["cuda:1", "cuda:1"], "each kernel must launch inside its tensors' GPU"
    torch.testing.assert_close(out[0], v[0].expand(2, 16))  # one key: attention returns its value
