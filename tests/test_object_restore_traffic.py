"""What reading a run from an object store downloads (issue 34), counted by a proxy on loopback.

A restore (single-process, and multi-rank with FSDP2 and DDP under a real
``torchrun``), ``trainstate verify URL``, ``export`` from a URL and the mirror's
pull on a fresh machine each read each byte they need once, and each commit
record, manifest and metadata object at most once per process and scope. The
proxy relays every request between the real ``obstore`` client and moto's
server on 127.0.0.1 and counts the body bytes it relays, so a GET that a
reader abandons counts with every byte the server had already sent.

Before (acea423), with the same proxy: a 2-rank FSDP2 restore of 14.2 MB read
49.8 MB in 68 GETs and 24 HEADs; a single-process restore of 12.6 MB read
25.3 MB; ``verify`` 16.8 MB.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch

import trainstate as ts
from distlaunch import launch
from objectservers import FaultProxy, moto_server  # noqa: F401  (fixture)
from trainstate import cli

pytestmark = pytest.mark.slow
pytest.importorskip("obstore")
SLACK = 64 << 10  # pointers, records, manifests, listings' bodies: metadata, not state


def summary(traffic: list) -> dict:
    gets = [t for t in traffic if t.method == "GET" and "list-type" not in t.path and "?uploads" not in t.path]
    return {"gets": len(gets), "heads": sum(t.method == "HEAD" for t in traffic),
            "lists": sum(t.method == "GET" and "list-type" in t.path for t in traffic),
            "get_bytes": sum(t.bytes for t in gets),
            "per_object": dict(Counter(t.path.split("?")[0].rsplit("/", 1)[-1] for t in gets))}


def assert_once_each(got: dict, processes: int, data_bytes: int, managers: int = 0) -> None:
    """Every byte of the state once (per process that needs it), each manifest, state, rank record and DCP metadata
    object once per process, each commit record once per process and scope: a manager's constructor reads the
    newest generation's (the recorded retention policy) and its restore once more."""
    assert got["get_bytes"] <= 1.05 * data_bytes + processes * SLACK, got
    for name, count in got["per_object"].items():
        if name.endswith(".json"):  # manifest, state, rank records, DCP metadata
            assert count <= processes, (name, got)
        if name.startswith("gen-"):  # a commit record
            assert count <= processes + managers, (name, got)


# single process ------------------------------------------------------------------------------------------------
def _state(seed: int = 0) -> ts.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    state = ts.TrainState(model=model, optimizer=opt, rngs={"noise": torch.Generator().manual_seed(seed)})
    state.next_update = 1
    return state


def _tensors(state: ts.TrainState) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v for k, v in state["model"].state_dict().items()}
    for i, entry in state["optimizer"].state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v for k, v in entry.items()})
    return out


@pytest.fixture(scope="module")
def saved(moto_server):
    url = moto_server.url(moto_server.make_bucket(), f"run-{uuid.uuid4().hex[:8]}")
    state = _state()
    with ts.CheckpointManager(url, storage_options=moto_server.storage_options()) as ckpt:
        info = ckpt.save(state)
    return url, info, _tensors(state)


@pytest.fixture
def proxied(moto_server, monkeypatch):
    with FaultProxy(moto_server.endpoint) as proxy:
        for name, value in (("AWS_ENDPOINT_URL", proxy.endpoint), ("AWS_ACCESS_KEY_ID", moto_server.access_key),
                            ("AWS_SECRET_ACCESS_KEY", moto_server.secret_key), ("AWS_REGION", moto_server.region),
                            ("AWS_ALLOW_HTTP", "true")):
            monkeypatch.setenv(name, value)
        yield proxy, moto_server.storage_options(endpoint=proxy.endpoint)


