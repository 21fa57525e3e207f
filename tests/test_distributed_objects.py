"""A multi-rank run on an object store (issue 13): no shared filesystem, one commit record for all ranks.

Two gloo ranks under a real ``torchrun`` save FSDP2 state to an ``s3://`` URL on moto's server on loopback:
each rank uploads its own shard files under the attempt prefix, rank 0 writes the metadata, the manifest and
the create-only commit record after every rank's records arrived. The resume is bitwise at the same world size.
"""

from __future__ import annotations

import json
import uuid

import pytest

from distlaunch import launch
from objectservers import moto_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow
pytest.importorskip("obstore")


def test_two_ranks_checkpoint_to_an_object_store_and_resume_bitwise(moto_server, tmp_path):
    bucket = moto_server.make_bucket()
    url = moto_server.url(bucket, f"run-{uuid.uuid4().hex[:8]}")
    remote = {"url": url, "storage_options": moto_server.storage_options()}
    launched = launch(tmp_path / "objects", ["object_store"], env={"TRAINSTATE_TEST_S3": json.dumps(remote)})
    results = launched.ok("object_store")
    for rank, r in enumerate(results):
        assert r["saved"] == r["generation"] == "gen-000000000006", r
        assert r["generations"] == ["gen-000000000006"], (r, launched.log[-3000:])  # keep_last=1 pruned the first
        assert r["identical"] and r["full_differs"] == [] and r["rank_differs"] == [], (rank, r)
        assert r["leftovers"] == [], r
        assert r["empty_restore"] is None and r["optimizer_state_after_empty_restore"] == 0, r  # once 6: step 1
        assert {"rank-00000.json", "rank-00001.json", "shard-00000.safetensors", "shard-00001.safetensors",
                "dcp-metadata.json", "manifest.json", "state.json"} <= set(r["files"]), r
