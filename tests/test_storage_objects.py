"""Object stores (issue 13): the S3 backend passes the storage conformance suite against a real server on
loopback, a run saved to a URL resumes bitwise, and a local-first mirror brings the run back on a machine
whose local directory is gone.

Every request goes over HTTP to moto's standalone server (or SeaweedFS, where atomic conditional writes
matter) through the real ``obstore`` client; nothing is mocked.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np
import pytest

import trainstate as ts
from objectservers import FaultProxy, moto_server, seaweed_server  # noqa: F401  (fixtures)
from store_conformance import StoreConformance
from trainer import assert_same, build, full_state, next_draws, step
from trainstate import cli
from trainstate.format.manifest import POINTER, generation_name
from trainstate.storage.objects import ObjectStore

pytest.importorskip("obstore")


@pytest.fixture(scope="module")
def bucket(moto_server) -> str:
    return moto_server.make_bucket()


def _fresh(seed: int) -> ts.TrainState:
    """A new run's state, the global RNGs (Python, NumPy) seeded too, so two runs start identically."""
    random.seed(seed)
    np.random.seed(seed)
    return build(seed=seed)


def _url(server, bucket: str) -> str:
    return server.url(bucket, f"run-{uuid.uuid4().hex[:8]}")


class TestObjectStore(StoreConformance):
    @pytest.fixture
    def store(self, moto_server, bucket):
        return ObjectStore(_url(moto_server, bucket), storage_options=moto_server.storage_options())

    @pytest.fixture
    def reopen(self, moto_server):
        return lambda store: ObjectStore(store.location, storage_options=moto_server.storage_options())


# a run on a URL ------------------------------------------------------------------------------------------
def _train(ckpt: ts.CheckpointManager, state: ts.TrainState, until: int, every: int = 2) -> None:
    while state.next_update < until:
        step(state)
        if state.next_update % every == 0:
            ckpt.save(state)


def test_a_run_saved_to_a_url_resumes_bitwise(moto_server, bucket):
    url = _url(moto_server, bucket)
    opts = moto_server.storage_options()
    reference = _fresh(3)
    for _ in range(6):
        step(reference)
    expected = full_state(reference), next_draws(reference)  # now: the global RNGs are the process's, not its
    with ts.CheckpointManager(url, keep_last=2, storage_options=opts) as ckpt:
        state = _fresh(3)
        assert ckpt.restore(state) is None
        _train(ckpt, state, 4)
        assert ckpt.generations() == [generation_name(4), generation_name(2)]
    with ts.CheckpointManager(url, storage_options=opts) as ckpt:
        resumed = build(seed=99)
        info = ckpt.restore(resumed)
        assert info.generation.name == generation_name(4) and info.identical_continuation
        for _ in range(2):
            step(resumed)
    assert_same((full_state(resumed), next_draws(resumed)), expected)


def test_a_damaged_remote_object_falls_back_to_the_newest_that_verifies(moto_server, bucket):
    url = _url(moto_server, bucket)
    opts = moto_server.storage_options()
    with ts.CheckpointManager(url, keep_last=3, storage_options=opts) as ckpt:
        state = build(seed=4)
        _train(ckpt, state, 4)
    store = ObjectStore(url, storage_options=opts)
    attempt = store._attempt(generation_name(4))
    key = f"attempts/{attempt}/tensors.safetensors"
    data = bytearray(store.client.get_small(key))
    data[-3] ^= 0x10  # one bit, same size: only the digest can tell
    store.client.put(key, bytes(data))
    with ts.CheckpointManager(url, storage_options=opts) as ckpt:
        info = ckpt.restore(build(seed=5))
    assert info.generation.name == generation_name(2)
    assert [r.generation for r in ckpt.last_rejections] == [generation_name(4)]


def test_permanent_errors_name_the_bucket_and_the_setting(moto_server, bucket):
    with pytest.raises(ts.StorageNotFound, match="no-such-bucket-here"):
        ts.CheckpointManager(moto_server.url("no-such-bucket-here", "run"),
                             storage_options=moto_server.storage_options()).generations()
    wrong = moto_server.storage_options(secret_access_key="wrong")
    if moto_server.kind == "moto":  # moto accepts any key unless told to check; SeaweedFS below enforces it
        pytest.skip("moto does not check signatures")
    with pytest.raises(ts.StorageAccessDenied, match="AWS_ACCESS_KEY_ID"):
        ts.CheckpointManager(_url(moto_server, bucket), storage_options=wrong).generations()


