"""The Kubernetes kit (deploy/kubernetes/): its PrometheusRule is generated from the Prometheus
alert rules, its manifests pass the strict schema check (and broken ones fail it), and they agree
with the relay's settings, the Dockerfile and each other. No cluster needed: files are parsed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from notify_outbox.cli.app import _parser
from notify_outbox.core.settings import DatabaseSettings, OutboxSettings, unknown_variables
from notify_outbox.ops.http import HttpSettings
from tools import k8s

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "deploy" / "kubernetes"
BROKEN = Path(__file__).parent / "k8s_broken"
SECRET_VARIABLES = re.compile(r"NOTIFY_OUTBOX_\w*(DSN|PASSWORD)$")


def _kit() -> dict[str, dict[str, Any]]:
    """The kit's resources by kind (one of each)."""
    found: dict[str, dict[str, Any]] = {}
    for path in k8s.manifest_files([KIT]):
        for doc in k8s.load_documents(path):
            assert doc["kind"] not in found, f"two {doc['kind']} in the kit"
            found[doc["kind"]] = doc
    return found


def _relay_env() -> dict[str, str]:
    lines = (KIT / "relay.env").read_text(encoding="utf-8").splitlines()
    pairs = (line.partition("=") for line in lines if line.strip() and not line.startswith("#"))
    return {key: value for key, _, value in pairs}


def _container(resource: dict[str, Any]) -> dict[str, Any]:
    (container,) = resource["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


# --- the PrometheusRule -----------------------------------------------------------------------


def test_prometheus_rule_is_generated_from_the_alert_rules() -> None:
    committed = (KIT / "prometheusrule.yaml").read_text(encoding="utf-8")
    assert committed == k8s.expected_prometheus_rule(), (
        "deploy/kubernetes/prometheusrule.yaml drifted from deploy/prometheus/"
        "notify-outbox-alerts.yml: run `python -m tools.k8s rules`"
    )


def test_prometheus_rule_has_the_same_rules_plus_runbook_urls() -> None:
    source = yaml.safe_load(k8s.ALERTS.read_text(encoding="utf-8"))["groups"]
    groups = _kit()["PrometheusRule"]["spec"]["groups"]
    site = k8s.docs_url(k8s.PYPROJECT.read_text(encoding="utf-8"))
    anchors = k8s.page_anchors(k8s.ALERTS_PAGE.read_text(encoding="utf-8"))
    assert k8s.docs_anchor("NotifyOutboxRelayDown") == "notifyoutboxrelaydown"
    assert [g["name"] for g in groups] == [g["name"] for g in source]
    for group, original in zip(groups, source, strict=True):
        assert len(group["rules"]) == len(original["rules"])
        for rule, want in zip(group["rules"], original["rules"], strict=True):
            url = rule["annotations"].pop("runbook_url")
            anchor = rule["alert"].lower()
            assert url == f"{site}operations/alerts/#{anchor}", url
            assert anchor in anchors, f"docs/operations/alerts.md has no section {rule['alert']}"
            assert rule == want


def test_a_changed_alert_rule_changes_the_rendering() -> None:
    # What the drift test relies on: the rendering follows its source.
    alerts = k8s.ALERTS.read_text(encoding="utf-8")
    changed = alerts.replace("> 1000", "> 2000", 1)
    assert changed != alerts

    def url(alert: str) -> str:
        return f"https://example.invalid/alerts/#{alert.lower()}"

    assert k8s.render_prometheus_rule(changed, url) != k8s.render_prometheus_rule(alerts, url)


def test_runbook_url_needs_the_alerts_runbook_heading() -> None:
    pyproject = k8s.PYPROJECT.read_text(encoding="utf-8")
    page = "# Alerts\n## NotifyOutboxRelayDown\n```\n## NotifyOutboxBacklogHigh\n```\n"
    assert k8s.runbook_url(pyproject, page, "NotifyOutboxRelayDown").endswith(
        "/operations/alerts/#notifyoutboxrelaydown"
    )
    # A heading inside fenced code is no heading; a missing one fails, naming the alert.
    with pytest.raises(k8s.KitError, match="no heading 'NotifyOutboxBacklogHigh'"):
        k8s.runbook_url(pyproject, page, "NotifyOutboxBacklogHigh")
    with pytest.raises(k8s.KitError, match="no heading"):
        k8s.runbook_url(pyproject, "# notify-outbox\n### Monitoring\n", "NotifyOutboxRelayDown")


# --- schema validation ------------------------------------------------------------------------


def test_the_kit_validates_strictly() -> None:
    files = k8s.manifest_files([KIT])
    assert {f.name for f in files} >= {
        "deployment.yaml",
        "migrate-job.yaml",
        "pdb.yaml",
        "service.yaml",
        "servicemonitor.yaml",
        "prometheusrule.yaml",
    }
    assert k8s.validate_files(files) == []


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("deployment-unknown-field.yaml", "'imagePulPolicy' was unexpected"),
        ("deployment-wrong-type.yaml", "spec.replicas: 'two' is not of type"),
        ("duplicate-key.yaml", "duplicate key 'name'"),
        ("unknown-kind.yaml", "no schema for Deploymnet apps/v1"),
        ("servicemonitor-unknown-field.yaml", "'intervall' was unexpected"),
        ("prometheusrule-bad-metadata.yaml", "metadata: Additional properties"),
        ("prometheusrule-bad-duration.yaml", "spec.groups.0.rules.0.for: 'five minutes'"),
    ],
)
def test_a_broken_manifest_is_rejected(name: str, why: str) -> None:
    problems = k8s.validate_files([BROKEN / name])
    assert problems, f"{name} was accepted"
    assert all(why in p for p in problems), problems


