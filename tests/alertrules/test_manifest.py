"""The second form of the rules: a PrometheusRule manifest generated from the plain files, plus
re-based links and time-scaled copies for demos."""

from __future__ import annotations

import jsonschema
import pytest
import yaml

from gpulens.alertrules import generate, manifest, ruleset

from .conftest import run

DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}

#: The subset of the monitoring.coreos.com/v1 PrometheusRule CRD schema that gpulens uses,
#: stricter than the CRD (no unknown fields, exactly one of alert/record).
PROMETHEUS_RULE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string", "minLength": 1},
                                    "namespace": {"type": "string"}, "labels": _STR_MAP}},
        "spec": {"type": "object", "additionalProperties": False, "required": ["groups"], "properties": {
            "groups": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "required": ["name", "rules"],
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "interval": {"type": "string", "pattern": DURATION},
                    "rules": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "additionalProperties": False, "required": ["expr"],
                        "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                        "properties": {
                            "alert": {"type": "string"}, "record": {"type": "string"},
                            "expr": {"type": "string", "minLength": 1},
                            "for": {"type": "string", "pattern": DURATION},
                            "labels": _STR_MAP, "annotations": _STR_MAP,
                        }}},
                }}}}},
    },
}


def _committed():
    return yaml.safe_load(generate.MANIFEST_PATH.read_text())


def test_committed_manifest_is_current():
    assert generate.main(["--check"]) == 0, "run python -m gpulens.alertrules.generate"


def test_check_reports_a_stale_manifest(tmp_path):
    out = tmp_path / "rule.yaml"
    assert generate.main(["--manifest-out", str(out)]) == 0
    assert generate.main(["--manifest-out", str(out), "--check"]) == 0
    out.write_text(out.read_text().replace("for: 5m", "for: 1m", 1))
    assert generate.main(["--manifest-out", str(out), "--check"]) == 1


def test_manifest_matches_the_prometheusrule_schema():
    jsonschema.Draft7Validator(PROMETHEUS_RULE).validate(_committed())


def test_schema_catches_what_the_crd_rejects():
    bad = _committed()
    del bad["spec"]["groups"][0]["rules"][0]["expr"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(PROMETHEUS_RULE).validate(bad)
    bad = _committed()
    bad["spec"]["groups"][0]["rules"][0]["for"] = "five minutes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(PROMETHEUS_RULE).validate(bad)


def test_manifest_holds_exactly_the_plain_rules(tmp_path, promtool):
    spec_groups = _committed()["spec"]["groups"]
    source = [g for p in ruleset.load().files for g in yaml.safe_load(p.read_text())["groups"]]
    assert spec_groups == source
    extracted = tmp_path / "extracted.rules.yml"
    extracted.write_text(yaml.safe_dump({"groups": spec_groups}))
    result = run(promtool, "check", "rules", str(extracted))
    assert result.returncode == 0, result.stdout + result.stderr


def test_rebase_and_labels(tmp_path):
    out, rules_out = tmp_path / "rule.yaml", tmp_path / "rules"
    rc = generate.main(["--manifest-out", str(out), "--rules-out", str(rules_out),
                        "--grafana-url", "https://grafana.corp/", "--runbook-base-url", "https://wiki.corp/gpu",
                        "--namespace", "monitoring", "--label", "release=kps", "--name", "gpu-rules"])
    assert rc == 0
    doc = yaml.safe_load(out.read_text())
    assert doc["metadata"] == {"name": "gpu-rules", "namespace": "monitoring", "labels": {
        "app.kubernetes.io/name": "gpulens", "app.kubernetes.io/component": "alertrules", "release": "kps"}}
    alerts = [r for g in doc["spec"]["groups"] for r in g["rules"] if "alert" in r]
    for a in alerts:
        assert a["annotations"]["runbook_url"] == f"https://wiki.corp/gpu/{a['labels']['diagnosis']}.md"
        assert a["annotations"]["dashboard_url"].startswith("https://grafana.corp/d/gpulens-")
        assert "example.com" not in str(a) and "localhost" not in str(a)
    plain = yaml.safe_load((rules_out / "gpulens-alerts.rules.yml").read_text())
    assert plain["groups"][0]["rules"][0]["annotations"]["runbook_url"].startswith("https://wiki.corp/gpu/")


def test_time_scale_for_demos(tmp_path, promtool):
    rules_out = tmp_path / "rules"
    assert generate.main(["--manifest-out", str(tmp_path / "m.yaml"), "--rules-out", str(rules_out),
                          "--time-scale", "0.0333"]) == 0
    result = run(promtool, "check", "rules", *map(str, sorted(rules_out.glob("*.yml"))))
    assert result.returncode == 0, result.stdout + result.stderr
    text = (rules_out / "gpulens-recording.rules.yml").read_text()
    assert "[5m]" not in text and "[10s]" in text and "offset 1m10s" in text
    alerts = (rules_out / "gpulens-alerts.rules.yml").read_text()
    assert "for: 5m" not in alerts and "for: 10s" in alerts
    # record names are contracts (dashboards read them): they keep their nominal windows
    assert "namespace_pod:gpulens_launches:rate5m" in text


@pytest.mark.parametrize("argv", [["--label", "novalue"], ["--time-scale", "0"], ["--time-scale", "-1"]])
def test_bad_arguments_fail_clearly(tmp_path, argv, capsys):
    with pytest.raises(SystemExit) if argv[0] == "--label" else _no_raise():
        rc = generate.main(argv + ["--manifest-out", str(tmp_path / "m.yaml")])
        assert rc == 2
    assert not (tmp_path / "m.yaml").exists()
    assert capsys.readouterr().err


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("text, seconds", [("5m", 300), ("1h30m", 5400), ("10s", 10), ("0", 0), ("1d", 86400)])
def test_durations(text, seconds):
    assert manifest.parse_duration(text) == seconds
    if seconds:
        assert manifest.parse_duration(manifest.format_duration(seconds)) == seconds


@pytest.mark.parametrize("text", ["", "5 minutes", "m5", "5x"])
def test_bad_durations(text):
    with pytest.raises(ValueError):
        manifest.parse_duration(text)
