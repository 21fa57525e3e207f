"""Incremental generations (issue 32): unchanged tensor files are linked, not rewritten; nothing changed is skipped.

A LoRA-shaped state (a frozen base, a trained adapter and its optimizer
state) saved with ``full_every``: each save writes the adapter's tensors and
links the base's part file from its parent (a hard link: the same inode, its
bytes stored once). Every generation restores bitwise; a write to the frozen
base by any route is written; retention removes generations without losing
a byte a kept one names; one damaged shared file is found in every generation
naming it, and restore falls back past all of them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
import torch

import trainstate as ts
from trainstate import cli
from trainstate.state import changes
from objectservers import counted_puts, moto_server  # noqa: F401  (fixture)

BASE = "part-"


def _model(seed: int = 0) -> torch.nn.ModuleDict:
    torch.manual_seed(seed)
    base = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))  # 1 MiB weights: parts
    base.requires_grad_(False)
    return torch.nn.ModuleDict({"base": base, "adapter": torch.nn.Linear(512, 4)})


def _state(seed: int = 0) -> ts.TrainState:
    model = _model(seed)
    opt = torch.optim.Adam(model["adapter"].parameters(), lr=1e-2)
    return ts.TrainState(model=model, optimizer=opt, rngs={"data": torch.Generator().manual_seed(seed)})


def _step(state: ts.TrainState) -> None:
    model, opt = state["model"], state["optimizer"]
    x = torch.randn(8, 512, generator=state.rngs["data"])
    model["adapter"](model["base"](x)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    state.next_update += 1


def _values(state: ts.TrainState) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, entry in state["optimizer"].state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v.clone() for k, v in entry.items()})
    return out


def _live(state: ts.TrainState) -> dict[str, torch.Tensor]:
    return {f"model.{k}": v for k, v in state["model"].state_dict().items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _manifest(run: Path, name: str) -> dict:
    return json.loads((run / name / "manifest.json").read_bytes())


def _train(run: Path, saves: int, *, full_every: int = 4, keep_last: int = 20, state=None, every=None):
    state = state if state is not None else _state()
    saved = {}
    with ts.CheckpointManager(run, keep_last=keep_last, full_every=full_every) as ckpt:
        for _ in range(saves):
            _step(state)
            if every is not None:
                every(state)
            info = ckpt.save(state)
            assert info.shared == sum(f["size"] for f in _manifest(run, info.name)["files"]
                                      if f["name"] in _manifest(run, info.name).get("shares", {}))
            saved[info.name] = _values(state)
    return state, saved


def test_a_steady_save_writes_the_adapter_and_links_the_base(tmp_path, capsys):
    """The frozen base (``requires_grad=False``) is laid out in a part at the first save, in two copies (the
    part and its spare); each later save writes the adapter and links the two copies crosswise, so no two
    generations in a row need the same copy, and no save after the first writes the base again."""
    run = tmp_path / "run"
    _, saved = _train(run, 4, full_every=0)
    names = sorted(saved)
    first, second, third, fourth = (_manifest(run, n) for n in names)
    part = next(f for f in first["fingerprints"] if f.startswith(BASE))
    spare = part.removesuffix(".safetensors") + ".spare"
    assert first["format_version"] == 5 and set(first["fingerprints"]) == {"tensors.safetensors", part}
    assert "shares" not in first and spare in {f["name"] for f in first["files"]}
    assert set(first["fingerprints"][part]) == {"model.base.0.weight", "model.base.1.weight"}  # biases: small
    assert second["shares"] == fourth["shares"] == {part: f"{names[0]}/{spare}", spare: f"{names[0]}/{part}"}
    assert third["shares"] == {part: names[0], spare: names[0]}  # where each copy's bytes were first written
    inodes = [os.stat(run / n / part).st_ino for n in names]
    assert inodes[0] == inodes[2] != inodes[1] == inodes[3]  # each generation's part, the one before's spare
    assert [os.stat(run / n / spare).st_ino for n in names] == inodes[1:2] + inodes[:1] + inodes[1:2] + inodes[:1]
    fourth = _manifest(run, names[3])
    part_size = os.stat(run / names[3] / part).st_size
    capsys.readouterr()
    assert cli.main(["inspect", str(run / names[3]), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["shared_bytes"] == 2 * part_size and {f["name"]: f.get("shared_from") for f in report["files"]}[
        part] == f"{names[0]}/{spare}"
    assert cli.main(["ls", str(run)]) == 0
    listing = capsys.readouterr().out
    assert "shared)" in next(line for line in listing.splitlines() if line.startswith(names[3]))
    assert "shared)" not in next(line for line in listing.splitlines() if line.startswith(names[0]))
    assert cli.main(["plan", str(run), "--total-updates", "100", "--every", "10", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    newest_bytes = sum(f["size"] for f in fourth["files"]) + (run / names[3] / "manifest.json").stat().st_size
    assert (planned["shared_bytes"], planned["generation_bytes"]) == (2 * part_size, newest_bytes - 2 * part_size)
    written = os.stat(run / names[3] / "tensors.safetensors").st_size
    base_bytes = sum(v.nbytes for k, v in saved[names[3]].items() if ".base." in k)
    assert written < 0.2 * base_bytes  # the adapter and its moments, not the base
    for name, values in saved.items():  # every generation restores bitwise, the linked ones included
        fresh = _state(seed=9)
        with ts.CheckpointManager(run) as ckpt:
            assert ckpt.restore(fresh, generation=name).generation.name == name
        assert _equal(_values(fresh), values), name


def test_every_nth_generation_links_nothing(tmp_path):
    run = tmp_path / "run"
    _, saved = _train(run, 9, full_every=3)
    linking = ["shares" in _manifest(run, n) for n in sorted(saved)]
    assert linking == [False, True, True, False, True, True, False, True, True]  # gen 1 lays the base out
    streak = 0
    for links in linking:  # never more than full_every - 1 generations in a row that link
        streak = streak + 1 if links else 0
        assert streak <= 2


@pytest.mark.parametrize("how", ["numpy view", ".data", "no_grad add_", "load_state_dict"])
def test_a_write_to_the_frozen_base_is_never_skipped(tmp_path, how, monkeypatch):
    """A frozen tensor written by any route is written; restore gives the new value. The control: with a
    detector that trusts the storage pointer, the save links the stale part and the restore misses the write."""

    def write(state):
        if state.next_update != 3:
            return
        layer = state["model"]["base"][1]
        if how == "numpy view":
            layer.weight.detach().numpy()[7, 3] += 1.0
        elif how == ".data":
            layer.weight.data.mul_(1.5)
        elif how == "no_grad add_":
            with torch.no_grad():
                layer.weight[-1].add_(0.25)
        else:
            layer.load_state_dict(torch.nn.Linear(512, 512).state_dict())

    run = tmp_path / "run"
    _, saved = _train(run, 4, every=write)
    names = sorted(saved)
    assert "shares" not in _manifest(run, names[2])  # the part with the written tensor was not linked
    fresh = _state(seed=9)
    with ts.CheckpointManager(run) as ckpt:
        ckpt.restore(fresh, generation=names[2])
    assert _equal(_values(fresh), saved[names[2]])

    def by_pointer(tensors, threads=None):  # a detector that misses every in-place write
        return {n: changes.Fingerprint(str(t.dtype), tuple(t.shape), f"{t.data_ptr():032x}")
                for n, t in tensors.items()}

    monkeypatch.setattr(changes, "fingerprints", by_pointer)
    from trainstate.lifecycle import incremental  # (its check of a file before linking would notice the garbage)
    monkeypatch.setattr(incremental, "intact", lambda *a, **k: True)
    control = tmp_path / "control"
    _, saved = _train(control, 4, every=write)
    fresh = _state(seed=9)
    with ts.CheckpointManager(control) as ckpt:
        ckpt.restore(fresh, generation=sorted(saved)[2])
    assert not _equal(_values(fresh), saved[sorted(saved)[2]])  # the test above catches such a detector


def test_retention_keeps_every_byte_a_kept_generation_names(tmp_path):
    run = tmp_path / "run"
    state, saved = _train(run, 6, full_every=10, keep_last=1)
    kept = sorted(p.name for p in run.glob("gen-*"))
    assert kept == [max(saved)]  # the generation that first wrote the part is gone; its bytes are not
    manifest = _manifest(run, kept[0])
    assert manifest["shares"] and all(not (run / origin).exists() for origin in manifest["shares"].values())
    fresh = _state(seed=9)
    with ts.CheckpointManager(run) as ckpt:
        ckpt.restore(fresh)
        assert cli.main(["verify", str(run)]) == 0
    assert _equal(_values(fresh), saved[kept[0]])


@pytest.mark.parametrize("copy", [0, 1])
def test_a_damaged_copy_of_a_part_leaves_the_generation_before_or_after_whole(tmp_path, capsys, copy):
    """The base's two copies alternate: gens 1 and 3 read copy A, gens 2 and 4 copy B, each holding the other as
    its spare. One flipped bit in either copy damages every generation that reads it; restore falls back at
    most one generation, to one that reads the other copy, and restores it bitwise. ``verify`` names every
    generation listing the damaged copy (as its part or its spare). The next save writes the damaged copy
    afresh (it is never linked), and the run is whole again."""
    run = tmp_path / "run"
    state, saved = _train(run, 4, full_every=0)
    names = sorted(saved)
    part = next(f for f in _manifest(run, names[0])["fingerprints"] if f.startswith(BASE))
    path = run / names[copy] / part
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x04
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))  # in place: the same inode, so every name of it sees the flip
    fresh = _state(seed=9)
    with ts.CheckpointManager(run) as ckpt:
        info = ckpt.restore(fresh)
    expected = names[2] if copy == 1 else names[3]
    assert info.generation.name == expected and [r.generation for r in info.rejected] == names[3:4 * copy]
    assert _equal(_values(fresh), saved[expected])
    capsys.readouterr()
    assert cli.main(["verify", str(run), "--json"]) != 0
    report = capsys.readouterr().out
    assert all(name in report for name in names)  # each lists the damaged copy
    with ts.CheckpointManager(run, keep_last=20, full_every=0) as ckpt:
        ckpt.restore(fresh)
        _step(fresh)
        after = ckpt.save(fresh)
    damaged = os.stat(path).st_ino
    assert all(os.stat(run / after.name / f).st_ino != damaged for f in (part, part.replace(".safetensors", ".spare")))
    assert cli.main(["verify", str(run / after.name)]) == 0
    again = _state(seed=3)
    with ts.CheckpointManager(run) as ckpt:
        assert ckpt.restore(again).generation.name == after.name
    assert _equal(_values(again), _values(fresh))


def test_background_saves_and_a_repeated_save_at_one_update(tmp_path):
    """Background saves link as blocking ones do; saving the same state again at the same update is a no-op
    (compared by fingerprints across the generation's files), and a changed one a revision."""
    run = tmp_path / "run"
    state = _state()
    saved = {}
    with ts.CheckpointManager(run, keep_last=20, full_every=10) as ckpt:
        for _ in range(4):
            _step(state)
            handle = ckpt.save(state, blocking=False)
            saved[handle.wait().name] = _values(state)
        again = ckpt.save(state)
        assert again.name == max(saved)  # nothing new written
        state["model"]["adapter"].bias.detach().numpy()[0] += 1.0
        revision = ckpt.save(state)
        assert revision.name == f"{max(saved)}-r001"
        saved[revision.name] = _values(state)
    assert "shares" in _manifest(run, sorted(saved)[3]) and "shares" in _manifest(run, revision.name)
    for name, values in saved.items():
        fresh = _state(seed=9)
        with ts.CheckpointManager(run) as ckpt:
            ckpt.restore(fresh, generation=name)
        assert _equal(_values(fresh), values), name


def test_a_tensor_that_keeps_changing_is_fingerprinted_only_when_probed(tmp_path, monkeypatch):
    """Full fine-tuning (every large tensor changes at every update), ``full_every=4``: a large tensor that changed
    when last compared records no fingerprint, and the next save writes it whole without a pass over its bytes.
    Every 4th incremental save of the process probes (fingerprints everything) and the save after it compares. A
    layer frozen before save 4 is found by the probe at save 5, laid out in a part at save 6 and linked at save 7.
    Saving the same state again at save 7's update is still a no-op (the manifest lacks the trained layer's
    fingerprint: it is taken from the stored file), a changed one a revision (the 8th incremental save); every
    generation restores bitwise."""
    passes: list[set[str]] = []
    real = changes.fingerprints
    monkeypatch.setattr(changes, "fingerprints", lambda tensors, **kw: (
        passes[-1].update(n for n, t in tensors.items() if t.nbytes >= 1 << 20), real(tensors, **kw))[1])
    model = _model()
    model.requires_grad_(True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    state = ts.TrainState(model=model, optimizer=opt, rngs={"data": torch.Generator().manual_seed(0)})
    run, saved, trained = tmp_path / "run", {}, "model.base.1.weight"
    with ts.CheckpointManager(run, keep_last=20, full_every=4) as ckpt:
        for save in range(1, 10):
            if save == 4:
                model["base"][0].requires_grad_(False)
            _step(state)
            passes.append(set())
            info = ckpt.save(state)
            saved[info.name] = _values(state)
            if save == 7:
                assert trained not in _manifest(run, info.name)["fingerprints"]["tensors.safetensors"]
                passes.append(set())  # (these two compare every tensor, the stored ones included)
                assert ckpt.save(state).name == info.name  # the same state: nothing written
                model["adapter"].bias.detach().numpy()[0] += 1.0
                revision = ckpt.save(state)
                assert revision.name == f"{info.name}-r001"
                saved[revision.name] = _values(state)
    del passes[7]
    # probes at saves 1, 5 and 8 (the revision was the 8th incremental save); saves 2 and 6 compare; the revision's
    # check took every fingerprint and it records them, so save 8 (probe) compares too, and save 9 skips
    assert [i + 1 for i, names in enumerate(passes) if trained in names] == [1, 2, 5, 6, 8], passes
    names = sorted(n for n in saved if "-r" not in n)
    part = next(f for f in _manifest(run, names[5])["fingerprints"] if f.startswith(BASE))
    assert set(_manifest(run, names[5])["fingerprints"][part]) == {"model.base.0.weight"}
    spare = part.replace(".safetensors", ".spare")  # (written with it at save 6)
    assert _manifest(run, names[6])["shares"] == {part: f"{names[5]}/{spare}", spare: f"{names[5]}/{part}"}
    for name, values in saved.items():
        fresh = _model(seed=9)
        fresh = ts.TrainState(model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=1e-3),
                              rngs={"data": torch.Generator()})
        with ts.CheckpointManager(run) as ckpt:
            ckpt.restore(fresh, generation=name)
        assert _equal(_values(fresh), values), name


@pytest.mark.parametrize("control", [False, True])
def test_a_same_update_save_after_a_skipped_pass_compares_the_stored_bytes(tmp_path, monkeypatch, control):
    """The generation a save at the same update descends from records no fingerprint for a large tensor that keeps
    changing. A write through ``.data`` to that tensor, then a save at the same update: the tensor is compared
    with the stored file's bytes, so the save is a revision holding the new value (never a no-op that drops it).
    Control: a comparison that takes the live fingerprint for the stored one makes that save a no-op, and the
    restore lacks the write."""
    from trainstate.lifecycle import incremental

    if control:
        monkeypatch.setattr(incremental, "stored_prints", lambda store, manifest, names: {
            n: changes.fingerprints({n: t})[n] for n, t in _live(state).items() if n in names})
    model = _model()
    model.requires_grad_(True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    state = ts.TrainState(model=model, optimizer=opt, rngs={"data": torch.Generator().manual_seed(0)})
    run, trained = tmp_path / "run", "model.base.1.weight"
    with ts.CheckpointManager(run, keep_last=20, full_every=4) as ckpt:
        for _ in range(3):
            _step(state)
            info = ckpt.save(state)
        assert trained not in _manifest(run, info.name)["fingerprints"]["tensors.safetensors"]
        assert ckpt.save(state).name == info.name  # unchanged: a no-op, decided from the stored bytes
        model["base"][1].weight.data[7, 7] += 1.0
        revision = ckpt.save(state)
        expected = _values(state)
    if control:
        assert revision.name == info.name  # the write was dropped
        return
    assert revision.name == f"{info.name}-r001"
    fresh = _model(seed=9)
    fresh = ts.TrainState(model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=1e-3),
                          rngs={"data": torch.Generator()})
    with ts.CheckpointManager(run) as ckpt:
        assert ckpt.restore(fresh).generation.name == revision.name
    assert _equal(_values(fresh), expected)


@pytest.mark.parametrize("digest", ["blake3-chunked", None])
def test_an_incremental_run_written_before_fingerprints_could_be_skipped_continues_bitwise(tmp_path, digest):
    """``tests/golden/incremental-v4-run``: gens 2 and 3 of this file's LoRA-shaped run, written by the code of
    1d7f9d7 (format 4, every tensor fingerprinted; gen 3 links gen 2's part; gen 1 dropped to keep it small). It
    restores bitwise against a replay of the same steps. Continued with its own digest (blake3-chunked) the next
    save writes the part afresh and keeps the old one as its spare; continued under today's default (xxh3-chunked
    for an unsigned run) the next save is whole. Either way it restores bitwise."""
    _continue_golden(tmp_path, "incremental-v4-run", 3, digest, 2)


def test_an_incremental_run_written_before_spares_continues_bitwise(tmp_path):
    """``tests/golden/incremental-v4-986bf55-run``: gens 3 and 4 of this file's LoRA-shaped run with the defaults
    of 986bf55 (format 4, ``full_every=8``: gen 2 laid the base out in one part, gens 3 and 4 link it; some
    fingerprints skipped). It restores bitwise; three more saves under today's defaults (the first writes the
    part afresh and keeps the old one as its spare, the next two link the copies crosswise) each restore
    bitwise."""
    _continue_golden(tmp_path, "incremental-v4-986bf55-run", 4, "xxh3-chunked", 2, more=3)


def _continue_golden(tmp_path: Path, fixture: str, newest: int, digest: str | None, origin: int,
                     more: int = 1) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(Path(__file__).parent / "golden" / fixture, run)
    replay = _state()
    for _ in range(newest):
        _step(replay)
    state, saved = _state(seed=9), {}
    with ts.CheckpointManager(run, keep_last=5, digest=digest) as ckpt:
        assert ckpt.restore(state).generation.name == f"gen-{newest:012d}"
        assert _equal(_values(state), _values(replay))
        for _ in range(more):
            _step(state)
            _step(replay)
            saved[ckpt.save(state).name] = _values(replay)
    names = sorted(saved)
    part = next(iter(_manifest(run, f"gen-{newest:012d}")["shares"]))
    spare = part.replace(".safetensors", ".spare")
    if digest is None:
        assert _manifest(run, names[0])["digest_algorithm"] == "xxh3-chunked" and "shares" not in _manifest(
            run, names[0])
    else:  # the old part kept as the spare of one written afresh, then the two linked crosswise
        assert _manifest(run, names[0])["shares"] == {spare: f"gen-{origin:012d}/{part}"}
        for name in names[1:]:
            assert set(_manifest(run, name)["shares"]) == {part, spare}
    for name, values in saved.items():
        fresh = _state(seed=7)
        with ts.CheckpointManager(run) as ckpt:
            assert ckpt.restore(fresh, generation=name).generation.name == name
        assert _equal(_values(fresh), values)


@pytest.mark.parametrize("bad", [-1, True, 2.5, "3"])
def test_full_every_must_be_a_count_of_saves(tmp_path, bad):
    with pytest.raises(ts.InvalidArgument, match="full_every"):
        ts.CheckpointManager(tmp_path / "run", full_every=bad)


def test_an_object_store_and_a_mirror_upload_only_what_changed(tmp_path, moto_server, monkeypatch):
    """An object store cannot link: a shared file is copied by the server instead, so a steady save uploads only
    what changed (the store keeps each generation's objects its own). A mirror of a local incremental run does
    the same from the remote parent's copy. Both restore bitwise. Bytes uploaded are counted at the client."""
    pytest.importorskip("obstore")
    from trainstate.storage.objectclient import Client

    uploaded: list[int] = []
    monkeypatch.setattr(Client, "put_stream", counted_puts(uploaded))
    options = moto_server.storage_options()
    url = moto_server.url(moto_server.make_bucket(), "run")
    state, saved = _state(), {}
    with ts.CheckpointManager(url, keep_last=5, full_every=4, storage_options=options) as ckpt:
        for _ in range(3):
            _step(state)
            uploaded.append(0)
            saved[ckpt.save(state).name] = _values(state)
    base = sum(v.nbytes for k, v in saved[max(saved)].items() if ".base." in k and k.endswith("weight"))
    assert uploaded[0] > base > 20 * max(uploaded[1:3]), uploaded  # the first lays the base out; then copies
    mirror = moto_server.url(moto_server.make_bucket(), "mirror")
    with ts.CheckpointManager(tmp_path / "local", keep_last=5, full_every=4, mirror=mirror,
                              mirror_options=options) as ckpt:
        for _ in range(3):
            _step(state)
            uploaded.append(0)
            saved[ckpt.save(state).name] = _values(state)
            deadline = time.monotonic() + 60  # the mirror's upload of this generation, counted as this save's
            while ckpt.status().mirror.remote_update != state.next_update and time.monotonic() < deadline:
                time.sleep(0.05)
    assert "shares" in _manifest(tmp_path / "local", max(saved))
    assert uploaded[3] > 2 * base > 40 * max(uploaded[4:6]), uploaded  # a local run's part and its spare
    for source, name, extra in ((url, sorted(saved)[2], {"storage_options": options}),
                                (tmp_path / "fresh", max(saved), {"mirror": mirror, "mirror_options": options})):
        fresh = _state(seed=9)
        with ts.CheckpointManager(source, **extra) as ckpt:
            assert ckpt.restore(fresh).generation.name == name
        assert _equal(_values(fresh), saved[name])


@pytest.mark.parametrize("digest", ["xxh3-chunked", "blake3-chunked", "blake3"])
def test_a_part_damaged_before_a_save_is_written_afresh_not_linked(tmp_path, caplog, digest):
    """A save never passes on damage: the copy it would link as its part (the parent's spare) is checked first
    (its header chunk by digest, its tensors by fingerprint), and a damaged one is written again from the live
    tensors, so the new generation restores bitwise; the parent's part is kept as the spare."""
    run = tmp_path / "run"
    state = _state()
    with ts.CheckpointManager(run, keep_last=10, full_every=10, digest=digest) as ckpt:
        for _ in range(3):
            _step(state)
            ckpt.save(state)
        newest = ckpt.latest()
        assert "shares" in _manifest(run, newest)  # the control: an intact part is linked
        part = next(p for p in (run / newest).glob(f"{BASE}*.spare"))
        data = bytearray(part.read_bytes())
        data[-11] ^= 0x10
        os.chmod(part, 0o644)
        part.write_bytes(bytes(data))
        _step(state)
        with caplog.at_level("WARNING", logger="trainstate"):
            info = ckpt.save(state)
        expected = _values(state)
    twin = part.name.replace(".spare", ".safetensors")
    assert set(_manifest(run, info.name)["shares"]) == {part.name} and "not linking" in caplog.text
    assert os.stat(run / info.name / twin).st_ino not in (part.stat().st_ino, (run / newest / twin).stat().st_ino)
    fresh = _state(seed=9)
    with ts.CheckpointManager(run) as ckpt:
        assert ckpt.restore(fresh).generation.name == info.name
    assert _equal(_values(fresh), expected)


@pytest.mark.parametrize("control", [False, True])
def test_the_last_two_generations_need_no_copy_in_common(tmp_path, monkeypatch, control):
    """keep_last=2 and no generation ever whole again (``full_every=0``, the default): the two kept generations
    read the two copies of the base, so one flipped bit in the newest's part still leaves the one before it
    to restore, bitwise. Control: link each part to itself (one copy, as before spares) and the same flip
    damages both, leaving nothing to restore."""
    from trainstate.lifecycle import incremental

    if control:
        real = incremental.prove
        monkeypatch.setattr(incremental, "prove", lambda store, p: real(store, dataclasses.replace(p, spares=False)))
    run = tmp_path / "run"
    _, saved = _train(run, 5, full_every=0, keep_last=2)
    names = sorted(saved)
    assert sorted(p.name for p in run.glob("gen-*")) == names[-2:]
    part = next(f for f in _manifest(run, names[-1])["shares"] if f.endswith(".safetensors"))
    path = run / names[-1] / part
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x04
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))  # in place: every generation naming this copy sees the flip
    fresh = _state(seed=9)
    with ts.CheckpointManager(run, keep_last=2) as ckpt:
        if control:
            with pytest.raises(ts.TrainStateError):
                ckpt.restore(fresh)
            return
        info = ckpt.restore(fresh)
    assert info.generation.name == names[-2] and [r.generation for r in info.rejected] == names[-1:]
    assert _equal(_values(fresh), saved[names[-2]])