def test_every_broken_manifest_has_a_case() -> None:
    source = Path(__file__).read_text(encoding="utf-8")
    assert all(f'"{p.name}"' in source for p in BROKEN.glob("*.yaml"))


def test_the_command_fails_on_a_broken_manifest(capsys: pytest.CaptureFixture[str]) -> None:
    assert k8s.main(["validate", str(BROKEN / "unknown-kind.yaml")]) == 1
    assert "no schema for Deploymnet" in capsys.readouterr().err


def test_a_manifest_left_out_of_the_kustomization_fails(tmp_path: Path) -> None:
    for path in KIT.iterdir():
        if path.is_file():
            (tmp_path / path.name).write_bytes(path.read_bytes())
    (tmp_path / "extra.yaml").write_text("apiVersion: v1\nkind: ConfigMap\n", encoding="utf-8")
    with pytest.raises(k8s.KitError, match=r"does not list \['extra.yaml'\]"):
        k8s.manifest_files([tmp_path])


# --- the manifests agree with the relay and with each other -----------------------------------


def test_settings_are_known_and_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    kit = _kit()
    env = _relay_env()
    named = set(env)
    for kind in ("Deployment", "Job"):
        named |= {e["name"] for e in _container(kit[kind]).get("env", [])}
    classes = (DatabaseSettings, OutboxSettings, HttpSettings)
    assert unknown_variables(dict.fromkeys(named, ""), settings=classes) == []
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = OutboxSettings(dsn="postgresql://relay@db/app")  # type: ignore[arg-type, call-arg]
    assert settings.http_host == "0.0.0.0"  # noqa: S104 - reachable by the kubelet's probes
    assert settings.http_port is not None
    pod = kit["Deployment"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > settings.shutdown_timeout + 5
    (port,) = _container(kit["Deployment"])["ports"]
    assert port["containerPort"] == settings.http_port


def test_secrets_come_from_the_secret() -> None:
    kit = _kit()
    assert not [key for key in _relay_env() if SECRET_VARIABLES.match(key)]
    for kind, key in (("Deployment", "dsn"), ("Job", "migrate-dsn")):
        container = _container(kit[kind])
        env = {e["name"]: e for e in container["env"]}
        # The DSN as a file of the Secret (NOTIFY_OUTBOX_DSN_FILE), never a value in the
        # environment.
        assert "NOTIFY_OUTBOX_DSN" not in env
        path = env["NOTIFY_OUTBOX_DSN_FILE"]["value"]
        directory, _, file = path.rpartition("/")
        assert file == key
        pod = kit[kind]["spec"]["template"]["spec"]
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == directory)
        assert mount["readOnly"] is True
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == "notify-outbox"
        # Readable by the relay's group only (the files are root's; the pod runs as 10001).
        assert volume["secret"]["defaultMode"] == 0o440
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
        assert all("value" not in e for n, e in env.items() if SECRET_VARIABLES.match(n))


def test_commands_probes_and_security() -> None:
    kit = _kit()
    relay, migrate = _container(kit["Deployment"]), _container(kit["Job"])
    assert relay["command"] == ["python", "-m", "notify_outbox", "run"]
    assert migrate["command"] == ["python", "-m", "notify_outbox", "migrate"]
    for command in (relay["command"], migrate["command"]):
        assert _parser().parse_args(command[3:]).command == command[3]
    assert relay["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}
    assert relay["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    uid = int(re.findall(r"--uid (\d+)", (ROOT / "Dockerfile").read_text(encoding="utf-8"))[0])
    for resource, container in ((kit["Deployment"], relay), (kit["Job"], migrate)):
        pod = resource["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == uid
        assert pod["automountServiceAccountToken"] is False
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["resources"]["limits"]["memory"]
        assert container["resources"]["requests"]["memory"]


def test_selectors_and_ports_match() -> None:
    kit = _kit()
    pod_labels = kit["Deployment"]["spec"]["template"]["metadata"]["labels"]
    service = kit["Service"]
    monitor = kit["ServiceMonitor"]["spec"]

    def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
        return selector.items() <= labels.items()

    assert selects(kit["Deployment"]["spec"]["selector"]["matchLabels"], pod_labels)
    assert selects(kit["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"], pod_labels)
    assert selects(service["spec"]["selector"], pod_labels)
    assert selects(monitor["selector"]["matchLabels"], service["metadata"]["labels"])
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == _container(kit["Deployment"])["ports"][0]["name"]
    assert [e["port"] for e in monitor["endpoints"]] == [port["name"]]
    # The alert rules match job="notify-outbox": the job comes from the jobLabel label.
    assert service["metadata"]["labels"][monitor["jobLabel"]] == "notify-outbox"
    assert 'job="notify-outbox"' in k8s.ALERTS.read_text(encoding="utf-8")
