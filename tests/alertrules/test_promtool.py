"""The rules, judged by the real promtool: they load, and every scenario (three incidents, the
extra diagnoses, the non-events) gets exactly the alerts it should. Mutation tests prove each
guard is load-bearing: break it, and a named scenario fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from alertrules import promtool_tests, ruleset, scenarios

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
        assert committed == text, f"alertrules/tests/{name} is stale: run python -m alertrules.promtool_tests"


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


RECORDING = "gpulens-recording.rules.yml"
ALERTS = "gpulens-alerts.rules.yml"

# (id, rule file, text to replace, replacement, test file that must fail, scenario it names)
MUTATIONS = [
    ("liveness-is-just-exported-counters", RECORDING,
     "          (\n"
     "              group by (namespace, pod, gpulens_job, node) (gpulens_process_gpu_memory_bytes)\n"
     "            or\n"
     "              (\n"
     "                  group by (namespace, pod, gpulens_job, node) (gpulens_kernel_launches_total)\n"
     "                unless on (node)\n"
     "                  (max by (node) (gpulens_exporter_source_up{source=\"nvml\"}) > 0)\n"
     "              )\n"
     "          )",
     "          group by (namespace, pod, gpulens_job, node) (gpulens_kernel_launches_total)",
     "non_events.test.yml", "job_ends"),
    ("gate-without-nvml-fallback", RECORDING,
     "unless on (node)\n                  (max by (node) (gpulens_exporter_source_up{source=\"nvml\"}) > 0)",
     "and on (node)\n                  (max by (node) (gpulens_exporter_source_up{source=\"nvml\"}) > 0)",
     "incidents.test.yml", "unclassified_demand_drop_without_nvml"),
    ("stall-without-a-live-process", ALERTS,
     "          and on (namespace, pod, gpulens_job, node)\n"
     "          group by (namespace, pod, gpulens_job, node) (gpulens_process_gpu_memory_bytes)\n", "",
     "non_events.test.yml", "job_ends_without_nvml"),
    ("no-minimum-baseline", RECORDING, ">= 20)", ">= 0)", "non_events.test.yml", "tiny_traffic"),
    ("no-history-guard", RECORDING,
     "          and on (namespace, pod, gpulens_job, node)\n"
     "          (namespace_pod:gpulens_launches:rate5m offset 35m)\n", "",
     "non_events.test.yml", "young_job"),
    ("contention-need-not-appear", RECORDING,
     "\n          and namespace_pod:gpulens_gpu_pods:max > namespace_pod:gpulens_gpu_pods:baseline30m_max", "",
     "incidents.test.yml", "input_starvation_on_shared_gpu"),
    ("counter-resets-not-handled", RECORDING,
     "(rate(gpulens_kernel_launches_total[5m]))", "(deriv(gpulens_kernel_launches_total[5m]))",
     "non_events.test.yml", 'expr: "count(namespace_pod:gpulens_launches:rate5m < 1500)"'),
    ("baseline-includes-the-drop", RECORDING,
     "avg_over_time(namespace_pod:gpulens_launches:rate5m[30m] offset 10m)",
     "avg_over_time(namespace_pod:gpulens_launches:rate5m[30m])",
     "incidents.test.yml", "noisy_neighbor"),
    ("no-for", ALERTS, "for: 5m", "for: 0s", "non_events.test.yml", "brief_dip"),
    ("wrong-diagnosis", ALERTS, "diagnosis: input_starvation", "diagnosis: noisy_neighbor",
     "incidents.test.yml", "input_starvation"),
    ("host-sync-ignores-contention", ALERTS,
     "          unless on (namespace, pod, gpulens_job, node) namespace_pod:gpulens_gpu_pods:max_rising\n"
     "          unless on (namespace, pod, gpulens_job, node) (\n",
     "          unless on (namespace, pod, gpulens_job, node) (\n",
     "non_events.test.yml", "neighbour_without_slowdown"),
    ("job-label-dropped", RECORDING,
     "expr: sum by (namespace, pod, gpulens_job, node) (rate(gpulens_kernel_launches_total[5m]))",
     "expr: sum by (namespace, pod, node) (rate(gpulens_kernel_launches_total[5m]))",
     "incidents.test.yml", "host_sync"),
    ("graph-launches-not-counted", RECORDING,
     "(namespace_pod:gpulens_kernel_launches:rate5m + namespace_pod:gpulens_graph_launches:rate5m)\n"
     "          or ", "", "recording.test.yml", 'expr: "namespace_pod:gpulens_launches:rate5m"'),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_breaking_a_guard_fails_a_named_scenario(promtool, rules_copy: Path, mutation):
    _, rule_file, old, new, test_file, scenario = mutation
    path = rules_copy / "rules" / rule_file
    text = path.read_text()
    assert old in text, "mutation no longer applies: update it with the rules"
    path.write_text(text.replace(old, new))
    assert run(promtool, "check", "rules", str(path)).returncode == 0, "mutant must still be valid"
    result = run(promtool, "test", "rules", test_file, cwd=rules_copy / "tests")
    assert result.returncode != 0, f"{test_file} passed against the mutant"
    output = result.stdout + result.stderr
    if scenario.startswith("expr:"):  # promtool names no test case for a promql_expr_test failure
        assert scenario in output, output[:2000]
        return
    failed = sorted({line.strip().split(":")[1].strip() for line in output.splitlines()
                     if line.strip().startswith("name:")})
    assert scenario in failed, f"expected {scenario!r} to fail, failed: {failed}"