def test_the_lightning_plugin_links_a_frozen_base(tmp_path):
    """``TrainStateCheckpointIO(full_every=...)``: Lightning's checkpoint dicts saved through the plugin link the
    unchanged base like a TrainState does, and load back bitwise."""
    pytest.importorskip("lightning")
    from trainstate.integrations.lightning import TrainStateCheckpointIO

    torch.manual_seed(0)
    base, head = torch.randn(512, 512), torch.randn(4, 512)
    plugin = TrainStateCheckpointIO(tmp_path / "run", keep_last=5, full_every=4)
    saved = {}
    for step in (1, 2, 3):
        head = head + 1
        checkpoint = {"global_step": step, "state_dict": {"base.weight": base, "head.weight": head.clone()},
                      "optimizer_states": [{"state": {}, "param_groups": []}]}
        path = tmp_path / f"step={step}.ckpt"
        plugin.save_checkpoint(checkpoint, path)
        saved[path] = checkpoint
    plugin.teardown()
    newest = max(p.name for p in (tmp_path / "run").glob("gen-*"))
    assert "shares" in _manifest(tmp_path / "run", newest)
    for path, checkpoint in saved.items():
        loaded = TrainStateCheckpointIO(tmp_path / "run").load_checkpoint(path)
        assert loaded["global_step"] == checkpoint["global_step"]
        assert all(torch.equal(loaded["state_dict"][k], v) for k, v in checkpoint["state_dict"].items())


