"""The README's test-cluster install, run as written: its values block and its command lines.

Each line runs as typed, by bash, with the `kubectl` (Debian's kubernetes-client, the cluster's
own version) and `helm` (the pinned v3.16.4 binary) that scripts/setup.sh puts into .venv/bin, and
the values file written as the README shows it. The lines are also parsed into steps (`parse`), so
the offline tests can check what the install does against the fixtures without a cluster; a line
of a shape they do not know is an error, so the README cannot show a command nobody checked."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

VALUES_MARK, COMMANDS_MARK = "gpulens-cluster:values", "gpulens-cluster:commands"
TRIAL_MARKS = ("gpulens-trial:values", "gpulens-trial:commands")
_VAR = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)\}")


class ReadmeError(ValueError):
    """The README block is missing, or holds a line or placeholder the tests cannot run."""


def block(text: str, marker: str, lang: str) -> str:
    m = re.search(rf"<!-- {re.escape(marker)} -->\s*```{lang}\n(.*?)```", text, re.S)
    if not m:
        raise ReadmeError(f"no ```{lang} block after <!-- {marker} --> in the README")
    return m.group(1)


def substitute(text: str, env: dict[str, str]) -> str:
    """`${NAME}` placeholders from `env`; an unknown one is an error (never left in a value)."""
    def one(m: re.Match) -> str:
        if m.group(1) not in env:
            raise ReadmeError(f"the README uses ${{{m.group(1)}}}, which the tests do not provide")
        return env[m.group(1)]
    return _VAR.sub(one, text)


@dataclass(frozen=True)
class Step:
    """One README command line, parsed: what it does, with which arguments."""

    verb: str                       # namespace | secret | secret-patch | label | helm-install
    args: dict[str, Any] = field(default_factory=dict)


def _opt(argv: list[str], *names: str) -> str | None:
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def _duration_s(text: str) -> int:
    m = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", text)
    if not m or not text:
        raise ReadmeError(f"--timeout {text!r}: expected e.g. 10m or 90s")
    return int(m.group(1) or 0) * 60 + int(m.group(2) or 0)


def _string_data_patch(line: str, argv: list[str]) -> dict[str, str]:
    """`--type merge -p '{"stringData": {KEY: VALUE}}'`: the one Secret patch the README shows."""
    if _opt(argv, "--type") != "merge":
        raise ReadmeError(f"{line!r}: expected --type merge")
    try:
        patch = json.loads(_opt(argv, "-p", "--patch") or "")
    except ValueError:
        patch = None
    data = patch.get("stringData") if isinstance(patch, dict) and set(patch) == {"stringData"} else None
    if not isinstance(data, dict) or not data or not all(isinstance(v, str) and v for v in data.values()):
        raise ReadmeError(f"{line!r}: expected -p '{{\"stringData\": {{\"KEY\": \"VALUE\"}}}}'")
    return data


def parse(commands: str) -> list[Step]:
    steps = []
    for raw in commands.splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        argv = shlex.split(line)
        ns = _opt(argv, "--namespace", "-n")
        if argv[:3] == ["kubectl", "create", "namespace"] and len(argv) == 4:
            steps.append(Step("namespace", {"name": argv[3]}))
        elif argv[:4] == ["kubectl", "create", "secret", "generic"] and ns:
            literals = [a.split("=", 1)[1] for a in argv if a.startswith("--from-literal=")]
            data = dict(kv.split("=", 1) for kv in literals if "=" in kv)
            if not data or len(data) != len(literals):
                raise ReadmeError(f"{line!r}: expected --from-literal=KEY=VALUE arguments")
            steps.append(Step("secret", {"name": argv[4], "namespace": ns, "data": data}))
        elif argv[:3] == ["kubectl", "patch", "secret"] and ns and len(argv) > 3 and not argv[3].startswith("-"):
            steps.append(Step("secret-patch", {"name": argv[3], "namespace": ns,
                                               "data": _string_data_patch(line, argv)}))
        elif argv[:3] == ["kubectl", "label", "namespace"] and len(argv) == 5 and "=" in argv[4]:
            key, value = argv[4].split("=", 1)
            steps.append(Step("label", {"name": argv[3], "labels": {key: value}}))
        elif argv[:2] == ["helm", "install"] and ns and _opt(argv, "-f", "--values"):
            sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set" and i + 1 < len(argv)]
            steps.append(Step("helm-install", {"release": argv[2], "chart": argv[3], "namespace": ns,
                                               "values_file": _opt(argv, "-f", "--values"), "sets": sets,
                                               "wait": "--wait" in argv,
                                               "timeout_s": _duration_s(_opt(argv, "--timeout") or "5m")}))
        else:
            raise ReadmeError(f"the tests cannot run this README line: {line!r}")
    return steps


@dataclass
class Install:
    """The README's install, parsed and with its placeholders filled."""

    values_name: str                # the file name the helm line reads (-f)
    values_text: str                # the values block as the README shows it, placeholders filled
    lines: list[str]                # the command lines as the README shows them, placeholders filled
    steps: list[Step]

    @property
    def values(self) -> dict[str, Any]:
        return yaml.safe_load(self.values_text)

    @classmethod
    def from_readme(cls, readme: Path, env: dict[str, str], marks: tuple[str, str] = (VALUES_MARK, COMMANDS_MARK)
                    ) -> "Install":
        """`marks`: the (values, commands) markers; the test cluster's by default, TRIAL_MARKS for
        the single-node trial in "Deploy on Kubernetes"."""
        text = readme.read_text()
        values_text = block(text, marks[0], "yaml")
        first = values_text.splitlines()[0] if values_text.strip() else ""
        name = re.match(r"#\s*(\S+\.ya?ml)", first)
        if not name:
            raise ReadmeError(f"the values block must start with '# <file>.yaml' (got {first!r})")
        commands = substitute(block(text, marks[1], "bash"), env)
        steps = parse(commands)
        helm = [s for s in steps if s.verb == "helm-install"]
        if len(helm) != 1 or helm[0].args["values_file"] != name.group(1):
            raise ReadmeError(f"expected one `helm install ... -f {name.group(1)}` line")
        lines = [raw for raw in commands.splitlines() if raw.strip() and not raw.strip().startswith("#")]
        return cls(name.group(1), substitute(values_text, env), lines, steps)

    @property
    def helm(self) -> Step:
        return next(s for s in self.steps if s.verb == "helm-install")

    def run(self, kubeconfig: str, repo: Path, workdir: Path, *, rerun: bool = False,
            timeout_s: float = 900) -> list[Ran]:
        """Run each README line as typed, in order, by bash, with the set-up's `kubectl` (the
        cluster's version) and `helm` first on PATH, in `workdir`: the values file written there
        as the README shows it, and `./helm` the repository's chart folder (a link, so nothing is
        written into the checkout). A failing line raises with its output.

        `rerun`: the install was run on this cluster before (a kept development cluster, or
        test_8 putting `gl` back): a `kubectl create` of an object that exists is accepted, and
        the `helm install` line runs again as `helm upgrade` with the same arguments."""
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / self.values_name).write_text(self.values_text)
        link = workdir / "helm"
        if not link.exists():
            link.symlink_to(repo / "helm", target_is_directory=True)
        tools = repo / ".venv" / "bin"
        env = dict(os.environ, PATH=f"{tools}:{os.environ.get('PATH', '/usr/bin:/bin')}", KUBECONFIG=kubeconfig,
                   HELM_CACHE_HOME=str(workdir / ".helm-cache"), HELM_CONFIG_HOME=str(workdir / ".helm-config"),
                   HELM_DATA_HOME=str(workdir / ".helm-data"))
        ran = []
        for line in self.lines:
            done = _bash(line, workdir, env, timeout_s)
            if done.returncode and rerun:
                argv = shlex.split(line.split(" #", 1)[0])
                if argv[:2] == ["kubectl", "create"] and "AlreadyExists" in done.stderr:
                    ran.append(done)
                    continue
                if argv[:2] == ["helm", "install"] and "cannot re-use a name" in done.stderr:
                    line = "helm upgrade " + line.split("helm install", 1)[1]
                    done = _bash(line, workdir, env, timeout_s)
            if done.returncode:
                raise ReadmeError(f"the README line {line!r} exited {done.returncode}:\n{done.stdout[-2000:]}"
                                  f"{done.stderr[-4000:]}")
            ran.append(done)
        return ran


@dataclass(frozen=True)
class Ran:
    """One README line as bash ran it."""

    line: str
    returncode: int
    stdout: str
    stderr: str


def _bash(line: str, cwd: Path, env: dict[str, str], timeout_s: float) -> Ran:
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", line], cwd=cwd, env=env, capture_output=True, check=False,
                       text=True, timeout=timeout_s)
    return Ran(line, p.returncode, p.stdout, p.stderr)
