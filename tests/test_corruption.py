"""The corruption matrix: damage a run directory every way a disk, a person or a tool can, then restore.

A pristine directory of three generations (updates 1, 2, 3; keep_last=5) of
the shared small model + AdamW state is built once per module and copied for
each case. Each damage is applied to the latest generation and, where it makes
sense, to every generation. For each case the contract is:

* ``restore`` falls back to the newest intact generation and names what it
  passed over (``RestoreInfo.rejected``), or raises :class:`NoValidGeneration`
  listing every generation it tried;
* what it restored equals, bit for bit, what was saved in that generation;
* nothing is written or deleted by restore, and a following save leaves every
  other generation (damaged ones included, as evidence) in place;
* ``trainstate verify DIR`` exits non-zero and names the damaged generation,
  and exits 0 on the undamaged directory.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import trainer
import trainstate as ts
from trainstate import cli
from trainstate.format.digest import digest_bytes

pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")

G1, G2, G3 = (f"gen-{u:012d}" for u in (1, 2, 3))
GENS = (G3, G2, G1)  # newest first, the order restore tries them
MANIFEST, STATE, TENSORS, POINTER = "manifest.json", "state.json", "tensors.safetensors", "latest"
FILES = (MANIFEST, STATE, TENSORS)
LOCK = ".trainstate.lock"


def gen(update: int) -> str:
    return f"gen-{update:012d}"


# --- the pristine directory --------------------------------------------------------------------


def rng_record(state: ts.TrainState) -> dict:
    """Every RNG stream the state promises to capture, in a form assert_same compares exactly."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy_global": (name, torch.from_numpy(keys.copy()), pos, has_gauss, gauss),
        "torch_cpu": torch.get_rng_state().clone(),
        "data": state.rngs["data"].get_state().clone(),
        "noise": copy.deepcopy(state.rngs["noise"].bit_generator.state),
    }


def saved_record(state: ts.TrainState) -> dict:
    return {"state": copy.deepcopy(trainer.full_state(state)), "rng": rng_record(state)}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """A run directory with generations 1, 2, 3 and what each one holds."""
    root = tmp_path_factory.mktemp("pristine") / "run"
    state = trainer.build(seed=0)
    expected = {}
    with ts.CheckpointManager(root, keep_last=5) as ckpt:
        for _ in range(3):
            trainer.step(state)
            ckpt.save(state)
            expected[gen(state.next_update)] = saved_record(state)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("gen-")) == [G1, G2, G3]
    return root, expected


@pytest.fixture
def run(pristine, tmp_path) -> Path:
    root = tmp_path / "run"
    shutil.copytree(pristine[0], root, symlinks=True)
    return root


def tree(root: Path) -> dict[str, object]:
    """Every entry under ``root`` (but the lock file): file bytes, link targets, directories."""
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            if rel == LOCK:
                continue
            if path.is_symlink():
                out[rel] = ("symlink", os.readlink(path))
            elif path.is_dir():
                out[rel] = ("dir",)
            else:
                out[rel] = path.read_bytes()
    return out


def assert_only_gen4_added(before: dict, after: dict) -> None:
    """A save adds gen 4 and moves the pointer; every other entry is untouched. A directory
    squatting on the pointer's name is kept, renamed out of the way."""
    aside = {k.replace(k.split("/")[0], POINTER, 1): v for k, v in after.items()
             if k.startswith(f"{POINTER}.rejected-")}
    assert {k: v for k, v in after.items()
            if k != POINTER and not k.startswith((gen(4), f"{POINTER}.rejected-"))} == \
        {k: v for k, v in before.items() if k != POINTER and not k.startswith(f"{POINTER}/")}, \
        "a save deleted or changed another generation"
    if aside:
        assert aside == {k: v for k, v in before.items() if k == POINTER or k.startswith(f"{POINTER}/")}


def restore_fresh(root: Path, keep_last: int = 5) -> tuple[ts.TrainState, ts.RestoreInfo | None]:
    state = trainer.build(seed=777)  # another seed: every restored bit must come from the checkpoint
    with ts.CheckpointManager(root, keep_last=keep_last) as ckpt:
        info = ckpt.restore(state)
    return state, info


