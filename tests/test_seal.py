"""Sealed folders (a framework's own checkpoint folder made a verified generation): every kind of damage is caught.

No framework here: the folders are written by the test, as Trainer would
write them. Each damage has its own case, and the undamaged folder (the
negative control) verifies.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from trainstate.errors import CorruptGeneration, InvalidArgument
from trainstate.format.seal import SEAL, SEAL_POINTER, parse_seal, parse_seal_pointer
from trainstate.storage.posix import PosixOps
from trainstate.storage.sealed import newest_verified, read_seal_pointer, seal_folder, verify_folder


def checkpoint(root, step: int):
    folder = root / f"checkpoint-{step}"
    (folder / "shards").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * (step + 1))
    (folder / "optimizer.pt").write_bytes(b"moments" * 100)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (folder / "shards" / "part-0.bin").write_bytes(b"\x01" * 10)
    (folder / "shards" / ".metadata").write_bytes(b"dcp")  # torch.distributed.checkpoint's name, as FSDP saves
    return folder


def test_a_sealed_folder_verifies_and_the_pointer_names_it(tmp_path):
    folder = checkpoint(tmp_path, 3)
    info = seal_folder(folder, meta={"global_step": 3})
    assert verify_folder(folder) == info.seal
    assert sorted(f.name for f in info.seal.files) == ["model.safetensors", "optimizer.pt", "shards/.metadata",
                                                       "shards/part-0.bin", "trainer_state.json"]
    assert info.seal.meta == {"global_step": 3}
    assert read_seal_pointer(tmp_path).name == "checkpoint-3"
    assert not [n for n in os.listdir(folder) if n.startswith(".trainstate")]  # no temp file left


DAMAGE = {
    "truncated": lambda f: os.truncate(f / "model.safetensors", 100),
    "bit flip": lambda f: (f / "optimizer.pt").write_bytes(b"moments" * 99 + b"momentz"),
    "file added": lambda f: (f / "scaler.pt").write_bytes(b"stale"),
    "file removed": lambda f: (f / "trainer_state.json").unlink(),
    "nested file removed": lambda f: (f / "shards" / "part-0.bin").unlink(),
    "replaced by a link": lambda f: ((f / "optimizer.pt").unlink(),
                                     (f / "optimizer.pt").symlink_to(f / "model.safetensors")),
    "seal edited": lambda f: (f / SEAL).write_text((f / SEAL).read_text().replace('"global_step": 3',
                                                                                  '"global_step": 4')),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_each_damage_is_caught_and_the_older_folder_chosen(tmp_path, damage):
    older, newer = checkpoint(tmp_path, 0), checkpoint(tmp_path, 3)
    seal_folder(older)
    seal_folder(newer, meta={"global_step": 3})
    assert newest_verified(tmp_path, ["checkpoint-3", "checkpoint-0"]).folder == str(newer)  # negative control
    DAMAGE[damage](newer)
    with pytest.raises(CorruptGeneration):
        verify_folder(newer)
    choice = newest_verified(tmp_path, ["checkpoint-3", "checkpoint-0"])
    assert choice.folder == str(older) and [r.generation for r in choice.rejected] == ["checkpoint-3"]


def test_a_folder_copied_over_another_name_is_refused(tmp_path):
    seal_folder(checkpoint(tmp_path, 3))
    shutil.copytree(tmp_path / "checkpoint-3", tmp_path / "checkpoint-6")
    with pytest.raises(CorruptGeneration, match="sealed as 'checkpoint-3'"):
        verify_folder(tmp_path / "checkpoint-6")


def test_an_unsealed_folder_was_never_committed(tmp_path):
    checkpoint(tmp_path, 3)
    with pytest.raises(FileNotFoundError):
        verify_folder(tmp_path / "checkpoint-3")
    choice = newest_verified(tmp_path, ["checkpoint-3"])
    assert choice.folder is None and choice.unsealed == ["checkpoint-3"] and not choice.rejected


class DieBeforeRename(PosixOps):
    """Fails the seal's commit, as a crash there would stop it."""

    def replace(self, src, dst):
        if dst.name == SEAL:
            raise OSError("simulated crash before the seal's rename")
        super().replace(src, dst)


def test_a_seal_interrupted_before_its_rename_leaves_an_unsealed_folder_that_a_new_seal_completes(tmp_path):
    folder = checkpoint(tmp_path, 3)
    with pytest.raises(OSError, match="simulated"):
        seal_folder(folder, ops=DieBeforeRename())
    assert not (folder / SEAL).exists() and read_seal_pointer(tmp_path) is None
    seal_folder(folder)  # the retry removes our leftover temp file, which would otherwise be an extra file
    verify_folder(folder)


def test_names_that_cannot_be_sealed_are_refused_before_anything_is_committed(tmp_path):
    folder = checkpoint(tmp_path, 3)
    (folder / "a name with spaces").write_bytes(b"x")
    with pytest.raises(InvalidArgument, match="cannot be sealed"):
        seal_folder(folder)
    assert not (folder / SEAL).exists()


def test_records_are_parsed_strictly(tmp_path):
    folder = checkpoint(tmp_path, 3)
    seal_folder(folder)
    data = (folder / SEAL).read_bytes()
    assert parse_seal(data, "s").name == "checkpoint-3"
    raw = json.loads(data)
    for bad in ({**raw, "extra": 1}, {**raw, "format_version": 2}, {**raw, "digest_algorithm": "md5"},
                {k: v for k, v in raw.items() if k != "files"}):
        with pytest.raises(CorruptGeneration):
            parse_seal(json.dumps(bad).encode(), "s")
    pointer = json.loads((tmp_path / SEAL_POINTER).read_bytes())
    assert parse_seal_pointer(json.dumps(pointer).encode(), "p").name == "checkpoint-3"
    with pytest.raises(CorruptGeneration):
        parse_seal_pointer(json.dumps({**pointer, "name": "../x"}).encode(), "p")
