"""Node-local tiers under SIGKILL: every process of a multi-node launch, or one node's, killed at random moments.

Each trial starts ``tests/tier_kill_worker.py``'s ``tier_kill_train`` on
several ``torchrun`` agents of this host (``tests/multinode.py``; 2 nodes x 2
ranks, ``replicas=2``, ``keep_last=2``, a blocking save after every update,
the replicas and pruning on the writer thread). Once one or two saves of this
launch have returned, the trial waits for the next entry into the phase it
aims at (``save``, ``replicate``, ``prune``: each aimed at once in every three
kills, in a random order) and a random part of that phase's usual length
after that entry, then SIGSTOPs and SIGKILLs every agent and rank at once
(found by an environment token in ``/proc``, whatever session torchrun put
them in; looked up before the moment, so that the scan does not delay it): one
moment for the whole launch, as if every machine lost power. It checks the node
directories with ``tests/tiercheck.py``: every ``latest`` served whole by the
nodes, every ``replicas/latest`` served whole after losing any one node, no
torn holding, every held byte verified. The next launch resumes; it must pick
exactly the newest generation the checker finds servable. At the end a launch
restores and trains to the fixed total: bitwise equal (model, optimizer,
schedule, clock, every rank's generator, global stream and loader position)
to the uninterrupted run computed in that launch.

Before that finish, on the same directories, one node trial: the last
node's agent and ranks are SIGKILLed on entering one step of a save (``write``,
``commit``, ``verify`` or ``point``: its ranks stop there, ``TS_KILL_PAUSE``),
the other nodes must fail on their own within seconds (no hang) leaving
nothing torn, and the lost node's directory is deleted: every survivor's
``replicas/latest`` must still be served whole, and the finish launch (an
empty directory for the lost node) restores from the survivors and their
replicas, refills the lost node, and ends bitwise equal.

A snapshot of the directories after the last kill of every process feeds the
negative controls: the checker must name a flipped byte, a torn file, a
deleted replica holding and a ``latest`` moved onto a generation no longer
held. A restore over empty tiers (and over an empty object-store run) returns
None and leaves a fresh optimizer without state (it used to give it step 1).

Kills inside uploads (the remote tier behind the nodes, a moto S3 server on
loopback; skipped without ``obstore``): on fresh node directories and a fresh
remote URL, ``tier_kill_train`` with ``mirror=URL, mirror_every=2`` (2 nodes x
1 rank by default) is SIGKILLed whole, every kill aimed at an upload on the
writer thread: at its files being sent (``send``), at rank 0's commit, remote
``latest`` move and remote pruning (``commit-remote``), or anywhere in it
(``upload``), a random part of that phase's shortest length so far in. After each kill
the node directories pass the checker, and so does the remote
(``tiercheck.check_remote``: its ``latest`` names a generation it serves
whole, no generation it lists is partial; leftovers of the interrupted upload
are allowed), and its ``latest`` never moved backwards. A finish launch ends
bitwise; then every node directory is deleted and a last launch restores from
the remote alone (its newest generation; not one byte from a disk), ends
bitwise too and leaves the nodes refilled. Negative controls on that remote:
a deleted file of the generation its ``latest`` names, a torn file of another
listed generation, and a ``latest`` left naming a generation whose commit
record is gone, are caught (each repaired after, the remote clean again).

Where each kill landed is read from the ranks' phase logs (save, replicate,
prune, upload, ...) and the leftovers found on disk; ``-s`` prints the table.

Knobs: ``TRAINSTATE_TIER_KILLS`` (kills per layout, default 3),
``TRAINSTATE_TIER_KILL_LAYOUTS`` (default ``2x2``; e.g. ``2x2,4x1``),
``TRAINSTATE_KILL_SEED`` (replay a schedule), ``TRAINSTATE_TIER_KILL_SLEEP``
(the worker's pause inside phases, seconds, default 0.02),
``TRAINSTATE_TIER_KILL_PHASE`` (the node trial's step of the save),
``TRAINSTATE_TIER_UPLOAD_KILLS`` (kills aimed at uploads, default 3),
``TRAINSTATE_TIER_UPLOAD_LAYOUT`` (default ``2x1``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest

import tiercheck
from multinode import NodesLaunch, launch_nodes
from objectservers import moto_server  # noqa: F401  (fixture)
from trainstate.format.manifest import POINTER, Pointer, parse_generation_name

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parent / "tier_kill_worker.py"
SEED = int(os.environ.get("TRAINSTATE_KILL_SEED") or random.SystemRandom().randrange(2**31))
KILLS = int(os.environ.get("TRAINSTATE_TIER_KILLS", "3"))
LAYOUTS = [x.strip() for x in os.environ.get("TRAINSTATE_TIER_KILL_LAYOUTS", "2x2").split(",") if x.strip()]
SLEEP = os.environ.get("TRAINSTATE_TIER_KILL_SLEEP", "0.02")
TOKEN = "TRAINSTATE_TEST_TIER_KILL"  # every agent and rank of a trial carries it: how the kill finds them
TOTAL = max(60, 6 * KILLS + 20)  # updates of the whole run: the trials save a few each, the finish trains the rest
TRAIN = "tier_kill_train"
MID_SAVE = ("write", "commit", "verify", "point")  # staging begun / written, not committed / committed / pointing
AIMS = ("save", "replicate", "prune")  # the phases the trials aim at
PRIORITY = ("save", "replicate", "upload", "prune", "refill", "restore")  # a kill landing in several: the first
UPLOAD_KILLS = int(os.environ.get("TRAINSTATE_TIER_UPLOAD_KILLS", "3"))
UPLOAD_LAYOUT = os.environ.get("TRAINSTATE_TIER_UPLOAD_LAYOUT", "2x1")
UPLOAD_AIMS = ("send", "commit-remote", "upload")  # inside an upload: its files sent, rank 0's commit, anywhere
UPLOAD_TOTAL = max(24, 4 * UPLOAD_KILLS + 12)  # a trial saves 1-4; the two finishes train the rest, twice each


# killing by token ----------------------------------------------------------------------------------------
def marked(value: str) -> list[int]:
    """The live processes whose environment holds ``TOKEN=value`` (zombies have none)."""
    needle, found = f"{TOKEN}={value}".encode(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def freeze(pids: list[int], value: str) -> None:
    """SIGSTOP those of ``pids`` that still carry ``TOKEN=value`` (found beforehand: the moment of a kill does not
    wait for a scan of /proc); :func:`kill_marked` then finds and kills every process of the launch."""
    needle = f"{TOKEN}={value}".encode()
    for pid in pids:
        try:
            if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                os.kill(pid, signal.SIGSTOP)
        except OSError:  # gone (ProcessLookupError is an OSError too)
            continue


def kill_marked(*values: str) -> int:
    """Freeze (SIGSTOP) every process carrying one of ``values``, then SIGKILL them all: one moment for the whole
    launch, as if its machines lost power; repeated until none is left. The count killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = [p for v in values for p in marked(v)]
        if not pids:
            return len(killed)
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        killed |= set(pids)
        time.sleep(0.05)
    raise AssertionError(f"processes {[p for v in values for p in marked(v)]} survived SIGKILL for 30 s")


