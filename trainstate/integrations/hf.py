"""Hugging Face Trainer: each ``checkpoint-N/`` sealed as a durable, verified generation; resume only what verifies.

Two lines in a training script::

    from trainstate.integrations.hf import DurableCheckpoints, last_verified_checkpoint

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[DurableCheckpoints()])
    trainer.train(resume_from_checkpoint=last_verified_checkpoint(args.output_dir))

What Trainer 5.x leaves out, and what each part adds:

- Trainer writes ``checkpoint-N/`` with plain writes, no fsync, into files it
  truncates in place. :class:`DurableCheckpoints` (``on_save``, called once
  the folder is complete) reads every file back while fsyncing it, records
  each size and digest in a seal committed inside the folder by rename, fsyncs
  the directories, and moves the seal pointer ``trainstate-latest``
  (:mod:`trainstate.storage.sealed`).
- ``get_last_checkpoint`` (and ``resume_from_checkpoint=True``) take the
  highest ``N``, complete or not. :func:`last_verified_checkpoint` returns the
  newest folder whose seal verifies (name, file set, sizes, digests), passing
  over unsealed (interrupted) and damaged ones, each logged.
- A run resumed from ``checkpoint-N`` would write ``checkpoint-M`` (M > N)
  again in place over what an earlier attempt left there. At train begin, the
  callback renames every ``checkpoint-M`` newer than the resumed step out of
  Trainer's sight (``incomplete-checkpoint-M-<hex>`` if never sealed,
  ``abandoned-checkpoint-M-<hex>`` if sealed), keeping it as evidence;
  ``trainstate discard OUTPUT_DIR --all`` deletes them after review.
- ``save_total_limit=1`` makes Trainer delete the previous checkpoint inside
  the save, before the new one is sealed; the callback refuses it.

Trainer's own files are kept as Trainer writes them (its optimizer, scheduler
and RNG files are pickles, which Trainer loads with ``weights_only=True``);
trainstate checks their bytes, it does not change their format.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..cli.hfdiscard import aside_name
from ..errors import GenerationNotFound, InvalidArgument, NoValidGeneration
from ..format.digest import new_hasher
from ..format.seal import SEAL, SEAL_POINTER
from ..storage.posix import PosixOps
from ..storage.sealed import SealInfo, newest_verified, read_seal_pointer, remove_temp_files, seal_folder

__all__ = ["DurableCheckpoints", "last_verified_checkpoint"]

log = logging.getLogger("trainstate")
_CHECKPOINT_RE = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)")  # get_last_checkpoint's pattern, anchored


def _step(name: str) -> int:
    return int(_CHECKPOINT_RE.fullmatch(name)[1])


def _checkpoints(output_dir: Path) -> list[str]:
    """``checkpoint-N`` folders, newest (highest N, parsed as a number) first."""
    names = [n for n in os.listdir(output_dir) if _CHECKPOINT_RE.fullmatch(n) and (output_dir / n).is_dir()]
    return sorted(names, key=_step, reverse=True)


def last_verified_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest ``checkpoint-N`` in ``output_dir`` whose seal verifies: ``trainer.train(resume_from_checkpoint=...)``.

    ``None`` on a fresh run: no folder, or only folders that were never sealed
    (a save killed before it completed). Unsealed and damaged folders are
    passed over, each logged (damage as a WARNING). If sealed folders exist
    but none verifies, raises :class:`~trainstate.NoValidGeneration` listing
    each and why, rather than silently starting over; nothing is deleted.
    """
    root = Path(output_dir)
    if not root.is_dir():
        return None
    choice = newest_verified(root, _checkpoints(root))
    if choice.folder is None:
        if choice.rejected:
            raise NoValidGeneration(str(root), choice.rejected)
        return None
    name = Path(choice.folder).name
    pointer = read_seal_pointer(root)
    if pointer is not None and _CHECKPOINT_RE.fullmatch(pointer.name) and _step(pointer.name) > _step(name):
        log.warning("resuming from %s, not %s that %s names: it did not verify", name, pointer.name,
                    root / SEAL_POINTER)
    log.info("resuming from %s (%d files, %d bytes verified%s)", name, len(choice.seal.files), choice.seal.size,
             "; passed over " + ", ".join([r.generation for r in choice.rejected] + choice.unsealed)
             if choice.rejected or choice.unsealed else "")
    return choice.folder


class DurableCheckpoints(TrainerCallback):
    """Seals each checkpoint Trainer saves; see the module docstring.

    ``digest`` names the algorithm (``"blake3"``, or ``"sha256"``).
    ``last`` is the last folder sealed by this process (a
    :class:`~trainstate.storage.sealed.SealInfo`), ``None`` before the first.
    """

    def __init__(self, *, digest: str = "blake3"):
        new_hasher(digest)  # an unknown algorithm is refused here, not at the first save
        self.digest = digest
        self.last: SealInfo | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if args.save_total_limit == 1:
            raise InvalidArgument(
                "save_total_limit=1 lets Trainer delete the previous checkpoint inside the save, before the new "
                "one is sealed: a kill then leaves no verified checkpoint. Use save_total_limit=2 or more (Trainer "
                "then keeps the last sealed checkpoint while it writes the next), or None.")
        if args.should_save and Path(args.output_dir).is_dir():
            remove_temp_files(args.output_dir)  # a pointer move that was interrupted
            _set_aside_newer(Path(args.output_dir), state.global_step)

    def on_save(self, args, state, control, **kwargs):
        _wait_for_every_rank(args)  # every rank has written its own RNG file before rank 0 seals the folder
        if not args.should_save:
            return
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if not folder.is_dir():
            raise GenerationNotFound(
                f"{folder} does not exist after Trainer's save; DurableCheckpoints seals checkpoints in "
                "args.output_dir (hyperparameter-search trials write elsewhere and are not supported)")
        self.last = seal_folder(folder, digest=self.digest, meta={"global_step": state.global_step})
        size, seconds = self.last.seal.size, self.last.seconds
        log.info("sealed %s: %d files, %d bytes in %.3f s (%.2f GB/s)", folder.name, len(self.last.seal.files), size,
                 seconds, size / max(seconds, 1e-9) / 1e9)


def _set_aside_newer(output_dir: Path, step: int) -> None:
    """Rename every ``checkpoint-M`` with M > ``step`` out of Trainer's sight, keeping it as evidence."""
    ops = PosixOps()
    moved = False
    for name in _checkpoints(output_dir):
        if _step(name) <= step:
            break
        reason = "abandoned" if (output_dir / name / SEAL).exists() else "incomplete"
        aside = aside_name(reason, name)  # the pattern `trainstate discard OUTPUT_DIR` recognises
        ops.rename(output_dir / name, output_dir / aside)
        moved = True
        log.warning("moved %s aside to %s: this run is at step %d, and Trainer would rewrite it in place", name, aside,
                    step)
    if moved:
        ops.fsync_dir(output_dir)


def _wait_for_every_rank(args) -> None:
    if args.world_size > 1:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            if dist.get_backend() == "nccl":  # NCCL's barrier must be told the device, or it guesses one by rank
                import torch

                dist.barrier(device_ids=[torch.cuda.current_device()])
            else:
                dist.barrier()
