"""Live recovery with the real torchft (issue 52): a replacement replica group heals from a live peer, verified.

A Lighthouse (``torchft_lighthouse``, on 127.0.0.1) and two replica groups, each under its own ``torchrun`` (two
gloo ranks, the first layer sharded across them by FSDP2 and the last replicated; ``tests/torchft_worker.py``),
training the same model on the same data, gradients averaged over the participating groups, the quorum
synchronous. Group 1 is SIGKILLed mid-training (its whole launch) and restarted: each of its ranks heals from the
same rank of group 0 through :class:`trainstate.integrations.torchft.Healing` (local shards and replicated
tensors), and from the step it joins each rank's digest (parameters, AdamW moments, every generator, the loader's
position, the scheduler, the clocks) equals that rank of group 0 at every step. One restarted group receives a stream with a flipped bit, another a truncated
one: each is refused (the heal is retried at the next quorum and succeeds). The control: torchft's stock
``HTTPTransport`` handed the same flipped bit loads it, and the healed group differs from the survivor.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

pytest.importorskip("torchft")

from distlaunch import _MARKER, kill_launch  # noqa: E402
from ftstock import loopback_http  # noqa: E402

pytestmark = pytest.mark.slow
WORKER = Path(__file__).resolve().parent / "torchft_worker.py"
NPROC = 2  # ranks in each replica group
_URLOPEN = urllib.request.urlopen


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """A Lighthouse and the replica groups of one scenario; every process stopped by its PID at the end."""

    def __init__(self, out: Path, cfg: dict):
        self.out, self.cfg, self.groups, self.markers, self._known = out, cfg, {}, {}, {}
        self.port = free_port()
        binary = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
        self.lighthouse = subprocess.Popen(
            [binary, "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "2000",
             "--heartbeat_timeout_ms", "2000", "--bind", f"127.0.0.1:{self.port}"],
            stdout=open(out / "lighthouse.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)

    def start(self, group: int, **cfg) -> None:
        marker = f"{_MARKER}=trainstate-{os.getpid()}-{uuid.uuid4().hex[:12]}"  # finds the rank torchrun starts
        self.markers[group] = marker
        env = {**os.environ, "REPLICA_GROUP_ID": str(group), "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{self.port}",
               "TRAINSTATE_TEST_FT": json.dumps({**self.cfg, **cfg}), "GLOO_SOCKET_IFNAME": "lo",
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **dict([marker.split("=", 1)])}
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={NPROC}", "--nnodes=1",
                   "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(WORKER), str(self.out)]
        log = open(self.out / f"group{group}.log", "ab")
        self.groups[group] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True)

    def kill(self, group: int) -> None:
        """SIGKILL the group: torchrun and the rank it started (in a session of its own)."""
        kill_launch([self.groups[group]], self.markers[group])
        self.groups[group].wait()

    def steps(self, group: int, rank: int = 0) -> list[dict]:
        path = self.out / f"group{group}-r{rank}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] \
            if path.exists() else []

    def wait_step(self, group: int, step: int | Callable[[int], bool], timeout: float = 90) -> int:
        """Wait until ``group``'s newest process commits ``step`` (or, from now on, a step ``step(s)`` accepts);
        that step."""
        deadline, pid = time.monotonic() + timeout, self.groups[group].pid
        accept = step if callable(step) else (lambda s: s >= step)
        seen = max((r["step"] for r in self.steps(group)), default=0) if callable(step) else -1
        while True:
            mine = [r for r in self.steps(group) if r["pid"] in self._pids(pid)]
            done = [r["step"] for r in mine if r["step"] > seen and accept(r["step"])]
            if done:
                return done[0]
            if time.monotonic() > deadline or self.groups[group].poll() is not None:
                raise AssertionError(f"group {group} did not reach step {step}:\n{self.log(group)}")
            time.sleep(0.02)

    def wait_healed(self, group: int, after: int, timeout: float = 90) -> None:
        """Wait until ``group``'s newest process has healed and committed ``after`` steps since."""
        deadline, pid = time.monotonic() + timeout, self.groups[group].pid
        while sum(1 for r in self.steps(group) if r["pid"] in self._pids(pid) and r["healed"] >= 1) < after:
            if time.monotonic() > deadline or self.groups[group].poll() is not None:
                raise AssertionError(f"group {group} did not heal:\n{self.log(group)}")
            time.sleep(0.02)

    def wait_file(self, name: str, any_pid: bool = False, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        pattern = name.rsplit("-", 1)[0] + "-*" if any_pid else name
        while not list(self.out.glob(pattern)):
            if time.monotonic() > deadline:
                raise AssertionError(f"no {pattern} in {self.out}:\n{self.log(1)}")
            time.sleep(0.01)

    def _pids(self, launcher: int) -> set[int]:
        """The worker processes (torchrun's children) of the launch whose torchrun is ``launcher``."""
        try:
            children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
        except OSError:
            children = []
        self._known.setdefault(launcher, set()).update(int(c) for c in children)
        return self._known[launcher]

    def finish(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        for group, proc in self.groups.items():
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"group {group} did not finish:\n{self.log(group)}") from None
            assert proc.returncode == 0, f"group {group} exited {proc.returncode}:\n{self.log(group)}"

    def log(self, group: int) -> str:
        return (self.out / f"group{group}.log").read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        for group in self.groups:
            self.kill(group)
        if self.lighthouse.poll() is None:
            os.killpg(self.lighthouse.pid, signal.SIGKILL)
            self.lighthouse.wait()


@pytest.fixture(scope="module")
def healed(tmp_path_factory):
    """One job, each group saving a generation every 5 updates into a directory of its own:

    1. group 1 SIGKILLed at step 5, restarted with the first stream it receives damaged by a flipped bit;
    2. SIGKILLed again 3 steps after it healed, restarted with its first stream slowed down, and SIGKILLed while
       receiving it (mid-transfer), restarted with the first stream cut in half;
    3. 3 steps after that heal, both groups SIGKILLed two updates past a save, and restarted from their newest
       generations; then both train until group 1 has committed 5 steps past its restart, and 3 more.

    Returns the job and every process's committed steps, in launch order, per group."""
    out = tmp_path_factory.mktemp("torchft") / "out"
    out.mkdir()
    job = Job(out, {"pace_s": 0.1, "run": str(out / "runs"), "save_every": 5})
    try:
        job.start(0)
        job.start(1)
        job.wait_step(1, 5)
        job.kill(1)
        job.start(1, corrupt=1)
        job.wait_healed(1, 3)
        job.kill(1)
        job.start(1, slow=1)
        job.wait_file(f"group1-r0-receiving-{job.groups[1].pid}", any_pid=True)
        job.kill(1)
        job.start(1, truncate=1)
        job.wait_healed(1, 3)
        step = job.wait_step(0, lambda s: s % 5 == 2)
        job.kill(0)
        job.kill(1)
        job.start(0)
        job.start(1)
        for _ in range(5):  # both back and training together for 5 of group 1's commits (however slow the start)
            job.wait_step(1, lambda s: True, timeout=180)
        last = max(r["step"] for g in (0, 1) for r in job.steps(g))
        (out / "stop.json").write_text(json.dumps({"step": max(step + 8, last + 3)}))
        job.finish()
    finally:
        job.stop()
    return job, {r: {g: _by_process(job.steps(g, r)) for g in (0, 1)} for r in range(NPROC)}


def _by_process(steps: list[dict]) -> list[list[dict]]:
    runs: list[list[dict]] = []
    for r in steps:
        if not runs or runs[-1][0]["pid"] != r["pid"]:
            runs.append([])
        runs[-1].append(r)
    return runs


def _differing(survivor: list[dict], healed: list[dict], joined_after: int) -> list[int]:
    """The steps after the heal at which the restarted group's digest differs from the survivor's."""
    by_step = {r["step"]: r["digest"] for r in survivor}
    assert healed and healed[0]["healed"] >= 1, healed[:3]
    assert healed[0]["step"] > joined_after, healed[0]  # it joined where the survivor was, not from the start
    return [r["step"] for r in healed if by_step.get(r["step"]) != r["digest"]]


def test_a_killed_group_heals_from_its_peer_and_continues_bitwise(healed):
    job, ranks = healed
    for rank, runs in ranks.items():
        survivor = runs[0][0]  # group 0's first process of this rank, up to the kill of both
        restarts = runs[1][1:-1]  # group 1's processes after each kill of it alone (the one killed mid-transfer
        assert len(restarts) == 2, (rank, [r[0]["pid"] for r in runs[1]])  # committed nothing)
        for run in restarts:
            assert _differing(survivor, run, 5) == [], (rank, run[:3], job.log(1))
    assert list(job.out.glob("group1-r0-receiving-*")), "the kill mid-transfer did not happen"


def test_a_damaged_or_cut_stream_is_refused_and_the_heal_retried(healed):
    job, _ = healed
    refused = [r["error"] for path in sorted(job.out.glob("group1-r*-refused-*.json"))
               for r in json.loads(path.read_text())]
    assert len(refused) == 2 * NPROC, refused  # one per rank of each damaged restart; the next quorum's heal held
    assert any("differs from what the sender sealed" in e for e in refused), refused
    assert any("cut short" in e for e in refused), refused


def test_losing_every_group_resumes_from_the_newest_generations_bitwise(healed):
    """Both groups SIGKILLed two updates past a save: each restarts from its newest generation (the manager's
    step restored with it). The first back continues from its generation exactly as the groups did before the
    kill; the other heals from it (or resumes alike) and equals it at every step, on every rank."""
    job, ranks = healed
    for rank, runs in ranks.items():
        before = {r["step"]: r["digest"] for r in runs[0][0]}
        finals = {g: runs[g][-1] for g in (0, 1)}
        restored = {g: json.loads((job.out / f"group{g}-r{rank}-restored-{finals[g][0]['pid']}.json").read_text())[
            "step"] for g in (0, 1)}
        assert all(step % 5 == 0 for step in restored.values()), restored
        resumed = [g for g, run in finals.items() if run[0]["step"] == restored[g] + 1 and run[0]["healed"] == 0]
        assert resumed, (restored, {g: run[:2] for g, run in finals.items()})  # from its own generation, no heal
        overlap = [r for run in finals.values() for r in run if r["step"] in before]
        assert overlap and all(before[r["step"]] == r["digest"] for r in overlap), overlap
        common = {r["step"]: r["digest"] for r in finals[0]}
        assert [r["step"] for r in finals[1] if r["step"] in common and common[r["step"]] != r["digest"]] == []
        assert len([r for r in finals[1] if r["step"] in common]) >= 5, finals


def test_a_healed_group_saves_generations_of_its_own_that_verify(healed, capsys):
    """After its heal, group 1's ranks go on saving into the group's run (one commit of both ranks, the
    generation named for the update the heal restored): each verifies, and the one each group saved at the same
    update holds the same tensors."""
    from trainstate import cli
    from trainstate.tools.diff import diff

    job, ranks = healed
    healed_saves = [r["saved"] for run in ranks[0][1][1:-1] for r in run if r.get("saved")]
    assert healed_saves, "no healed process of group 1 reached a save"
    runs = job.out / "runs"
    for group in (0, 1):
        assert cli.main(["verify", "--json", str(runs / f"group{group}")]) == 0, capsys.readouterr()
    common = sorted({p.name for p in (runs / "group0").glob("gen-*")} & {p.name for p in (runs / "group1").glob("gen-*")})
    assert common, "the groups kept no generation of the same update"
    report = diff(runs / "group0" / common[-1], runs / "group1" / common[-1])
    assert report.identical, (report.first, [(c.name, c.entries[:3]) for c in report.categories if c.entries])


def _flipping_urlopen(monkeypatch, where):
    """Every HTTP response read by urllib gets one bit flipped at ``where(data)``, as a damaged link would."""
    import io

    def flipped(url, *args, **kwargs):
        with _URLOPEN(url, *args, **kwargs) as response:
            data = bytearray(response.read())
        data[where(bytes(data))] ^= 0x01
        return io.BytesIO(bytes(data))

    monkeypatch.setattr(urllib.request, "urlopen", flipped)


def _middle_of_a_parameter(data: bytes) -> int:
    """In torchft's stream (a pickled table of records, then each record's bytes), the middle of the first
    record of the first layer's weight's size. (The control reads torch's framing to aim; trainstate never does.)"""
    import io
    import pickle

    stream = io.BytesIO(data)
    at = (entries := pickle.load(stream)) and stream.tell()
    for entry in entries:
        if entry.is_storage and entry.length == 64 * 16 * 4:
            return at + entry.length // 2
        at += entry.length
    raise AssertionError("no record of the weight's size")


def test_the_control_the_stock_http_transport_loads_a_flipped_bit(monkeypatch):
    """The same snapshot, offered by torchft's stock ``HTTPTransport`` and by trainstate's, one bit flipped in
    transit in the middle of a parameter's bytes: the stock transport hands the damaged tensor over (and unpickles
    with ``weights_only=False`` to do so); trainstate's refuses the stream."""
    import torch

    import trainstate as ts
    from trainstate.errors import CorruptGeneration
    from trainstate.integrations.torchft import Healing

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    state = ts.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()))
    heal, stock = Healing(state), loopback_http()
    try:
        heal.boundary()
        offered = {"user": {"default": heal.state_dict()}, "torchft": {"step": 3, "batches_committed": 6}}
        _flipping_urlopen(monkeypatch, _middle_of_a_parameter)
        stock.send_checkpoint([1], 3, offered, timedelta(seconds=20))
        got = stock.recv_checkpoint(0, stock.metadata(), 3, timedelta(seconds=20))["user"]["default"]["tensors"]
        sent = offered["user"]["default"]["tensors"]
        damaged = [n for n in sent if not torch.equal(got[n], sent[n])]
        assert len(damaged) == 1 and got[damaged[0]].shape == (64, 16), damaged  # loaded, one weight-sized tensor
        _flipping_urlopen(monkeypatch, lambda data: len(data) // 2)
        heal.transport.send_checkpoint([1], 3, offered, timedelta(seconds=20))
        with pytest.raises(CorruptGeneration, match="differs from what the sender sealed"):
            heal.transport.recv_checkpoint(0, heal.transport.metadata(), 3, timedelta(seconds=20))
    finally:
        stock.shutdown(wait=False)
        heal.shutdown()