def test_a_restore_reads_each_byte_once(saved, proxied):
    url, info, expected = saved
    proxy, options = proxied
    fresh = _state(seed=3)
    with ts.CheckpointManager(url, storage_options=options) as ckpt:
        assert ckpt.restore(fresh).generation.name == info.name
    got = summary(proxy.traffic)
    print(json.dumps({"restore": got, "size": info.size}))
    assert all(torch.equal(v, expected[k]) for k, v in _tensors(fresh).items())
    assert_once_each(got, 1, info.size, managers=1)
    assert not [t for t in proxy.traffic if t.method == "GET" and t.range is None and "tensors" in t.path]


def _modelled(url: str, options: dict):
    """What ``trainstate cost`` counts for one restore of the run's newest full generation."""
    from trainstate.cli.cost import restore_reads
    from trainstate.lifecycle.generations import Lifecycle
    from trainstate.storage.locate import open_store

    store = open_store(url, storage_options=options)
    return restore_reads(store, Lifecycle(store, None).newest_full())


def test_the_cost_model_counts_with_the_readers_request_sizes():
    from trainstate.format.digest import CHUNK_BYTES
    from trainstate.lifecycle import costs
    from trainstate.storage import chunked, fetched

    assert (costs.CHUNK_SPAN, costs.FETCH_SPAN, costs.READ_SPAN) == (
        CHUNK_BYTES, chunked.FETCH_BYTES, fetched.REQUEST_BYTES)


def assert_cost_matches(got: dict, model) -> None:
    """``trainstate cost`` uses what a restore reads: the bytes exactly (metadata aside), the requests closely."""
    requests = got["gets"] + got["heads"] + got["lists"]
    assert model.bytes <= got["get_bytes"] <= model.bytes + model.processes * SLACK, (model, got)
    assert abs(model.requests - requests) <= 0.25 * requests, (model, requests, got)


def test_cost_counts_what_a_restore_reads(saved, proxied):
    url, info, _ = saved
    proxy, options = proxied
    with ts.CheckpointManager(url, storage_options=options) as ckpt:
        ckpt.restore(_state(seed=6))
    got = summary(proxy.traffic)
    proxy.clear()
    assert_cost_matches(got, _modelled(url, options))


def test_control_two_passes_are_counted_twice(saved, proxied):
    """The instrument catches a double read: verifying, then restoring, downloads the state twice."""
    url, info, _ = saved
    proxy, options = proxied
    with ts.CheckpointManager(url, storage_options=options) as ckpt:
        assert cli.main(["verify", url]) == 0
        ckpt.restore(_state(seed=4))
    assert summary(proxy.traffic)["get_bytes"] >= 2 * info.size


def test_verify_of_a_url_reads_each_byte_once(saved, proxied, capsys):
    url, info, _ = saved
    proxy, _ = proxied
    assert cli.main(["verify", url]) == 0
    got = summary(proxy.traffic)
    print(json.dumps({"verify": got}))
    assert_once_each(got, 1, info.size)


def test_export_from_a_url_reads_each_byte_once(saved, proxied, tmp_path):
    url, info, expected = saved
    proxy, options = proxied
    out = ts.export(url, tmp_path / "release", storage_options=options)
    got = summary(proxy.traffic)
    print(json.dumps({"export": got}))
    assert_once_each(got, 1, info.size)
    assert out is not None


def test_the_mirror_pull_on_a_fresh_machine_reads_each_byte_once(saved, proxied, tmp_path):
    url, info, expected = saved
    proxy, options = proxied
    fresh = _state(seed=5)
    with ts.CheckpointManager(tmp_path / "local", mirror=url, mirror_options=options) as ckpt:
        assert ckpt.restore(fresh).generation.name == info.name
    got = summary(proxy.traffic)
    print(json.dumps({"mirror pull": got}))
    assert all(torch.equal(v, expected[k]) for k, v in _tensors(fresh).items())
    assert_once_each(got, 1, info.size, managers=1)