class Background:
    """``launch_nodes`` on a thread, so that the test can kill it meanwhile."""

    def __init__(self, *args, **kwargs):
        self.launch: NodesLaunch | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=args, kwargs=kwargs, daemon=True)
        self.thread.start()

    def _run(self, *args, **kwargs) -> None:
        try:
            self.launch = launch_nodes(*args, **kwargs)
        except BaseException as exc:  # shown by the test
            self.error = exc

    def alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float | None = None) -> NodesLaunch:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the launch outlived its join"
        if self.error is not None:
            raise self.error
        return self.launch


# where a kill landed -----------------------------------------------------------------------------------------
def open_phases(out: Path) -> dict[str, list[str]]:
    """Per rank, the phases entered and not left at the kill (``thread:phase``, outermost first)."""
    found = {}
    for log in sorted(out.glob("phases-rank*.log")):
        stacks: dict[str, list[str]] = {}
        for line in log.read_text().splitlines():
            parts = line.split()
            if len(parts) != 7:
                continue  # cannot happen with whole O_APPEND lines; tolerated
            _, _, _, thread, event, phase, _ = parts
            stack = stacks.setdefault(thread, [])
            if event == "enter":
                stack.append(phase)
            elif phase in stack:
                del stack[len(stack) - 1 - stack[::-1].index(phase):]
        found[log.stem.replace("phases-", "")] = [f"{t}:{p}" for t, s in sorted(stacks.items()) for p in s]
    return found


def landed(phases: dict[str, list[str]]) -> str:
    """One name for where the kill landed: the first of PRIORITY open on any rank, with its innermost phase."""
    for top in PRIORITY:
        for stack in phases.values():
            names = [p.split(":", 1)[1] for p in stack]
            if top in names:
                return f"{top}/{names[-1]}" if names[-1] != top else top
    return "training"