def assert_restored(state: ts.TrainState, record: dict) -> None:
    trainer.assert_same(record["state"], trainer.full_state(state))
    trainer.assert_same(record["rng"], rng_record(state))


def verify_json(root: Path | str, capsys) -> tuple[int, dict]:
    capsys.readouterr()
    rc = cli.main(["verify", str(root), "--json"])
    return rc, json.loads(capsys.readouterr().out)


# --- damage primitives -------------------------------------------------------------------------


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def after(path: Path, marker: bytes) -> int:
    """Offset of the first byte after ``marker`` in the file."""
    return path.read_bytes().index(marker) + len(marker)


def tensor_data_start(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def truncate_half(g: Path, f: str) -> None:
    data = (g / f).read_bytes()
    (g / f).write_bytes(data[: len(data) // 2])


def truncate_empty(g: Path, f: str) -> None:
    (g / f).write_bytes(b"")


def missing(g: Path, f: str) -> None:
    (g / f).unlink()


def symlink(g: Path, f: str) -> None:
    """Same bytes, but through a link: only the link itself is wrong."""
    outside = g.parent.parent / "outside" / g.name
    outside.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(g / f, outside / f)
    (g / f).unlink()
    os.symlink(outside / f, g / f)


def directory(g: Path, f: str) -> None:
    (g / f).unlink()
    (g / f).mkdir()


def flip_tensor_data(g: Path) -> None:
    path = g / TENSORS
    start = tensor_data_start(path)
    flip(path, start + (path.stat().st_size - start) // 2)


def flip_tensor_header(g: Path) -> None:
    flip(g / TENSORS, after(g / TENSORS, b'"shape":['))


def flip_state(g: Path) -> None:
    path = g / STATE
    flip(path, path.stat().st_size // 2)


def flip_manifest_digest(g: Path) -> None:
    flip(g / MANIFEST, after(g / MANIFEST, b'"digest": "'))


def flip_manifest_created(g: Path) -> None:
    """A digit of the timestamp: still valid JSON, still a valid manifest, but not the bytes written."""
    flip(g / MANIFEST, after(g / MANIFEST, b'"created": "') + 3)


def flip_manifest_syntax(g: Path) -> None:
    flip(g / MANIFEST, 0)


def extra_file(g: Path) -> None:
    (g / "notes.txt").write_bytes(b"an unknown file\n")


# --- the matrix --------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenDamage:
    """A damage applied to one generation directory."""

    damage: Callable[[Path], None]
    words: tuple[str, ...]  # the rejection reason contains one of these
    file: str | None = None  # the rejection reason names this file


def _per_file(name: str, fn: Callable[[Path, str], None], words: tuple[str, ...]) -> dict[str, GenDamage]:
    return {f"{name}-{f}": GenDamage(lambda g, f=f: fn(g, f), words, f) for f in FILES}


GEN_DAMAGES: dict[str, GenDamage] = {
    **_per_file("truncated-half", truncate_half, ("bytes", "JSON")),
    **_per_file("truncated-empty", truncate_empty, ("bytes", "JSON")),
    "flipped-tensor-data": GenDamage(flip_tensor_data, ("digest",), TENSORS),
    "flipped-tensor-header": GenDamage(flip_tensor_header, ("digest",), TENSORS),
    "flipped-state": GenDamage(flip_state, ("digest",), STATE),
    "flipped-manifest-digest-field": GenDamage(flip_manifest_digest, ("digest", "pointer", "invalid file record")),
    "flipped-manifest-created-field": GenDamage(flip_manifest_created, ("pointer", "self-digest"), MANIFEST),
    "flipped-manifest-syntax": GenDamage(flip_manifest_syntax, ("JSON",), MANIFEST),
    **_per_file("missing", missing, ("missing",)),
    "extra-unknown-file": GenDamage(extra_file, ("unexpected files",)),
    **_per_file("symlink", symlink, ("symbolic link", "regular file")),
    **_per_file("directory", directory, ("regular file",)),
}



def gen_damage_params(scopes=("latest", "all")):
    return [pytest.param(damage, scope, id=f"{name}-{scope}")
            for name, damage in GEN_DAMAGES.items() for scope in scopes]


def apply_gen_damage(run: Path, damage: GenDamage, scope: str) -> tuple[str, ...]:
    damaged = (G3,) if scope == "latest" else GENS
    for name in damaged:
        damage.damage(run / name)
    return damaged


def check_reason(rejection: ts.Rejection, damage: GenDamage) -> None:
    assert rejection.generation in rejection.reason, rejection
    assert any(w in rejection.reason for w in damage.words), rejection
    if damage.file is not None:
        assert damage.file in rejection.reason, rejection


@pytest.mark.parametrize("damage,scope", gen_damage_params())
def test_restore_falls_back_past_damaged_generation(run, pristine, damage, scope):
    damaged = apply_gen_damage(run, damage, scope)
    before = tree(run)
    if scope == "latest":
        state, info = restore_fresh(run)
        assert info.generation.name == G2
        assert [r.generation for r in info.rejected] == [G3]
        check_reason(info.rejected[0], damage)
        assert_restored(state, pristine[1][G2])
    else:
        with pytest.raises(ts.NoValidGeneration) as caught:
            restore_fresh(run)
        assert [r.generation for r in caught.value.rejections] == list(damaged)
        for rejection in caught.value.rejections:
            check_reason(rejection, damage)
        for name in damaged:
            assert name in str(caught.value)
    assert tree(run) == before, "restore changed the run directory"


@pytest.mark.parametrize("damage,scope", gen_damage_params())
def test_verify_names_damaged_generation(run, damage, scope, capsys):
    damaged = apply_gen_damage(run, damage, scope)
    rc, report = verify_json(run, capsys)
    assert rc == 1
    failures = json.dumps(report["failures"])
    for name in damaged:
        assert name in failures
    assert set(GENS) - set(damaged) <= set(report["verified"])




@pytest.mark.parametrize("damage", [
    pytest.param(d, id=name) for name, d in GEN_DAMAGES.items()])
def test_verify_generation_directory_fails(run, damage, capsys):
    damage.damage(run / G3)
    capsys.readouterr()
    assert cli.main(["verify", str(run / G3)]) == 1
    assert G3 in capsys.readouterr().out
    assert cli.main(["verify", str(run / G2)]) == 0


@pytest.mark.parametrize("damage", [pytest.param(d, id=n) for n, d in GEN_DAMAGES.items()])
def test_save_after_fallback_keeps_every_other_generation(run, pristine, damage):
    damage.damage(run / G3)
    before = tree(run)
    state, info = restore_fresh(run)
    assert info.generation.name == G2
    while state.next_update < 4:  # past the damaged generation's update number: see the test below
        trainer.step(state)
    with ts.CheckpointManager(run, keep_last=5) as ckpt:
        ckpt.save(state)
    expected = saved_record(state)
    assert_only_gen4_added(before, tree(run))
    assert json.loads((run / POINTER).read_bytes())["generation"] == gen(4)
    again, info = restore_fresh(run)
    assert info.generation.name == gen(4) and info.rejected == ()
    assert_restored(again, expected)


# --- damage to the pointer and to generation directories as a whole -----------------------------


@dataclass(frozen=True)
class RunDamage:
    damage: Callable[[Path], None]
    restored: str | None  # None: NoValidGeneration
    rejected: tuple[str, ...]  # in the order restore tried them
    words: tuple[str, ...]
    named_by_verify: tuple[str, ...]


def pointer_bytes(data: bytes) -> Callable[[Path], None]:
    return lambda run: (run / POINTER).write_bytes(data)


def edit_pointer(**changes) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        pointer = json.loads((run / POINTER).read_bytes())
        pointer.update(changes)
        (run / POINTER).write_bytes(json.dumps(pointer).encode())
    return damage


def pointer_digest_of(other: str) -> Callable[[Path], None]:
    """A well-formed pointer to the latest generation carrying another manifest's digest."""
    def damage(run: Path) -> None:
        size = (run / other / MANIFEST).stat().st_size
        digest = digest_bytes(json.loads((run / POINTER).read_bytes())["digest_algorithm"],
                              (run / other / MANIFEST).read_bytes())
        edit_pointer(manifest_digest=digest, manifest_size=size)(run)
    return damage


def pointer_symlink(run: Path) -> None:
    shutil.copyfile(run / POINTER, run.parent / "latest-copy")
    (run / POINTER).unlink()
    os.symlink(run.parent / "latest-copy", run / POINTER)


def pointer_directory(run: Path) -> None:
    (run / POINTER).unlink()
    (run / POINTER).mkdir()


def rename(pairs: dict[str, str]) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        for old, new in pairs.items():
            os.rename(run / old, run / new)
    return damage



RUN_DAMAGES = {
    "pointer-deleted": RunDamage(lambda run: (run / POINTER).unlink(), G3, (POINTER,), ("missing",), (POINTER,)),
    "pointer-names-missing-generation": RunDamage(
        lambda run: shutil.rmtree(run / G3), G2, (G3,), ("missing",), (G3,)),
    "pointer-names-never-existing-generation": RunDamage(
        edit_pointer(generation=gen(7), next_update=7), G3, (gen(7),), ("missing",), (gen(7),)),
    "pointer-random-bytes": RunDamage(
        pointer_bytes(b"\xff" + random.Random(0).randbytes(300)), G3, (POINTER,), ("JSON",), (POINTER,)),
    "pointer-empty": RunDamage(pointer_bytes(b""), G3, (POINTER,), ("JSON",), (POINTER,)),
    "pointer-json-list": RunDamage(pointer_bytes(b'["gen-000000000003"]'), G3, (POINTER,), ("object",), (POINTER,)),
    "pointer-json-string": RunDamage(pointer_bytes(b'"gen-000000000003"'), G3, (POINTER,), ("object",), (POINTER,)),
    "pointer-json-wrong-fields": RunDamage(
        pointer_bytes(b'{"generation": "gen-000000000003"}'), G3, (POINTER,), ("field",), (POINTER,)),
    "pointer-json-wrong-types": RunDamage(
        edit_pointer(manifest_size="721"), G3, (POINTER,), ("wrong type",), (POINTER,)),
    "pointer-json-name-disagrees": RunDamage(
        edit_pointer(generation=G2), G3, (POINTER,), ("disagrees",), (POINTER,)),
    "pointer-wrong-manifest-digest": RunDamage(
        pointer_digest_of(G2), G2, (G3,), ("pointer",), (G3,)),
    "pointer-symlink": RunDamage(pointer_symlink, G3, (POINTER,), ("symbolic link",), (POINTER,)),
    "pointer-directory": RunDamage(pointer_directory, G3, (POINTER,), ("regular file",), (POINTER,)),
    "latest-renamed-to-other-number": RunDamage(
        rename({G3: gen(7)}), G2, (G3, gen(7)), ("missing", "renamed"), (G3, gen(7))),
    "latest-renamed-to-non-generation-name": RunDamage(
        rename({G3: f"{G3}.bak"}), G2, (G3,), ("missing",), (G3,)),
    "all-renamed-to-other-numbers": RunDamage(
        rename({G1: gen(11), G2: gen(12), G3: gen(13)}), None, (G3, gen(13), gen(12), gen(11)),
        ("missing", "renamed"), (G3, gen(11), gen(12), gen(13))),
    "all-renamed-to-non-generation-names": RunDamage(
        rename({g: f"old-{g}" for g in GENS}), None, (G3,), ("missing",), (G3,)),
}



def run_damage_params():
    return [pytest.param(d, id=n) for n, d in RUN_DAMAGES.items()]


@pytest.mark.parametrize("damage", run_damage_params())
def test_restore_survives_run_damage(run, pristine, damage):
    damage.damage(run)
    before = tree(run)
    if damage.restored is not None:
        state, info = restore_fresh(run)
        assert info.generation.name == damage.restored
        assert_restored(state, pristine[1][damage.restored])
        rejections = info.rejected
    else:
        with pytest.raises(ts.NoValidGeneration) as caught:
            restore_fresh(run)
        rejections = tuple(caught.value.rejections)
        for name in damage.rejected:
            assert name in str(caught.value)
    assert [r.generation for r in rejections] == list(damage.rejected)
    for rejection in rejections:
        assert any(w in rejection.reason for w in damage.words), rejection
    assert tree(run) == before, "restore changed the run directory"


@pytest.mark.parametrize("damage", run_damage_params())
def test_verify_names_run_damage(run, damage, capsys):
    damage.damage(run)
    rc, report = verify_json(run, capsys)
    assert rc == 1
    named = json.dumps(report.get("failures", report.get("error")))
    for name in damage.named_by_verify:
        assert name in named


@pytest.mark.parametrize("damage", [
    p for p in run_damage_params()
    if p.values[0].restored is not None])
def test_save_after_run_damage_keeps_every_other_generation(run, pristine, damage):
    damage.damage(run)
    state, info = restore_fresh(run)
    while state.next_update < 4:
        trainer.step(state)
    before = tree(run)
    with ts.CheckpointManager(run, keep_last=5) as ckpt:
        ckpt.save(state)
    assert_only_gen4_added(before, tree(run))
    again, info = restore_fresh(run)
    assert info.generation.name == gen(4) and info.rejected == ()


# --- the undamaged directory, and the continuation after a fallback ------------------------------


def test_undamaged_directory_verifies_and_restores_latest(run, pristine, capsys):
    rc, report = verify_json(run, capsys)
    assert rc == 0 and report == {"verified": list(GENS), "failures": [], "signature": "absent", "authenticated": False}
    for name in GENS:
        assert cli.main(["verify", str(run / name)]) == 0
    state, info = restore_fresh(run)
    assert info.generation.name == G3 and info.rejected == ()
    assert_restored(state, pristine[1][G3])
    for name in GENS:  # every generation restores exactly what it saved
        state = trainer.build(seed=778)
        with ts.CheckpointManager(run) as ckpt:
            ckpt.restore(state, generation=name)
        assert_restored(state, pristine[1][name])


def test_verify_exit_status_is_real(run):
    """One real process, for the exit status a shell sees: 0 undamaged, 1 damaged."""
    flip_state(run / G2)
    script = ("import sys; from trainstate.cli import main; "
              "codes = [main(['verify', a]) for a in sys.argv[1:]]; print(codes); sys.exit(max(codes))")
    ok = subprocess.run([sys.executable, "-c", script, str(run / G3), str(run / G1)], capture_output=True, text=True)
    assert ok.returncode == 0 and "[0, 0]" in ok.stdout, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "trainstate", "verify", str(run)], capture_output=True, text=True)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert f"FAILED  {G2}" in bad.stdout and f"ok      {G3}" in bad.stdout


def test_training_continues_after_fallback(run, pristine):
    extra_file(run / G3)
    state, info = restore_fresh(run)
    assert info.generation.name == G2
    trainer.step(state)  # next_update 2 -> 3: the damaged generation's number
    with ts.CheckpointManager(run, keep_last=5) as ckpt:
        ckpt.save(state)
    expected = saved_record(state)
    assert (run / G1).is_dir() and (run / G2).is_dir()
    again, info = restore_fresh(run)
    assert info.generation.name == G3 and info.rejected == ()
    assert_restored(again, expected)


def test_keep_last_counts_only_restorable_generations(run):
    flip_tensor_data(run / G3)
    state, info = restore_fresh(run, keep_last=2)
    assert info.generation.name == G2
    while state.next_update < 4:
        trainer.step(state)
    with ts.CheckpointManager(run, keep_last=2) as ckpt:
        ckpt.save(state)
    assert (run / G2).is_dir(), "the only other restorable generation was pruned while a corrupt one was kept"
