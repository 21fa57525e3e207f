"""The restart policy of ``trainstate supervise``: pure classification, decisions and the attempt log's summary.

A supervised child ends in one of six ways, and each has its own answer:

==========  ==========================================================  ===========================
kind        when                                                        then
==========  ==========================================================  ===========================
done        exit 0 and the DONE record verifies                         stop, exit 0
incomplete  exit 0 without a valid DONE record (missing or stale)       a failure: back off, restart
permanent   exit :data:`EXIT_PERMANENT` (``ts.exit_code_for``)           stop at once, exit 78
preempted   exit :data:`EXIT_PREEMPTED` (a preemption save)             restart at once (own bound)
transient   any other exit status, or death by a signal                 back off, restart
stopped     the operator stopped it (SIGTERM/SIGINT, the stop file)     stop, exit 128 + signal
==========  ==========================================================  ===========================

``Policy.max_starts`` bounds the starts that follow failures (the first start
included); restarts after a preemption do not count against it and have their
own bound, ``max_preemptions``. The process handling is
:mod:`trainstate.lifecycle.supervisor`; nothing here touches a process or a file.
"""

from __future__ import annotations

import shlex
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import EXIT_FAILED, EXIT_PERMANENT, InvalidArgument
from .preemption import EXIT_PREEMPTED

EXIT_DONE = 0
EXIT_GAVE_UP = EXIT_FAILED  # every start the policy allows was used up by failures
KINDS = ("done", "incomplete", "permanent", "preempted", "transient", "stopped")
PREFLIGHT_SLACK = 64 << 10  # a manifest, and a block of slack per file, as the save's own preflight counts


@dataclass(frozen=True)
class Policy:
    """How many starts, and how long to wait between them.

    ``backoff[i]`` is the wait after the (i+1)-th failure; the last entry
    repeats. Preemptions restart with no wait, at most ``max_preemptions`` times.
    """

    max_starts: int = 3
    backoff: tuple[float, ...] = (10.0, 20.0, 40.0)
    max_preemptions: int = 10

    def __post_init__(self) -> None:
        if type(self.max_starts) is not int or self.max_starts < 1:
            raise InvalidArgument(f"max_starts must be a positive int, got {self.max_starts!r}")
        if type(self.max_preemptions) is not int or self.max_preemptions < 0:
            raise InvalidArgument(f"max_preemptions must be an int >= 0, got {self.max_preemptions!r}")
        if not self.backoff or any(not (w >= 0 and w < float("inf")) for w in self.backoff):
            raise InvalidArgument(f"backoff must be one or more finite waits >= 0 (seconds), got {self.backoff!r}")

    def wait_after(self, failures: int) -> float:
        """The wait after the ``failures``-th failure (1-based)."""
        return float(self.backoff[min(failures, len(self.backoff)) - 1])


def parse_backoff(text: str) -> tuple[float, ...]:
    """``"10,20,40"`` -> ``(10.0, 20.0, 40.0)``."""
    try:
        waits = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise InvalidArgument(f"--backoff takes seconds separated by commas (10,20,40), got {text!r}") from None
    Policy(backoff=waits)  # the same checks as the policy's
    return waits


def parse_size(text: str) -> int:
    """``"512M"``, ``"20G"``, ``"1T"`` or plain bytes."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
    number, unit = text.strip().upper().rstrip("B").rstrip("I"), ""
    if number and number[-1] in units:
        number, unit = number[:-1], number[-1]
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise InvalidArgument(f"a size is bytes or a number with K, M, G, T or P (20G), got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise InvalidArgument(f"a size must be >= 0, got {text!r}")
    return int(value)


def describe_status(returncode: int) -> tuple[int | None, str | None, str]:
    """``(exit code, signal name, words)`` for a ``Popen.returncode``."""
    if returncode < 0:
        name = _signal_name(-returncode)
        return None, name, f"killed by {name}"
    return returncode, None, f"exit {returncode}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass(frozen=True)
class Outcome:
    kind: str
    detail: str


def classify(returncode: int, *, stopped_by: int | None, done: Any = None) -> Outcome:
    """What one attempt's end means. ``done``: the DONE verdict (checked only after exit 0)."""
    _, _, words = describe_status(returncode)
    if returncode == 0 and done:
        return Outcome("done", f"{words}; the DONE record verifies ({done.record.generation})")
    if stopped_by is not None:
        return Outcome("stopped", f"{words} after the operator's stop ({_signal_name(stopped_by)} forwarded)")
    if returncode == 0:
        why = "there is no DONE record" if done is None or done.status == "missing" else \
            f"the DONE record is stale: {done.reason}"
        return Outcome("incomplete", f"{words}, but {why}; a run is done only when its DONE record verifies")
    if returncode == EXIT_PERMANENT:
        return Outcome("permanent", f"{words}: a permanent error (a restart would meet it again)")
    if returncode == EXIT_PREEMPTED:
        return Outcome("preempted", f"{words}: preempted after saving")
    return Outcome("transient", words)


@dataclass
class Counts:
    starts: int = 0
    failures: int = 0  # transient and incomplete attempts
    preemptions: int = 0


@dataclass(frozen=True)
class Decision:
    restart: bool
    wait_s: float | None  # before the next start; None when there is none
    exit_code: int | None  # the supervisor's, when it stops
    reason: str


