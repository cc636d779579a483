"""Where `gpulens up` keeps its files and which ports it uses, decided once from its options."""

from __future__ import annotations

import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Layout", "Ports"]


@dataclass(frozen=True)
class Ports:
    """Every port is `base + offset`, so one `--port-base` moves the whole tree (tests use this)."""

    base: int = 9450

    @property
    def exporter(self) -> int:
        return self.base

    @property
    def agent(self) -> int:
        return self.base + 1

    @property
    def gateway(self) -> int:
        return self.base + 3

    @property
    def ui(self) -> int:
        return self.base + 5

    @property
    def prometheus(self) -> int:
        return self.base + 10

    @property
    def alertmanager(self) -> int:
        return self.base + 11

    def coordinator(self, index: int) -> int:
        if not 0 <= index < 20:
            raise ValueError("gpulens up runs at most 20 coordinators (one per job attempt)")
        return self.base + 20 + index


@dataclass(frozen=True)
class Layout:
    workdir: Path

    @classmethod
    def create(cls, workdir: Path) -> "Layout":
        layout = cls(workdir.resolve())
        for d in (layout.registry, layout.traces, layout.socket_dir, layout.logs, layout.secrets, layout.state,
                  layout.archive_dir, layout.stub_state):
            d.mkdir(parents=True, exist_ok=True)
        # Kineto (in the trainer, possibly another uid) must create files in the trace and socket dirs.
        for d in (layout.traces, layout.socket_dir, layout.registry):
            os.chmod(d, 0o1777)
        os.chmod(layout.secrets, 0o700)
        for name in ("agent", "coordinator", "gateway"):
            path = layout.token_file(name)
            if not path.exists():
                path.write_text(secrets.token_urlsafe(32))
                os.chmod(path, 0o600)
        return layout

    @property
    def registry(self) -> Path:
        return self.workdir / "registry"

    @property
    def traces(self) -> Path:
        return self.workdir / "traces"

    @property
    def socket_dir(self) -> Path:
        """Kineto's IPC socket folder. It must be short: `<dir>/dynoconfigclient<uuid>` has to fit
        the 108-byte sun_path, so it lives in /tmp under a name derived from the workdir."""
        digest = hashlib.sha256(str(self.workdir).encode()).hexdigest()[:10]
        return Path("/tmp") / f"gpulens-{digest}"

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"

    @property
    def secrets(self) -> Path:
        return self.workdir / "secrets"

    @property
    def state(self) -> Path:
        return self.workdir / "state"

    @property
    def archive_dir(self) -> Path:
        return self.workdir / "archive"

    @property
    def archive_root(self) -> str:
        return f"file://{self.archive_dir}"

    @property
    def stub_state(self) -> Path:
        return self.workdir / "stub-state"

    @property
    def annotations_file(self) -> Path:
        return self.state / "annotations.json"

    @property
    def routes_file(self) -> Path:
        return self.state / "gateway-routes.json"

    @property
    def coordinator_targets_file(self) -> Path:
        """The coordinators Prometheus scrapes (file_sd), rewritten as they start and stop."""
        return self.state / "prometheus-coordinators.json"

    @property
    def incident_file(self) -> Path:
        return self.state / "incident"

    def token_file(self, name: str) -> Path:
        return self.secrets / f"{name}.token"