@pytest.mark.parametrize("control", [False, True])
def test_a_run_that_changes_its_digest_writes_its_next_generation_whole(tmp_path, monkeypatch, control):
    """Linked files keep the digests they were written with, so a save links nothing from a parent that names
    another algorithm (a run saved before xxh3-chunked became the default, continued now): the new generation is
    whole and restores bitwise. Control: linking anyway yields a manifest whose reused chunk digests do not match
    its algorithm, which no reader accepts."""
    from trainstate.lifecycle import incremental

    run = tmp_path / "run"
    state = _state()
    with ts.CheckpointManager(run, keep_last=10, full_every=10, digest="blake3-chunked") as ckpt:
        for _ in range(2):
            _step(state)
            ckpt.save(state)
    if control:
        real = incremental.parent_of
        monkeypatch.setattr(incremental, "parent_of", lambda store, *a, **k: real(
            type("Same", (), {"digest_algorithm": "blake3-chunked", "__getattr__": lambda s, n: getattr(store, n)})(),
            *a, **k))
    _step(state)
    with ts.CheckpointManager(run, keep_last=10, full_every=10) as ckpt:  # the default: xxh3-chunked
        if control:
            with pytest.raises(ts.TrainStateError, match="chunk digests"):
                ckpt.save(state)
            return
        info = ckpt.save(state)
        expected = _values(state)
    manifest = _manifest(run, info.name)
    assert manifest["digest_algorithm"] == "xxh3-chunked" and "shares" not in manifest
    fresh = _state(seed=9)
    with ts.CheckpointManager(run) as ckpt:
        assert ckpt.restore(fresh).generation.name == info.name
    assert _equal(_values(fresh), expected)


