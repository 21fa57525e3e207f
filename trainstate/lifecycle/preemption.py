"""Save at the next update boundary when the scheduler says the job is about to die.

SLURM (``--signal``), Kubernetes (pod termination) and most cloud spot
services send SIGTERM (some SIGUSR1) some seconds before the kill. The
handler only sets a flag; the training loop checks it at an update boundary,
where the state is consistent, saves a full generation and exits with
:data:`EXIT_PREEMPTED` so the supervisor knows to requeue::

    with ts.PreemptionHandler(grace_s=60) as preempt:
        while state.next_update < total_updates:
            train_one_update()
            state.next_update += 1
            if preempt.requested:
                ckpt.save(state)
                preempt.exit()            # SystemExit(EXIT_PREEMPTED)

In a multi-rank job the ranks see the signal at different moments (one
before its boundary, another after), so a rank's own flag would send it into
``save`` while the others go on to the next step's all-reduce, and both wait
there until the collective timeout. Ask :meth:`PreemptionHandler.agreed`
instead, on every rank at every boundary: one 8-byte all-reduce on a gloo group
of the handler's own, true on every rank once any rank was signalled::

            if preempt.agreed():          # every rank, every boundary
                ckpt.save(state)
                preempt.exit()

A second signal, or the grace deadline passing before the loop reaches a
boundary, restores the signal's default action and re-delivers it: the
process dies at once. That is safe: a save cut short leaves only an
invisible staging directory, and the previous generation stays the latest.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any

from ..errors import InvalidArgument

log = logging.getLogger("trainstate")

EXIT_PREEMPTED = 75
"""Exit status after a preemption save (EX_TEMPFAIL: a temporary failure, retry the job)."""


class PreemptionHandler:
    """Turn SIGTERM/SIGUSR1 into a flag checked at update boundaries (a context manager).

    ``signals``: which signals mean "preempted". ``grace_s``: seconds after
    the first signal before falling back to the default action (``None``:
    wait for the loop forever; the scheduler's own kill still comes). Only the
    main thread may install signal handlers. Previous handlers come back on exit.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1), grace_s: float | None = None):
        if grace_s is not None and not grace_s > 0:
            raise InvalidArgument(f"grace_s must be positive or None, got {grace_s!r}")
        self.signals = tuple(signals)
        self.grace_s = grace_s
        self.received: int | None = None
        self.received_at: float | None = None
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None
        self._group: Any = None  # agreed(): a gloo group of this handler's own (CPU flags under NCCL too)

    @property
    def requested(self) -> bool:
        """True once a preemption signal arrived: save at this boundary, then :meth:`exit`."""
        return self.received is not None

    def agreed(self, process_group: Any = None) -> bool:
        """Whether any rank of ``process_group`` (default: every rank) was signalled, the same answer on every
        rank: a collective, so every rank calls it at the same boundary. Without an initialized process group,
        :attr:`requested`. The gloo group it reduces on is made at the first call (collective too)."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.requested
        if self._group is None:
            self._group = dist.new_group(ranks=None if process_group is None else dist.get_process_group_ranks(
                process_group), backend="gloo")
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if flag.item() and not self.requested:
            log.warning("a preemption signal reached another rank: saving at this boundary with it")
        return bool(flag.item())

    def __enter__(self) -> PreemptionHandler:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._group is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            log.warning("second %s: terminating now; the last published generation stays the latest",
                        signal.Signals(signum).name)
            self._die(signum)
        self.received, self.received_at = signum, time.monotonic()
        log.warning("%s received: will save at the next update boundary and exit with status %d",
                    signal.Signals(signum).name, EXIT_PREEMPTED)
        if self.grace_s is not None:
            self._timer = threading.Timer(self.grace_s, self._deadline, (signum,))
            self._timer.daemon = True
            self._timer.start()

    def _deadline(self, signum: int) -> None:
        # On the timer thread: only the main thread may change handlers, so re-deliver the signal and let
        # the main-thread handler treat it as the second one. If the main thread is stuck in native code
        # and cannot run it, SIGKILL follows: a save cut short is still never visible.
        log.warning("no update boundary within the %.3g s grace period: terminating without saving", self.grace_s)
        os.kill(os.getpid(), signum)
        fallback = threading.Timer(5.0, os.kill, (os.getpid(), signal.SIGKILL))
        fallback.daemon = True
        fallback.start()

    @staticmethod
    def _die(signum: int) -> None:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def exit(self) -> None:
        """Leave with :data:`EXIT_PREEMPTED` (raises ``SystemExit``, so ``with`` blocks unwind and close)."""
        raise SystemExit(EXIT_PREEMPTED)