def test_a_late_damaged_chunk_of_a_remote_generation_falls_back_bitwise(moto_server, monkeypatch):
    """The parallel ranged reads verify each chunk before it reaches a live tensor: a bit flipped in the last
    chunk of the newest generation (the chunks before it already placed) makes the restore fall back to the
    previous one, which loads completely over them. The control: with the chunk check disabled, the damaged
    generation loads, flipped bit and all."""
    from trainstate.storage import chunked
    from trainstate.storage.objects import ObjectStore

    url = moto_server.url(moto_server.make_bucket(), "run")
    options = moto_server.storage_options()
    state = _state(seed=1)
    with ts.CheckpointManager(url, keep_last=3, storage_options=options) as ckpt:
        ckpt.save(state)
        first = {k: v.clone() for k, v in _tensors(state).items()}
        with torch.no_grad():
            for p in state["model"].parameters():
                p.add_(1)
        state.next_update = 2
        ckpt.save(state)
    store = ObjectStore(url, storage_options=options)
    key = f"attempts/{store._attempt('gen-000000000002')}/tensors.safetensors"
    data = bytearray(store.client.get_small(key))
    data[-100] ^= 0x01
    store.client.put(key, bytes(data))
    ranged = []
    real = chunked._ranged_chunks
    monkeypatch.setattr(chunked, "_ranged_chunks", lambda *a, **k: ranged.append(1) or real(*a, **k))

    live = _state(seed=7)
    with ts.CheckpointManager(url, storage_options=options) as ckpt:
        info = ckpt.restore(live)
    assert ranged and info.generation.name == "gen-000000000001", info
    assert "chunk" in info.rejected[0].reason and ts.unusable_reason(live) is None
    assert all(torch.equal(v, first[k]) for k, v in _tensors(live).items())

    monkeypatch.setattr(chunked, "_check", lambda *a, **k: None)  # the control: nothing checked, damage loads
    live = _state(seed=7)
    with ts.CheckpointManager(url, storage_options=options) as ckpt:
        assert ckpt.restore(live).generation.name == "gen-000000000002"


@pytest.mark.parametrize("fault", ["unavailable", "memory", "control"])
def test_a_remote_restore_that_fails_halfway_leaves_the_state_unusable(moto_server, monkeypatch, fault):
    """The last ranged GET of a restore streaming the tensor file into live tensors fails, after the others placed
    their chunks, over a state restored completely before: the store stops answering (StorageUnavailable) or the
    process runs out of memory (MemoryError); each is raised as it is, no other generation tried. Either way the
    state holds part of the generation and is unusable: its save is refused. The control (nothing marks it) saves
    the mix of two states."""
    import time

    from trainstate import restore as restore_mod
    from trainstate.errors import StorageUnavailable
    from trainstate.storage import chunked

    url = moto_server.url(moto_server.make_bucket(), "run")
    options = moto_server.storage_options()
    with ts.CheckpointManager(url, storage_options=options) as ckpt:
        ckpt.save(_state(seed=1))
    live = _state(seed=7)
    with ts.CheckpointManager(url, storage_options=options) as ckpt:
        ckpt.restore(live)  # restored completely once: the state belongs to the run
        with torch.no_grad():
            for p in live["model"].parameters():
                p.zero_()
        real = chunked._ranged_chunks
        error = StorageUnavailable("GET refused (the test cut it)") if fault == "unavailable" else MemoryError()

        def cut(spans, record, *args, **kwargs):
            last = (len(record.chunks) - 1) * chunked.CHUNK_BYTES

            def refused(begin: int, end: int) -> memoryview:
                if end > last:
                    time.sleep(0.2)  # the other requests land and place their chunks first
                    raise error
                return spans(begin, end)
            return real(refused, record, *args, **kwargs)
        monkeypatch.setattr(chunked, "_ranged_chunks", cut)
        if fault == "control":
            monkeypatch.setattr(restore_mod, "mark_unusable", lambda *a, **k: None)
        with pytest.raises(StorageUnavailable if fault == "unavailable" else MemoryError) as raised:
            ckpt.restore(live)
        monkeypatch.undo()
        assert [k for k, v in _tensors(live).items() if k.startswith("m.") and v.any()], "the cut came too early"
        if fault == "control":
            assert ts.unusable_reason(live) is None
            ckpt.save(live)  # the mix of two states, published: what the mark prevents
            return
        assert ts.unusable_reason(live), raised.value
        if fault == "unavailable":
            assert "GET refused" in str(raised.value), raised.value  # the cause, not "unreadable (None)"
            assert "left the state unusable" in str(raised.value), raised.value
        with pytest.raises(ts.errors.StateUnusable):
            ckpt.save(live)


