"""The rules, judged by the real promtool: they load, and every scenario (three incidents, the
extra diagnoses, the non-events) gets exactly the alerts it should. Mutation tests prove each
guard is load-bearing: break it, and a named scenario fails."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gpulens.alertrules import promtool_tests, ruleset, scenarios

from .conftest import ALERTRULES, run

TEST_FILES = sorted(promtool_tests.FILES)


def test_rule_files_pass_promtool_check(promtool):
    files = [str(p) for p in ruleset.load().files]
    result = run(promtool, "check", "rules", *files)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(files)


def test_committed_promtool_tests_match_the_scenarios():
    rendered = promtool_tests.render_files()
    assert sorted(rendered) == TEST_FILES
    for name, text in rendered.items():
        committed = (ALERTRULES / "tests" / name).read_text()
        assert committed == text, f"alertrules/tests/{name} is stale: run python -m gpulens.alertrules.promtool_tests"


def test_stale_test_file_is_reported(tmp_path):
    assert promtool_tests.main(["--out", str(tmp_path)]) == 0
    assert promtool_tests.main(["--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "incidents.test.yml").write_text("# edited by hand\n")
    assert promtool_tests.main(["--out", str(tmp_path), "--check"]) == 1


@pytest.mark.parametrize("test_file", TEST_FILES)
def test_promtool_scenarios(promtool, test_file):
    result = run(promtool, "test", "rules", test_file, cwd=ALERTRULES / "tests")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_check_lists_every_alert_name():
    """'Nothing else fires' is only proven if each check names every alert (empty = silent)."""
    import yaml
    names = set(ruleset.load().alert_names)
    for test_file in TEST_FILES:
        doc = yaml.safe_load((ALERTRULES / "tests" / test_file).read_text())
        for case in doc["tests"]:
            by_time: dict[str, set[str]] = {}
            for check in case.get("alert_rule_test", []):
                by_time.setdefault(check["eval_time"], set()).add(check["alertname"])
            for eval_time, checked in by_time.items():
                assert checked == names, f"{test_file} {case['name'][:40]} at {eval_time}"


def test_design_incidents_have_their_own_diagnosis():
    """DESIGN.md: each of the three incidents gets a distinct diagnosis named after it."""
    by_name = {s.name: s for s in scenarios.INCIDENTS}
    seen = set()
    for incident in ("host_sync", "noisy_neighbor", "input_starvation"):
        firing = [f for e in by_name[incident].expect for f in e.firing]
        assert len(firing) == 1
        alertname, labels = firing[0]
        assert labels["diagnosis"] == incident
        assert ruleset.load().alert(alertname)["labels"]["diagnosis"] == incident
        seen.add(alertname)
    assert len(seen) == 3


def test_non_events_expect_silence():
    for scenario in scenarios.NON_EVENTS:
        assert scenario.expect, scenario.name
        assert all(not e.firing for e in scenario.expect), scenario.name
    names = {s.name for s in scenarios.NON_EVENTS}
    assert {"steady_job", "job_ends", "exporter_restart_counter_reset",
            "exporter_restart_between_scrapes", "tiny_traffic"} <= names
    for scenario in scenarios.NON_EVENTS_WORKLOADS:
        assert len(scenario.expect) >= 25 and all(not e.firing for e in scenario.expect), scenario.name
    assert {s.name for s in scenarios.NON_EVENTS_WORKLOADS} == {
        "rollout_without_change", "scale_in_4_to_2", "scale_out_2_to_4", "new_run_same_job_label",
        "process_restart"}


def test_workload_scenarios_state_when_the_alert_starts_and_stops():
    """Issue 14: each lasting or replaced-pod incident fires one named alert for the new pod, from
    a stated minute to a stated minute (silent the minute before and the minute after)."""
    by_name = {s.name: s for s in scenarios.WORKLOADS}
    assert set(by_name) == {"redeploy_host_sync", "resize_input_starvation", "noisy_neighbor_for_an_hour",
                            "rollback_resolves", "host_sync_reverted_in_place", "host_sync_lasting"}
    T = scenarios.T
    for name, (alertname, start, stop) in {
        "redeploy_host_sync": ("GPUWorkloadHostSync", T + 18, T + 95),
        "resize_input_starvation": ("GPUWorkloadInputStarvation", T + 15, T + 95),
        "noisy_neighbor_for_an_hour": ("GPUWorkloadNoisyNeighbor", T + 10, T + 60),
        "host_sync_lasting": ("GPUWorkloadHostSync", T + 9, T + 96),
    }.items():
        expect = {e.minute: e.firing for e in by_name[name].expect}
        assert expect[start - 1] == () and expect[stop] == (), name
        assert [f[0] for f in expect[start]] == [alertname] and [f[0] for f in expect[stop - 1]] == [alertname]
        assert stop - start >= 50, f"{name}: the alert must last while the regression does"
    # the new pod is the one named, with its workload
    labels = dict(by_name["redeploy_host_sync"].expect[-5].firing[0][1])
    assert labels["pod"] == "llama-ft-worker-0-p9q4z" and labels["gpulens_workload"] == "job/llama-ft"


RECORDING = "gpulens-recording.rules.yml"
ALERTS = "gpulens-alerts.rules.yml"
K = "namespace, pod, gpulens_job, gpulens_workload, node"

# (id, rule file, text to replace (every occurrence), replacement, test file, scenario that must fail)
CAPTURE = "gpulens-capture.rules.yml"

MUTATIONS = [
    ("captures-failing-without-a-minimum", CAPTURE, ">= 4", ">= 0", "capture.test.yml", "captures_mostly_archived"),
    ("agent-down-on-any-scrape", CAPTURE, 'up{job=~".*gpulens.*agent.*"} == 0', "up == 0", "capture.test.yml",
     "agent_down"),
    ("captures-failing-on-any-failure", CAPTURE, ") > 0.5", ") > 0", "capture.test.yml", "captures_mostly_archived"),
    ("liveness-is-just-exported-counters", RECORDING,
     "          (\n"
     f"              group by ({K}) (gpulens_process_gpu_memory_bytes)\n"
     "            or\n"
     "              (\n"
     f"                  group by ({K}) (gpulens_kernel_launches_total)\n"
     "                unless on (node)\n"
     "                  (max by (node) (gpulens_exporter_source_up{source=\"nvml\"}) > 0)\n"
     "              )\n"
     "          )",
     f"          group by ({K}) (gpulens_kernel_launches_total)",
     "non_events.test.yml", "job_ends"),
    ("gate-without-nvml-fallback", RECORDING,
     "unless on (node)\n                  (max by (node) (gpulens_exporter_source_up{source=\"nvml\"}) > 0)",
     "and on (node)\n                  (max by (node) (gpulens_exporter_source_up{source=\"nvml\"}) > 0)",
     "incidents.test.yml", "unclassified_demand_drop_without_nvml"),
    ("stall-without-a-live-process", ALERTS,
     f"          and on ({K})\n"
     f"          group by ({K}) (gpulens_process_gpu_memory_bytes)\n", "",
     "non_events.test.yml", "job_ends_without_nvml"),
    ("no-minimum-baseline", RECORDING, ">= 20)", ">= 0)", "non_events.test.yml", "tiny_traffic"),
    ("no-history-guard", RECORDING,
     "          and on (namespace, gpulens_workload)\n"
     "          (namespace_workload:gpulens_launches_per_worker:rate5m offset 35m)\n", "",
     "non_events.test.yml", "young_job"),
    ("contention-need-not-appear", RECORDING,
     "\n          and namespace_pod:gpulens_gpu_pods:max\n"
     "            > on (namespace, gpulens_workload) group_left () namespace_workload:gpulens_gpu_pods:baseline_avg_max",
     "", "incidents.test.yml", "input_starvation_on_shared_gpu"),
    ("counter-resets-not-handled", RECORDING,
     "(rate(gpulens_kernel_launches_total[5m]))", "(deriv(gpulens_kernel_launches_total[5m]))",
     "non_events.test.yml", 'expr: "count(namespace_pod:gpulens_launches:rate5m < 1500)"'),
    ("no-for", ALERTS, "for: 5m", "for: 0s", "non_events.test.yml", "brief_dip"),
    ("wrong-diagnosis", ALERTS, "diagnosis: input_starvation", "diagnosis: noisy_neighbor",
     "incidents.test.yml", "input_starvation"),
    ("host-sync-ignores-contention", ALERTS,
     f"          unless on ({K}) namespace_pod:gpulens_gpu_pods:max_rising\n"
     f"          unless on ({K}) (\n",
     f"          unless on ({K}) (\n",
     "non_events.test.yml", "neighbour_without_slowdown"),
    ("job-label-dropped", RECORDING,
     f"expr: sum by ({K}) (rate(gpulens_kernel_launches_total[5m]))",
     "expr: sum by (namespace, pod, gpulens_workload, node) (rate(gpulens_kernel_launches_total[5m]))",
     "incidents.test.yml", "host_sync"),
    ("graph-launches-not-counted", RECORDING,
     "(namespace_pod:gpulens_kernel_launches:rate5m + namespace_pod:gpulens_graph_launches:rate5m)\n"
     "          or ", "", "recording.test.yml", 'expr: "namespace_pod:gpulens_launches:rate5m"'),
    # --- the workload baselines (issue 14) ---
    ("baseline-keyed-on-the-pod", RECORDING, "gpulens_workload)", "gpulens_workload, pod)",
     "workloads.test.yml", "redeploy_host_sync"),
    ("workload-summed-not-per-pod", RECORDING,
     "avg by (namespace, gpulens_workload) (\n              namespace_pod:gpulens_launches_per_worker:rate5m",
     "sum by (namespace, gpulens_workload) (\n              namespace_pod:gpulens_launches_per_worker:rate5m",
     "workloads.test.yml", "scale_in_4_to_2"),
    ("new-pods-judged-during-warm-up", RECORDING,
     "(namespace_pod:gpulens_live:since_timestamp offset 10m)", "(namespace_pod:gpulens_live:since_timestamp)",
     "workloads.test.yml", "rollout_without_change"),
    ("process-restart-not-a-new-warm-up", RECORDING,
     "          (\n"
     "              last_over_time(namespace_pod:gpulens_live:since_timestamp[2m])\n"
     f"            and on ({K})\n"
     "              namespace_pod:gpulens_live:group\n"
     "          )\n"
     "          or (namespace_pod:gpulens_live:group * 0 + time())",
     "          namespace_pod:gpulens_live:group * 0",
     "workloads.test.yml", "process_restart"),
    ("baseline-absorbs-the-regression", RECORDING,
     "\n          unless on (namespace, gpulens_workload)\n"
     "          max_over_time(namespace_workload:gpulens_off_baseline:group[5m])", "",
     "workloads.test.yml", "host_sync_lasting"),
    ("baseline-not-held", RECORDING, "[1h])", "[1m])", "workloads.test.yml", "host_sync_lasting"),
    # --- per worker (issue 29): the old per-pod sums let 8 small workers cross a floor that one does not ---
    ("demand-floor-per-pod", RECORDING,
     f"namespace_pod:gpulens_launches:rate5m / on ({K}) namespace_pod:gpulens_workers:count",
     "namespace_pod:gpulens_launches:rate5m", "workers.test.yml", "workers_tiny_noise_8"),
    ("demand-floor-per-pod-2", RECORDING,
     f"namespace_pod:gpulens_launches:rate5m / on ({K}) namespace_pod:gpulens_workers:count",
     "namespace_pod:gpulens_launches:rate5m", "workers.test.yml", "workers_tiny_noise_2"),
    ("copy-floors-per-pod", RECORDING,
     f"\n          / on ({K}) group_left () namespace_pod:gpulens_workers:count\n", "\n",
     "workers.test.yml", "workers_device_slowdown_8"),
    ("feed-floor-per-pod", RECORDING,
     f"\n          / on ({K}) group_left () namespace_pod:gpulens_workers:count\n", "\n",
     "workers.test.yml", "workers_demand_drop_2"),
    ("blocked-share-unbounded", RECORDING,
     "clamp_max(rate(gpulens_sync_wait_seconds_total[5m]), 1)", "rate(gpulens_sync_wait_seconds_total[5m])",
     "workers.test.yml", 'expr: "namespace_pod:gpulens_sync_wait_seconds:avg_rate5m"'),
    ("exited-workers-counted", RECORDING,
     "rate(gpulens_kernel_launches_total[5m]) > 0 or rate(gpulens_graph_launches_total[5m]) > 0",
     "gpulens_kernel_launches_total", "workers.test.yml", "workers_one_rank_exits"),
    ("workers-without-rank", RECORDING, "container, gpu, rank)", "container, gpu)",
     "workers.test.yml", 'expr: "namespace_pod:gpulens_workers:count"'),
]


def _only_the_scenario(test_file: Path, scenario: str) -> None:
    """Keep only the test case the mutation names (or, for an expr, the cases that check it): the
    rest of the file passes or fails on its own, and promtool is slow on the whole file."""
    import yaml
    doc = yaml.safe_load(test_file.read_text())
    if scenario.startswith("expr:"):
        expr = scenario.split('"')[1]
        keep = [c for c in doc["tests"] if any(e["expr"] == expr for e in c.get("promql_expr_test", []))]
    else:
        keep = [c for c in doc["tests"] if c["name"].split(":")[0] == scenario]
    assert keep, f"no test case {scenario!r} in {test_file.name}"
    doc["tests"] = keep
    test_file.write_text(yaml.safe_dump(doc, sort_keys=False, width=1000))


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_breaking_a_guard_fails_a_named_scenario(promtool, rules_copy: Path, mutation):
    _, rule_file, old, new, test_file, scenario = mutation
    path = rules_copy / "rules" / rule_file
    text = path.read_text()
    assert old in text, "mutation no longer applies: update it with the rules"
    path.write_text(text.replace(old, new))
    assert run(promtool, "check", "rules", str(path)).returncode == 0, "mutant must still be valid"
    _only_the_scenario(rules_copy / "tests" / test_file, scenario)
    result = run(promtool, "test", "rules", test_file, cwd=rules_copy / "tests")
    assert result.returncode != 0, f"{scenario} in {test_file} passed against the mutant"
    output = result.stdout + result.stderr
    if scenario.startswith("expr:"):  # promtool names no test case for a promql_expr_test failure
        assert scenario in output, output[:2000]
        return
    failed = sorted({line.strip().split(":")[1].strip() for line in output.splitlines()
                     if line.strip().startswith("name:")})
    assert scenario in failed, f"expected {scenario!r} to fail, failed: {failed}"


def test_the_unmutated_scenarios_pass_one_by_one(promtool, rules_copy: Path):
    """The mutation tests run one scenario at a time: the same extraction passes on the real rules."""
    for _, _, _, _, test_file, scenario in MUTATIONS[-7:]:
        _only_the_scenario(rules_copy / "tests" / test_file, scenario)
        result = run(promtool, "test", "rules", test_file, cwd=rules_copy / "tests")
        assert result.returncode == 0, result.stdout + result.stderr
        shutil.copy(ALERTRULES / "tests" / test_file, rules_copy / "tests" / test_file)


def test_worker_counts_fire_the_same_alert_at_the_same_minute():
    """Issue 29: each per-worker story is told with 1, 2 and 8 workers per container and expects the
    same alerts (name and diagnosis) at the same minutes, silence included; promtool then proves it."""
    stories: dict[str, dict[int, scenarios.Scenario]] = {}
    for s in scenarios.WORKERS:
        if s.expect and s.name.rsplit("_", 1)[1].isdigit():
            story, n = s.name.rsplit("_", 1)
            stories.setdefault(story, {})[int(n)] = s
    assert set(stories) == {"workers_host_sync", "workers_device_slowdown", "workers_demand_drop", "workers_tiny_noise"}
    for story, by_n in stories.items():
        assert sorted(by_n) == list(scenarios.WORKER_COUNTS) == [1, 2, 8], story
        timelines = set()
        for n, s in by_n.items():
            (pod,) = s.pods
            assert pod.workers == n and len(pod.ranks()) == n
            timelines.add(tuple((e.minute, tuple((a, labels["diagnosis"]) for a, labels in e.firing)) for e in s.expect))
        assert len(timelines) == 1, f"{story}: the worker counts expect different alerts or minutes"
        (timeline,) = timelines
        if story != "workers_tiny_noise":     # the minute before the first firing is checked silent
            first = next(i for i, (_, firing) in enumerate(timeline) if firing)
            assert timeline[first - 1][0] == timeline[first][0] - 1 and not timeline[first - 1][1]
        else:
            assert all(not firing for _, firing in timeline)
