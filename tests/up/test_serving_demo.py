"""The serving demo's pieces of `gpulens up` (issue 30): its records make a serving revision, whose
coordinator runs with --serving, its replicas are told apart, and the CLI keeps the demos apart."""

from __future__ import annotations

import json
from pathlib import Path

from gpulens.cli import main as cli_main
from gpulens.up import command
from gpulens.up.local_operator import LocalOperator, serving_jobs
from gpulens.up.runner import SERVING_PODS, SERVING_REVISION, SERVING_WORKLOAD, Runner
from gpulens.up.supervisor import ChildSpec

from .test_local_operator import fake_runner, record


def up_args(tmp_path: Path, *argv: str):
    import argparse
    parser = argparse.ArgumentParser()
    command.configure(parser)
    return parser.parse_args(["--work-dir", str(tmp_path / "w"), *argv])


def test_records_naming_a_deployment_make_a_serving_revision(tmp_path):
    record(tmp_path, "train.json")
    record(tmp_path, "a.json", job_id=SERVING_REVISION, pod=SERVING_PODS[0], workload=SERVING_WORKLOAD)
    record(tmp_path, "b.json", job_id=SERVING_REVISION, pod=SERVING_PODS[1], workload=SERVING_WORKLOAD)
    record(tmp_path, "odd.json", job_id="cron", workload="CronJob/nightly")      # a workload, but not serving
    assert serving_jobs(tmp_path) == {("ns", SERVING_REVISION, 0)}


async def test_the_local_operator_starts_a_serving_coordinator_for_the_revision(tmp_path):
    runner = fake_runner(tmp_path)
    asked: list[tuple[str, bool]] = []

    def spec(ns, job, attempt, index, serving=False):
        asked.append((job, serving))
        return ChildSpec(f"coordinator-{ns}-{job}-a{attempt}", ["true"], url=f"http://127.0.0.1:{9470 + index}")

    runner.coordinator_spec = spec
    record(runner.layout.registry, "t.json")
    for i, pod in enumerate(SERVING_PODS):
        record(runner.layout.registry, f"r{i}.json", job_id=SERVING_REVISION, pod=pod, workload=SERVING_WORKLOAD)
    await LocalOperator(runner).reconcile()
    assert sorted(asked) == [(SERVING_REVISION, True), ("train", False)]
    assert any(f"serving revision ns/{SERVING_REVISION} attempt 0 registered" in s for s in runner.said)
    routes = json.loads(runner.layout.routes_file.read_text())
    assert {f"ns/{p}" for p in SERVING_PODS} <= set(routes["pods"])


def test_a_serving_coordinator_runs_with_serving_and_without_the_demo_baseline(tmp_path):
    runner = Runner(up_args(tmp_path, "--demo", "--serving", "--incident", "noisy_neighbor"))
    serving = runner.coordinator_spec("demo", SERVING_REVISION, 0, 0, serving=True).argv
    assert "--serving" in serving and "--baseline-after-s" not in serving   # its peer is its comparison
    training = Runner(up_args(tmp_path, "--demo", "--incident", "host_sync")).coordinator_spec("demo", "demo", 0, 0).argv
    assert "--serving" not in training and "--baseline-after-s" in training


def test_each_replica_is_its_own_pod_on_its_own_gpu(tmp_path):
    runner = Runner(up_args(tmp_path, "--demo", "--serving"))
    runner.stub = type("Stub", (), {"libcuda": Path("/stub/libcuda.so.1"), "env": staticmethod(lambda **kw: kw)})()
    specs = [runner._replica_spec(pod, device) for device, pod in enumerate(SERVING_PODS)]
    assert [s.argv[s.argv.index("--device") + 1] for s in specs] == ["0", "1"]
    envs = [s.env for s in specs]
    assert {e["GPULENS_JOB_ID"] for e in envs} == {SERVING_REVISION}
    assert {e["GPULENS_WORKLOAD"] for e in envs} == {SERVING_WORKLOAD}
    assert [e["GPULENS_POD_NAME"] for e in envs] == list(SERVING_PODS)
    # both are rank 0 of the revision: the agent tells them apart by pod uid, which must differ
    assert len({e["GPULENS_POD_UID"] for e in envs}) == 2 and all(e["GPULENS_POD_UID"] for e in envs)
    assert {e["GPULENS_STUB_DEVICES"] for e in envs} == {"2"}


def test_the_cli_keeps_serving_to_the_demo_and_its_incident(tmp_path, capsys):
    work = str(tmp_path / "w")
    assert cli_main(["up", "--work-dir", work, "--serving"]) == 2
    assert "--serving needs --demo" in capsys.readouterr().err
    assert cli_main(["up", "--work-dir", work, "--demo", "--serving", "--incident", "host_sync"]) == 2
    assert "induces noisy_neighbor" in capsys.readouterr().err


def test_up_without_the_demo_prints_the_lines_for_a_trainer_of_ones_own(tmp_path):
    """Issue 43: a hand-armed trainer is local/<GPULENS_JOB_ID> (the hook's default namespace), not
    demo/demo; and a dynolog daemon must be started with the trainers' socket folder."""
    own = Runner(up_args(tmp_path, "--trigger", "dynolog"))
    capture, arm, dynolog = own.hand_lines()
    assert "--namespace local --job <GPULENS_JOB_ID> --wait" in capture and "--job demo" not in capture
    assert f"GPULENS_SOCKET_DIR={own.layout.socket_dir}" in arm and "--namespace local --job <job>" in arm
    assert f"KINETO_IPC_SOCKET_DIR={own.layout.socket_dir} dynolog --enable_ipc_monitor" in dynolog
    builtin = Runner(up_args(tmp_path, "--trigger", "builtin")).hand_lines()
    assert len(builtin) == 2 and not any("dynolog" in line for line in builtin)
    demo = Runner(up_args(tmp_path, "--demo", "--trigger", "builtin")).hand_lines()
    assert "--namespace demo --job demo --wait" in demo[0]
    serving = Runner(up_args(tmp_path, "--demo", "--serving", "--trigger", "builtin")).hand_lines()
    assert f"--namespace demo --job {SERVING_REVISION} --wait" in serving[0]