def _lists(traffic: list) -> Counter:
    """LIST requests by the prefix they listed."""
    from urllib.parse import parse_qs, urlsplit

    return Counter(parse_qs(urlsplit(t.path).query).get("prefix", [""])[0].rsplit("/", 2)[-2] + "/"
                   for t in traffic if t.method == "GET" and "list-type" in t.path)


@pytest.mark.parametrize("held", [True, False])
def test_a_save_lists_the_records_once_before_its_first_write(moto_server, proxied, monkeypatch, held):
    """A save's steps before its first write (interrupted replacements, the name, leftovers, the run identity)
    each ask for the generations and the set-aside records: one LIST request each, answered from memory after,
    until the client writes anything; after its commit it lists again. Leftovers are looked for at a manager's
    first save only (and after a failed one). The control (nothing held) lists once per step."""
    from trainstate.storage import objectclient

    if not held:
        monkeypatch.setattr(objectclient.Client, "listings_held", lambda self: contextlib.nullcontext())
    proxy, options = proxied
    url = moto_server.url(moto_server.make_bucket(), "run")
    state = _state(seed=2)
    lists = []
    with ts.CheckpointManager(url, storage_options=options) as ckpt:
        for update in (1, 2):
            state.next_update = update
            proxy.traffic.clear()
            ckpt.save(state)
            lists.append(_lists(proxy.traffic))
        names = ckpt.generations()
    print(json.dumps({"held": held, "lists": lists}))
    assert names == ["gen-000000000002", "gen-000000000001"]
    first, steady = lists
    assert first["attempts/"] == first["staging/"] == 1 and steady["attempts/"] == steady["staging/"] == 0, lists
    new = [n for prefix, n in steady.items() if prefix.startswith("gen-000000000002-")]
    assert new == [2], lists  # the new generation's files: its check after the commit, then the prune's
    if held:  # the first save: its same-run check (before publishing), the steps before its first write, its prune
        assert first["commits/"] <= 3 and first["aside/"] <= 1 and steady["commits/"] <= 2, lists
    else:
        assert first["commits/"] >= 5 and first["aside/"] >= 2 and steady["commits/"] >= 3, lists


@pytest.mark.parametrize("flagged", [True, False])
def test_a_save_after_a_failed_one_removes_what_it_left(moto_server, monkeypatch, flagged):
    """The commit record cannot be written and the attempt's own cleanup fails too: its objects stay. The next
    save of the same manager looks for leftovers again and removes them. The control (the failure not
    remembered) leaves them: a steady save does not look."""
    from trainstate import publish as publish_mod
    from trainstate.storage import objects as objects_mod

    url = moto_server.url(moto_server.make_bucket(), "run")
    state = _state(seed=4)
    with ts.CheckpointManager(url, storage_options=moto_server.storage_options()) as ckpt:
        ckpt.save(state)
        real_commit = objects_mod.ObjectStaging.commit

        def refused(self):
            raise ts.errors.StorageUnavailable("PUT commits/... refused (the test cut it)")
        monkeypatch.setattr(objects_mod.ObjectStaging, "commit", refused)
        monkeypatch.setattr(objects_mod.ObjectStaging, "abort", lambda self: None)  # its cleanup fails as well
        state.next_update = 2
        with pytest.raises(ts.errors.StorageUnavailable):
            ckpt.save(state)
        monkeypatch.setattr(objects_mod.ObjectStaging, "commit", real_commit)
        left = ckpt.store.leftovers()
        assert len(left) == 1 and left[0].startswith("gen-000000000002-"), left
        if not flagged:
            ckpt._publisher.clean_due = False
        assert isinstance(ckpt._publisher, publish_mod.Publisher)
        ckpt.save(state)
        assert ckpt.store.leftovers() == ([] if flagged else left)
        assert ckpt.generations() == ["gen-000000000002", "gen-000000000001"]


