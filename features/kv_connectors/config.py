"""`kv_transfer_config`: what `LLM(..., kv_transfer_config=...)` and `--kv-transfer-config` take, checked.

What it is: `KVTransferConfig`, vLLM's names (`kv_connector`, `kv_role`, `kv_connector_extra_config`),
and `parse`, which turns a dict (or a JSON string, the server's flag) into one, with a
`ValueError` naming the field on a bad one:

    kv_transfer_config={"kv_connector": "OffloadingConnector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"cpu_bytes_to_use": 64 << 20,
                                                      "disk_path": "/tmp/kv", "disk_bytes_to_use": 1 << 30}}

    kv_connector               which connector: "OffloadingConnector" (a tiered prefix cache) or
                               "TCPConnector" (disaggregated prefill and decode, between engines)
    kv_role                    "kv_both" (saves and loads: OffloadingConnector's only role);
                               TCPConnector's: "kv_producer" (the prefill instance: it keeps a
                               finished prompt's blocks for a consumer to fetch) or "kv_consumer"
                               (the decode instance: it fetches them before it admits the request)
    kv_ip, kv_port             TCPConnector: where a producer serves its blocks (port 0: any free
                               port, reported in each response's kv_transfer_params)
    kv_buffer_size             TCPConnector: a producer's bound in bytes on the blocks it keeps for
                               consumers (the oldest go first)
    kv_connector_extra_config  the connector's own settings. TCPConnector's: timeout_s (a consumer's
                               bound on one fetch, default 10 s; past it, the prompt is computed)
                               and ttl_s (a producer's bound on how long it keeps a request's blocks
                               unfetched, default 60 s). OffloadingConnector's:
        cpu_bytes_to_use       the host tier's bound in bytes (vLLM's name; required)
        disk_path              a directory for a disk tier below the host tier (optional; the
                               engine writes its files in a folder of its own inside, removed
                               when the engine goes)
        disk_bytes_to_use      the disk tier's bound in bytes (required with disk_path), kept as a
                               number of blocks: each file adds about 1.5 KB of torch.save's framing

What it is not: vLLM's whole `KVTransferConfig` (no `kv_rank`, `kv_parallel_size` or
`engine_id`: a consumer finds its producer from each request's kv_transfer_params), or the
connectors (offloading.py, tcp.py).

Reference: vLLM `vllm/config/kv_transfer.py` (`KVTransferConfig`) and its OffloadingConnector
usage guide (`docs/features/kv_offloading_usage.md`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

CONNECTORS = ("OffloadingConnector", "TCPConnector")
ROLES = ("kv_both", "kv_producer", "kv_consumer")
EXTRA_KEYS = {"OffloadingConnector": ("cpu_bytes_to_use", "disk_path", "disk_bytes_to_use"),
              "TCPConnector": ("timeout_s", "ttl_s")}  # fmt: skip


@dataclass
class KVTransferConfig:
    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579  # vLLM's default
    kv_buffer_size: int = 1 << 30

    def __post_init__(self):
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config kv_connector={self.kv_connector!r} is not built; built: "
                             f"{', '.join(CONNECTORS)}")  # fmt: skip
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config kv_role={self.kv_role!r} must be one of {', '.join(ROLES)}")
        extra, keys = self.kv_connector_extra_config, EXTRA_KEYS[self.kv_connector]
        unknown = sorted(set(extra) - set(keys))
        if unknown:
            raise ValueError(f"kv_transfer_config kv_connector_extra_config has no key(s) {', '.join(unknown)}; "
                             f"{self.kv_connector} takes: {', '.join(keys)}")  # fmt: skip
        if self.kv_connector == "TCPConnector":
            self._check_tcp()
        else:
            self._check_offloading()

    def _check_tcp(self) -> None:
        if self.kv_role == "kv_both":
            raise ValueError("kv_transfer_config kv_role='kv_both': a TCPConnector is one side of disaggregated "
                             "prefill, kv_producer (prefill) or kv_consumer (decode)")  # fmt: skip
        if not isinstance(self.kv_port, int) or isinstance(self.kv_port, bool) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config kv_port={self.kv_port!r} must be a port number (0: any free one)")
        if not isinstance(self.kv_buffer_size, int) or self.kv_buffer_size < 1:
            raise ValueError(f"kv_transfer_config kv_buffer_size={self.kv_buffer_size!r} must be a whole number "
                             "of bytes >= 1")  # fmt: skip
        for key in ("timeout_s", "ttl_s"):
            value = self.kv_connector_extra_config.get(key)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"kv_transfer_config kv_connector_extra_config {key}={value!r} must be seconds > 0")

    def _check_offloading(self) -> None:
        if self.kv_role != "kv_both":
            raise ValueError(f"kv_transfer_config kv_role={self.kv_role!r}: an OffloadingConnector both saves and "
                             "loads (kv_both); the roles of disaggregated prefill are TCPConnector's")  # fmt: skip
        extra = self.kv_connector_extra_config
        for key in ("cpu_bytes_to_use", "disk_bytes_to_use"):
            value = extra.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"kv_transfer_config kv_connector_extra_config {key}={value!r} must be a whole "
                                 "number of bytes >= 1")  # fmt: skip
        if "cpu_bytes_to_use" not in extra:
            raise ValueError("kv_transfer_config kv_connector_extra_config needs cpu_bytes_to_use (the host "
                             "tier's bytes)")  # fmt: skip
        if ("disk_path" in extra) != ("disk_bytes_to_use" in extra):
            raise ValueError("kv_transfer_config kv_connector_extra_config: disk_path and disk_bytes_to_use go "
                             "together (a disk tier needs both)")  # fmt: skip


def parse(value) -> KVTransferConfig:
    """A dict, a JSON object as a string, or a KVTransferConfig -> one KVTransferConfig."""
    if isinstance(value, KVTransferConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_transfer_config is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"kv_transfer_config={value!r} must be a dict of vLLM's fields (kv_connector, ...)")
    known = {f.name for f in fields(KVTransferConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"kv_transfer_config has no field(s) {', '.join(unknown)}; it takes: {', '.join(sorted(known))}")
    if "kv_connector" not in value:
        raise ValueError("kv_transfer_config needs kv_connector (built: " + ", ".join(CONNECTORS) + ")")
    return KVTransferConfig(**value)


__all__ = ["KVTransferConfig", "parse", "CONNECTORS", "ROLES"]
