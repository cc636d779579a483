"""Finding driver library files in /proc/*/maps: a fixture /proc tree, then real processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpulens.exporter.discovery import LibraryScanner, glob_regex
from gpulens.exporter.procfs import ProcFS


class FakeProc:
    """A /proc tree on disk with the files discovery reads: maps, stat, root/, map_files/."""

    def __init__(self, root: Path):
        self.root = root

    def add(self, pid: int, maps: list[tuple[Path | str, str]], start: int = 100, container_root: Path | None = None):
        d = self.root / str(pid)
        (d / "map_files").mkdir(parents=True, exist_ok=True)
        lines = []
        for i, (file, shown) in enumerate(maps):
            st = os.stat(file)
            rng = f"7f00{i:04x}0000-7f00{i:04x}1000"
            lines.append(f"{rng} r-xp 00001000 {os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x} {st.st_ino}    {shown}")
            link = d / "map_files" / rng
            if not link.exists():
                link.symlink_to(file)
        lines.append("7ffd0000-7ffd1000 rw-p 00000000 00:00 0                          [stack]")
        (d / "maps").write_text("\n".join(lines) + "\n")
        (d / "stat").write_text(f"{pid} (proc {pid}) S " + " ".join(["0"] * 18) + f" {start} 0 0\n")
        if container_root is not None and not (d / "root").exists():
            (d / "root").symlink_to(container_root)
        elif not (d / "root").exists():
            (d / "root").symlink_to("/")

    def remove(self, pid: int):
        shutil.rmtree(self.root / str(pid))


@pytest.fixture
def proc(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()
    return FakeProc(root)


@pytest.fixture
def libs(tmp_path):
    d = tmp_path / "host" / "usr" / "lib"
    d.mkdir(parents=True)
    for name in ("libcuda.so.550.54.15", "libcudart.so.12", "libnvidia-ml.so.1"):
        (d / name).write_bytes(b"\x7fELF" + name.encode())
    return d


def test_maps_regex_picks_driver_files_only():
    r = glob_regex(["libcuda.so*"])
    maps = (b"7f1-7f2 r-xp 00001000 fd:01 123 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n"
            b"7f1-7f2 r-xp 00001000 fd:01 124 /usr/local/cuda/lib64/libcudart.so.12\n"
            b"7f1-7f2 r-xp 00001000 fd:01 125 /opt/app/libcuda_helpers.so\n"
            b"7f1-7f2 r-xp 00001000 fd:01 126 /usr/lib/x86_64-linux-gnu/libcuda.so.1 (deleted)\n"
            b"7f1-7f2 rw-p 00000000 00:00 0 [heap]\n")
    found = [(m.group(5), bool(m.group(6))) for m in r.finditer(maps)]
    assert found == [(b"/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15", False),
                     (b"/usr/lib/x86_64-linux-gnu/libcuda.so.1", True)]


def test_configurable_glob_and_full_path_glob():
    maps = b"7f1-7f2 r-xp 00001000 fd:01 7 /opt/drivers/v2/libcudadrv.so.3\n"
    assert not list(glob_regex(["libcuda.so*"]).finditer(maps))
    assert list(glob_regex(["libcudadrv.so.?"]).finditer(maps))
    assert list(glob_regex(["/opt/*/v2/libcudadrv.so*"]).finditer(maps))
    assert not list(glob_regex(["/opt/*/libcudadrv.so*"]).finditer(maps))   # '*' never crosses '/'


def test_one_entry_per_file_with_users(proc, libs):
    lib = libs / "libcuda.so.550.54.15"
    proc.add(10, [(lib, str(lib)), (libs / "libcudart.so.12", str(libs / "libcudart.so.12"))])
    proc.add(11, [(lib, str(lib))])
    proc.add(12, [(libs / "libnvidia-ml.so.1", str(libs / "libnvidia-ml.so.1"))])
    scan = LibraryScanner(ProcFS(proc.root), ["libcuda.so*"], self_pid=1).scan()
    st = os.stat(lib)
    key = (st.st_dev, st.st_ino)
    assert list(scan.libraries) == [key]
    assert scan.users[key] == {10, 11}
    assert scan.libraries[key].attach_path.endswith("/10/root" + str(lib)) or \
        scan.libraries[key].attach_path.endswith("/11/root" + str(lib))


def test_library_seen_through_the_container_root(proc, libs, tmp_path):
    """Inside a container the file is at /usr/lib/...; only <proc>/<pid>/root/usr/lib/... opens it."""
    container = tmp_path / "container-rootfs"
    (container / "usr" / "lib64").mkdir(parents=True)
    inside = container / "usr" / "lib64" / "libcuda.so.1"
    shutil.copy(libs / "libcuda.so.550.54.15", inside)
    proc.add(20, [(inside, "/usr/lib64/libcuda.so.1")], container_root=container)
    scan = LibraryScanner(ProcFS(proc.root), ["libcuda.so*"], self_pid=1).scan()
    (lib,) = scan.libraries.values()
    assert lib.path == "/usr/lib64/libcuda.so.1"
    assert lib.attach_path == str(proc.root / "20" / "root") + "/usr/lib64/libcuda.so.1"
    assert os.stat(lib.attach_path).st_ino == os.stat(inside).st_ino


def test_deleted_library_resolves_through_map_files(proc, libs):
    lib = libs / "libcuda.so.550.54.15"
    proc.add(30, [(lib, "/usr/lib/libcuda.so.1 (deleted)")])
    scan = LibraryScanner(ProcFS(proc.root), ["libcuda.so*"], self_pid=1).scan()
    (found,) = scan.libraries.values()
    assert "/30/map_files/" in found.attach_path


def test_exited_and_unmapping_processes_drop_the_library(proc, libs):
    clock = [0.0]
    lib = libs / "libcuda.so.550.54.15"
    proc.add(40, [(lib, str(lib))])
    proc.add(41, [(lib, str(lib))])
    scanner = LibraryScanner(ProcFS(proc.root), ["libcuda.so*"], rescan_interval=5.0, clock=lambda: clock[0],
                             self_pid=1)
    assert len(scanner.scan().libraries) == 1
    proc.remove(40)
    proc.add(41, [(libs / "libcudart.so.12", str(libs / "libcudart.so.12"))])   # 41 dlclose'd libcuda
    clock[0] = 1.0
    assert len(scanner.scan().libraries) == 1            # 41 not re-read yet (rescan interval)
    clock[0] = 6.0
    assert scanner.scan().libraries == {}


def test_new_pids_are_read_at_once_known_pids_at_the_rescan_interval(proc, libs):
    clock = [0.0]
    scanner = LibraryScanner(ProcFS(proc.root), ["libcuda.so*"], rescan_interval=5.0, clock=lambda: clock[0],
                             self_pid=1)
    proc.add(50, [])
    assert scanner.scan().scanned == 1
    clock[0] = 1.0
    proc.add(51, [(libs / "libcuda.so.550.54.15", "/x/libcuda.so.1")])
    result = scanner.scan()
    assert result.scanned == 1 and len(result.libraries) == 1      # only the new pid was read
    proc.add(52, [], start=100)
    proc.remove(50)
    proc.add(50, [(libs / "libcuda.so.550.54.15", "/x/libcuda.so.1")], start=999)   # pid reused
    clock[0] = 2.0
    result = scanner.scan()
    assert result.scanned == 2                                     # 52 is new, 50 is a new process
    assert result.users[next(iter(result.libraries))] == {50, 51}


def test_unreadable_and_vanishing_entries_are_skipped(proc, libs):
    proc.add(60, [(libs / "libcuda.so.550.54.15", "/x/libcuda.so.1")])
    (proc.root / "61").mkdir()                    # a pid directory without maps (raced exit)
    (proc.root / "self").mkdir()                  # non-numeric entries are not pids
    (proc.root / "62").mkdir()
    (proc.root / "62" / "maps").write_bytes(b"\xff\xfe garbage that is no maps format\n")
    scan = LibraryScanner(ProcFS(proc.root), ["libcuda.so*"], self_pid=1).scan()
    assert {p for users in scan.users.values() for p in users} == {60}


def test_real_processes_mapping_the_stand_in(stub, tmp_path):
    lib_dir = tmp_path / "drv"
    lib_dir.mkdir()
    shutil.copy2(stub.libcuda, lib_dir / "libcuda.so.1")
    code = "import ctypes,sys; ctypes.CDLL(sys.argv[1]); print('ok', flush=True); sys.stdin.read()"
    user = subprocess.Popen([sys.executable, "-c", code, str(lib_dir / "libcuda.so.1")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    bystander = subprocess.Popen([sys.executable, "-c", "import sys; print('ok', flush=True); sys.stdin.read()"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert user.stdout.readline().startswith("ok") and bystander.stdout.readline().startswith("ok")
        scan = LibraryScanner(ProcFS(), [str(lib_dir) + "/libcuda.so*"]).scan()
        st = os.stat(lib_dir / "libcuda.so.1")
        assert set(scan.libraries) == {(st.st_dev, st.st_ino)}
        assert scan.users[(st.st_dev, st.st_ino)] == {user.pid}
    finally:
        for p in (user, bystander):
            p.kill()
            p.wait(10)
            p.stdin.close()
            p.stdout.close()
