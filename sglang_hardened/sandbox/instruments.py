"""The test instrumentation a cluster can start with, in one folder: the page ledger
(``sgl_ledger``), the injected transfer faults (``sgl_faults``) and the slowed write
call, each switched on or off by a file there while the servers run.

The soak and the fault matrix drive faults through these files; a cluster without
them serves as operators run it (``sandbox up`` without ``--instrument``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .env import overlay_module
from .ledger import ledger_env, writer

FAULT_FILE_ENV = overlay_module("sgl_faults").FILE_ENV
SLOW_S = 6.0  # a slowed write call waits this long before it writes: a fault can land while it is in flight


@dataclass(frozen=True)
class Instruments:
    """The files of one cluster's instrumentation, under ``folder``."""

    folder: Path
    slow_s: float = SLOW_S

    @property
    def ledger_dir(self) -> Path:
        return self.folder / "ledger"

    @property
    def fault_file(self) -> Path:
        """Holds the name of the injected fault that hits transfers now (empty: none)."""
        return self.folder / "fault"

    @property
    def slow_switch(self) -> Path:
        """While it exists, each large write call is slowed by ``slow_s``."""
        return self.folder / "slow"

    def prepare(self) -> Instruments:
        """Create the folder with the ledger on, no fault and no slowing; return self."""
        self.ledger_dir.mkdir(parents=True, exist_ok=True)
        self.fault_file.write_text("")
        self.slow_switch.unlink(missing_ok=True)
        return self

    def env(self) -> tuple[str, ...]:
        """The servers' NAME=VALUE entries that point the overlay at these files."""
        return (*ledger_env(self.ledger_dir, self.slow_s), f"{writer.SLOW_SWITCH_ENV}={self.slow_switch}",
                f"{FAULT_FILE_ENV}={self.fault_file}")