def test_a_held_listing_is_requested_again_after_any_write(moto_server):
    """Within ``listings_held``: the second listing comes from memory; a write (here the staging marker of
    another save) makes the next one a request again, which sees it."""
    from trainstate.storage.objects import ObjectStore

    store = ObjectStore(moto_server.url(moto_server.make_bucket(), "run"),
                        storage_options=moto_server.storage_options())
    calls = []
    real = store.client._call
    store.client._call = lambda what, key, fn, **kw: calls.append(what) or real(what, key, fn, **kw)
    with store.listings_held():
        assert store.client.names("staging/") == [] and store.client.names("staging/") == []
        assert calls.count("listing") == 1
        store.client.put("staging/gen-000000000001-0123456789abcdef", b"{}", create=True)
        assert store.client.names("staging/") == ["gen-000000000001-0123456789abcdef"]
        assert calls.count("listing") == 2
    assert store.client.names("staging/") and calls.count("listing") == 3  # outside: every call a request


# multi-rank ------------------------------------------------------------------------------------------------------
def restore_traffic(moto_server, tmp_path: Path, mode: str) -> tuple[dict, list, object]:
    bucket = moto_server.make_bucket()
    url = moto_server.url(bucket, f"run-{uuid.uuid4().hex[:8]}")
    common = {"url": url, "mode": mode, "reference": str(tmp_path / "ref.safetensors")}
    saved = launch(tmp_path / "save", ["object_restore"], env={"TRAINSTATE_TEST_S3": json.dumps(
        {**common, "phase": "save", "storage_options": moto_server.storage_options()})}).ok("object_restore")
    with FaultProxy(moto_server.endpoint) as proxy:
        restored = launch(tmp_path / "restore", ["object_restore"], env={"TRAINSTATE_TEST_S3": json.dumps(
            {**common, "phase": "restore", "storage_options": moto_server.storage_options(endpoint=proxy.endpoint)})}
        ).ok("object_restore")
        traffic = list(proxy.traffic)
    return {"saved": saved, "restored": restored}, traffic, _modelled(url, moto_server.storage_options())


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_a_multi_rank_restore_reads_each_rank_share_once(moto_server, tmp_path, mode):
    """FSDP2: each rank reads its own shard (and the small replicated items); DDP: every rank loads every
    replicated byte. Either way each byte is downloaded once over all ranks: by one rank that needs it, which
    hands it to the others (each verifies what it keeps)."""
    runs, traffic, model = restore_traffic(moto_server, tmp_path, mode)
    size = runs["saved"][0]["size"]
    got = summary(traffic)
    print(json.dumps({"mode": mode, "size": size, **got, "seconds": [r["seconds"] for r in runs["restored"]]}))
    for r in runs["restored"]:
        assert r["differs"] == [], r
    assert_once_each(got, 2, size, managers=2)
    assert got["heads"] <= 2 * 2, got  # a manifest each; no HEAD before each ranged read
    assert_cost_matches(got, model)


def test_control_a_chunk_a_peer_hands_over_is_verified_by_the_rank_that_keeps_it(moto_server, tmp_path):
    """Rank 0 flips one bit of every chunk it hands to rank 1: rank 1 refuses them, every rank passes over the
    generation together, and nothing loads (the store's bytes are intact: only the handover lied)."""
    bucket = moto_server.make_bucket()
    common = {"url": moto_server.url(bucket, "run"), "mode": "ddp", "reference": str(tmp_path / "ref.safetensors"),
              "storage_options": moto_server.storage_options()}
    launch(tmp_path / "save", ["object_restore"], env={"TRAINSTATE_TEST_S3": json.dumps(
        {**common, "phase": "save"})}).ok("object_restore")
    results = launch(tmp_path / "bad", ["object_restore"], env={"TRAINSTATE_TEST_S3": json.dumps(
        {**common, "phase": "bad-peer"})}).ok("object_restore")
    for r in results:
        assert r["outcome"] == "NoValidGeneration" and "as rank 0 handed it over" in r["message"], r


