"""Struct member offsets from the running kernel's BTF (/sys/kernel/btf/vmlinux).

bcc compiles against whatever kernel headers are installed, and nodes often carry headers of a
different kernel than the one running; reading `task_struct` through mismatched headers returns
garbage. The BPF program therefore reads the two fields it needs (`group_leader`,
`start_boottime`) at offsets taken from the running kernel's own type information and passed in
as compile-time constants: a minimal form of CO-RE.
"""

from __future__ import annotations

import struct
from pathlib import Path

__all__ = ["BtfError", "member_offsets", "VMLINUX_BTF"]

VMLINUX_BTF = Path("/sys/kernel/btf/vmlinux")

_MAGIC = 0xEB9F
_KIND_STRUCT, _KIND_UNION = 4, 5
_KIND_TYPEDEF, _KIND_VOLATILE, _KIND_CONST, _KIND_RESTRICT, _KIND_TYPE_TAG = 8, 9, 10, 11, 18
# bytes that follow each btf_type record: fixed extra, and per-vlen entry size
_EXTRA = {1: (4, 0), 3: (12, 0), 4: (0, 12), 5: (0, 12), 6: (0, 8), 13: (0, 8), 14: (4, 0),
          15: (0, 12), 17: (4, 0), 19: (0, 12)}


class BtfError(ValueError):
    """The BTF blob is missing, malformed, or lacks the struct or member."""


def _parse(data: bytes):
    if len(data) < 24:
        raise BtfError("BTF blob too short")
    magic, _version, _flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from("<HBBIIIII", data, 0)
    if magic != _MAGIC:
        raise BtfError("not a little-endian BTF blob")
    types_at = hdr_len + type_off
    strings = data[hdr_len + str_off: hdr_len + str_off + str_len]
    types: list[tuple[int, int, int, int, list[tuple[int, int, int]]]] = [(0, 0, 0, 0, [])]  # id 0 = void
    pos, end = types_at, types_at + type_len
    while pos < end:
        name_off, info, size_or_type = struct.unpack_from("<III", data, pos)
        pos += 12
        kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
        extra, per = _EXTRA.get(kind, (0, 0))
        members = []
        if kind in (_KIND_STRUCT, _KIND_UNION):
            for i in range(vlen):
                m_name, m_type, m_off = struct.unpack_from("<III", data, pos + i * 12)
                members.append((m_name, m_type, (m_off & 0xFFFFFF) if kflag else m_off))
        pos += extra + per * vlen
        types.append((name_off, kind, size_or_type, kflag, members))
    return types, strings


def _name(strings: bytes, off: int) -> str:
    return strings[off: strings.index(b"\0", off)].decode()


def _resolve(types, type_id: int) -> int:
    while types[type_id][1] in (_KIND_TYPEDEF, _KIND_VOLATILE, _KIND_CONST, _KIND_RESTRICT, _KIND_TYPE_TAG):
        type_id = types[type_id][2]
    return type_id


def _find(types, strings, type_id: int, member: str) -> int | None:
    """Bit offset of `member` in the struct/union, looking through anonymous members."""
    for m_name, m_type, m_bits in types[type_id][4]:
        if m_name and _name(strings, m_name) == member:
            return m_bits
        if not m_name:
            inner = _resolve(types, m_type)
            if types[inner][1] in (_KIND_STRUCT, _KIND_UNION):
                found = _find(types, strings, inner, member)
                if found is not None:
                    return m_bits + found
    return None


def member_offsets(struct_name: str, members: list[str], btf: Path = VMLINUX_BTF) -> dict[str, int]:
    """Byte offsets of `members` in `struct struct_name`; raises BtfError or OSError."""
    types, strings = _parse(Path(btf).read_bytes())
    for type_id, (name_off, kind, _size, _kflag, _members) in enumerate(types):
        if kind == _KIND_STRUCT and name_off and _name(strings, name_off) == struct_name:
            out = {}
            for member in members:
                bits = _find(types, strings, type_id, member)
                if bits is None or bits % 8:
                    raise BtfError(f"struct {struct_name} has no byte-aligned member {member}")
                out[member] = bits // 8
            return out
    raise BtfError(f"struct {struct_name} not found in {btf}")
