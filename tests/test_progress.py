"""Progress bars (issue 17): tqdm on stderr only when asked or when stderr is a terminal, exact byte counts
through ``on_bytes``, and ``trainstate copy`` (upload and download, verified as it copies)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

import trainer
import trainstate as ts
from objectservers import moto_server  # noqa: F401,F811  (fixture)
from trainstate import cli
from trainstate.lifecycle.mirror import copy_generation
from trainstate.progress import bar
from trainstate.storage.local import LocalStore
from trainstate.storage.locate import open_store
from trainstate.storage.verify import read_layouts, read_manifest, verify_generation
from trainstate.tools.diff import diff
from trainstate.tools.export import export

pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")

G1, G2 = (f"gen-{u:012d}" for u in (1, 2))
BAR_MARKS = ("\r", "B/s", "it/s", "%|")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("progress") / "run"
    state = trainer.build(seed=0)
    with ts.CheckpointManager(root, keep_last=5) as ckpt:
        for _ in range(2):
            trainer.step(state)
            ckpt.save(state)
    return root


@pytest.fixture
def run(built, tmp_path) -> Path:
    root = tmp_path / "run"
    shutil.copytree(built, root, symlinks=True)
    return root


def _cli(*argv: str, stderr_fd: int | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainstate", *argv], stdout=subprocess.PIPE,
                          stderr=stderr_fd if stderr_fd is not None else subprocess.PIPE, timeout=300)


def _gen_bytes(store, name: str) -> int:
    return sum(f.size for f in read_manifest(store, name, None, None)[0].files)


def _in_process(capsys, *argv: str) -> tuple[int, str, str]:
    """The command run by ``cli.main`` in this process: its stderr is captured, so not a terminal, as a pipe is."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_no_bar_when_stderr_is_not_a_terminal_and_json_stays_clean(run, tmp_path, capsys):
    # the whole process once (a pipe as stderr), then the other commands in this process
    verify = _cli("verify", str(run), "--json")
    assert verify.returncode == 0, verify.stderr
    assert json.loads(verify.stdout)["failures"] == []
    done = [(verify.returncode, verify.stdout.decode(), verify.stderr.decode())]
    done.append(_in_process(capsys, "export", str(run), str(tmp_path / "out"), "--json"))
    assert done[-1][0] == 0, done[-1][2]
    assert json.loads(done[-1][1])["generation"] == G2
    done.append(_in_process(capsys, "diff", f"{run}@1", f"{run}@2", "--json"))
    assert done[-1][0] == 1, done[-1][2]  # different generations
    json.loads(done[-1][1])
    for _, out, err in done:
        assert not any(mark in err for mark in BAR_MARKS), err[-500:]
        assert not any(mark in out for mark in ("\r", "B/s")), "a bar reached stdout"


def test_progress_forced_shows_tqdm_on_stderr_only(run, tmp_path, capsys):
    for argv in (("verify", str(run)), ("export", str(run), str(tmp_path / "out")),
                 ("diff", f"{run}@1", f"{run}@2")):
        code, out, err = _in_process(capsys, *argv, "--json", "--progress")
        assert code in (0, 1), err
        assert "B/s" in err and argv[0] in err, (argv, err[-500:])
        json.loads(out)  # the bar never reaches stdout
    # the negative control: --no-progress silences it even when forced elsewhere
    code, _, err = _in_process(capsys, "verify", str(run), "--no-progress")
    assert code == 0 and "B/s" not in err


def test_bar_is_on_by_default_when_stderr_is_a_terminal(run):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a fresh pty is 0 columns wide
    try:
        proc = subprocess.Popen([sys.executable, "-m", "trainstate", "verify", str(run), "--json"],
                                stdout=subprocess.PIPE, stderr=slave)
        os.close(slave)
        seen = b""
        while True:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                seen += chunk
            elif proc.poll() is not None:
                break
        out, _ = proc.communicate(timeout=300)
    finally:
        os.close(master)
    assert proc.returncode == 0
    assert b"verify" in seen and b"B/s" in seen, seen[-500:]
    json.loads(out)


def test_on_bytes_counts_exactly_the_bytes_read_and_written(run, tmp_path):
    store = LocalStore(run, create=False)
    counted = bar(None, "test", enabled=False)
    verify_generation(store, G2, on_bytes=counted.update)
    assert counted.count == _gen_bytes(store, G2)

    written = bar(None, "test", enabled=False)
    export(str(run), tmp_path / "out", on_bytes=written.update)
    assert written.count == sum(p.stat().st_size for p in (tmp_path / "out").rglob("*") if p.is_file())

    copied = bar(None, "test", enabled=False)
    dst = LocalStore(tmp_path / "copy")
    copy_generation(store, dst, G2, None, on_bytes=copied.update)
    assert copied.count == _gen_bytes(store, G2)

    compared = bar(None, "test", enabled=False)
    report = diff(f"{run}@2", f"{run}@2", on_bytes=compared.update)
    assert report.identical
    manifest = read_manifest(store, G2, None, None)[0]
    tensor_bytes = sum(e.nbytes for layout in read_layouts(store, manifest).values() for e in layout.entries)
    assert compared.count == 2 * _gen_bytes(store, G2) + 2 * tensor_bytes


def _restored(location: str, **options) -> dict:
    state = trainer.build(seed=1)
    with ts.CheckpointManager(location, **options) as ckpt:
        ckpt.restore(state)
    return trainer.full_state(state)


