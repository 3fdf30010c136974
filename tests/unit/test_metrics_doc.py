"""docs/metrics.md is generated from metrics.py's spec table and must match it."""
from __future__ import annotations

import pathlib

from torch_watchdog.sidecar.core.correlate import CAUSES
from torch_watchdog.sidecar.present import metrics_doc
from torch_watchdog.sidecar.present.metrics import METRICS

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_docs_metrics_md_is_the_rendered_table():
    assert DOC.read_text() == metrics_doc.render(), (
        f"docs/metrics.md is out of date with watchdog/sidecar/present/metrics.py: "
        f"regenerate it with `{metrics_doc.COMMAND}`")


def test_every_metric_of_the_spec_table_is_on_the_page_with_its_type_and_labels():
    page = metrics_doc.render()
    assert len(METRICS) > 40  # the table, not an empty stand-in
    for name, kind, labels, _help in METRICS:
        row = next((line for line in page.splitlines() if line.startswith(f"| `{name}` |")),
                   None)
        assert row is not None, f"{name} is missing from docs/metrics.md"
        assert f"| {kind} |" in row
        for label in labels:
            assert f"`{label}`" in row, (name, label)
    for cause in CAUSES:
        assert f"`{cause}`" in page


def test_the_page_names_the_command_that_regenerates_it():
    head = "\n".join(metrics_doc.render().splitlines()[:12])
    assert metrics_doc.COMMAND in head


def test_notes_name_only_metrics_of_the_table():
    names = {name for name, *_ in METRICS}
    assert set(metrics_doc.NOTES) <= names, set(metrics_doc.NOTES) - names


def test_render_is_pure_and_follows_its_rows():
    rows = [("torch_watchdog_x_total", "counter", ("a", "b"), "An x | with a pipe."),
            ("torch_watchdog_y", "gauge", (), "A y.")]
    text = metrics_doc.render(rows, notes={"torch_watchdog_y": "Note."}, causes=())
    assert text == metrics_doc.render(rows, notes={"torch_watchdog_y": "Note."}, causes=())
    assert "| `torch_watchdog_x_total` | counter | `a`, `b` | An x \\| with a pipe. |" in text
    assert "| `torch_watchdog_y` | gauge | — | A y. Note. |" in text
    assert "torch_watchdog_gpu_memory_used_bytes" not in text


def test_main_writes_the_page(capsys):
    assert metrics_doc.main([]) == 0
    assert capsys.readouterr().out == metrics_doc.render()