def _lora(seed: int = 0) -> ts.TrainState:
    """A 16 MiB frozen base (4 x ``Linear(1024, 1024)``), rank-16 adapters trained with AdamW: 1.5 MiB change
    per update (the adapters and their two moments)."""
    torch.manual_seed(seed)
    base = torch.nn.ModuleList(torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)).requires_grad_(False)
    adapters = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(1024, 16) * 0.01) for _ in range(8))
    model = torch.nn.ModuleDict({"base": base, "adapters": adapters})
    return ts.TrainState(model=model, optimizer=torch.optim.AdamW(adapters.parameters(), lr=1e-3))


def _lora_step(state: ts.TrainState) -> None:
    model, opt = state["model"], state["optimizer"]
    x = torch.randn(4, 1024)
    for i, layer in enumerate(model["base"]):
        a, b = model["adapters"][2 * i], model["adapters"][2 * i + 1]
        x = layer(x) + (x @ a) @ b.T
    x.square().mean().backward()
    opt.step()
    opt.zero_grad()
    state.next_update += 1


def _blocks(run: Path) -> dict[tuple[int, int], int]:
    """Bytes allocated to each inode under ``run`` (a hard-linked file counted once)."""
    found = {}
    for path in run.glob("gen-*/*"):
        st = path.stat()
        found[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return found


@pytest.mark.parametrize("control", [None, "full_every=8", "no requires_grad hint"])
def test_a_lora_run_writes_what_changed_amortized_over_twenty_saves(tmp_path, monkeypatch, control):
    """Issue 51: with the defaults, 20 saves of a LoRA run (``keep_last=3``) add to the disk, saves 2-20 taken
    together, at most 1.2x the bytes that changed (the first save, which writes the base and its spare, is
    excepted). Counted as the blocks each save adds to the run directory, each inode once. Controls: the old
    default (``full_every=8``: the base written whole again every 8th save) and the first layout without the
    ``requires_grad`` hint (the base written at the second save) both exceed it."""
    from trainstate.state import snapshot

    if control == "no requires_grad hint":
        monkeypatch.setattr(snapshot, "frozen", lambda state, tensors: frozenset())
    state, run, added, seen = _lora(), tmp_path / "run", [], {}
    options = {"full_every": 8} if control == "full_every=8" else {}
    with ts.CheckpointManager(run, keep_last=3, **options) as ckpt:
        for _ in range(20):
            _lora_step(state)
            ckpt.save(state)
            now = _blocks(run)
            added.append(sum(size for inode, size in now.items() if inode not in seen))
            seen = now
    moments = [v for entry in state["optimizer"].state.values() for v in entry.values() if v.dim()]
    changed = sum(p.nbytes for p in state["model"]["adapters"].parameters()) + sum(m.nbytes for m in moments)
    amortized = sum(added[1:]) / (19 * changed)
    base = sum(p.nbytes for p in state["model"]["base"].parameters())
    if control:
        assert amortized > 1.2, (amortized, added)
        return
    assert amortized <= 1.2 and max(added[1:]) < 0.2 * base, (amortized, added)
    assert added[0] > 2 * base  # the base and its spare


@pytest.mark.parametrize("control", [False, True])
def test_whichever_single_file_is_damaged_a_kept_generation_restores_bitwise(tmp_path, monkeypatch, control):
    """Five saves with the defaults and ``keep_last=3``; then, one at a time, one bit flipped in each file of the
    run directory (each inode once: the two copies of the base, every generation's own files, the pointer): a
    fresh restore still resumes a kept generation, bitwise, and never the damaged bytes. Control: each part
    linked to itself (one copy of the base): a flip in it leaves nothing to restore."""
    from trainstate.lifecycle import incremental

    if control:
        real = incremental.prove
        monkeypatch.setattr(incremental, "prove", lambda store, p: real(store, dataclasses.replace(p, spares=False)))
    run = tmp_path / "run"
    _, saved = _train(run, 5, full_every=0, keep_last=3)
    inodes: dict[int, Path] = {}
    for path in sorted(run.rglob("*")):
        if path.is_file() and path.stat().st_size:  # (an empty lock file holds no bit to flip)
            inodes.setdefault(path.stat().st_ino, path)
    failures = []
    for path in inodes.values():
        data = path.read_bytes()
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0x20
        os.chmod(path, 0o644)
        path.write_bytes(bytes(flipped))
        try:
            fresh = _state(seed=9)
            with ts.CheckpointManager(run, keep_last=3) as ckpt:
                name = ckpt.restore(fresh).generation.name
            if not _equal(_values(fresh), saved[name]):
                failures.append(f"{path.relative_to(run)}: {name} restored other values")
        except ts.TrainStateError as exc:
            failures.append(f"{path.relative_to(run)}: {type(exc).__name__}")
        finally:
            path.write_bytes(data)
    assert len(inodes) >= 12  # 3 generations x (state, tensors, manifest), the 2 copies, the pointer, ...
    if control:
        assert failures and all(BASE in f for f in failures), failures
        return
    assert not failures, failures