def leftovers(nodes: list[tiercheck.Node]) -> dict[str, int]:
    """Leftovers found on disk, counted by kind and tier (``staging/own``, ``trash/replica``...)."""
    count: dict[str, int] = {}
    for node in nodes:
        for tier, names in node.leftovers.items():
            for name in names:
                kind = name.split("-")[1]
                count[f"{kind}/{tier}"] = count.get(f"{kind}/{tier}", 0) + 1
    return count


def read_progress(out: Path) -> dict | None:
    try:
        return json.loads((out / TRAIN / "progress.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


# one trial -------------------------------------------------------------------------------------------------
def layout(name: str) -> tuple[int, int]:
    nodes, nproc = name.split("x")
    return int(nodes), int(nproc)


def _new_lines(out: Path, offsets: dict[Path, int]) -> list[list[str]]:
    """The whole phase lines appended to every rank's log since ``offsets`` (updated), split in fields."""
    lines = []
    for log in out.glob("phases-rank*.log"):
        data = log.read_bytes()
        done = data.rfind(b"\n") + 1
        lines += [line.split() for line in data[offsets.get(log, 0):done].decode().splitlines()]
        offsets[log] = max(offsets.get(log, 0), done)
    return lines


def _durations(out: Path, phase: str) -> list[float]:
    """How long each completed ``phase`` took on every rank so far (from the phase logs)."""
    took = []
    for log in out.glob("phases-rank*.log"):
        entered = {}
        for fields in (line.split() for line in log.read_text().splitlines()):
            if len(fields) == 7 and fields[5] == phase:
                if fields[4] == "enter":
                    entered[fields[3]] = float(fields[0])
                elif fields[3] in entered:
                    took.append(float(fields[0]) - entered.pop(fields[3]))
    return took


def kill_trial(root: Path, dirs: list[Path], nproc: int, rng: random.Random, aim: str, *,
               remote: dict | None = None, total: int = TOTAL, shortest: bool = False, later: bool = False,
               known: dict[str, list[float]] | None = None) -> dict:
    """Start the training launch; once one or two of its saves returned, wait for the next entry into ``aim``
    (``save``, ``replicate`` or ``prune``: one that removes something; with ``remote`` (``{"url",
    "storage_options"}``: the remote tier behind the nodes) also ``upload`` or one of its steps) on any rank,
    then a random part of that phase's usual length (its mean so far; ``shortest``: its shortest, so that the
    kill lands inside it nearly always), and SIGKILL every process of the launch; then check the node
    directories, and the remote. ``later``: not an entry while saving the launch's first generation (so that
    the first generation's upload, due at once, has completed: the remote holds something). ``known``: the
    phases' lengths in earlier trials (per phase; extended here), for a phase this launch has not completed yet."""
    out = root / "out"
    for stale in (out / TRAIN / "progress.json", *(out / TRAIN).glob("phases-rank*.log")):
        stale.unlink(missing_ok=True)
    token = uuid.uuid4().hex
    began = time.monotonic()
    env = {TOKEN: token, "TS_KILL_TOTAL": str(total), "TS_KILL_SLEEP": SLEEP}
    if remote is not None:
        env["TRAINSTATE_TEST_S3"] = json.dumps(remote)
    run = Background(out, dirs, [TRAIN], worker=WORKER, nproc=nproc, timeout=300, env=env)
    started = target = None
    offsets: dict[Path, int] = {}
    while run.alive():  # one or two saves of this launch returned
        progress = read_progress(out)
        if progress is not None:
            if started is None:
                started = progress["started"]
                target = started + rng.randint(1, 2)
            if progress["update"] >= target:
                break
        time.sleep(0.005)
    _new_lines(out / TRAIN, offsets)
    pids = marked(token)  # found now, not at the moment of the kill: /proc is slow to scan on a busy machine
    aimed = None
    while run.alive() and aimed is None:  # the next entry into the phase aimed at
        for fields in _new_lines(out / TRAIN, offsets):
            if len(fields) == 7 and fields[4:6] == ["enter", aim] and (aim != "prune" or int(fields[6]) >= 3) \
                    and (not later or int(fields[6]) > started + 1):
                aimed = fields
                break
        else:
            time.sleep(0.002)
    lengths = _durations(out / TRAIN, aim) or (known or {}).get(aim, [])
    usual = (min(lengths) if shortest else sum(lengths) / len(lengths)) if lengths else 0.2
    delay = rng.uniform(0, usual)
    moment = float(aimed[0]) + delay if aimed else time.time()  # after the entry itself, not after seeing it
    time.sleep(max(0.0, moment - time.time()))
    late = time.time() - moment
    freeze(pids, token)
    killed = kill_marked(token)
    launch = run.join(60)
    assert started is not None and aimed is not None and killed, \
        f"the launch ended before a save and a {aim} of it:\n{launch.tail()}"
    if known is not None:
        for phase in {*AIMS, *UPLOAD_AIMS}:
            known.setdefault(phase, []).extend(_durations(out / TRAIN, phase))
    phases = open_phases(out / TRAIN)
    progress = read_progress(out)
    nodes = tiercheck.survey(dirs, [])
    record = {"started": started, "resumed": progress["resumed"], "reached": progress["update"], "aim": aim,
              "delay_s": round(delay, 3), "late_s": round(late, 3), "killed": killed, "exits": launch.returncodes,
              "landed": landed(phases), "phases": phases, "leftovers": leftovers(nodes),
              "pointers": {str(n.path.name): {t: (p.generation if p else None) for t, p in n.pointers.items()}
                           for n in nodes},
              "servable": tiercheck.servable(nodes), "violations": tiercheck.check(dirs),
              "seconds": round(time.monotonic() - began, 1)}
    if remote is not None:
        record["remote_violations"] = found = []
        seen = tiercheck.survey_remote(remote["url"], remote["storage_options"], found)
        record["remote"] = {"latest": seen.pointer and seen.pointer.generation,
                            "latest_update": seen.pointer and seen.pointer.next_update,
                            "generations": seen.generations, "whole": seen.whole, "leftovers": seen.leftovers,
                            "aside": seen.aside}
    return record


def node_trial(root: Path, dirs: list[Path], nproc: int, rng: random.Random, resumes_at: int) -> dict:
    """The last node's agent and ranks SIGKILLed on entering one step of a save (its ranks stop there), the other
    nodes left to fail on their own (they must exit, not hang); then its directory is deleted (an empty one
    comes back)."""
    out, lost = root / "out", len(dirs) - 1  # not agent 0, which serves the rendezvous
    for stale in (out / TRAIN / "progress.json", *(out / TRAIN).glob("phases-rank*.log")):
        stale.unlink(missing_ok=True)
    update = resumes_at + rng.randint(1, 2)
    phase = os.environ.get("TRAINSTATE_TIER_KILL_PHASE") or rng.choice(MID_SAVE)
    tokens = [uuid.uuid4().hex for _ in dirs]
    began = time.monotonic()
    run = Background(out, dirs, [TRAIN], worker=WORKER, nproc=nproc, timeout=300,
                     node_env=[{TOKEN: t} for t in tokens],
                     env={"TS_KILL_TOTAL": str(TOTAL), "TS_KILL_PAUSE": f"{lost}:{update}:{phase}",
                          "TRAINSTATE_TEST_TIMEOUT": "30"})
    while run.alive() and not list((out / TRAIN).glob("paused-rank*")):
        time.sleep(0.01)
    paused = run.alive()
    killed = kill_marked(tokens[lost]) if paused else 0
    killed_at = time.monotonic()
    run.thread.join(120)  # the other nodes fail on their own: their collectives lose their peers
    survivors_s = time.monotonic() - killed_at
    hung = run.alive()
    if hung:
        kill_marked(*tokens)
    launch = run.join(60)
    for stale in (out / TRAIN).glob("paused-rank*"):
        stale.unlink()
    results = {r: json.loads((out / TRAIN / f"rank{r}.json").read_text()) for r in range(len(dirs) * nproc)
               if (out / TRAIN / f"rank{r}.json").exists()}
    phases = open_phases(out / TRAIN)
    progress = read_progress(out)
    violations = tiercheck.check(dirs)
    before = tiercheck.survey(dirs)
    shutil.rmtree(dirs[lost])
    dirs[lost].mkdir()
    nodes = tiercheck.survey(dirs)
    return {"update": update, "phase": phase, "lost": lost, "paused": paused, "killed": killed, "hung": hung,
            "survivors_s": round(survivors_s, 1), "exits": launch.returncodes, "tail": launch.tail(1500),
            "survivor_errors": {r: v.get("error", "")[:300] for r, v in results.items()},
            "survivors_ok": [r for r, v in results.items() if v.get("ok")],
            "resumed": progress and progress["resumed"], "landed": landed(phases), "leftovers": leftovers(before),
            "violations": violations, "servable": tiercheck.servable(nodes),
            "replicas_latest": [n.pointers["replica"] and n.pointers["replica"].generation for n in nodes[:lost]],
            "seconds": round(time.monotonic() - began, 1)}


@pytest.fixture(scope="module", params=LAYOUTS)
def kills(request, tmp_path_factory) -> dict:
    """On the same node directories: KILLS trials that kill every process, a snapshot of the directories after
    the last, one trial that kills one node mid-save and deletes its directory, then the finish."""
    nodes, nproc = layout(request.param)
    root = tmp_path_factory.mktemp(f"tierkill-{request.param}")
    dirs = [root / f"node{i}" for i in range(nodes)]
    rng = random.Random(f"{SEED}-{request.param}")
    began = time.monotonic()
    trials, aims = [], []
    for _ in range(KILLS):
        aims = aims or rng.sample(AIMS, len(AIMS))  # every phase aimed at, in a random order
        trials.append(kill_trial(root, dirs, nproc, rng, aims.pop()))
    snapshot = root / "snapshot"
    for d in dirs:
        shutil.copytree(d, snapshot / d.name, symlinks=True)
    resumes = trials[-1]["servable"][0] if trials and trials[-1]["servable"] else "gen-000000000000"
    node = node_trial(root, dirs, nproc, rng, parse_generation_name(resumes)[0])
    finish = launch_nodes(root / "out", dirs, ["tier_kill_finish", "tier_restore_empty"], worker=WORKER, nproc=nproc,
                          timeout=300, env={"TS_KILL_TOTAL": str(TOTAL)})
    record = {"layout": request.param, "seed": SEED, "trials": trials, "node": node,
              "finish": finish.ok("tier_kill_finish"), "empty": finish.ok("tier_restore_empty"),
              "after_finish": tiercheck.check(dirs), "snapshot": [snapshot / d.name for d in dirs],
              "seconds": round(time.monotonic() - began, 1)}
    _report(record)
    return record


def _kill_line(i: int, t: dict) -> str:
    return (f"  kill {i}: launch from update {t['started']} (resumed {t['resumed']}), reached {t['reached']}, "
            f"{t['aim']} +{t['delay_s']} s (late {t['late_s']} s): landed in {t['landed']}; leftovers "
            f"{t['leftovers']}; servable {t['servable'][:2]}")


def _report(record: dict) -> None:
    print(f"\n{record['layout']}: {len(record['trials'])} kills of every process + 1 of one node "
          f"(seed {record['seed']}), {record['seconds']} s")
    for i, t in enumerate(record["trials"]):
        print(f"{_kill_line(i, t)}; {t['seconds']} s")
    n = record["node"]
    print(f"  node {n['lost']} killed entering {n['phase']} of update {n['update']} (resumed {n['resumed']}); the "
          f"others exited {n['survivors_s']} s later; leftovers {n['leftovers']}; servable without it "
          f"{n['servable'][:2]}; {n['seconds']} s")
    done = record["finish"][0]
    print(f"  finish: restored {done.get('generation')} (sources {done.get('sources')}; {done.get('seconds')} s)")


def _context(record: dict) -> str:
    return (f"TRAINSTATE_KILL_SEED={record['seed']} ({record['layout']}):\n"
            + json.dumps({k: v for k, v in record.items() if k != "snapshot"}, indent=1, default=str)[:8000])


def test_every_process_killed_at_random_moments_tiers_stay_servable_and_resume_bitwise(kills):
    context = _context(kills)
    trials = kills["trials"]
    assert len(trials) == KILLS, context
    for i, trial in enumerate(trials):
        assert trial["violations"] == [], f"kill {i}: {trial['violations']}\n{context}"
        assert trial["servable"], f"kill {i}: nothing servable after the kill\n{context}"
        assert all(code != 0 for code in trial["exits"]), f"kill {i}: an agent finished before the kill\n{context}"
    # each launch resumed from the newest generation the checker found servable after the kill before it
    for before, after in zip(trials, [*trials[1:], kills["node"]]):
        assert after["resumed"] == before["servable"][0], context
    finish = kills["finish"]
    for rank, result in enumerate(finish):
        assert "raised" not in result, f"rank {rank}: {result}\n{context}"
        assert result["full_differs"] == [] and result["rank_differs"] == [], f"rank {rank} diverged\n{context}"
        assert any(k.startswith("model.") for k in result["compared"]) and "noise" in result["compared"], context
    assert kills["after_finish"] == [], context


def test_one_node_killed_mid_save_and_its_directory_lost_a_fresh_launch_resumes_bitwise(kills):
    """The node trial: the killed node's peers exit on their own and leave nothing torn; with its directory
    gone, every survivor's ``replicas/latest`` is still served whole, and the fresh launch (an empty directory
    for the lost node) restores the newest generation the survivors serve, fetches the lost node's shards from
    its replicas, refills it, and finishes bitwise."""
    node, context = kills["node"], _context(kills)
    assert node["paused"] and node["killed"], f"the node was not stopped mid-save\n{context}"
    assert not node["hung"], f"the surviving nodes did not exit within 120 s of losing a node\n{context}"
    assert node["survivor_errors"] and not node["survivors_ok"], context  # they failed, each with an error
    assert node["violations"] == [], context
    assert node["servable"] and all(r in node["servable"] for r in node["replicas_latest"]), context
    finish = kills["finish"]
    assert finish[0]["generation"] == node["servable"][0], context
    assert finish[0]["sources"]["peer"] > 0, f"the lost node's shards came from its replicas\n{context}"
    for rank, result in enumerate(finish):
        assert "raised" not in result and result["full_differs"] == [] == result["rank_differs"], context


# the checker catches what it must ------------------------------------------------------------------------------
def _fresh_copy(snapshot: list[Path], where: Path) -> list[Path]:
    dirs = []
    for d in snapshot:
        shutil.copytree(d, where / d.name, symlinks=True)
        dirs.append(where / d.name)
    return dirs


def _flip(path: Path, offset: int = -3) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_negative_controls_the_checker_catches_a_flipped_byte_a_torn_file_and_pointers_it_cannot_serve(kills,
                                                                                                        tmp_path):
    snapshot = kills["snapshot"]
    assert tiercheck.check(snapshot) == [], "the untouched snapshot is fine"
    nodes = tiercheck.survey(snapshot)
    replicated = nodes[0].pointers["replica"]
    assert replicated is not None, _context(kills)
    name = replicated.generation

    # a flipped byte in a held rank file (size unchanged): its copy does not verify
    dirs = _fresh_copy(snapshot, tmp_path / "flip")
    shard = sorted((dirs[0] / name).glob("rank-*.safetensors"))[0]
    _flip(shard)
    assert any(str(shard) in v and "does not verify" in v for v in tiercheck.check(dirs))

    # a torn file (truncated): named as torn
    dirs = _fresh_copy(snapshot, tmp_path / "torn")
    shard = sorted((dirs[1] / name).glob("shard-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-5])
    assert any(str(shard) in v and "torn" in v for v in tiercheck.check(dirs))

    # node 0's replica holding deleted: replicas/latest no longer survives losing the node whose files it kept
    dirs = _fresh_copy(snapshot, tmp_path / "replica")
    shutil.rmtree(dirs[0] / "replicas" / name)
    found = tiercheck.check(dirs)
    assert any("does not survive losing" in v and name in v for v in found), found

    # node 1's own holding deleted, and the replica of it too; node 0's latest rewritten to name that generation
    dirs = _fresh_copy(snapshot, tmp_path / "latest")
    shutil.rmtree(dirs[1] / name)
    for d in dirs:
        if (d / "replicas" / name).exists():
            shutil.rmtree(d / "replicas" / name)
    for d in dirs:  # the other pointers name something else entirely: only node 0's latest is wrong
        for pointer in (d / POINTER, d / "replicas" / POINTER):
            pointer.unlink(missing_ok=True)
    manifest = (dirs[0] / name / "manifest.json").read_bytes()
    parsed, digest, size = tiercheck.read_manifest(tiercheck.stores(dirs[0])["own"], name)
    (dirs[0] / POINTER).write_bytes(Pointer(name, digest, size, parsed.digest_algorithm, parsed.next_update).to_bytes())
    assert size == len(manifest)
    found = tiercheck.check(dirs)
    assert any(f"{dirs[0] / POINTER} names {name}" in v and "do not serve whole" in v for v in found), found


def test_restore_over_empty_tiers_leaves_the_objects_untouched(kills):
    """``restore()`` where no node holds anything returns None, and must leave the objects as they were: a
    script that always restores first would otherwise train differently from one that does not (the worker
    restores only when something is held, for that reason)."""
    for rank, result in enumerate(kills["empty"]):
        assert result["returned"] is None and result["shared_returned"] is None, result
        assert result["optimizer_state_before"] == 0 == result["optimizer_state_after_shared"], result  # control
        assert result["optimizer_state_after"] == 0, f"rank {rank}: restore() over empty tiers changed the " \
            f"optimizer: {result['optimizer_state_after']} entries, step counters {result['steps_after']}"


# kills inside uploads: the remote tier behind the nodes ---------------------------------------------------------
@pytest.fixture(scope="module")
def upload_kills(request, tmp_path_factory) -> dict:
    """On fresh node directories and a fresh remote URL (moto): UPLOAD_KILLS trials that kill every process,
    each aimed inside an upload; the finish; then every node directory deleted and a launch from the remote
    alone."""
    pytest.importorskip("obstore")
    server = request.getfixturevalue("moto_server")
    nodes, nproc = layout(UPLOAD_LAYOUT)
    root = tmp_path_factory.mktemp(f"tierupload-{UPLOAD_LAYOUT}")
    dirs = [root / f"node{i}" for i in range(nodes)]
    remote = {"url": server.url(server.make_bucket(), f"run-{uuid.uuid4().hex[:8]}"),
              "storage_options": server.storage_options()}
    rng = random.Random(f"{SEED}-upload")
    began = time.monotonic()
    trials, aims, known = [], [], {}
    for i in range(UPLOAD_KILLS):  # the first kill spares the first upload: the remote is never left empty
        aims = aims or rng.sample(UPLOAD_AIMS, len(UPLOAD_AIMS))
        trials.append(kill_trial(root, dirs, nproc, rng, aims.pop(), remote=remote, total=UPLOAD_TOTAL,
                                 shortest=True, later=i == 0, known=known))
    env = {"TS_KILL_TOTAL": str(UPLOAD_TOTAL), "TRAINSTATE_TEST_S3": json.dumps(remote)}
    at = time.monotonic()
    finish = launch_nodes(root / "out", dirs, ["tier_kill_finish"], worker=WORKER, nproc=nproc, timeout=300,
                          env=env).ok("tier_kill_finish")
    finish_s = time.monotonic() - at
    after_finish = tiercheck.check(dirs) + tiercheck.check_remote(remote["url"], remote["storage_options"])
    before_loss = tiercheck.survey_remote(remote["url"], remote["storage_options"])
    for d in dirs:  # every node lost: only the remote is left
        shutil.rmtree(d)
        d.mkdir()
    at = time.monotonic()
    alone = launch_nodes(root / "alone", dirs, ["tier_kill_finish"], worker=WORKER, nproc=nproc, timeout=300,
                         env=env).ok("tier_kill_finish")
    alone_s = time.monotonic() - at
    record = {"layout": UPLOAD_LAYOUT, "seed": SEED, "remote": remote, "trials": trials, "finish": finish,
              "finish_s": round(finish_s, 1), "after_finish": after_finish,
              "before_loss": {"latest": before_loss.pointer and before_loss.pointer.generation,
                              "generations": before_loss.generations, "whole": before_loss.whole,
                              "leftovers": before_loss.leftovers},
              "alone": alone, "alone_s": round(alone_s, 1),
              "after_alone": tiercheck.check(dirs) + tiercheck.check_remote(remote["url"], remote["storage_options"]),
              "refilled": tiercheck.servable(tiercheck.survey(dirs)),
              "seconds": round(time.monotonic() - began, 1)}
    _report_upload(record)
    return record


def _report_upload(record: dict) -> None:
    print(f"\n{record['layout']} with a remote tier (mirror_every=2): {len(record['trials'])} kills aimed inside "
          f"uploads (seed {record['seed']}), {record['seconds']} s")
    for i, t in enumerate(record["trials"]):
        r = t["remote"]
        print(f"{_kill_line(i, t)}; remote latest {r['latest']}, generations {r['generations']}, leftovers "
              f"{len(r['leftovers'])}; {t['seconds']} s")
    done, alone = record["finish"][0], record["alone"][0]
    print(f"  finish: restored {done.get('generation')} (sources {done.get('sources')}); {record['finish_s']} s")
    print(f"  every node directory deleted; the remote held {record['before_loss']['generations']} (latest "
          f"{record['before_loss']['latest']}): restored {alone.get('generation')} (sources {alone.get('sources')}); "
          f"{record['alone_s']} s")


def _bitwise(results: list[dict], context: str) -> None:
    for rank, result in enumerate(results):
        assert "raised" not in result, f"rank {rank}: {result}\n{context}"
        assert result["full_differs"] == [] and result["rank_differs"] == [], f"rank {rank} diverged\n{context}"
        assert any(k.startswith("model.") for k in result["compared"]) and "noise" in result["compared"], context


def test_kills_inside_uploads_leave_the_nodes_and_the_remote_servable_and_resume_bitwise(upload_kills):
    context = _context(upload_kills)
    trials = upload_kills["trials"]
    assert len(trials) == UPLOAD_KILLS, context
    for i, trial in enumerate(trials):
        assert trial["violations"] == [], f"kill {i}: {trial['violations']}\n{context}"
        assert trial["remote_violations"] == [], f"kill {i}: {trial['remote_violations']}\n{context}"
        assert trial["servable"], f"kill {i}: nothing servable after the kill\n{context}"
        assert all(code != 0 for code in trial["exits"]), f"kill {i}: an agent finished before the kill\n{context}"
        assert trial["remote"]["generations"], f"kill {i}: the remote lost everything\n{context}"
    # the remote latest never moves backwards, and the kills did land inside uploads (most of them)
    updates = [t["remote"]["latest_update"] for t in trials if t["remote"]["latest"] is not None]
    assert updates == sorted(updates), context
    assert any(t["landed"].startswith("upload") for t in trials), f"no kill landed inside an upload\n{context}"
    for before, after in zip(trials, trials[1:]):
        assert after["resumed"] == before["servable"][0], context
    finish = upload_kills["finish"]
    assert finish[0]["generation"] == trials[-1]["servable"][0], context
    assert finish[0]["sources"]["remote"] == 0, f"the nodes served it: not one byte from the remote\n{context}"
    _bitwise(finish, context)
    assert upload_kills["after_finish"] == [], context


def test_every_node_directory_lost_the_remote_alone_resumes_bitwise(upload_kills):
    """After all those kills the remote copy is usable: with every node's directory deleted, a launch restores
    the remote's newest generation (all its bytes from the remote) and ends bitwise; the nodes are refilled."""
    context = _context(upload_kills)
    held = upload_kills["before_loss"]
    assert held["whole"] and held["whole"] == held["generations"] and held["latest"] in held["whole"], context
    alone = upload_kills["alone"]
    assert alone[0]["generation"] == held["generations"][0], context
    sources = alone[0]["sources"]  # every rank's bytes, summed; "peer": a file several ranks need, downloaded by
    assert sources["local"] == 0 and sources["remote"] > 0, f"{sources}\n{context}"  # one, handed to the others
    _bitwise(alone, context)
    assert upload_kills["after_alone"] == [], context
    assert upload_kills["refilled"][:1] == [alone[0]["generation"]], f"the nodes were not refilled\n{context}"


def test_negative_controls_the_remote_check_catches_a_missing_file_a_torn_file_and_a_pointer_it_cannot_serve(
        upload_kills):
    """Each damage done to the remote the fixture left (then repaired, and the remote checked clean again)."""
    url, options = upload_kills["remote"]["url"], upload_kills["remote"]["storage_options"]
    assert tiercheck.check_remote(url, options) == [], "the untouched remote is fine"
    store = tiercheck.open_remote(url, options)
    client = store.client
    found = tiercheck.survey_remote(url, options)
    name = found.pointer.generation

    def content(key: str) -> bytes:
        with client.reader(key) as stream:
            return stream.read()

    # one file of the generation the remote latest names, deleted: the latest does not serve it whole
    shard = sorted(f for f in store.files(name) if f.startswith("shard-"))[0]
    key = f"attempts/{store._attempt(name)}/{shard}"
    kept = content(key)
    client.delete(key)
    problems = tiercheck.check_remote(url, options)
    assert any(f"{POINTER} names {name}" in v and "does not serve whole" in v for v in problems), problems
    assert any(f"{name} is listed (committed) but partial" in v for v in problems), problems
    client.put(key, kept)
    assert tiercheck.check_remote(url, options) == []

    # a listed generation other than the latest's, one file torn (truncated): partial, though nothing points at it
    others = [g for g in found.generations if g != name]
    if others:
        files = tiercheck.open_remote(url, options)  # a fresh store: nothing cached
        rank = sorted(f for f in files.files(others[0]) if f.startswith("rank-"))[0]
        key = f"attempts/{files._attempt(others[0])}/{rank}"
        kept = content(key)
        client.put(key, kept[:-5])
        problems = tiercheck.check_remote(url, options)
        assert any(f"{others[0]} is listed (committed) but partial" in v for v in problems), problems
        client.put(key, kept)
        assert tiercheck.check_remote(url, options) == []

    # the generation the latest names, removed (its commit record gone): the latest names what the remote lacks
    record = f"commits/{name}"
    kept = content(record)
    client.delete(record)
    problems = tiercheck.check_remote(url, options)
    assert any(f"{POINTER} names {name}, which the remote does not serve" in v for v in problems), problems
    client.put(record, kept, create=True)
    assert tiercheck.check_remote(url, options) == []
