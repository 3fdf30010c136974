"""Every fixture and corpus log replays to the decisions recorded in
tests/fixtures/replay-golden/, byte for byte (tests/golden.py writes them): a change of the core
that changes a decision, an alert's detail or a server's numbers shows here, named by fixture,
config and line."""
import gzip

import pytest

from tests import golden


@pytest.mark.parametrize("config", sorted(golden.CONFIGS))
@pytest.mark.parametrize("name", golden.fixtures())
def test_fixture_replays_to_its_recorded_decisions(name, config):
    with gzip.open(golden.path(name, config), "rt") as f:
        want = f.read().splitlines()
    got = list(golden.decisions(name, config))
    for i, (w, g) in enumerate(zip(want, got)):
        assert g == w, f"{name} ({config}), line {i + 1} differs"
    assert len(got) == len(want), f"{name} ({config}): {len(got)} lines, recorded {len(want)}"


def test_every_fixture_has_its_recorded_decisions():
    assert len([n for n in golden.fixtures() if not n.startswith("corpus")]) >= 10
    assert len([n for n in golden.fixtures() if n.startswith("corpus")]) >= 16
    for name in golden.fixtures():
        for config in golden.CONFIGS:
            with gzip.open(golden.path(name, config), "rt") as f:
                assert f.read().endswith("\n")
