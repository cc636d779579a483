"""How many worker processes a trainer container starts, read from how it is launched.

The webhook stamps `gpulens.dev/local-world-size` from this at admission. A GPU limit alone says
little (`torchrun --nproc-per-node=2` on a CPU node has none, and gets two workers), so the
launcher's own setting comes first: torchrun's `--nproc-per-node` / `--nproc_per_node`, also
under `python -m torch.distributed.run` or `torch.distributed.launch`, in the command, its args,
or a `sh -c` script, else the `PET_NPROC_PER_NODE` environment torchrun reads (PyTorchJob sets
it). `None` means "not known": the caller then writes nothing rather than a wrong number, and
the coordinator takes the count from the workers' own registration records.
"""

from __future__ import annotations

import shlex
from typing import Any, Mapping, Sequence

__all__ = ["local_world_size"]

_SHELLS = {"sh", "bash", "dash", "ash", "zsh"}
_LAUNCH_MODULES = {"torch.distributed.run", "torch.distributed.launch"}
_FLAGS = ("--nproc-per-node", "--nproc_per_node")
_TORCHRUN_DEFAULT = 1          # torchrun's own default for --nproc-per-node


def _basename(token: str) -> str:
    return token.rsplit("/", 1)[-1]


def _tokens(container: Mapping[str, Any]) -> list[str]:
    """command + args, with the script of any `sh -c SCRIPT` split into words as the shell would."""
    raw = [str(t) for t in (container.get("command") or [])] + [str(t) for t in (container.get("args") or [])]
    out: list[str] = []
    shell = False
    for i, tok in enumerate(raw):
        out.append(tok)
        if _basename(tok) in _SHELLS:
            shell = True
        elif shell and tok.startswith("-") and "c" in tok[1:] and not tok.startswith("--") and i + 1 < len(raw):
            try:
                out.extend(shlex.split(raw[i + 1], comments=True))
            except ValueError:
                pass           # unbalanced quotes: the shell would fail too
    return out


def _launcher_at(tokens: Sequence[str]) -> int | None:
    """Index just past the launcher (torchrun or `-m torch.distributed.run|launch`), or None."""
    for i, tok in enumerate(tokens):
        if _basename(tok) == "torchrun":
            return i + 1
        if tok == "-m" and i + 1 < len(tokens) and tokens[i + 1] in _LAUNCH_MODULES:
            return i + 2
        if tok.startswith("-m") and tok[2:] in _LAUNCH_MODULES:
            return i + 1
    return None


def _nproc(value: str, gpus: int | None) -> int | None:
    value = value.strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    if value == "gpu":
        return gpus
    return None               # "auto", "cpu", "xpu", a shell variable: decided on the node, not here


def local_world_size(container: Mapping[str, Any], gpus: int | None) -> int | None:
    """Worker processes the container starts; `gpus` is its `nvidia.com/gpu` limit (None: none)."""
    tokens = _tokens(container)
    start = _launcher_at(tokens)
    if start is not None:
        rest = tokens[start:]
        for i, tok in enumerate(rest):
            for flag in _FLAGS:
                if tok == flag and i + 1 < len(rest):
                    return _nproc(rest[i + 1], gpus)
                if tok.startswith(flag + "="):
                    return _nproc(tok.split("=", 1)[1], gpus)
    env = {e.get("name"): e for e in container.get("env") or [] if isinstance(e, Mapping)}
    pet = env.get("PET_NPROC_PER_NODE")
    if pet is not None:
        return _nproc(str(pet.get("value", "")), gpus) if "value" in pet else None
    if start is not None:
        return _TORCHRUN_DEFAULT
    return gpus               # no launcher named: one worker per GPU (mpirun, custom launchers), else unknown