def test_a_multi_rank_restore_reads_its_shard_as_it_loads_verified_and_marks_a_half_load(moto_server, tmp_path):
    """Each rank reads its own shard straight from the store while DCP loads it (no copy held in memory). A bit
    flipped in the last chunk of rank 0's shard of the newest generation is found there: every rank passes over
    it to the previous generation, which loads completely, bitwise. A read that fails halfway (the store refuses
    rank 0's GETs after the header chunk) fails the restore on every rank and leaves every rank's state unusable:
    its save is refused. A store that stops answering one rank in a fetch round (StorageUnavailable past the
    client's retries) fails the restore on every rank, nothing loaded, rather than resuming from an older
    generation. Controls: with the chunk checks off the damaged generation loads; with nothing marked, the
    half-loaded state is saved; with the outage counted as damage, the older generation loads."""
    url = moto_server.url(moto_server.make_bucket(), "run")
    remote = {"url": url, "storage_options": moto_server.storage_options()}
    worker = Path(__file__).resolve().parent / "dist_objects_worker.py"
    launched = launch(tmp_path / "faults", ["object_faults", "object_leftovers"], worker=worker,
                      env={"TRAINSTATE_TEST_S3": json.dumps(remote)})
    results = launched.ok("object_faults")
    _leftovers_looked_for_after_a_failure(launched.ok("object_leftovers"))
    assert results[0]["chunks"] >= 2, results[0]  # the flipped bit lies past the header chunk
    for rank, r in enumerate(results):
        own = f"shard-{rank:05d}.safetensors"
        assert r["direct"] == [own], r  # its own shard, read as it loads: of it only the header's chunk is held
        assert sorted(set(r["held"][own])) == [0], r["held"]
        damaged, unchecked = r["damaged"], r["unchecked"]
        assert damaged["generation"] == r["older"] and damaged["unusable"] is None, (damaged, r)
        assert damaged["rejected"][0].startswith(r["newer"]) and "chunk" in damaged["rejected"][0], damaged
        assert r["damaged_differs"] == [], r
        assert unchecked["generation"] == r["newer"] and r["unchecked_differs"], r  # the flipped bit loaded
        cut, control = r["cut"], r["cut_unmarked"]
        assert cut.get("outcome") and cut["unusable"] and "connection reset" in cut["unusable"], cut
        assert cut["save"] == "StateUnusable", cut
        assert control.get("outcome") and control["unusable"] is None and control["save"].startswith("gen-"), control
        down, fell_back = r["unavailable"], r["unavailable_fell_back"]
        assert down.get("outcome") == "StorageUnavailable" and down["unusable"] is None, down
        assert "rank 1: GET" in down["message"] and "loaded nothing" in down["message"], down
        assert fell_back.get("generation") == r["older"] and fell_back["rejected"][0].startswith(r["newer"]), fell_back
        assert fell_back["differs_older"] == [], fell_back


def _leftovers_looked_for_after_a_failure(results: list[dict]) -> None:
    """(launched with the test above: ``object_leftovers``) A multi-rank save looks for the leftovers of
    interrupted saves at a manager's first save and after a failed one: counted on rank 0, the only one that looks.
    A save that rank 1 could not stage, whose objects rank 0 failed to remove, leaves them; the next save removes
    them, and the control (the failure not remembered) leaves them."""
    flagged, control = results[0]["flagged"], results[0]["control"]
    assert flagged["failed"] == "CheckpointFailed" and flagged["left"], flagged
    assert flagged["scans"] == [1, 0, 1] and flagged["after"] == [], flagged
    assert control["scans"] == [1, 0, 0] and control["after"] == control["left"], control
    assert flagged["generations"][0] == "gen-000000000003", flagged