def test_storage_options_apply_to_urls_only(tmp_path):
    with pytest.raises(ts.InvalidArgument, match="storage_options"):
        ts.CheckpointManager(tmp_path, storage_options={"region": "x"})


# the mirror ------------------------------------------------------------------------------------------------
def _wait_for_remote(ckpt: ts.CheckpointManager, name: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while ckpt.status().mirror.remote_latest != name:
        assert time.monotonic() < deadline, ckpt.status().mirror
        time.sleep(0.05)


def test_mirror_uploads_in_the_background_and_a_fresh_machine_resumes_from_it(moto_server, bucket, tmp_path):
    url = _url(moto_server, bucket)
    opts = moto_server.storage_options()
    local = tmp_path / "nvme" / "run"
    reference = _fresh(7)
    for _ in range(8):
        step(reference)
    expected = full_state(reference), next_draws(reference)  # now: the global RNGs are the process's, not its
    with ts.CheckpointManager(local, keep_last=2, mirror=url, mirror_options=opts) as ckpt:
        state = _fresh(7)
        _train(ckpt, state, 6)
        status = ckpt.status()
        assert status.recovery_point == generation_name(6)
        assert status.mirror.url == url
    # close waited for the uploads: the remote latest is the local one
    remote = ObjectStore(url, storage_options=opts)
    assert remote.read_pointer(POINTER) is not None
    assert remote.generations()[0] == generation_name(6)
    shutil.rmtree(local.parent)  # the instance is gone, its NVMe with it
    with ts.CheckpointManager(local, keep_last=2, mirror=url, mirror_options=opts) as ckpt:
        resumed = build(seed=1)
        info = ckpt.restore(resumed)
        assert info.generation.name == generation_name(6)
        _train(ckpt, resumed, 8)
        _wait_for_remote(ckpt, generation_name(8))
        assert ckpt.status().mirror.lag_updates == 0
    assert_same((full_state(resumed), next_draws(resumed)), expected)


def test_an_upload_failure_never_fails_a_save_and_local_pruning_waits_for_it(moto_server, bucket, tmp_path):
    opts = moto_server.storage_options()
    url = _url(moto_server, bucket)
    with FaultProxy(moto_server.endpoint) as proxy:
        proxied = moto_server.storage_options(endpoint=proxy.endpoint, retry_config={"max_retries": 0})
        proxy.fail(1, "500", method="PUT", times=10_000)  # every upload fails until cleared
        with ts.CheckpointManager(tmp_path / "run", keep_last=1, mirror=url, mirror_options=proxied,
                                  mirror_timeout_s=2) as ckpt:
            state = build(seed=2)
            _train(ckpt, state, 6)  # three saves; none may fail
            deadline = time.monotonic() + 30
            while ckpt.status().mirror.failures == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            status = ckpt.status().mirror
            assert status.failures >= 1 and status.last_error and status.remote_latest is None
            assert status.lag_updates == 6 and status.lag_s > 0
            # nothing is remote yet, so keep_last=1 prunes nothing locally
            assert ckpt.generations() == [generation_name(6), generation_name(4), generation_name(2)]
            proxy.clear()
            _wait_for_remote(ckpt, generation_name(6))
            committed = {r.path.rsplit("/", 1)[-1] for r in proxy.requests
                         if r.method == "PUT" and "/commits/" in r.path and r.status == 200}
            assert committed == {generation_name(6)}, committed  # behind, the uploader skipped to the newest
            step(state)
            step(state)
            ckpt.save(state)
            _wait_for_remote(ckpt, generation_name(8))
            step(state)
            step(state)
            ckpt.save(state)  # the remote holds 8 now: local keeps 10 (not remote yet) and 8, prunes 6
            assert ckpt.generations() == [generation_name(10), generation_name(8)]
    remote = ObjectStore(url, storage_options=opts)
    assert remote.generations() == [generation_name(10)]  # close waited for it; keep_last=1 remotely too
    with ts.CheckpointManager(url, storage_options=opts) as ckpt:
        assert ckpt.restore(build(seed=0)).generation.name == generation_name(10)


def test_the_command_line_takes_urls(moto_server, bucket, monkeypatch, capsys):
    """ls, verify, inspect, plan, pin and prune on s3:// URLs; credentials and endpoint from the environment."""
    url = _url(moto_server, bucket)
    with ts.CheckpointManager(url, keep_last=3, storage_options=moto_server.storage_options()) as ckpt:
        _train(ckpt, _fresh(1), 6)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto_server.secret_key)
    monkeypatch.setenv("AWS_REGION", moto_server.region)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    assert cli.main(["ls", url, "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["recovery_point"] == generation_name(6)
    assert cli.main(["verify", url]) == 0
    assert cli.main(["verify", f"{url}/{generation_name(4)}"]) == 0
    assert cli.main(["inspect", url]) == 0
    capsys.readouterr()
    assert cli.main(["pin", url, "keep", generation_name(2)]) == 0
    capsys.readouterr()
    assert cli.main(["plan", url, "--total-updates", "20", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)
    assert cli.main(["prune", url, "--keep-last", "1", "--dry-run", "--json"]) == 0
    assert generation_name(4) in capsys.readouterr().out
    assert cli.main(["prune", url, "--keep-last", "1"]) == 0
    remaining = ObjectStore(url, storage_options=moto_server.storage_options()).generations()
    assert remaining == [generation_name(6), generation_name(2)]  # the pinned one stays
    store = ObjectStore(url, storage_options=moto_server.storage_options())
    key = f"attempts/{store._attempt(generation_name(6))}/state.json"
    data = bytearray(store.client.get_small(key))
    data[5] ^= 1
    store.client.put(key, bytes(data))
    capsys.readouterr()
    assert cli.main(["verify", url]) == 1  # a damaged object fails verification, as on a disk


# races, against a server that makes conditional writes atomic (SeaweedFS) -----------------------------------
def _committer(url: str, opts: dict, name: str, barrier: threading.Barrier, out: list) -> None:
    store = ObjectStore(url, storage_options=opts)
    staging = store.begin(name)
    staging.write("a.bin", [staging.name.encode()])
    barrier.wait()
    try:
        staging.commit()
        out.append(("won", staging.name))
    except ts.GenerationExists:
        staging.abort()
        out.append(("lost", staging.name))


def test_exactly_one_of_many_concurrent_committers_wins(seaweed_server):
    bucket = seaweed_server.make_bucket()
    opts = seaweed_server.storage_options()
    for round_ in range(10):
        url = seaweed_server.url(bucket, f"race-{round_}")
        out: list = []
        barrier = threading.Barrier(6)
        threads = [threading.Thread(target=_committer, args=(url, opts, generation_name(1), barrier, out))
                   for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        winners = [who for result, who in out if result == "won"]
        assert len(out) == 6 and len(winners) == 1, out
        store = ObjectStore(url, storage_options=opts)
        with store.open(generation_name(1), "a.bin") as stream:
            assert stream.read() == winners[0].encode()  # the generation is the winner's attempt, whole
        assert store.leftovers() == []  # every loser deleted its own attempt


def test_the_pointer_never_moves_backwards_under_concurrent_writers(seaweed_server):
    """Writers publish pointers for updates 1..N in random order; whatever interleaving, latest ends at N and
    a writer that would move it back while the newer generation exists is refused."""
    bucket = seaweed_server.make_bucket()
    opts = seaweed_server.storage_options()
    url = seaweed_server.url(bucket, "pointer-race")
    store = ObjectStore(url, storage_options=opts)
    for update in range(1, 9):
        _publish_with_pointer(store, update)
    order = list(range(1, 9))
    random.Random(5).shuffle(order)
    refused: list[int] = []

    def write(update: int) -> None:
        try:
            ObjectStore(url, storage_options=opts).write_pointer(POINTER, _pointer_bytes(update))
        except ts.DirectoryLocked:
            refused.append(update)

    threads = [threading.Thread(target=write, args=(u,)) for u in order]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    final = json.loads(store.read_pointer(POINTER))
    assert final["generation"] == generation_name(8), (final, refused)
    assert 8 not in refused and refused, refused  # some older writers came late and were refused


def _pointer_bytes(update: int) -> bytes:
    from trainstate.format.manifest import Pointer

    return Pointer(generation_name(update), "0" * 64, 10, "blake3", update).to_bytes()


def _publish_with_pointer(store: ObjectStore, update: int) -> None:
    staging = store.begin(generation_name(update))
    staging.write("a.bin", [b"x"])
    staging.commit()


# transient faults: retried, never committed twice ----------------------------------------------------------
@pytest.mark.parametrize("how", ["500", "reset"])
def test_a_transient_fault_on_the_commit_is_retried_and_commits_once(moto_server, bucket, how):
    """The proxy fails the commit record's PUT after the server got it (500) or drops the connection (reset);
    the client retries; a retried create-only put that had landed must not be taken for a lost race."""
    with FaultProxy(moto_server.endpoint) as proxy:
        opts = moto_server.storage_options(endpoint=proxy.endpoint)
        url = _url(moto_server, bucket)
        with ts.CheckpointManager(url, storage_options=opts) as ckpt:
            state = _fresh(2)
            step(state)
            ckpt.save(state)
            proxy.fail(1, how, method="PUT", path_contains="/commits/")
            step(state)
            info = ckpt.save(state)
            assert proxy.count(method="PUT", path_contains="/commits/") >= 3  # the fault, then the retry
        assert info.name == generation_name(2)
    store = ObjectStore(url, storage_options=moto_server.storage_options())
    assert store.generations() == [generation_name(2), generation_name(1)] and store.leftovers() == []
    with ts.CheckpointManager(url, storage_options=moto_server.storage_options()) as ckpt:
        assert ckpt.restore(_fresh(0)).generation.name == generation_name(2)


def test_a_fault_that_outlasts_the_retries_fails_the_save_and_publishes_nothing(moto_server, bucket):
    with FaultProxy(moto_server.endpoint) as proxy:
        opts = moto_server.storage_options(endpoint=proxy.endpoint, retry_config={"max_retries": 1})
        url = _url(moto_server, bucket)
        with ts.CheckpointManager(url, storage_options=opts) as ckpt:
            state = _fresh(2)
            step(state)
            ckpt.save(state)
            proxy.fail(1, "503", method="PUT", path_contains="/latest", times=100)
            step(state)
            with pytest.raises(ts.StorageUnavailable, match="retries"):
                ckpt.save(state)
            proxy.clear()
            assert ckpt.latest() == generation_name(1)
            ckpt.save(state)  # the same update again, once the store answers: published now
            assert ckpt.latest() == generation_name(2)


@pytest.mark.parametrize("control", [False, True])
def test_a_store_that_stops_answering_mid_restore_raises_and_passes_over_nothing(moto_server, bucket, monkeypatch,
                                                                              control):
    """Every GET of the newest generation's objects answers 503, past the client's retries: the restore raises
    StorageUnavailable (a supervisor restarts on it), loads nothing, and does not resume from the older generation,
    whose bytes answer but are two updates behind. Once the store answers, the newest loads. The control (a read
    the store did not answer counted as damage, as before) resumes from the older generation."""
    from trainstate.errors import EXIT_FAILED, CorruptGeneration
    from trainstate.storage import verify

    with FaultProxy(moto_server.endpoint) as proxy:
        opts = moto_server.storage_options(endpoint=proxy.endpoint, retry_config={"max_retries": 1})
        url = _url(moto_server, bucket)
        with ts.CheckpointManager(url, storage_options=opts) as ckpt:
            state = _fresh(2)
            for _ in range(2):
                step(state)
                ckpt.save(state)
            saved = full_state(state)
        if control:
            monkeypatch.setattr(verify, "unreadable", lambda where, exc, what="unreadable":
                                CorruptGeneration(where, f"{what} ({exc})"))
        fresh = _fresh(5)
        untouched = full_state(_fresh(5))
        newest = f"attempts/{ObjectStore(url, storage_options=opts)._attempt(generation_name(2))}/"
        with ts.CheckpointManager(url, storage_options=opts) as ckpt:
            proxy.fail(1, "503", method="GET", path_contains=newest, times=10_000)  # its objects, after the constructor
            if control:
                info = ckpt.restore(fresh)
                assert info.generation.name == generation_name(1) and info.rejected[0].generation == generation_name(2)
                return
            with pytest.raises(ts.StorageUnavailable, match="retries") as raised:
                ckpt.restore(fresh)
            assert ts.exit_code_for(raised.value) == EXIT_FAILED  # NoValidGeneration would stop a supervisor
            assert str(raised.value).endswith("The restore loaded nothing; call it again once the store answers")
            assert ts.unusable_reason(fresh) is None
            assert_same(full_state(fresh), untouched)
            proxy.clear()
            assert ckpt.restore(fresh).generation.name == generation_name(2)
        assert_same(full_state(fresh), saved)


# the writer lease ----------------------------------------------------------------------------------------------
_HOLDER = """
import json, os, sys, time
import trainstate as ts
ckpt = ts.CheckpointManager(sys.argv[1], storage_options=json.loads(sys.argv[2]))
ckpt.__enter__()
print("locked", flush=True)
time.sleep(600)
"""


def test_a_second_writer_is_refused_and_a_killed_writers_lease_is_taken_over_at_once(moto_server, bucket):
    url, opts = _url(moto_server, bucket), moto_server.storage_options()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, url, json.dumps(opts)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ts.DirectoryLocked, match=f"pid {holder.pid}"):
            with ts.CheckpointManager(url, storage_options=opts):
                pass
        holder.kill()  # SIGKILL: the lease object stays behind, its holder gone
        holder.wait(10)
        with ts.CheckpointManager(url, storage_options=opts) as ckpt:  # same host, dead pid: no waiting
            state = _fresh(0)
            step(state)
            assert ckpt.save(state).name == generation_name(1)
    finally:
        holder.kill()
        holder.stdout.close()


def test_an_expired_lease_of_another_host_is_taken_over(moto_server, bucket):
    url, opts = _url(moto_server, bucket), moto_server.storage_options()
    store = ObjectStore(url, storage_options=opts)
    foreign = {"owner": "0" * 16, "host": "another-host", "pid": 1, "expires": time.time() + 2}
    store.client.put("lock", json.dumps(foreign).encode(), create=True)
    with pytest.raises(ts.DirectoryLocked, match="another-host"):
        ObjectStore(url, storage_options=opts).lock()
    time.sleep(2.2)
    taker = ObjectStore(url, storage_options=opts)
    taker.lock()
    assert json.loads(store.client.get_small("lock"))["host"] != "another-host"
    taker.unlock()
    assert store.client.get_small("lock") is None


def test_an_open_multipart_upload_of_a_killed_save_is_aborted_by_the_next_save(moto_server, bucket):
    """A process killed mid-upload leaves its multipart upload open (parts billed, no object listed); the
    next save's cleanup finds it under an attempt no commit record names, and aborts it."""
    import boto3

    url, opts = _url(moto_server, bucket), moto_server.storage_options()
    prefix = url.split("/", 3)[3]
    s3 = boto3.client("s3", endpoint_url=moto_server.endpoint, region_name=moto_server.region,
                      aws_access_key_id=moto_server.access_key, aws_secret_access_key=moto_server.secret_key)
    key = f"{prefix}/attempts/{generation_name(1)}-{'ab' * 8}/shard.safetensors"
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    s3.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * (5 << 20))
    store = ObjectStore(url, storage_options=opts)
    assert store.leftovers() == [f"{generation_name(1)}-{'ab' * 8}"]  # no object: only the open upload shows it
    with ts.CheckpointManager(url, storage_options=opts) as ckpt:
        state = _fresh(0)
        step(state)
        ckpt.save(state)
    assert s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []) == []
    assert store.leftovers() == []


# multipart part size -------------------------------------------------------------------------------------
def test_the_part_size_grows_so_that_no_file_needs_more_parts_than_the_store_allows():
    from trainstate.storage.multipart import MAX_PARTS, PART_SIZE, part_size

    assert part_size(None) == part_size(0) == part_size(100 << 20) == PART_SIZE
    for size in (PART_SIZE * MAX_PARTS, 160 << 30, 1 << 40, 5 << 40):
        chosen = part_size(size)
        assert chosen % (1 << 20) == 0 and -(-size // chosen) <= MAX_PARTS * 10 // 11 + 1, (size, chosen)
    assert part_size(1 << 40) > PART_SIZE  # a 1 TiB file at 16 MiB would need 65,536 parts


def _multipart_parts(store: ObjectStore, key: str) -> int:
    """The number of parts the server assembled the object from (its ETag ends in -N)."""
    import obstore

    e_tag = obstore.head(store.client.store, key)["e_tag"].strip('"')
    return int(e_tag.rsplit("-", 1)[1]) if "-" in e_tag else 1


def test_an_upload_with_a_size_hint_stays_within_the_part_limit(moto_server, bucket, monkeypatch):
    from trainstate.storage import multipart

    monkeypatch.setattr(multipart, "PART_SIZE", 5 << 20)  # S3's smallest part
    monkeypatch.setattr(multipart, "MAX_PARTS", 3)
    store = ObjectStore(_url(moto_server, bucket), storage_options=moto_server.storage_options())
    data = np.random.default_rng(0).integers(0, 255, 24 << 20, dtype=np.uint8).tobytes()
    blocks = [memoryview(data)[i : i + (1 << 20)] for i in range(0, len(data), 1 << 20)]
    counts = {}
    for hint in (len(data), None):  # None: the negative control, 5 MiB parts
        staging = store.begin(generation_name(7 if hint else 8, "full"))
        try:
            record = staging.write("big.bin", iter(blocks), size_hint=hint)
            assert record.size == len(data)
            counts[hint] = _multipart_parts(store, staging.prefix + "big.bin")
        finally:
            staging.abort()
    assert counts[len(data)] <= 3, counts
    assert counts[None] == 5, counts  # the server does report the parts: without the hint they exceed 3


# commit records remembered under the lease ---------------------------------------------------------------
def _commit_reads(store: ObjectStore, generation: str) -> Callable[[], int]:
    """A counter of the GETs of ``generation``'s commit record made through ``store``'s client from now on."""
    seen = [0]
    original = store.client.get_small

    def counting(key: str):
        seen[0] += key == f"commits/{generation}"
        return original(key)
    store.client.get_small = counting
    return lambda: seen[0]


def test_the_writer_reads_each_commit_record_once_and_forgets_what_it_changes(moto_server, bucket):
    from store_conformance import publish, read

    url = _url(moto_server, bucket)
    writer = ObjectStore(url, storage_options=moto_server.storage_options())
    reader = ObjectStore(url, storage_options=moto_server.storage_options())  # no lease: never remembers
    name = generation_name(5, "full")
    writer.lock()
    try:
        publish(writer, name, {"a.bin": b"first"})
        writes, reads = _commit_reads(writer, name), _commit_reads(reader, name)
        for _ in range(3):
            assert read(writer, name, "a.bin") == read(reader, name, "a.bin") == b"first"
        assert writes() == 1 and reads() == 3  # the control: a store without the lease asks every time

        writer.remove(name)  # the same name published again: a new attempt, which both must read
        publish(writer, name, {"a.bin": b"second"})
        assert read(writer, name, "a.bin") == read(reader, name, "a.bin") == b"second"
        aside = writer.set_aside(name, "rejected")
        with pytest.raises(FileNotFoundError):
            writer.open(name, "a.bin")
        writer.reinstate(aside, name)
        assert read(writer, name, "a.bin") == b"second"
    finally:
        writer.unlock()
    assert writer._attempts == {}  # released: another writer may change the records from now on


def test_each_manifest_is_downloaded_once_per_attempt_and_a_republished_one_again(moto_server, bucket):
    """An attempt's manifest never changes once committed, so every store (a writer's or a reader's) downloads it
    once; the same name published again is a new attempt, whose manifest is downloaded (the control)."""
    from store_conformance import publish, read

    url = _url(moto_server, bucket)
    writer = ObjectStore(url, storage_options=moto_server.storage_options())
    reader = ObjectStore(url, storage_options=moto_server.storage_options())
    name = generation_name(6, "full")
    fetched: list[str] = []
    for store in (writer, reader):
        original = store.client.reader
        store.client.reader = lambda key, original=original: fetched.append(key) or original(key)
    publish(writer, name, {"manifest.json": b'{"v": 1}', "a.bin": b"x"})
    writer.lock()
    try:
        for store in (writer, reader):
            for _ in range(3):
                assert read(store, name, "manifest.json") == b'{"v": 1}'
                assert read(store, name, "a.bin") == b"x"  # other files are streamed every time
        assert sorted(k.rsplit("/", 1)[1] for k in fetched) == ["a.bin"] * 6 + ["manifest.json"] * 2
        writer.remove(name)
        publish(writer, name, {"manifest.json": b'{"v": 2}', "a.bin": b"y"})
        fetched.clear()
        assert read(writer, name, "manifest.json") == read(reader, name, "manifest.json") == b'{"v": 2}'
        assert len(fetched) == 2  # a new attempt: downloaded by each
    finally:
        writer.unlock()
