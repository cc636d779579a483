"""The ELF dynsym reader (probe offsets) and the BTF reader (task_struct offsets)."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from gpulens.exporter.btf import VMLINUX_BTF, BtfError, member_offsets
from gpulens.exporter.elfsyms import ElfError, function_offsets
from gpulens.exporter.symbols import DRIVER_PROBES, probe_names
from tests.conftest import requires


def test_stub_exports_every_probed_symbol_at_distinct_addresses(stub):
    offsets = function_offsets(stub.libcuda, probe_names())
    assert set(offsets) == set(probe_names())
    # identical-code folding would put two names on one address and double-count calls
    assert len(set(offsets.values())) == len(offsets)


@requires(None if shutil.which("nm") and shutil.which("readelf") else "binutils missing")
def test_offsets_agree_with_binutils(stub):
    """file offset = symbol value - segment vaddr + segment file offset, as binutils reports them."""
    nm = subprocess.run(["nm", "-D", "--defined-only", str(stub.libcuda)], capture_output=True, text=True, check=True)
    values = {parts[2]: int(parts[0], 16) for parts in (l.split() for l in nm.stdout.splitlines()) if len(parts) == 3}
    ph = subprocess.run(["readelf", "-lW", str(stub.libcuda)], capture_output=True, text=True, check=True)
    loads = [(int(p[2], 16), int(p[1], 16), int(p[4], 16)) for p in
             (l.split() for l in ph.stdout.splitlines()) if p and p[0] == "LOAD"]
    offsets = function_offsets(stub.libcuda, ["cuLaunchKernel", "cuMemcpyDtoH_v2", "cuInit"])
    for name, off in offsets.items():
        v = values[name]
        (vaddr, foff, _size), = [(va, fo, sz) for va, fo, sz in loads if va <= v < va + sz]
        assert off == v - vaddr + foff


def test_missing_symbols_are_left_out(stub):
    assert function_offsets(stub.libcuda, ["cuLaunchKernel", "cuNoSuchThing", "printf"]).keys() == {"cuLaunchKernel"}


def test_real_system_library_has_no_driver_symbols():
    libc = next((p for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6") if os.path.exists(p)), None)
    if libc is None:
        pytest.skip("no libc found")
    assert function_offsets(libc, probe_names()) == {}
    assert "malloc" in function_offsets(libc, ["malloc"])


@pytest.mark.parametrize("content", [b"", b"not an elf at all", b"\x7fELF\x01\x01\x01" + b"\0" * 60,
                                     b"\x7fELF\x02\x02\x01" + b"\0" * 60])
def test_bad_files_raise_elf_error(tmp_path, content):
    f = tmp_path / "libcuda.so.1"
    f.write_bytes(content)
    with pytest.raises(ElfError):
        function_offsets(f, ["cuLaunchKernel"])


def test_truncated_library_raises_elf_error(stub, tmp_path):
    data = stub.libcuda.read_bytes()
    f = tmp_path / "libcuda.so.1"
    f.write_bytes(data[: len(data) // 3])
    with pytest.raises(ElfError):
        function_offsets(f, ["cuLaunchKernel"])


def test_every_probe_has_a_kind_the_bpf_program_handles():
    source = (Path(__file__).resolve().parents[2] / "exporter" / "bpf" / "counters.c").read_text()
    for spec in DRIVER_PROBES:
        assert f"int {spec.entry}(struct pt_regs *ctx)" in source
        assert f"return handle_entry(ctx, " in source
    kinds = {spec.entry: spec.kind for spec in DRIVER_PROBES}
    for entry, kind in kinds.items():
        # the per-probe wrapper and the cookie path must agree on the number
        wrapper = [l for l in source.splitlines() if l.startswith(f"int {entry}(")][0]
        macro = wrapper.split("handle_entry(ctx, ")[1].split(")")[0]
        assert f"#define {macro} {kind}" in source


# ---- BTF ----------------------------------------------------------------------------------------

def _btf_blob(strings: list[str], types: list[bytes]) -> bytes:
    strtab = b"\0" + b"".join(s.encode() + b"\0" for s in strings)
    body = b"".join(types)
    hdr = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(body), len(body), len(strtab))
    return hdr + body + strtab


def _str_off(strings, s):
    return 1 + sum(len(x) + 1 for x in strings[: strings.index(s)])


def test_btf_offsets_through_anonymous_members(tmp_path):
    strings = ["int", "task_struct", "pid", "start_boottime", "group_leader", "other"]
    so = lambda s: _str_off(strings, s)  # noqa: E731
    t_int = struct.pack("<III", so("int"), (1 << 24), 4) + struct.pack("<I", 32)                 # id 1: INT
    t_anon = struct.pack("<III", 0, (4 << 24) | 2, 16) + struct.pack("<III", so("start_boottime"), 1, 0) \
        + struct.pack("<III", so("other"), 1, 64)                                                  # id 2: anon struct
    t_ptr = struct.pack("<III", 0, (2 << 24), 3)                                                   # id 3: PTR
    t_task = struct.pack("<III", so("task_struct"), (4 << 24) | 3, 64) \
        + struct.pack("<III", so("pid"), 1, 32) + struct.pack("<III", 0, 2, 128) \
        + struct.pack("<III", so("group_leader"), 3, 256)                                         # id 4
    f = tmp_path / "btf"
    f.write_bytes(_btf_blob(strings, [t_int, t_anon, t_ptr, t_task]))
    assert member_offsets("task_struct", ["pid", "start_boottime", "group_leader"], f) == \
        {"pid": 4, "start_boottime": 16, "group_leader": 32}
    with pytest.raises(BtfError, match="no byte-aligned member nope"):
        member_offsets("task_struct", ["nope"], f)
    with pytest.raises(BtfError, match="not found"):
        member_offsets("mm_struct", ["pid"], f)


@pytest.mark.parametrize("blob", [b"", b"\x9f\xeb" + b"\0" * 30, b"hello world, this is not BTF at all"])
def test_bad_btf_raises(tmp_path, blob):
    f = tmp_path / "btf"
    f.write_bytes(blob)
    with pytest.raises(BtfError):
        member_offsets("task_struct", ["pid"], f)


@pytest.mark.skipif(not VMLINUX_BTF.exists(), reason="kernel without BTF")
def test_running_kernel_task_struct():
    offs = member_offsets("task_struct", ["pid", "tgid", "group_leader", "start_boottime", "start_time"])
    assert offs["tgid"] == offs["pid"] + 4                    # adjacent pid_t fields
    assert offs["start_boottime"] == offs["start_time"] + 8   # adjacent u64 fields
    assert offs["group_leader"] % 8 == 0
