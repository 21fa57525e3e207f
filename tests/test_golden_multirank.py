"""A multi-rank run written before ``shard-NNNNN-small.safetensors`` existed still restores and continues bitwise.

``tests/golden/multirank-v3`` was written by the code at b698658 (2 gloo ranks, FSDP2, saved after 3
updates; ``after-*.safetensors`` hold the state 2 updates later, from the same uninterrupted process). It is
restored at world size 2 from a local directory and from an object store (each rank then fetches the small
replicated items from inside the other rank's shard), continued for 2 updates, compared bitwise, saved in
today's layout and restored again.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest

from distlaunch import launch
from objectservers import moto_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow
GOLDEN = Path(__file__).parent / "golden" / "multirank-v3"


def _check(results: list[dict]) -> None:
    for r in results:
        assert r["restored"] == "gen-000000000003" and r["identical"], r
        assert r["full_differs"] == [] and r["rank_differs"] == [], r
        assert r["saved"] == r["again"] == "gen-000000000005" and r["again_differs"] == [], r


def test_the_golden_multi_rank_run_restores_and_continues_bitwise(tmp_path):
    source = tmp_path / "golden"
    shutil.copytree(GOLDEN, source)
    _check(launch(tmp_path / "read", ["golden_multirank_read"],
                  env={"TRAINSTATE_TEST_SOURCE": str(source)}).ok("golden_multirank_read"))
    assert not list((source / "run" / "gen-000000000003").glob("shard-*-small.safetensors"))  # the old layout
    assert list((source / "run" / "gen-000000000005").glob("shard-*-small.safetensors"))  # today's


def test_the_golden_multi_rank_run_restores_from_an_object_store(tmp_path, moto_server, monkeypatch, capsys):
    pytest.importorskip("obstore")
    from trainstate import cli

    url = moto_server.url(moto_server.make_bucket(), f"golden-{uuid.uuid4().hex[:8]}")
    for name, value in (("AWS_ENDPOINT_URL", moto_server.endpoint), ("AWS_ACCESS_KEY_ID", moto_server.access_key),
                        ("AWS_SECRET_ACCESS_KEY", moto_server.secret_key), ("AWS_REGION", moto_server.region),
                        ("AWS_ALLOW_HTTP", "true")):
        monkeypatch.setenv(name, value)
    shutil.copytree(GOLDEN / "run", tmp_path / "run")  # copy reads through a lock file it creates
    assert cli.main(["copy", str(tmp_path / "run"), url]) == 0  # the files as they are: the old layout
    capsys.readouterr()
    remote = {"url": url, "storage_options": moto_server.storage_options()}
    _check(launch(tmp_path / "read", ["golden_multirank_read"], env={
        "TRAINSTATE_TEST_SOURCE": str(GOLDEN), "TRAINSTATE_TEST_S3": json.dumps(remote)}).ok("golden_multirank_read"))


def test_diff_compares_generations_cut_for_different_world_sizes(tmp_path):
    """``trainstate diff`` of the golden generation (2 ranks) and the same state saved again by 1 rank: DCP cut
    every tensor differently, so each is assembled whole on both sides; model and optimizer are bitwise equal."""
    import subprocess
    import sys

    source = tmp_path / "golden"
    shutil.copytree(GOLDEN, source)
    result = launch(tmp_path / "one", ["golden_reshard"], ranks=1,
                    env={"TRAINSTATE_TEST_SOURCE": str(source)}).ok("golden_reshard", 1)[0]
    assert (result["restored"], result["saved"]) == ("gen-000000000003", "gen-000000000003-r001"), result
    done = subprocess.run([sys.executable, "-m", "trainstate", "diff", str(source / "run" / "gen-000000000003"),
                           str(source / "run" / "gen-000000000003-r001"), "--json"], capture_output=True, text=True)
    report = json.loads(done.stdout)
    categories = {c["name"]: c for c in report["categories"]}
    assert categories["model"]["entries"] == [] and categories["model"]["tensors"] == 6, categories["model"]
    assert categories["optimizer"]["entries"] == [] and categories["optimizer"]["tensors"] >= 12, \
        categories["optimizer"]
    assert report["first"] == "contract", report["first"]  # the world size: 2 -> 1
