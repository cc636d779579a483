"""Exported function symbols of a shared library, as file offsets (what a uprobe is placed at).

A small reader of the ELF dynamic symbol table, so the exporter can list which driver symbols a
given libcuda actually exports (versions differ: `_ptsz`, `_v2`, `cuLaunchKernelEx` since 11.8)
without a toolchain in the image. Only 64-bit little-endian ELF (x86-64, aarch64) is supported.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO, Iterable

__all__ = ["ElfError", "function_offsets"]

_SHT_DYNSYM = 11
_PT_LOAD = 1
_STT_FUNC = 2
_STT_GNU_IFUNC = 10
_SHN_UNDEF = 0


class ElfError(ValueError):
    """The file is not an ELF64 little-endian shared object we can read."""


def _read(f: BinaryIO, offset: int, size: int) -> bytes:
    f.seek(offset)
    data = f.read(size)
    if len(data) != size:
        raise ElfError(f"truncated ELF file (wanted {size} bytes at {offset})")
    return data


def function_offsets(path: str | Path, names: Iterable[str]) -> dict[str, int]:
    """Map each of `names` that the library defines as a function to its file offset.

    Names the library does not export are left out. Raises ElfError or OSError.
    """
    wanted = set(names)
    with open(path, "rb") as f:
        ident = _read(f, 0, 64)
        if ident[:4] != b"\x7fELF":
            raise ElfError(f"{path}: not an ELF file")
        if ident[4] != 2 or ident[5] != 1:
            raise ElfError(f"{path}: only 64-bit little-endian ELF is supported")
        (e_phoff, e_shoff) = struct.unpack_from("<QQ", ident, 0x20)
        (e_phentsize, e_phnum, e_shentsize, e_shnum) = struct.unpack_from("<HHHH", ident, 0x36)
        loads = []
        for i in range(e_phnum):
            ph = _read(f, e_phoff + i * e_phentsize, 56)
            p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack_from("<IIQQQQ", ph, 0)
            if p_type == _PT_LOAD:
                loads.append((p_vaddr, p_offset, p_filesz))
        sections = [_read(f, e_shoff + i * e_shentsize, 64) for i in range(e_shnum)]
        result: dict[str, int] = {}
        for sh in sections:
            _name, sh_type, _flags, _addr, sh_offset, sh_size, sh_link, _info, _align, sh_entsize = \
                struct.unpack_from("<IIQQQQIIQQ", sh, 0)
            if sh_type != _SHT_DYNSYM or sh_entsize == 0:
                continue
            if sh_link >= len(sections):
                raise ElfError(f"{path}: bad string table index")
            str_off, str_size = struct.unpack_from("<QQ", sections[sh_link], 0x18)
            strtab = _read(f, str_off, str_size)
            symtab = _read(f, sh_offset, sh_size)
            for off in range(0, sh_size - sh_entsize + 1, sh_entsize):
                st_name, st_info, _other, st_shndx, st_value, _size = struct.unpack_from("<IBBHQQ", symtab, off)
                if st_shndx == _SHN_UNDEF or (st_info & 0xF) not in (_STT_FUNC, _STT_GNU_IFUNC):
                    continue
                end = strtab.find(b"\0", st_name)
                name = strtab[st_name:end].decode("ascii", "replace")
                if name not in wanted or name in result:
                    continue
                for vaddr, offset, filesz in loads:
                    if vaddr <= st_value < vaddr + filesz:
                        result[name] = st_value - vaddr + offset
                        break
        return result
