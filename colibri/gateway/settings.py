"""Gateway settings: one frozen dataclass, validated where it is built."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_WEB = REPO / "web" / "dist"
DEFAULT_EXPERTS_JSON = REPO / "data" / "experts.json"
MAX_SLOTS = 16  # KV_SLOTS range of the mux protocol (spec: 1-16)
MAX_REPLICAS = 16  # engine subprocesses, each holding the whole model


@dataclass(frozen=True)
class GatewaySettings:
    """How `colibri gateway` serves one model."""

    model_dir: Path
    model_id: str  # the name /v1/models lists and responses carry
    kv_slots: int = 4  # KV slots of each engine = requests it decodes at once
    max_waiting: int = 8  # requests queued for each engine's slots beyond those; more get 429
    replicas: int = 1  # engine subprocesses, each with its own kv_slots
    api_key: str | None = None  # required as `Authorization: Bearer <key>` when set
    max_body: int = 1 << 20  # request body cap in bytes (413 above)
    web_root: Path | None = DEFAULT_WEB  # static site; None = none
    experts_json: Path | None = DEFAULT_EXPERTS_JSON  # served as /experts.json if present
    bind_host: str = "127.0.0.1"  # on a loopback address only these Host names are served
    request_timeout: float = 30.0  # seconds a begun request has to arrive whole (408, closed)

    def __post_init__(self) -> None:
        if not 1 <= self.kv_slots <= MAX_SLOTS:
            raise ValueError(f"kv_slots={self.kv_slots}: expected 1..{MAX_SLOTS}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting={self.max_waiting}: expected >= 0")
        if not 1 <= self.replicas <= MAX_REPLICAS:
            raise ValueError(f"replicas={self.replicas}: expected 1..{MAX_REPLICAS}")
        if self.max_body < 1024:
            raise ValueError(f"max_body={self.max_body}: expected >= 1024 bytes")
        if not 0 < self.request_timeout <= 3600:
            raise ValueError(f"request_timeout={self.request_timeout}: expected 0 < s <= 3600")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty")


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def allowed_hosts(settings: GatewaySettings) -> frozenset[str] | None:
    """The Host names a loopback gateway answers (its address and the loopback names), so that
    no web page can reach it through a name it controls (DNS rebinding); None: any (a gateway
    bound elsewhere needs a key)."""
    if not is_loopback(settings.bind_host):
        return None
    return frozenset((*LOOPBACK_NAMES, settings.bind_host.strip("[]").lower()))


def is_loopback(host: str) -> bool:
    """Whether binding host keeps the server on this machine (names other than localhost: no)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
