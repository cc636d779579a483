"""image/requirements.txt (what the image installs, --no-deps) agrees with pyproject's pins.

Not a container test (no marker): it reads the lock, pyproject and the installed .venv only.
"""

import importlib.util

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("image_lock", REPO / "image" / "lock.py")
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)


def _locked() -> dict[str, str]:
    lines = (REPO / "image" / "requirements.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def test_every_runtime_pin_is_locked_at_its_version():
    locked = _locked()
    for name, version in lock.runtime_pins().items():
        assert locked.get(name) == version, f"{name}: pyproject {version}, image lock {locked.get(name)}"


def test_lock_is_the_current_closure():
    # Fails when a dependency's own requirements changed and image/lock.py was not re-run.
    assert (REPO / "image" / "requirements.txt").read_text() == lock.render(lock.closure(list(lock.runtime_pins())))


def test_notebook_and_test_stacks_stay_out():
    locked = _locked()
    for name in ("jupyterlab", "notebook", "jupyter-server", "pytest", "torch", "pydot", "moto"):
        assert name not in locked
    assert "psutil" in locked          # HTA imports it without declaring it


def test_chart_default_tag_is_the_image_build_sh_makes():
    import tomllib
    import yaml
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((REPO / "helm" / "gpulens" / "Chart.yaml").read_text())
    assert chart["appVersion"] == version      # image/build.sh tags localhost/gpulens:<version>
