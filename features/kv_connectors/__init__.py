"""Room: KV connectors. KV cache that lives outside an engine's device pool, moved in and out of it.

What it is: what `kv_transfer_config=` asks for (vLLM's names), in small files:

    config.py      `KVTransferConfig`: kv_connector, kv_role, kv_connector_extra_config, checked
    base.py        `KVConnectorBase`: vLLM V1's seam, the scheduler's side and the worker's
    tiers.py       the host tier and the disk tier: bounded, LRU, entries checked by name and content
    offloading.py  `OffloadingConnector`: the device pool's victims saved to the tiers, and a prefix
                   that misses the pool but hits a tier loaded back instead of computed
    tcp.py         `TCPConnector`: disaggregated prefill and decode, a finished prompt's blocks kept by
                   the prefill instance (kv_producer) and fetched by the decode instance (kv_consumer)
    wire.py        the transfer's format on the socket: a hello, the blocks' tokens, a CRC per block
    demo.py        `python -m features.kv_connectors.demo`: a chat that outgrows the pool, with and
                   without a host tier (lab 3c's experiment)

The seams: level 3's block pool tells the connector which named block it is about to reuse, its
KV cache manager asks it at admission how much of a prefix it holds and tells it which blocks
receive it, its engine hands the step's moves to the worker, and level 1's worker makes them
before the forward; its scheduler leaves a request whose KV is still arriving out of the
admissible ones. A level never imports this room (ladder/rooms.py). The proxy in front of a
prefill and a decode instance is level 6's (level6_serving/disagg.py). The lesson is
docs/kv_connectors.md.

What it is not (yet): level 4 with a draft model and level 5 over ranks (both refuse a
kv_transfer_config in one line), or a transfer straight between GPUs (RDMA, NCCL).

Reference: vLLM `vllm/distributed/kv_transfer/kv_connector/v1/` and `vllm/v1/kv_offload/`.
"""

from .base import KVConnectorBase
from .config import KVTransferConfig, parse
from .offloading import OffloadingConnector
from .tcp import TCPConnector


def make_connector(value, block_size: int, hash_fn, model: str = "") -> KVConnectorBase:
    """`kv_transfer_config=` (a dict, JSON or KVTransferConfig) -> the connector it names; `model`
    is the engine's model's name (two engines that trade KV must agree on it)."""
    config = parse(value)
    if config.kv_connector == "TCPConnector":
        return TCPConnector(config, block_size, hash_fn, model)
    return OffloadingConnector(config, block_size, hash_fn)


__all__ = ["KVConnectorBase", "KVTransferConfig", "OffloadingConnector", "TCPConnector", "make_connector", "parse"]