def test_copy_local_to_local_round_trips(run, tmp_path, capsys):
    dst = tmp_path / "mirror"
    assert cli.main(["copy", str(run), str(dst), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["copied"] == [G2] and report["pointer_moved_to"] == [G2]
    assert cli.main(["verify", str(dst)]) == 0
    capsys.readouterr()
    trainer.assert_same(_restored(str(dst)), _restored(str(run)))
    # again: already there, verified, skipped; an older one copied later leaves the pointer alone
    assert cli.main(["copy", str(run), str(dst), G2, G1, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["skipped"] == [G2] and report["copied"] == [G1] and report["pointer_moved_to"] == []
    assert cli.main(["ls", str(dst), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recovery_point"] == G2


def test_copy_refuses_a_damaged_source_and_publishes_nothing(run, tmp_path, capsys):
    manifest = read_manifest(LocalStore(run, create=False), G2, None, None)[0]
    victim = run / G2 / max(manifest.files, key=lambda f: f.size).name
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    os.chmod(victim, 0o644)
    victim.write_bytes(bytes(data))
    dst = tmp_path / "mirror"
    assert cli.main(["copy", str(run), str(dst)]) == 1
    err = capsys.readouterr().err
    assert "trainstate copy:" in err and "digest mismatch" in err
    store = LocalStore(dst, create=False)
    assert store.generations() == [] and store.read_pointer("latest") is None
    # control: the undamaged generation copies fine into the same destination
    assert cli.main(["copy", str(run), str(dst), G1]) == 0
    assert LocalStore(dst, create=False).generations() == [G1]


def test_copy_uploads_to_and_downloads_from_s3(run, tmp_path, moto_server, monkeypatch, capsys):  # noqa: F811
    url = moto_server.url(moto_server.make_bucket(), "run")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto_server.secret_key)
    monkeypatch.setenv("AWS_REGION", moto_server.region)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    assert cli.main(["copy", str(run), url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["copied"] == [G2]
    assert cli.main(["verify", url]) == 0
    capsys.readouterr()
    remote = open_store(url, storage_options=moto_server.storage_options())
    assert remote.generations() == [G2]
    trainer.assert_same(_restored(url, storage_options=moto_server.storage_options()), _restored(str(run)))
    back = tmp_path / "back"
    assert cli.main(["copy", url, str(back), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["copied"] == [G2]
    for f in read_manifest(LocalStore(back, create=False), G2, None, None)[0].files:
        assert (back / G2 / f.name).read_bytes() == (run / G2 / f.name).read_bytes()


def _recorded_bars(monkeypatch) -> list[tuple[str, int, int | None]]:
    """Every library bar as it closes: (what it counted, bytes counted, the total it aimed at)."""
    closed: list[tuple[str, int, int | None]] = []
    close = ts.progress.Bar.close

    def recording(self):
        closed.append((self.desc, self.count, self.total))
        close(self)
    monkeypatch.setattr(ts.progress.Bar, "close", recording)
    return closed


def _tensor_and_state_bytes(store, name: str) -> int:
    return sum(f.size for f in read_manifest(store, name, None, None)[0].files if f.name != "manifest.json")


@pytest.mark.parametrize("in_place", [None, False])
def test_manager_progress_counts_every_byte_saved_and_restored(run, tmp_path, monkeypatch, capfd, in_place):
    closed = _recorded_bars(monkeypatch)
    state = trainer.build(seed=0)
    with ts.CheckpointManager(tmp_path / "new", progress=True) as ckpt:
        trainer.step(state)
        info = ckpt.save(state)
        ckpt.save(state, blocking=False).wait()  # nothing to write: the same state at the same update
    restored = trainer.build(seed=1)
    with ts.CheckpointManager(tmp_path / "new", progress=True) as ckpt:
        ckpt.restore(restored, in_place=in_place)
    trainer.assert_same(trainer.full_state(restored), trainer.full_state(state))
    store = LocalStore(tmp_path / "new", create=False)
    total = _tensor_and_state_bytes(store, info.name)
    assert [c[0] for c in closed] == [f"save {info.name}", f"restore {info.name}"], closed
    assert closed == [(f"save {info.name}", total, total), (f"restore {info.name}", total, total)], closed
    out, err = capfd.readouterr()
    assert out == "" and "B/s" in err and f"save {info.name}" in err, err[-500:]


def test_manager_progress_restarts_on_a_fallback_and_is_off_by_default(run, tmp_path, monkeypatch, capfd):
    from test_cli import flip_tensor_data
    flip_tensor_data(run / G2)
    closed = _recorded_bars(monkeypatch)
    state = trainer.build(seed=1)
    with ts.CheckpointManager(run, progress=True) as ckpt:
        info = ckpt.restore(state)
    assert info.generation.name == G1 and [r.generation for r in info.rejected] == [G2]
    total = _tensor_and_state_bytes(LocalStore(run, create=False), G1)
    assert closed == [(f"restore {G1}", total, total)], closed
    capfd.readouterr()
    with ts.CheckpointManager(run) as ckpt:  # the default: no bar, nothing counted, nothing on stderr
        ckpt.restore(trainer.build(seed=1))
        trainer.step(state)
        ckpt.save(state)
    assert len(closed) == 1
    out, err = capfd.readouterr()
    assert out == "" and "B/s" not in err
