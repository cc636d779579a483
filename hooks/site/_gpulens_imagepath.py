"""Put back the `PYTHONPATH` the trainer's image sets, which arming replaced (issue 43).

The webhook must set the container's `PYTHONPATH` to load this hook, and Kubernetes lets that
value replace the one the image's `ENV` gives. An init container of the trainer's own image wrote
the image's value to `<this folder>/image-env/<container>/PYTHONPATH` (capture/operator/arming.py,
`image_env_container`); this inserts its entries into sys.path right after this folder, where
`PYTHONPATH=<hook>:<image's>` would have put them, and into `os.environ["PYTHONPATH"]` for the
trainer's own child processes. Standard library only; with no such file it does nothing.
"""

from __future__ import annotations

import os
import sys

IMAGE_ENV_DIR = "image-env"


def restore(here: str, container: str | None = None) -> list[str]:
    """Entries added to sys.path (empty when there is nothing to restore)."""
    name = container if container is not None else os.environ.get("GPULENS_CONTAINER_NAME", "")
    if not name or "/" in name:
        return []
    try:
        with open(os.path.join(here, IMAGE_ENV_DIR, name, "PYTHONPATH"), encoding="utf-8") as f:
            value = f.read().strip()
    except (OSError, ValueError):       # none (nothing to restore), or not text
        return []
    entries = [e for e in value.split(os.pathsep) if e]
    have = {os.path.abspath(p) for p in sys.path if p}
    new = [e for e in entries if os.path.abspath(e) not in have]
    if not new:
        return []
    at = next((i + 1 for i, p in enumerate(sys.path) if p and os.path.abspath(p) == here), 0)
    sys.path[at:at] = new
    env = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    os.environ["PYTHONPATH"] = os.pathsep.join(env + [e for e in entries if e not in env])
    return new
