"""The README's test-cluster install, run as written: its values block and its command lines.

Neither `kubectl` nor `helm` can be obtained on these machines (no Go module proxy, no Debian
package), so each README line is translated into the call the CLI would make — the Kubernetes API
(the `kubernetes` client) and Helm's own engine (helm-python-sdk, the Go library behind `helm`).
Only the few command shapes the README uses are understood; any other line is an error, so the
README cannot show a command the tests do not run."""

from __future__ import annotations

import base64
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

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


def _set(values: dict, dotted: str) -> None:
    """`helm --set a.b=c` (strings only, as the README uses it)."""
    key, _, value = dotted.partition("=")
    *path, last = key.split(".")
    node = values
    for p in path:
        node = node.setdefault(p, {})
    node[last] = value


@dataclass
class Install:
    """The README's install, parsed and with its placeholders filled."""

    values_name: str                # the file name the helm line reads (-f)
    values: dict[str, Any]
    steps: list[Step]

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
        values = yaml.safe_load(substitute(values_text, env))
        steps = parse(substitute(block(text, marks[1], "bash"), env))
        helm = [s for s in steps if s.verb == "helm-install"]
        if len(helm) != 1 or helm[0].args["values_file"] != name.group(1):
            raise ReadmeError(f"expected one `helm install ... -f {name.group(1)}` line")
        return cls(name.group(1), values, steps)

    @property
    def helm(self) -> Step:
        return next(s for s in self.steps if s.verb == "helm-install")

    def run(self, api, kubeconfig: str, repo: Path, exists_ok: Callable[[int], bool] = lambda status: False):
        """Run each step in order; returns the Helm release. `exists_ok(409)` lets a kept
        development cluster (GPULENS_CLUSTER_REUSE) take the same steps twice."""
        from helm_python import Config
        from kubernetes import client
        from kubernetes.client.rest import ApiException
        release = None
        for step in self.steps:
            a = step.args
            try:
                if step.verb == "namespace":
                    api.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=a["name"])))
                elif step.verb == "secret":
                    api.create_namespaced_secret(a["namespace"], client.V1Secret(
                        metadata=client.V1ObjectMeta(name=a["name"]),
                        data={k: base64.b64encode(v.encode()).decode() for k, v in a["data"].items()}))
                elif step.verb == "secret-patch":
                    # What `kubectl patch --type merge` sends; the apiserver folds stringData into data.
                    api.patch_namespaced_secret(a["name"], a["namespace"], {"stringData": a["data"]},
                                                _content_type="application/merge-patch+json")
                elif step.verb == "label":
                    api.patch_namespace(a["name"], {"metadata": {"labels": a["labels"]}})
                else:
                    values = yaml.safe_load(yaml.safe_dump(self.values))
                    for s in a["sets"]:
                        _set(values, s)
                    cfg = Config(kubeconfig_path=kubeconfig, namespace=a["namespace"])
                    chart = str((repo / a["chart"]).resolve())
                    wait = "watcher" if a["wait"] else None
                    if exists_ok(409) and any(r.get("name") == a["release"]
                                              for r in cfg.list(name_filter=f"^{re.escape(a['release'])}$") or []):
                        release = cfg.upgrade(chart, a["release"], values, namespace=a["namespace"], wait=wait,
                                              timeout=a["timeout_s"])
                    else:
                        release = cfg.install(chart, a["release"], values, namespace=a["namespace"], wait=wait,
                                              timeout=a["timeout_s"])
            except ApiException as e:
                if not exists_ok(e.status):
                    raise
        return release
