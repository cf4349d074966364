"""The transport: the messages the driver sends its ranks, and how they and the tensors travel.

What it is: three typed messages, the whole vocabulary between the driver and a rank,

    Execute(model_input, mb)       run micro-batch `mb` (a ModelInput: plain CPU tensors, it pickles)
    CollectiveRPC(method, args)    call worker.method(*args) on every rank; each sends its answer to rank 0
    Shutdown()                     leave the rank loop

and how they move: `send_down` broadcasts a message to stage 0's TP group and sends it on
to stage 1 (each stage passes it to the next: `receive` on a rank). Objects go over a
point-to-point link as a length, then the pickled bytes; tensors as themselves. Every send
is an `isend`: gloo's `send` waits for the receiver, and a pipeline whose stages each wait
to hand over their result would deadlock. An `isend` returns its work *and* its buffer,
which must stay alive until the work is waited on.

Also here: the alpha-beta measurement of a point-to-point link (a round trip and its echo).

What it is not: the collectives of one stage (all-reduce, gather: `parallel_state.Comm`),
or who starts which process (`executor.py`).

Reference: vLLM `v1/executor/multiproc_executor.py` (its message queue of `collective_rpc`
calls), `distributed/device_communicators/shm_broadcast.py`.
"""

from __future__ import annotations

import pickle
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from level1_paged.model_input import ModelInput

from .parallel_state import Comm, fit_alpha_beta, sync


# --- the messages ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Execute:
    """Run one micro-batch: stage 0 embeds it, later stages receive the hidden states [T, d]."""

    model_input: ModelInput
    mb: int  # the micro-batch's number, in submission order (each rank's timeline records it)


@dataclass(frozen=True)
class CollectiveRPC:
    """Call `worker.method(*args)` on every rank; each rank other than 0 sends rank 0 its answer.
    A method that raises ends its rank (the driver then raises WorkerDiedError)."""

    method: str
    args: tuple = ()


@dataclass(frozen=True)
class Shutdown:
    """Leave the rank loop (after the sends still in progress are done)."""


Message = Execute | CollectiveRPC | Shutdown


# --- objects over point-to-point links: a length, then the pickled bytes ------------------------
def isend_object(comm: Comm, obj, dst: int) -> list:
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    comm.stats.add("send_object", data.numel(), 0.0)
    return [(dist.isend(size, dst=dst), size), (dist.isend(data, dst=dst), data)]  # keep the buffers alive


def recv_object(comm: Comm, src: int):
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(data, src=src)
    comm.stats.add("recv_object", data.numel(), 0.0)
    return pickle.loads(data.numpy().tobytes())


def isend_tensor(comm: Comm, x: torch.Tensor, dst: int) -> list:
    x = x.contiguous()
    t0 = time.perf_counter()
    work = dist.isend(x, dst=dst)
    comm.stats.add("send", x.numel() * x.element_size(), time.perf_counter() - t0)
    return [(work, x)]


# --- a message to every rank ----------------------------------------------------------------------
def send_down(comm: Comm, msg: Message) -> list:
    """From the driver: broadcast to stage 0, send on to stage 1 (which passes it on). Returns
    the sends still in progress (wait on them once the message has surely arrived)."""
    comm.broadcast_object(msg)
    topo = comm.topo
    return isend_object(comm, msg, topo.rank_of(1, 0)) if topo.pp > 1 else []


def receive(comm: Comm) -> Message:
    """On a rank other than 0: the next message (stage 0 from the broadcast, later stages from
    the same TP rank of the stage before)."""
    topo = comm.topo
    if topo.is_first_stage:
        return comm.broadcast_object(None)
    return recv_object(comm, topo.rank_of(topo.pp_rank - 1, topo.tp_rank))


# --- what a link costs ----------------------------------------------------------------------------
def p2p_alpha_beta(comm: Comm, peer: int, sizes=(1, 256, 4096, 65536), repeats: int = 20) -> dict:
    """Round trips of a float32 tensor to `peer` and back (it echoes): t(one way) = alpha + beta * bytes
    (a loop's mean per size, fitted on relative errors by `fit_alpha_beta`)."""
    xs, ts, dev = [], [], comm.device
    for n in sizes:
        x, y = torch.ones(n, device=dev), torch.empty(n, device=dev)
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(repeats):
            w = dist.isend(x, dst=peer)
            dist.recv(y, src=peer)
            w.wait()
        sync(dev)  # NCCL's wait() orders the stream, not the host
        xs.append(4.0 * n)
        ts.append((time.perf_counter() - t0) / repeats / 2)
    return fit_alpha_beta(sizes, xs, ts)


def echo(peer: int, sizes=(1, 256, 4096, 65536), repeats: int = 20, device: torch.device | str = "cpu") -> None:
    """The other end of `p2p_alpha_beta`: send every tensor straight back."""
    for n in sizes:
        y = torch.empty(n, device=device)
        for _ in range(repeats):
            dist.recv(y, src=peer)
            dist.isend(y, dst=peer).wait()


def free_port() -> int:
    """A TCP port nobody listens on now: the rendezvous of ranks spawned on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
