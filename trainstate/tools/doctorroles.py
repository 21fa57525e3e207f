"""The doctor's roles: each a fresh process (a factory and a step) or a launch of a multi-rank job's own command,
and the records they leave (see :mod:`trainstate.tools.doctor`, which compares them).

:func:`jobs` decides the roles (``resumed``, ``repeat``, ``reference``) and what each restores or replays;
:func:`run_children` runs :mod:`trainstate.tools.doctorrun` once per role, side by side;
:func:`launch_roles` runs a job's command once per role, one launch after another
(:mod:`trainstate.tools.doctorjob` records inside it); :func:`read` and :func:`read_launched` turn what a role
wrote into a :class:`Record`.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import InvalidArgument
from ..format.manifest import parse_generation_name
from . import doctorjob
from .diffread import resolve


@dataclass(frozen=True)
class Record:
    """What one process saw and did in update k: observations by name, and its before/after generations."""

    role: str
    tensors: dict[str, torch.Tensor]
    values: dict[str, str]
    notes: list[str]
    before: Path | str  # a generation: its directory, or RUN@UPDATE (a launched role's)
    after: Path | str
    streams: dict[str, bool] = field(default_factory=dict)  # RNG stream -> whether the update drew from it


def _full_generation(store: Any, update: int, where: str) -> str:
    found = sorted(g for g in store.generations() if (parse_generation_name(g) or (None, None)) == (update, "full"))
    if not found:
        have = sorted({p[0] for g in store.generations() if (p := parse_generation_name(g)) and p[1] == "full"})
        raise InvalidArgument(f"{where} has no full generation at update {update} (it has: {have or 'none'}); "
                              "the reference must hold the same update")
    return found[-1]


def jobs(run: str, factory: str, step: str, against: str | None, replay_from: str | int, repeat: bool,
          work: Path) -> tuple[list[dict[str, Any]], str, int, str]:
    store, generation = resolve(run)
    parsed = parse_generation_name(generation)
    if parsed is None or parsed[1] != "full":
        raise InvalidArgument(f"{run}: {generation} is not a full generation; the doctor resumes from one")
    update = parsed[0]
    base = {"factory": factory, "step": step, "update": update, "replay_from": None}
    roles = ("resumed", "repeat") if repeat else ("resumed",)
    jobs = [dict(base, role=r, run=store.location, generation=generation) for r in roles]
    if against is not None:
        other, _ = resolve(against)
        reference = dict(base, role="reference", run=other.location,
                         generation=_full_generation(other, update, against))
        described = f"the uninterrupted run's {reference['generation']} in {other.location}"
    else:
        start = "start" if replay_from == "start" else _replay_start(store, replay_from, update)
        reference = dict(base, role="reference", run=store.location, generation=None, replay_from=start)
        described = ("an uninterrupted replay from the factory's fresh state (update 0)" if start == "start"
                     else f"an uninterrupted replay from {start}")
    jobs.append(reference)
    for job in jobs:
        job["out"] = str(work / job["role"])
        Path(job["out"]).mkdir()
    return jobs, generation, update, described


def _replay_start(store: Any, replay_from: str | int, update: int) -> str:
    text = str(replay_from)
    start = parse_generation_name(text)[0] if parse_generation_name(text) else int(text) if text.isdigit() else None
    if start is None:
        raise InvalidArgument(f"replay_from={replay_from!r}: give 'start', an update number or a generation name")
    if start > update:
        raise InvalidArgument(f"replay_from={replay_from!r} is after update {update}, the update being diagnosed")
    return _full_generation(store, start, store.location)


def _environment() -> dict[str, str]:
    """The children import what this process can: its working directory and its sys.path."""
    env = dict(os.environ)
    paths = [os.getcwd()] + [p for p in sys.path if p] + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def launch_roles(jobs: list[dict[str, Any]], work: Path, launch: str | list[str], timeout_s: float | None) -> None:
    """Each role runs the job's own command (one ``torchrun`` launch, every rank), one role after another: two
    launches at once would compete for the rendezvous port and the cores."""
    command = shlex.split(launch) if isinstance(launch, str) else [str(a) for a in launch]
    for job in jobs:
        spec = work / f"{job['role']}.json"
        spec.write_text(json.dumps(job))
        env = dict(_environment(), **{doctorjob.ENV: str(spec)})
        with open(work / f"{job['role']}.log", "wb") as log:
            proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired as exc:
                raise InvalidArgument(f"the {job['role']} launch ran longer than {timeout_s} s; raise timeout_s"
                                      ) from exc
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        records = sorted(Path(job["out"]).glob("record-rank*.safetensors"))
        if code or not records:
            raise InvalidArgument(f"the {job['role']} launch failed: {_launch_failure(work, job, code, records)}")


def _launch_failure(work: Path, job: dict[str, Any], code: int, records: list[Path]) -> str:
    errors = sorted(Path(job["out"]).glob("error-rank*.json"))
    if errors:
        data = json.loads(errors[0].read_text())
        return f"{data['type']}: {data['message']} ({errors[0].stem.removeprefix('error-')})"
    log = (work / f"{job['role']}.log").read_bytes().decode(errors="replace")
    if not code and not records:
        return ("it exited 0 without a record: the job's checkpointer did not act on the doctor's job (a "
                f"trainstate integration that supports --launch: torchtitan's), or never reached step "
                f"{job['update'] + 1}. Its output ends: {log[-1200:]}")
    return f"exit status {code}: {log[-1500:]}"


def run_children(jobs: list[dict[str, Any]], work: Path, timeout_s: float | None) -> None:
    env, running = _environment(), []
    try:
        for job in jobs:
            spec = work / f"{job['role']}.json"
            spec.write_text(json.dumps(job))
            with open(work / f"{job['role']}.log", "wb") as log:
                running.append(subprocess.Popen([sys.executable, "-m", "trainstate.tools.doctorrun", str(spec)],
                                                env=env, stdout=log, stderr=subprocess.STDOUT))
        for job, proc in zip(jobs, running):
            code = proc.wait(timeout=timeout_s)
            if code:
                raise InvalidArgument(f"the {job['role']} process failed: {_failure(work, job, code)}")
    except subprocess.TimeoutExpired as exc:
        raise InvalidArgument(f"a doctor process ran longer than {timeout_s} s; raise timeout_s") from exc
    finally:
        for proc in running:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _failure(work: Path, job: dict[str, Any], code: int) -> str:
    error = Path(job["out"]) / "error.json"
    if error.exists():
        data = json.loads(error.read_text())
        return f"{data['type']}: {data['message']}"
    log = (work / f"{job['role']}.log").read_bytes().decode(errors="replace")
    return f"exit status {code}: {log[-1500:]}"


def read_launched(job: dict[str, Any]) -> Record:
    """The ranks' records as one: each name marked with its rank after the stage (``grads/model.w[rank1]``),
    a stream drawn from when any rank drew from it, the state before and after as the role's two generations."""
    out = Path(job["out"])
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, str] = {}
    notes: list[str] = []
    streams: dict[str, bool] = {}
    for path in sorted(out.glob("record-rank*.safetensors"), key=lambda p: int(p.stem.removeprefix("record-rank"))):
        rank = path.stem.removeprefix("record-")
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["doctor"])
            for name in meta["order"]:
                tensors[f"{name}[{rank}]"] = f.get_tensor(name)
        values.update({f"{name}[{rank}]": value for name, value in meta["values"].items()})
        notes += [n for n in meta["notes"] if n not in notes]
        for stream, moved in meta.get("streams", {}).items():
            streams[stream] = streams.get(stream, False) or moved
    gens = out / "gens"
    return Record(job["role"], tensors, values, notes, f"{gens}@{job['update']}", f"{gens}@{job['update'] + 1}",
                  streams)


def read(job: dict[str, Any]) -> Record:
    out = Path(job["out"])
    tensors, path = {}, str(out / "record.safetensors")
    with safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()["doctor"])
        for name in meta["order"]:
            tensors[name] = f.get_tensor(name)
    return Record(job["role"], tensors, meta["values"], meta["notes"], out / "before", out / "after",
                  meta.get("streams", {}))
