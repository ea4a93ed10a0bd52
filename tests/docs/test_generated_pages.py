"""The docs say what the code says: generated pages are current, and names in prose exist.

The reference pages (settings, metrics, alerts, commands), the runbook's rule blocks and
alert list, and the runbook entries of mkdocs.yml's nav are written by
`python scripts/gen_docs.py`; these tests fail when one of them differs from what the
script would write now, and say so with the command. The hand-written pages (and the
README) may name only settings, metrics and alerts that exist.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", REPO / "scripts" / "gen_docs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()

# RECEIPTS_* names the docs may mention that are no setting, each for a reason.
NOT_SETTINGS = {
    "RECEIPTS_CONCURENCY",  # the misspelling the unknown_setting warning catches
    "RECEIPTS_SERVICE_HOST", "RECEIPTS_PORT_9464_TCP_ADDR",  # Kubernetes service links
    "RECEIPTS_CHAOS_JOBS", "RECEIPTS_CHAOS_SEED",  # knobs of the chaos test
    "RECEIPTS_MODEL_EXAMPLES", "RECEIPTS_MODEL_STEPS",  # knobs of the lifecycle model test
    "RECEIPTS_TEST_REQUIRE_PG15",  # CI's switch for the machine's PostgreSQL 15
}
# receipts_* names that are no metric: database objects and code.
NOT_METRICS = {
    "receipts_enqueue",  # the SQL function
    "receipts_record_attempts",  # the attempt history's one door (migration 0009)
    "receipts_prune",  # pruning's one door (migration 0009)
    "receipts_pause_reason",  # the effective pause rule (migration 0008)
    "receipts_job_rules",  # the job row's rules, one CHECK (migration 0012)
    "receipts_refuse_unguarded_done",  # the done guard's trigger function
    "receipts_ready",  # the LISTEN/NOTIFY channel
    "receipts_waker",  # the waker's heartbeat channel
    "receipts_fleet",  # the waker's announcement channel (members' shares, watermark)
    "receipts_schema_migrations",  # the migrations' tracking table
    "receipts_drain",  # bench.procs' drain
    "receipts_jobs_due_or_in_flight",  # the External metric an adapter serves to the HPA
}


def _prose() -> dict[Path, str]:
    """Every hand-written page (generated references excluded) and the two READMEs."""
    pages = [p for p in sorted(DOCS.rglob("*.md")) if "reference" not in p.parts]
    pages += [REPO / "README.md", REPO / "bench" / "README.md"]
    return {p: p.read_text() for p in pages}


def _metric_names() -> set[str]:
    return {f["name"] for families in gen.metric_families().values() for f in families}


def test_every_generated_page_is_what_the_code_says_now() -> None:
    try:
        pages: dict[Path, str] = gen.pages()
    except SystemExit as exc:  # the generator's one-line refusal (a page lost its markers)
        pytest.fail(str(exc))
    stale = [str(path.relative_to(REPO)) for path, text in sorted(pages.items())
             if not path.exists() or path.read_text() != text]
    assert not stale, (
        f"stale generated pages: {stale}; regenerate them with `python scripts/gen_docs.py` "
        "(after `python tests/chart/chartkit.py write-rules` if the chart's alerts changed), "
        "then review and commit the diff")


def test_every_setting_has_a_description() -> None:
    from receipts.settings import Settings

    missing = [name for name, field in Settings.model_fields.items()
               if not (field.description or "").strip()]
    assert not missing, (f"settings without a description: {missing}; give each Field a "
                         "description (the one source of --help's and the reference's text)")


def test_help_and_the_settings_reference_say_the_same_thing_for_each_setting() -> None:
    """One source for each description: --help's epilogs and the reference page both
    print the field's text, and each field is in some command's --help."""
    from receipts import cli
    from receipts.settings import ENV_PREFIX, Settings

    page = gen.settings_page()
    helps = {command: " ".join(cli.settings_help(command).split())
             for command in ("worker", *cli.COMMAND_SETTINGS)}
    for name, field in Settings.model_fields.items():
        text = " ".join((field.description or "").split())
        variable = f"{ENV_PREFIX}{name.upper()}"
        shown = [command for command, help_text in helps.items() if variable in help_text]
        assert shown, f"{variable} is in no command's --help"
        for command in shown:
            assert text in helps[command], f"`receipts {command} --help` differs for {variable}"
        assert gen._cell(text) in page, f"docs/reference/settings.md differs for {variable}"


def test_every_alert_has_a_written_runbook_page_titled_with_its_name() -> None:
    for rule in gen.alert_rules():
        page = gen.runbook_dir(rule["alert"]) / "README.md"
        text = page.read_text()
        assert text.startswith(f"# {rule['alert']}\n"), f"{page}: its title is the alert's name"
        assert gen.STUB_MARK not in text, (
            f"{page.relative_to(REPO)} is a stub: write what the on-call engineer does")
    pages = {p.parent.name for p in (DOCS / "runbook").glob("*/README.md")}
    assert pages == {r["alert"].lower() for r in gen.alert_rules()}, (
        "a runbook page for an alert that no longer exists")


def test_the_docs_name_only_settings_that_exist() -> None:
    from receipts.settings import ENV_PREFIX, Settings

    known = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields} | NOT_SETTINGS
    for path, text in _prose().items():
        # Whole names only: `RECEIPTS_OUTAGE_*` stands for a family.
        named = set(re.findall(r"\bRECEIPTS_[A-Z0-9_]*[A-Z0-9]\b(?![_*])", text))
        assert named <= known, f"{path.relative_to(REPO)} names no such setting: {named - known}"


def test_the_docs_name_only_metrics_that_exist() -> None:
    known = _metric_names()
    for path, text in _prose().items():
        named = set(re.findall(r"(?<![#/])\breceipts_[a-z0-9_]*[a-z0-9]\b", text)) - NOT_METRICS
        unknown = {n for n in named if re.sub(r"_(bucket|sum|count)$", "", n) not in known}
        assert not unknown, f"{path.relative_to(REPO)} names no such metric: {sorted(unknown)}"


def test_the_docs_name_only_alerts_that_exist() -> None:
    known = {rule["alert"] for rule in gen.alert_rules()}
    for path, text in _prose().items():
        named = set(re.findall(r"\bReceipts[A-Z][A-Za-z]+\b", text))
        assert named <= known, f"{path.relative_to(REPO)} names no such alert: {named - known}"


def test_the_metrics_page_says_what_normal_is_for_every_metric() -> None:
    text = (DOCS / "metrics.md").read_text()
    rows = set(re.findall(r"^\| `(receipts_[a-z0-9_]+)` \|", text, flags=re.MULTILINE))
    missing = _metric_names() - rows
    assert not missing, (f"docs/metrics.md has no row for {sorted(missing)}: say what each "
                         "means and what normal looks like")


def test_the_readme_links_only_to_files_that_exist() -> None:
    text = (REPO / "README.md").read_text()
    targets: list[Any] = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links into the docs"
    missing = [t for t in local if not (REPO / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_the_readme_fits_a_couple_of_screens() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


def test_runbook_pages_show_no_raw_alert_template_text() -> None:
    # `{{ $labels.namespace }}` means something to Alertmanager only; a page shows it raw.
    for page in sorted((DOCS / "runbook").glob("*/README.md")):
        text = page.read_text()
        assert "{{" not in text and "$labels" not in text, page


def test_the_planner_example_in_the_scaling_guide_is_what_the_planner_prints() -> None:
    """docs/scaling.md §3: the Helm values for 2,000/s at 200 ms, and the table's memory
    column, as `receipts plan` gives them today."""
    import yaml

    from receipts.planner import helm_values, plan

    text = (DOCS / "scaling.md").read_text()
    section = text.split("## 3. The planner", 1)[1].split("\n## 4.", 1)[0]
    (example,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    p = plan(2000, 0.2)
    assert yaml.safe_load(example) == yaml.safe_load(helm_values(p))
    for rate in (1, 40, 2000):
        q = plan(rate, 0.2)
        row = next(line for line in section.splitlines()
                   if line.startswith(f"| {rate:,} | "))
        mib = 1024 * 1024
        assert f"| {q.memory_request_bytes // mib} / {q.memory_limit_bytes // mib} Mi |" in row
