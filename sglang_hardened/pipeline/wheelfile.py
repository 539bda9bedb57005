"""Wheel surgery: unpack a wheel, let the caller change files, repack it reproducibly.

Like auditwheel's InWheel: this module knows the wheel format (RECORD,
signatures, entry order, timestamps) and nothing about what is changed.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import stat
import tempfile
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..common.hashing import record_digest

SIGNATURES = ("RECORD.jws", "RECORD.p7s")
ZIP_EPOCH_MIN = 315532800  # 1980-01-01: the earliest time a zip entry can hold


class WheelTree:
    """An unpacked wheel: files under `root`, one `*.dist-info` directory."""

    def __init__(self, root: Path):
        self.root = root

    @property
    def dist_info(self) -> Path:
        found = [p for p in self.root.iterdir() if p.name.endswith(".dist-info") and p.is_dir()]
        if len(found) != 1:
            raise ValueError(f"wheel has {len(found)} .dist-info directories, expected one")
        return found[0]

    def rename_dist_info(self, name: str) -> Path:
        """Move the dist-info directory (its name carries the version)."""
        target = self.root / name
        self.dist_info.rename(target)
        return target

    def _files(self) -> list[str]:
        """Archive names in the spec's recommended order: dist-info last, RECORD at the end."""
        dist = self.dist_info.name
        names = sorted(
            p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file()
        )
        record = f"{dist}/RECORD"
        payload = [n for n in names if not n.startswith(dist + "/")]
        meta = [n for n in names if n.startswith(dist + "/") and n != record]
        return payload + meta + [record]

    def write_record(self) -> None:
        """Drop signatures (they no longer match) and rewrite RECORD over every file."""
        for sig in SIGNATURES:
            (self.dist_info / sig).unlink(missing_ok=True)
        record = self.dist_info / "RECORD"
        record.write_text("")
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")  # paths may hold commas: CSV quoting
        for name in self._files():
            if name == f"{self.dist_info.name}/RECORD":
                writer.writerow((name, "", ""))
                continue
            data = (self.root / name).read_bytes()
            writer.writerow((name, record_digest(data), len(data)))
        record.write_text(buffer.getvalue())

    def pack(self, dest: Path, epoch: int) -> None:
        """Write the wheel: sorted entries, one timestamp, fixed permissions.

        Same tree + same epoch => byte-identical file. Executable bits are kept
        (compiled extensions are 0755 in upstream's wheels), nothing else is.
        """
        self.write_record()
        stamp = time.gmtime(max(epoch, ZIP_EPOCH_MIN))[:6]
        with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            for name in self._files():
                path = self.root / name
                mode = 0o755 if path.stat().st_mode & stat.S_IXUSR else 0o644
                info = zipfile.ZipInfo(name, date_time=stamp)
                info.external_attr = (stat.S_IFREG | mode) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                info.create_system = 3  # unix, so the mode bits above are honoured
                with path.open("rb") as src, zf.open(info, "w") as out:
                    shutil.copyfileobj(src, out, 1 << 20)


def _extract(wheel: Path, root: Path) -> None:
    """Unpack keeping each entry's executable bit (zipfile's extractall drops it)."""
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            target = Path(zf.extract(info, root))
            if not info.is_dir() and (info.external_attr >> 16) & stat.S_IXUSR:
                os.chmod(target, 0o755)


def read_members(wheel: Path, names: set[str]) -> dict[str, str | None]:
    """The text of a few files in a wheel (None for those it lacks), without unpacking it."""
    with zipfile.ZipFile(wheel) as zf:
        present = set(zf.namelist())
        return {n: zf.read(n).decode() if n in present else None for n in names}


def record_entries(wheel: Path) -> dict[str, str]:
    """Each file a wheel's RECORD lists, with its hash (``sha256=…``; empty for RECORD itself),
    read without unpacking the wheel."""
    with zipfile.ZipFile(wheel) as zf:
        [record] = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
        return {row[0]: row[1] for row in csv.reader(io.StringIO(zf.read(record).decode())) if row}


def python_sources(wheel: Path) -> dict[str, str]:
    """Each ``.py`` file of a wheel with its RECORD hash: what wheels built for different
    Pythons and machines must share for one series to harden them all."""
    return {name: digest for name, digest in record_entries(wheel).items() if name.endswith(".py")}


@contextmanager
def unpacked(wheel: Path, workdir: Path | None = None) -> Iterator[WheelTree]:
    """Unpack `wheel` into a temporary directory removed on exit, success or not."""
    with tempfile.TemporaryDirectory(dir=workdir, prefix=".unpack-") as tmp:
        _extract(wheel, Path(tmp))
        yield WheelTree(Path(tmp))
