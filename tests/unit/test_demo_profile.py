"""The demo's profiles write configs the sidecar accepts, with the demo's reload settings."""
import os

import pytest
import yaml

from torch_watchdog.demo.profile import FULL, PROFILES, SHORT, render_config
from torch_watchdog.sidecar import config


@pytest.mark.parametrize("profile", [FULL, SHORT], ids=lambda p: p.name)
def test_each_profile_writes_a_valid_config_that_reloads_by_signal(tmp_path, profile):
    path = tmp_path / "watchdog.yaml"
    path.write_text(render_config(profile, work=str(tmp_path), socket_path=str(tmp_path / "s"),
                                  port=19464, budget_bytes=900 << 20))
    cfg, problems = config.check(str(path))
    assert problems == []
    assert cfg.reload.method == "signal" and not cfg.policy.dry_run
    assert cfg.forecast.process_budget_bytes == 900 << 20
    assert cfg.state_dir == str(tmp_path / "state") and cfg.metrics_port == 19464
    assert cfg.sample_log == os.path.join(str(tmp_path), "sidecar-samples.jsonl")
    # the storm is found with the recompiles the demo's limit allows (limit 4: 3 recompiles)
    assert cfg.correlate.storm_recompiles <= profile.limit - 1
    assert cfg.policy.warmup_s <= profile.settle_s + 2 and cfg.policy.cooldown_s >= 600


def test_the_short_profile_is_shorter_in_every_timing():
    assert set(PROFILES) == {"full", "short"}
    for field in ("warm_requests", "window_s", "reload_lead_s", "serve_again", "timeout_s"):
        assert getattr(SHORT, field) < getattr(FULL, field), field
    # the restarted server ends the demo while its traffic is still the three warm lengths
    for p in (FULL, SHORT):
        assert p.serve_again < p.warm_requests
        assert yaml.safe_load(render_config(p, work="/w", socket_path="/w/s", port=1,
                                            budget_bytes=1))["forecast"]["window_s"] == p.window_s
