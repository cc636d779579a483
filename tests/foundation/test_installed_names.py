"""The design card's layout, installed as one namespace (issue 41): every module of every folder that
pyproject.toml maps (gpulens/, exporter/, capture/, alertrules/, dashboards/, hooks/) imports by its
`gpulens.*` name through the README set-up's editable install, from the file in that folder, in an
interpreter started outside the checkout (so the working directory lends nothing); and the folders'
own names are not importable there. The wheel's side is tests/e2e/test_wheel.py."""

from __future__ import annotations

import json
import subprocess
import sys

from tests import package_tree
from tests.conftest import REPO

PROBE = r"""
import importlib, json, sys
from pathlib import Path
repo, dirs = Path(sys.argv[1]), json.loads(sys.argv[2])
seen, wrong = [], {}
for name, folder in dirs.items():
    for path in sorted((repo / folder).rglob("*.py")):
        rel = path.relative_to(repo / folder)
        if "__pycache__" in rel.parts or rel.parts[:1] == ("site",):   # hooks/site: data for trainers, not a package
            continue
        parts = [name, *rel.with_suffix("").parts]
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        try:
            got = importlib.import_module(module).__file__
            if Path(got).resolve() != path.resolve():
                wrong[module] = got
        except Exception as e:
            wrong[module] = repr(e)[:300]
        seen.append(module)
tops = {}
for folder in set(dirs.values()) - {"gpulens"}:
    try:
        importlib.import_module(folder)
        tops[folder] = "imported"
    except ImportError:
        pass
print(json.dumps({"seen": seen, "wrong": wrong, "tops": tops, "path0": sys.path[0]}))
"""


def test_the_editable_install_imports_every_module_by_its_gpulens_name(tmp_path):
    dirs = package_tree.package_dirs()
    assert set(dirs.values()) == {"gpulens", "exporter", "capture", "alertrules", "dashboards", "hooks"}
    r = subprocess.run([sys.executable, "-c", PROBE, str(REPO), json.dumps(dirs)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["wrong"] == {}, out["wrong"]
    seen = set(out["seen"])
    for plane in ("gpulens.cli", "gpulens.capture.agent.pipeline", "gpulens.exporter.collector",
                  "gpulens.alertrules.generate", "gpulens.dashboards.build", "gpulens.hooks"):
        assert plane in seen, plane
    assert len(seen) > 150
    assert out["tops"] == {}, out["tops"]   # `import capture` finds nothing: the folders are not top-level names
