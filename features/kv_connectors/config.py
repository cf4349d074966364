"""`kv_transfer_config`: what `LLM(..., kv_transfer_config=...)` and `--kv-transfer-config` take, checked.

What it is: `KVTransferConfig`, vLLM's names (`kv_connector`, `kv_role`, `kv_connector_extra_config`),
and `parse`, which turns a dict (or a JSON string, the server's flag) into one, with a
`ValueError` naming the field on a bad one:

    kv_transfer_config={"kv_connector": "OffloadingConnector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"cpu_bytes_to_use": 64 << 20,
                                                      "disk_path": "/tmp/kv", "disk_bytes_to_use": 1 << 30}}

    kv_connector               which connector: "OffloadingConnector" (the only one built so far)
    kv_role                    "kv_both" (saves and loads: an offloading cache); "kv_producer" and
                               "kv_consumer" name the two sides of disaggregated prefill (not built)
    kv_connector_extra_config  the connector's own settings. OffloadingConnector's:
        cpu_bytes_to_use       the host tier's bound in bytes (vLLM's name; required)
        disk_path              a directory for a disk tier below the host tier (optional; the
                               engine writes its files in a folder of its own inside, removed
                               when the engine goes)
        disk_bytes_to_use      the disk tier's bound in bytes (required with disk_path), kept as a
                               number of blocks: each file adds about 1.5 KB of torch.save's framing

What it is not: vLLM's whole `KVTransferConfig` (no `kv_ip`, `kv_port`, `kv_rank`: nothing here
goes over a network yet), or the connector (offloading.py).

Reference: vLLM `vllm/config/kv_transfer.py` (`KVTransferConfig`) and its OffloadingConnector
usage guide (`docs/features/kv_offloading_usage.md`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

CONNECTORS = ("OffloadingConnector",)
ROLES = ("kv_both", "kv_producer", "kv_consumer")
OFFLOADING_KEYS = ("cpu_bytes_to_use", "disk_path", "disk_bytes_to_use")


@dataclass
class KVTransferConfig:
    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config kv_connector={self.kv_connector!r} is not built; built: "
                             f"{', '.join(CONNECTORS)}")  # fmt: skip
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config kv_role={self.kv_role!r} must be one of {', '.join(ROLES)}")
        if self.kv_role != "kv_both":
            raise ValueError(f"kv_transfer_config kv_role={self.kv_role!r}: an OffloadingConnector both saves and "
                             "loads (kv_both); disaggregated prefill's roles are not built yet")  # fmt: skip
        extra = self.kv_connector_extra_config
        unknown = sorted(set(extra) - set(OFFLOADING_KEYS))
        if unknown:
            raise ValueError(f"kv_transfer_config kv_connector_extra_config has no key(s) {', '.join(unknown)}; "
                             f"OffloadingConnector takes: {', '.join(OFFLOADING_KEYS)}")  # fmt: skip
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
