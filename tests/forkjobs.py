"""Run a list of jobs, each in its own forked process, from one interpreter that imported a framework once.

Importing transformers costs about 10 CPU seconds here, so the framework
tests import it once in a child interpreter and fork a fresh process per job:
each job is a real process that can really be SIGKILLed (the jobs kill
themselves at seeded moments) and leaves nothing in the interpreter the next
job forks from. Jobs run in order; each one's exit status (``-9`` for a
SIGKILL) goes to the results file for the test to judge.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path


def threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1


def warm_imports() -> None:
    """Import what an optimizer's first use imports lazily (torch._dynamo: seconds), once, before forking."""
    import torch

    model = torch.nn.Linear(1, 1)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 1)).sum().backward()
    opt.step()


def fork_call(fn: Callable[[], object], log: str | None = None) -> tuple[int, int]:
    """Run ``fn`` in a forked process (its output appended to ``log``, if given): its pid and raw ``waitpid`` status.

    The process exits 0 when ``fn`` returns, with ``SystemExit``'s code, or 1 on any other exception
    (traceback printed); a signal (a SIGKILL the job aimed at itself) shows in the status.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            if log is not None:
                with open(log, "a") as out:
                    os.dup2(out.fileno(), 1)
                    os.dup2(out.fileno(), 2)
            fn()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - any failure is this job's exit status
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid, os.waitpid(pid, 0)[1]


def run_jobs(jobs_file: str, results_file: str, job: Callable[[dict], None]) -> int:
    warm_imports()
    if threads() != 1:
        raise RuntimeError(f"{threads()} threads before forking: a forked job could inherit a held lock")
    results = []
    for spec in json.loads(Path(jobs_file).read_text()):
        _, status = fork_call(lambda spec=spec: job(spec), spec["log"])
        results.append({"name": spec["name"], "exit": os.waitstatus_to_exitcode(status)})
    Path(results_file).write_text(json.dumps(results))
    return 0


def launch(script: Path, jobs: list[dict], directory: Path, timeout: float = 300) -> dict[str, int]:
    """Run ``script``'s jobs (``python script jobs.json results.json``); each job's exit status by name."""
    import subprocess

    jobs_file, results_file = directory / "jobs.json", directory / "results.json"
    jobs_file.write_text(json.dumps(jobs))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           # transformers imports pyarrow, whose jemalloc would start a background thread: no forking after that
           "JE_ARROW_MALLOC_CONF": "background_thread:false"}
    done = subprocess.run([sys.executable, str(script), str(jobs_file), str(results_file)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {r["name"]: r["exit"] for r in json.loads(results_file.read_text())}
