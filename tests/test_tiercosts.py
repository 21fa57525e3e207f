"""The arithmetic of ``trainstate cost`` for node-local tiers (:mod:`trainstate.lifecycle.tiercosts`), worked by hand.

The end-to-end check on a real tiered run is in tests/test_tiers_remote.py (``_check_cost``).
"""

from __future__ import annotations

import pytest

import trainstate as ts
from trainstate.lifecycle.costs import GB, MONTH_S, KindFigures, TierRates
from trainstate.lifecycle.tiercosts import Tiering, node_volumes, remote_figures, replication_cost

FULL = KindFigures("full", size_bytes=10 * GB, files=5, interval_s=MONTH_S / 1000, updates_per_save=50, keep=2,
                   interval_source="manifests")


def tiering(**changes) -> Tiering:
    fields = dict(nodes=8, ranks=64, domains=4, replicas=3, keep_last=2, mirror_every=10, remote_keep=3)
    return Tiering(**{**fields, **changes})


def test_capacity_is_keep_last_plus_the_one_being_written_of_own_and_replicas():
    v = node_volumes(tiering(), FULL, own_bytes=GB, replica_bytes=2 * GB)
    assert v.node_capacity_bytes == 3 * 3 * GB  # (2 kept + 1 in flight) x (1 own + 2 replicas)


def test_replication_sends_replicas_minus_one_copies_and_those_across_domains_cross_first():
    v = node_volumes(tiering(), FULL, GB, 2 * GB)
    assert v.saves_per_month == pytest.approx(1000)
    assert v.replicated_gb == pytest.approx(1000 * 10 * 2)  # every save: 10 GB to 2 more nodes
    assert v.cross_domain_gb == v.replicated_gb  # 4 domains: both copies land in domains that hold none
    two = node_volumes(tiering(domains=2), FULL, GB, 2 * GB)
    assert two.cross_domain_gb == pytest.approx(two.replicated_gb / 2)  # one copy crosses, the other stays
    one = node_volumes(tiering(domains=1), FULL, GB, 2 * GB)
    assert one.cross_domain_gb == 0  # the control: one domain, nothing crosses
    alone = node_volumes(tiering(replicas=1), FULL, GB, 0)
    assert alone.replicated_gb == 0 and alone.cross_domain_gb == 0


def test_the_remote_tier_is_priced_at_one_upload_every_mirror_every_saves_keeping_its_own():
    remote = remote_figures(tiering(), FULL)
    assert remote.interval_s == pytest.approx(FULL.interval_s * 10) and remote.updates_per_save == 500
    assert remote.keep == 3 and remote.size_bytes == FULL.size_bytes
    assert node_volumes(tiering(), FULL, GB, GB).uploads_per_month == pytest.approx(100)
    with pytest.raises(ts.InvalidArgument, match="no remote tier"):
        remote_figures(tiering(mirror_every=0), FULL)


def test_cross_domain_traffic_is_priced_in_and_out():
    v = node_volumes(tiering(domains=2), FULL, GB, 2 * GB)
    cost = replication_cost(v, TierRates("zone", gb_month=0, per_gb_in=0.01, per_gb_out=0.02))
    assert cost.transfer == pytest.approx(10000 * 0.03)


def test_a_tiering_without_nodes_or_replicas_is_refused():
    with pytest.raises(ts.InvalidArgument):
        tiering(replicas=0)
    with pytest.raises(ts.InvalidArgument):
        tiering(nodes=0)


def test_replication_tier_needs_a_node_directory(tmp_path, capsys):
    from trainstate.cli.main import main
    from trainer import build, step

    state = build()
    with ts.CheckpointManager(tmp_path / "run") as ckpt:
        for _ in range(2):
            step(state)
            ckpt.save(state)
    rates = tmp_path / "rates.toml"
    rates.write_text('date = 2026-12-01\n[tiers.zone]\ngb_month = 0\n')
    assert main(["cost", str(tmp_path / "run"), "--rates", str(rates), "--replication-tier", "zone"]) != 0
    assert "not one node's directory" in capsys.readouterr().err
