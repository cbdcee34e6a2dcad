"""The docs site's generated references (tools/docgen.py) match the code: the configuration
reference documents every ``NOTIFY_OUTBOX_*`` variable, the CLI reference every command and flag,
and the committed pages are exactly what the generator gives today."""

from __future__ import annotations

import argparse
import copy
import re
from pathlib import Path

import markdown
import pytest
import yaml

from notify_outbox.cli.app import _parser
from notify_outbox.core.settings import _OTHER_VARIABLES, OutboxSettings
from tools import docgen, k8s

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted(docgen.expected_pages()), ids=lambda p: p.name)
def test_generated_reference_matches_the_code(path: Path) -> None:
    expected = docgen.expected_pages()[path]
    committed = path.read_text(encoding="utf-8") if path.exists() else None
    assert committed == expected, (
        f"{path.relative_to(ROOT)} drifted from the code: run `make docs-reference` "
        "(python -m tools.docgen) and commit the result"
    )


def test_every_setting_is_documented_with_its_variable_and_description() -> None:
    page = docgen.render_configuration()
    for name, field in OutboxSettings.model_fields.items():
        assert f"| `NOTIFY_OUTBOX_{name.upper()}` |" in page, name
        assert field.description, f"OutboxSettings.{name} has no Field(description=...)"
    for suffix in _OTHER_VARIABLES:
        assert f"| `NOTIFY_OUTBOX_{suffix}` |" in page, suffix


def test_a_field_without_a_description_is_refused() -> None:
    field = copy.copy(OutboxSettings.model_fields["workers"])
    field.description = None
    with pytest.raises(ValueError, match="no description"):
        docgen._field_row("workers", field)


def _commands(
    parser: argparse.ArgumentParser, path: str
) -> list[tuple[str, argparse.ArgumentParser]]:
    found = []
    for name, _, sub in docgen._subcommands(parser):
        found.append((f"{path} {name}", sub))
        found.extend(_commands(sub, f"{path} {name}"))
    return found


def test_every_command_and_flag_is_in_the_cli_reference() -> None:
    page = docgen.render_cli()
    commands = _commands(_parser(), "notify-outbox")
    # The sub-CLIs are reachable from the main parser, and so documented.
    names = {path for path, _ in commands}
    assert {
        "notify-outbox run",
        "notify-outbox inbox purge",
        "notify-outbox debezium install",
        "notify-outbox dead-letters requeue",
        "notify-outbox replay",
    } <= names
    for path, sub in commands:
        heading = f"# `{path}`\n"
        assert heading in page, path
        section = page.split(heading, 1)[1].split("\n#", 1)[0]
        for action in sub._actions:
            if not docgen._documented(action, top=False):
                continue
            name = action.option_strings[0] if action.option_strings else action.dest
            assert f"`{name}`" in section, f"{path}: {name}"


# --- the site and the alerts' runbook ---------------------------------------------------------


def test_site_url_is_the_documentation_url_of_pyproject() -> None:
    site_url = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["site_url"]
    assert site_url == k8s.docs_url(k8s.PYPROJECT.read_text(encoding="utf-8"))


def test_every_alert_has_a_runbook_section() -> None:
    alerts = k8s.alert_names(k8s.ALERTS.read_text(encoding="utf-8"))
    assert len(alerts) == 8
    page = k8s.ALERTS_PAGE.read_text(encoding="utf-8")
    anchors = k8s.page_anchors(page)
    for alert in alerts:
        assert f"\n## {alert}\n" in page, f"docs/operations/alerts.md: no section for {alert}"
        assert k8s.docs_anchor(alert) in anchors
        assert f"(#{k8s.docs_anchor(alert)})" in page, f"{alert} is missing from the table"


@pytest.mark.parametrize(
    "heading",
    ["NotifyOutboxRelayDown", "Tracing (OpenTelemetry, optional)", "`notify-outbox run`", "Ä b–c"],
)
def test_the_runbook_anchors_are_mkdocs_anchors(heading: str) -> None:
    # The anchor tools.k8s links to is the one the site's Markdown (toc) gives the heading.
    html = markdown.markdown(f"## {heading}\n", extensions=["toc"])
    expected = re.search(r'id="([^"]*)"', html)
    assert expected is not None
    assert k8s.docs_anchor(heading.replace("`", "")) == expected.group(1)