def decide(outcome: Outcome, counts: Counts, policy: Policy, stopped_by: int | None = None) -> Decision:
    """Restart or stop after ``outcome``; updates ``counts``."""
    kind = outcome.kind
    if kind == "done":
        return Decision(False, None, EXIT_DONE, "the run is done")
    if kind == "stopped":
        return Decision(False, None, 128 + (stopped_by or signal.SIGTERM), "stopped by the operator")
    if kind == "permanent":
        return Decision(False, None, EXIT_PERMANENT, "a permanent error: not restarting")
    if kind == "preempted":
        counts.preemptions += 1
        if counts.preemptions > policy.max_preemptions:
            return Decision(False, None, EXIT_PREEMPTED,
                            f"{counts.preemptions} preemptions, more than --max-preemptions {policy.max_preemptions}")
        return Decision(True, 0.0, None, f"preemption {counts.preemptions} of at most {policy.max_preemptions}: "
                                           "restarting at once")
    counts.failures += 1
    if counts.failures >= policy.max_starts:
        return Decision(False, None, EXIT_GAVE_UP,
                        f"{counts.failures} failed starts: --max-starts {policy.max_starts} used up")
    wait = policy.wait_after(counts.failures)
    return Decision(True, wait, None, f"failure {counts.failures} of at most {policy.max_starts}: "
                                      f"restarting after {wait:g} s")


def start_problem(*, first: bool, recovery_point: str | None, full_generations: int, seen_generation: bool
                  ) -> str:
    """Why the next start must not happen, or ``""``: never a fresh start over a run that had generations.

    The first start goes ahead (the child reports what it finds). A restart
    needs a validated full generation to resume from, unless the directory
    never held one (a crash before the first save restarts fresh).
    """
    if first or recovery_point is not None:
        return ""
    if full_generations:
        return (f"{full_generations} full generation(s) exist but none validates: a restart would fail or start "
                "over. Inspect with `trainstate verify`; nothing was deleted")
    if seen_generation:
        return ("the generations this run had are gone: a restart would start a fresh run. Find out who removed "
                "them (restore from the mirror, or start a new run deliberately)")
    return ""


def space_needed(generation_bytes: int | None, headroom: float, min_free: int) -> int:
    """Free bytes a start needs: room for one more generation of the newest one's size (plus headroom)."""
    if generation_bytes is None:
        return min_free
    return max(min_free, int((generation_bytes + PREFLIGHT_SLACK) * (1 + headroom)))


def space_problem(free: int | None, needed: int, directory: str) -> str:
    if free is None or free >= needed:
        return ""
    return (f"disk preflight: {free:,} bytes free in {directory}, about {needed:,} needed for the next generation; "
            "free space (or lower keep_last) and start again. Nothing was started, nothing deleted")


# the attempt log -------------------------------------------------------------------------------------------------
@dataclass
class Session:
    """One supervisor's records, in order, and what they add up to."""

    id: str
    began: str | None = None
    command: list = field(default_factory=list)
    attempts: list = field(default_factory=list)  # one dict per start (or refused start), merged with its end
    exit: dict | None = None


def sessions(records: Iterable[dict]) -> list[Session]:
    """Group the log's records by supervisor session, in order of appearance (unknown records are skipped)."""
    out: dict[str, Session] = {}
    for r in records:
        if type(r) is not dict or type(r.get("session")) is not str:
            continue
        s = out.setdefault(r["session"], Session(r["session"]))
        event = r.get("event")
        if event == "begin":
            s.began, s.command = r.get("time"), list(r.get("command") or [])
        elif event in ("start", "refused"):
            s.attempts.append(dict(r))
        elif event == "end" and s.attempts and s.attempts[-1].get("attempt") == r.get("attempt"):
            s.attempts[-1].update({k: v for k, v in r.items() if k not in ("event", "time")}, ended=r.get("time"))
        elif event == "exit":
            s.exit = dict(r)
    return list(out.values())


def summary(session: Session) -> dict:
    """Counts and the end of one session, as ``--status`` shows them."""
    kinds = [a.get("classification") for a in session.attempts]
    started = [a for a in session.attempts if a.get("event") == "start"]
    return {"session": session.id, "began": session.began, "command": session.command, "starts": len(started),
            "failures": sum(k in ("transient", "incomplete") for k in kinds),
            "preemptions": kinds.count("preempted"),
            "running_or_killed": bool(started) and "classification" not in started[-1] and session.exit is None,
            "exit_code": session.exit.get("exit_code") if session.exit else None,
            "reason": session.exit.get("reason") if session.exit else None, "attempts": session.attempts}


def render(summaries: list[dict], log_path: str) -> str:
    """The text ``trainstate supervise --status`` prints for the newest session."""
    if not summaries:
        return f"no supervisor sessions recorded in {log_path}"
    s = summaries[-1]
    lines = [f"{log_path}: {len(summaries)} supervisor session(s); the newest began {s['began']}",
             f"  command: {shlex.join(s['command'])}",
             f"  {s['starts']} start(s): {s['failures']} failure(s), {s['preemptions']} preemption(s)"]
    for a in s["attempts"]:
        status = "refused to start" if a.get("event") == "refused" else \
            (a.get("signal") and f"killed by {a['signal']}") or \
            (a.get("exit_code") is not None and f"exit {a['exit_code']}") or "no end recorded"
        wait = a.get("wait_s")
        lines.append(f"  #{a.get('attempt')} {a.get('time', '-')}  resumed from {a.get('resumed_from') or '-'}  "
                     f"{status}  {a.get('classification', '')}"
                     + (f"  then waited {wait:g} s" if isinstance(wait, (int, float)) else "")
                     + (f"\n      {a['detail']}" if a.get("detail") not in (None, "", status) else ""))
    if s["exit_code"] is not None:
        lines.append(f"  ended: exit {s['exit_code']} ({s['reason']})")
    elif s["running_or_killed"]:
        lines.append("  no end recorded: the supervisor is still running, or was killed")
    return "\n".join(lines)
