"""Kill drill: train in a child process, SIGKILL it at random moments, resume, compare bitwise.

Two halves share this module so that the demo, the tests and a person at a
shell all run the same thing:

* the worker, ``python -m trainstate.drill worker --dir D --total N --every K``,
  trains a small deterministic model (every kind of state a real run has:
  parameters, BatchNorm buffers, AdamW moments, an LR schedule, a GradScaler,
  and five random streams, each drawn from in every update), resumes from
  ``D``, saves every ``K`` updates and a final generation at ``N``, then writes
  the *next draws* of every random stream and a probe update to
  ``D/next_draws.json``. It reports progress on stdout, one line each::

      ready                 built; waiting for "go" on stdin (--wait-for-go)
      fresh | restored <generation> next_update=<n> rejected=<names or -> identical=<0|1>
      training <n>
      step <n>              after each update
      saving <n>            right before ckpt.save
      saved <n>             right after it returns
      uploaded <n>          with --mirror URL: the remote latest reached update n
      done <n>

  With ``--loader-workers W`` the batches come from a ``ts.ResumableLoader``
  (component ``loader``; ``W`` forked DataLoader workers, persistent,
  prefetching; per-sample augmentation from ``ts.sample_generator``), and
  the worker appends the sample ids of every update to
  ``D/consumed_ids.log``, which :func:`compare_runs` checks too (see
  :class:`ConsumedIds` for how kills and redone updates are resolved).

* the parent (:func:`run_reference`, :func:`run_interrupted`,
  :func:`compare_runs`) runs one uninterrupted reference and one run that is
  SIGKILLed repeatedly, some kills at random moments and some just after a
  ``saving`` line so that they land inside the save. After every kill it
  checks that every visible generation verifies in full and predicts which
  generation the next start must restore; the next start must report it.
  With a mirror it checks the remote copy after every kill too, and can
  delete the local directory after chosen kills (a lost instance), so that
  the next start resumes from the remote alone.

Workers start either as fresh interpreters (:class:`Spawner`) or forked from
a process that imported torch once (:class:`Zygote`); both are real
processes that build everything and restore from disk after they start.
"""

from __future__ import annotations

from .compare import (
    Comparison,
    ConsumedIds,
    compare_consumed,
    compare_runs,
    compare_values,
    describe_compared,
    read_consumed_ids,
)
from .driver import (
    RESTORE_WINDOW_S,
    DrillReport,
    KillPlan,
    Start,
    Timing,
    check_remote,
    check_visible,
    expected_restore,
    plan_kills,
    run_interrupted,
    run_reference,
)
from .launch import (
    Spawner,
    Zygote,
    processes_holding,
    wait_for_exit,
    worker_args,
    worker_env,
    zygote_main,
)
from .worker import (
    DRAWS_FILE,
    FORGET_CHOICES,
    IDS_LOG,
    IN_FEATURES,
    LOADER_LOG,
    OUT_FEATURES,
    DrillConfig,
    DrillError,
    IdsLog,
    SyntheticDataset,
    build,
    build_loader,
    build_model,
    dataset_size,
    next_draws,
    probe,
    train_step,
    worker_main,
)
from .surroundings import MIRROR_OPTIONS_ENV, mirror_options

__all__ = [
    'DRAWS_FILE',
    'FORGET_CHOICES',
    'IDS_LOG',
    'IN_FEATURES',
    'LOADER_LOG',
    'MIRROR_OPTIONS_ENV',
    'OUT_FEATURES',
    'RESTORE_WINDOW_S',
    'Comparison',
    'ConsumedIds',
    'DrillConfig',
    'DrillError',
    'DrillReport',
    'IdsLog',
    'KillPlan',
    'Spawner',
    'Start',
    'SyntheticDataset',
    'Timing',
    'Zygote',
    'build',
    'build_loader',
    'build_model',
    'check_remote',
    'check_visible',
    'compare_consumed',
    'compare_runs',
    'compare_values',
    'dataset_size',
    'describe_compared',
    'expected_restore',
    'mirror_options',
    'next_draws',
    'plan_kills',
    'probe',
    'processes_holding',
    'read_consumed_ids',
    'run_interrupted',
    'run_reference',
    'train_step',
    'wait_for_exit',
    'worker_args',
    'worker_env',
    'worker_main',
    'zygote_main',
]
