"""Format 3 (chunked digests: ``xxh3-chunked``, ``blake3-chunked``): restore reads each byte once, and nothing unverified reaches a live tensor.

A chunk that fails late is the hard case of a one-pass restore: verified
chunks before it are already in live tensors. Restore then falls back to the
previous generation, which loads completely over them; with no fallback the
state is marked unusable and every save refuses it.
"""

from __future__ import annotations

import io
import json
import os

import pytest
import torch

import trainstate as ts
from trainstate.format.digest import CHUNK_BYTES, ChunkedHasher, chunked_top, digest_bytes
from trainstate.format.manifest import parse_manifest
from trainstate.storage import chunked
from trainstate.storage.local import LocalStore

TENSORS = "tensors.safetensors"


def _state(seed: int) -> ts.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1536), torch.nn.Linear(1536, 1024))  # ~12.6 MB: 4 chunks
    return ts.TrainState(model=model, capture_global_rngs=False)


def _params(state: ts.TrainState) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state["model"].state_dict().items()}


def _save(run, seeds=(1, 2), full_every=8) -> list[dict[str, torch.Tensor]]:
    saved = []
    state = _state(seeds[0])
    with ts.CheckpointManager(run, keep_last=5, full_every=full_every) as ckpt:
        for update, seed in enumerate(seeds, 1):
            with torch.no_grad():
                for name, value in _state(seed)["model"].state_dict().items():
                    state["model"].state_dict()[name].copy_(value)
            state.next_update = update
            ckpt.save(state)
            saved.append(_params(state))
    return saved


def _flip(run, generation: str, offset_from_end: int) -> int:
    path = run / generation / TENSORS
    data = bytearray(path.read_bytes())
    at = len(data) - offset_from_end
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    return at


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("full_every", [8, None])
def test_manifest_lists_verifiable_chunks(tmp_path, full_every):
    _save(tmp_path, seeds=(1,), full_every=full_every)
    gen = tmp_path / "gen-000000000001"
    manifest = parse_manifest((gen / "manifest.json").read_bytes(), "m")
    record = manifest.file(TENSORS)
    assert manifest.digest_algorithm == "xxh3-chunked" and manifest.format_version == (4 if full_every else 3)
    data = (gen / TENSORS).read_bytes()
    assert len(record.chunks) == -(-len(data) // CHUNK_BYTES) >= 4
    hasher = ChunkedHasher("xxh3-chunked")
    for i in range(0, len(data), 1_000_003):  # updates that straddle chunk boundaries
        hasher.update(data[i : i + 1_000_003])
    assert hasher.hexdigest() == record.digest and tuple(hasher.chunks) == record.chunks
    assert chunked_top(record.size, record.chunks, "xxh3-chunked") == record.digest
    assert all(len(c) == 32 for c in record.chunks)  # XXH3-128


def test_late_bad_chunk_falls_back_and_the_fallback_overwrites_everything(tmp_path):
    saved = _save(tmp_path)
    _flip(tmp_path, "gen-000000000002", 100)  # in the last chunk: three verified chunks load first
    live = _state(99)
    with ts.CheckpointManager(tmp_path) as ckpt:
        info = ckpt.restore(live)
        assert info.generation.name == "gen-000000000001"
        assert info.rejected[0].generation == "gen-000000000002" and "chunk" in info.rejected[0].reason
        assert _equal(_params(live), saved[0])  # bitwise the fallback, not a mix
        assert ts.unusable_reason(live) is None
        live.next_update = 3
        ckpt.save(live)  # usable: the fallback loaded completely


@pytest.mark.parametrize("full_every", [8, None])
def test_late_bad_chunk_without_fallback_marks_the_state_unusable(tmp_path, full_every):
    saved = _save(tmp_path, seeds=(1,), full_every=full_every)
    at = _flip(tmp_path, "gen-000000000001", 100)
    live = _state(99)
    before = _params(live)
    with ts.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ts.NoValidGeneration, match="UNUSABLE") as caught:
            ckpt.restore(live)
        assert "chunk" in str(caught.value)
        reason = ts.unusable_reason(live)
        assert reason and "gen-000000000001" in reason
        with pytest.raises(ts.StateUnusable, match="unusable"):
            ckpt.save(live)
        assert not list(tmp_path.glob("gen-000000000000*"))  # nothing was published
    # Verified chunks reached the live tensors; the damaged chunk did not: its bytes are the live ones from before.
    path = tmp_path / "gen-000000000001" / TENSORS
    header = json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
    order = [k.removeprefix("model.") for k in sorted((k for k in header if k != "__metadata__"),
                                                       key=lambda k: header[k]["data_offsets"][0])]  # file order

    def flat(values):
        return torch.cat([values[k].reshape(-1).view(torch.uint8) for k in order])

    flat_live, flat_saved, flat_before = flat(live["model"].state_dict()), flat(saved[0]), flat(before)
    data_start = (tmp_path / "gen-000000000001" / TENSORS).stat().st_size - flat_saved.numel()
    bad = (at // CHUNK_BYTES) * CHUNK_BYTES - data_start  # where the damaged chunk starts in the tensor data
    assert torch.equal(flat_live[:bad], flat_saved[:bad])
    assert torch.equal(flat_live[bad:], flat_before[bad:])
    assert not torch.equal(flat_live, flat_before)  # the control: live bytes did change


def test_unusable_is_cleared_by_a_restore_that_loads_completely(tmp_path):
    _save(tmp_path / "bad", seeds=(1,))
    saved = _save(tmp_path / "good", seeds=(5,))
    _flip(tmp_path / "bad", "gen-000000000001", 100)
    live = _state(99)
    with ts.CheckpointManager(tmp_path / "bad") as ckpt, pytest.raises(ts.NoValidGeneration):
        ckpt.restore(live)
    assert ts.unusable_reason(live)
    with ts.CheckpointManager(tmp_path / "good") as ckpt:
        ckpt.restore(live)
        assert ts.unusable_reason(live) is None and _equal(_params(live), saved[0])
        live.next_update = 2
        ckpt.save(live)


def test_bad_first_chunk_changes_nothing_live(tmp_path):
    """The control for the two above: a failure before any chunk was copied leaves the state usable."""
    _save(tmp_path, seeds=(1,))
    size = (tmp_path / "gen-000000000001" / TENSORS).stat().st_size
    _flip(tmp_path, "gen-000000000001", size - 200)  # inside the header's chunk: refused during the choice
    live = _state(99)
    before = _params(live)
    with ts.CheckpointManager(tmp_path) as ckpt, pytest.raises(ts.NoValidGeneration, match="nothing was loaded"):
        ckpt.restore(live)
    assert ts.unusable_reason(live) is None and _equal(_params(live), before)


def test_a_tampered_chunk_list_is_refused(tmp_path):
    _save(tmp_path, seeds=(1,))
    gen = tmp_path / "gen-000000000001"
    raw = json.loads((gen / "manifest.json").read_bytes())
    record = next(f for f in raw["files"] if f["name"] == TENSORS)

    def sealed() -> bytes:  # an attacker who edits the manifest and recomputes its self-digest
        body = {k: v for k, v in raw.items() if k not in ("self_digest", "signature")}
        raw["self_digest"] = digest_bytes(raw["digest_algorithm"], json.dumps(body, indent=1, sort_keys=True).encode())
        return json.dumps(raw).encode()

    parse_manifest(sealed(), "m")  # the control: resealing alone is accepted
    record["chunks"][1] = "0" * len(record["chunks"][1])  # one chunk digest replaced (to pass off a changed chunk)
    with pytest.raises(ts.CorruptGeneration, match="do not combine"):
        parse_manifest(sealed(), "m")
    record["chunks"] = record["chunks"][:-1]
    with pytest.raises(ts.CorruptGeneration, match="malformed chunk digests"):
        parse_manifest(sealed(), "m")


@pytest.mark.parametrize("workers", [1, 3])
def test_chunk_reader_matches_a_plain_read(tmp_path, workers):
    _save(tmp_path, seeds=(3,))
    store = LocalStore(tmp_path, create=False)
    manifest = parse_manifest((tmp_path / "gen-000000000001" / "manifest.json").read_bytes(), "m")
    out: dict[str, torch.Tensor] = {}
    progress = chunked.Progress()
    chunked.read_file(store, manifest, TENSORS, {"model.0.weight", "model.1.bias"},
                      out, progress=progress, workers=workers)
    state = _state(3)
    assert torch.equal(out["model.0.weight"], state["model"][0].weight.detach())
    assert torch.equal(out["model.1.bias"], state["model"][1].bias.detach())
    assert progress.chunks == len(manifest.file(TENSORS).chunks) and not progress.live_changed


def test_copying_an_older_format_generation_checks_it_with_its_own_digest(tmp_path):
    """A run upgraded to format 3 still mirrors its format-2 generations (the copy digests as they were)."""
    from trainstate.lifecycle.mirror import copy_generation

    state = _state(1)
    state.next_update = 1
    with ts.CheckpointManager(tmp_path / "old", digest="blake3", full_every=None) as ckpt:
        ckpt.save(state)
    dst = LocalStore(tmp_path / "copy")  # the store's own default is xxh3-chunked
    assert dst.digest_algorithm == "xxh3-chunked"
    verified = copy_generation(LocalStore(tmp_path / "old", create=False), dst, "gen-000000000001", None)
    assert verified.manifest.digest_algorithm == "blake3" and verified.manifest.format_version == 3
    live = _state(7)
    with ts.CheckpointManager(tmp_path / "copy") as ckpt:
        # no pointer in the copy: restore finds the generation by name
        assert ckpt.restore(live, generation="gen-000000000001").generation.name == "gen-000000000001"
    assert _equal(_params(live), _params(state))


def _manifest(run, generation="gen-000000000001"):
    return parse_manifest((run / generation / "manifest.json").read_bytes(), "m")


@pytest.mark.parametrize("rewrite", [False, True, "link"])
def test_a_file_written_while_it_is_read_fails_the_read(tmp_path, rewrite):
    """Chunks are verified in the page cache and then copied: a write between the two is caught by the file's
    identity (the same byte written back moves its change time), and the restore path treats it as damage."""
    _save(tmp_path, seeds=(3,))
    path = tmp_path / "gen-000000000001" / TENSORS
    manifest = _manifest(tmp_path)
    live = _state(9)
    into = {f"model.{k}": v.detach() for k, v in live["model"].state_dict().items()}
    seen = []

    def on_bytes(n: int) -> None:
        seen.append(n)
        if rewrite == "link" and len(seen) == 1:  # an incremental save linking it: its change time moves
            os.link(path, tmp_path / "linked")
        elif rewrite and len(seen) == 1:
            with open(path, "r+b") as f:  # same content, so every chunk still verifies
                f.seek(200)
                byte = f.read(1)
                f.seek(200)
                f.write(byte)
    progress = chunked.Progress()
    call = lambda: chunked.read_file(LocalStore(tmp_path, create=False), manifest, TENSORS, set(into), {},  # noqa: E731
                                     into=into, progress=progress, on_bytes=on_bytes, workers=1)
    if rewrite is True:
        with pytest.raises(ts.CorruptGeneration, match="written while it was being read"):
            call()
        assert progress.live_changed  # the caller marks the state unusable
    else:
        call()  # the control: the same read with no write (or a new name for the file) passes
        assert _equal(_params(live), _params(_state(3)))
        assert sum(seen) == manifest.file(TENSORS).size


def test_on_bytes_counts_every_verified_byte_once(tmp_path):
    _save(tmp_path, seeds=(3,))
    manifest = _manifest(tmp_path)
    seen: list[int] = []
    with (tmp_path / "gen-000000000001" / TENSORS).open("rb") as stream:
        chunked.verify_file(stream, manifest.file(TENSORS), "w", manifest.digest_algorithm, on_bytes=seen.append)
    assert sum(seen) == manifest.file(TENSORS).size and len(seen) == len(manifest.file(TENSORS).chunks)


class _StreamingStore(LocalStore):
    """A local store whose files come back as plain streams (no descriptor), as an object store's do."""

    def open(self, generation, file):
        import io

        with super().open(generation, file) as f:
            return io.BytesIO(f.read())


class _RangedStream(io.BytesIO):
    """A stream with an object store's parallel ranged reads (``span_reader``), over a file's bytes: the
    reads it served are recorded, so a test can tell that the ranged path (not the ring) read the file."""

    def __init__(self, data: bytes, requests: list):
        super().__init__(data)
        self._data, self.requests = data, requests

    def span_reader(self):
        def span(begin: int, end: int) -> memoryview:
            self.requests.append((begin, end))
            return memoryview(self._data[begin:end])
        return span


class _RangedStore(LocalStore):
    """A local store whose files come back as an object store's do: a stream with ranged reads."""

    requests: list = []

    def open(self, generation, file):
        with super().open(generation, file) as f:
            return _RangedStream(f.read(), self.requests)


STORES = {"mapped": LocalStore, "ring": _StreamingStore, "ranged": _RangedStore}


@pytest.mark.parametrize("kind", list(STORES))
def test_fresh_tensors_never_keep_an_unverified_chunk(tmp_path, kind):
    """A chunk read straight into a fresh tensor is verified where it landed; a bad one fails the read (the
    mapped path for local files, the ring for streams, and parallel ranged reads for object stores)."""
    _save(tmp_path, seeds=(3,))
    store = STORES[kind](tmp_path, create=False)
    manifest = _manifest(tmp_path)
    out: dict[str, torch.Tensor] = {}
    chunked.read_file(store, manifest, TENSORS, {"model.0.weight"}, out)  # the control: intact, it reads
    assert torch.equal(out["model.0.weight"], _state(3)["model"][0].weight.detach())
    _flip(tmp_path, "gen-000000000001", 100)
    store = STORES[kind](tmp_path, create=False)
    with pytest.raises(ts.CorruptGeneration, match="digest mismatch in chunk"):
        chunked.read_file(store, manifest, TENSORS, {"model.0.weight"}, {})


def test_a_file_shorter_than_its_record_is_refused_before_anything_is_mapped(tmp_path):
    _save(tmp_path, seeds=(3,))
    path = tmp_path / "gen-000000000001" / TENSORS
    manifest = _manifest(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(manifest.file(TENSORS).size - CHUNK_BYTES // 2)
    with pytest.raises(ts.CorruptGeneration, match="ends .* bytes early"):
        chunked.read_file(LocalStore(tmp_path, create=False), manifest, TENSORS, {"model.0.weight"}, {})


@pytest.mark.parametrize("bad", ["late", "first", "none"])
def test_ranged_reads_verify_each_chunk_before_a_live_tensor_changes(tmp_path, bad):
    """The object-store path: runs of chunks fetched on several threads, each chunk checked before any of its
    bytes is copied into a live tensor. A late bad chunk fails the read with the chunks before it placed (the
    caller marks the state unusable); a bad first chunk leaves every live byte as it was."""
    saved = _save(tmp_path, seeds=(3,))
    manifest = _manifest(tmp_path)
    size = manifest.file(TENSORS).size
    if bad != "none":
        _flip(tmp_path, "gen-000000000001", 100 if bad == "late" else size - 8 - 200)  # the header's chunk: 0
    live = _state(9)
    before = _params(live)
    into = {f"model.{k}": v.detach() for k, v in live["model"].state_dict().items()}
    progress = chunked.Progress()
    store = _RangedStore(tmp_path, create=False)
    store.requests = requests = []
    call = lambda: chunked.read_file(store, manifest, TENSORS, set(into), {}, into=into,  # noqa: E731
                                     progress=progress)
    if bad == "none":
        call()
        assert _equal(_params(live), saved[0]) and progress.live_changed
        spans = sorted(requests)  # the header's chunk was read (and kept) first: the rest, each byte once
        assert [b for b, _ in spans] == [CHUNK_BYTES] + [e for _, e in spans[:-1]] and spans[-1][1] == size
        assert all(e - b <= chunked.FETCH_BYTES for b, e in spans) and len(spans) >= 2
        return
    with pytest.raises(ts.CorruptGeneration, match="digest mismatch in chunk"):
        call()
    if bad == "late":
        assert progress.live_changed and not _equal(_params(live), before)
    else:
        assert not progress.live_changed and _equal(_params(live), before)
