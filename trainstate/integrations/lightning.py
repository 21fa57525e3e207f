"""Lightning: durable, verified, pickle-free checkpoints and an exact resume, in two lines.

::

    from trainstate.integrations.lightning import TrainStateCallback, TrainStateCheckpointIO

    trainer = L.Trainer(..., plugins=[TrainStateCheckpointIO()], callbacks=[TrainStateCallback(), checkpointing])
    trainer.fit(model, train_dataloaders=loader, ckpt_path="last")

What Lightning 2.x leaves out, and what each part adds:

- Its ``TorchCheckpointIO`` writes a ``torch.save`` pickle with no fsync and
  loads it with ``torch.load``. :class:`TrainStateCheckpointIO` turns the
  checkpoint dict into a trainstate generation through the pickle-free codec
  (a value it cannot encode is refused at save time, naming its key path),
  publishes it through :class:`~trainstate.CheckpointManager` (staged,
  fsynced, committed by rename, verified, ``latest`` moved, pruned), and
  leaves at the ``.ckpt`` path a small JSON entry naming the generation
  (:mod:`trainstate.integrations.lightning_entry`), written atomically and
  durably. Lightning's own discovery keeps working on those entries:
  ``ckpt_path="last"`` picks the newest ``last*.ckpt`` by mtime, and
  ``save_top_k`` pruning calls :meth:`remove_checkpoint`, which drops the
  entry and the pin that kept its generation; a link made valid by each
  generation's commit lets it find the run at every moment of a save.
- ModelCheckpoint saves the top-k file and then ``last.ckpt`` from one state:
  the second save is an entry naming the first's generation (one
  generation, not two writes). A second save at the same global step whose
  state differs (``trainer.save_checkpoint`` after ``fit``, once the loops
  have finished) is published as a revision of that step
  (``gen-<step>-r001``), which supersedes the first; its entry names it.
- Loading verifies the generation an entry names before anything is
  returned; an entry named ``last*.ckpt`` loads the run's recovery point
  (what ``latest`` names, which is never older than the entry's, since the
  entry is written after ``latest`` moves). A damaged generation falls back
  to the newest that verifies, as :meth:`~trainstate.CheckpointManager.restore`
  does, with a WARNING and the rejections in :attr:`TrainStateCheckpointIO.last_restore`.
- Lightning keeps no RNG state. :class:`TrainStateCallback` saves every
  stream (Python ``random``, NumPy's global, torch CPU and each CUDA device,
  plus the named generators given to it) and restores them at the first
  training batch after a resume, just before ``training_step`` draws (or,
  resumed from the final step, when the fit ends).
- The data position: Lightning saves and restores any train dataloader with
  ``state_dict``/``load_state_dict`` (inside ``loops.fit_loop``), and
  :class:`~trainstate.ResumableLoader` is one, so its epoch and cursor resume
  exactly. The callback warns (``ContinuationWarning``) at train start when a
  train dataloader keeps no position.

``lightning.pytorch`` (the ``lightning`` package) is what this module
imports. With the standalone ``pytorch_lightning`` package installed too, the
plugin is also registered as a ``pytorch_lightning`` ``CheckpointIO`` when
``pytorch_lightning`` was imported first, and the
callback works there when passed in a list (Lightning calls callback hooks by
name). Single process only for now (``devices=1``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import logging
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

try:
    from lightning.fabric.plugins import CheckpointIO
    from lightning.pytorch import Callback
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("trainstate.integrations.lightning needs Lightning 2.x: "
                      "pip install 'trainstate[lightning]'") from exc

from ..errors import (ContinuationWarning, CorruptGeneration, DirectoryLocked, ExistingRun, GenerationExists,
                      GenerationNotFound, InvalidArgument, InvalidType, NoValidGeneration, PinNotFound,
                      ReadOnlyDirectory, Rejection)
from ..format.codec import TensorTable, encode
from ..format.manifest import parse_generation_name
from ..lifecycle.incremental import DEFAULT_FULL_EVERY
from ..format.signing import SigningKey
from ..lifecycle.retention import Retention
from ..manager import CheckpointManager
from ..records import GenerationInfo, RestoreInfo
from ..state import rng as rng_mod
from ..state.train_state import TrainState
from .lightning_entry import (MAX_ENTRY_BYTES, PUBLISHED_FOR, TMP, Entry, apply_overrides, bridge_ahead, bridged,
                              entry_bytes, fsync_dir, is_last, last_entry, looks_like_entry, parse_entry, pin_name,
                              local_path, read_entry, referenced_paths, same_state_overrides, settle_bridges,
                              unlink_durably, write_durably)

__all__ = ["TrainStateCallback", "TrainStateCheckpointIO"]
log = logging.getLogger("trainstate")
_REMOVING = ".trainstate-removing"


class LightningCheckpoint:
    """The component that carries Lightning's checkpoint dict through a save or a restore."""

    def __init__(self) -> None:
        self.value: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any] | None:
        return self.value

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.value = saved


@dataclass(frozen=True)
class _Published:
    """The generation this plugin published last, and the encoded checkpoint it holds (tensors by name)."""

    step: int
    run: str
    info: GenerationInfo
    skeleton: Any


class TrainStateCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves each checkpoint as a durable, verified trainstate generation.

    >>> trainer = L.Trainer(plugins=[TrainStateCheckpointIO()], callbacks=[TrainStateCallback(), ...])

    ``directory`` is the run directory holding the generations; by default
    the directory of the first checkpoint path used (ModelCheckpoint's
    ``dirpath``), so the generations sit beside the ``.ckpt`` entries and
    ``trainstate ls DIR`` shows them. ``keep_last``/``retention``,
    ``digest``, ``verify``, ``signing_key`` and ``full_every`` (incremental
    generations: a frozen base is linked, not rewritten) are
    :class:`~trainstate.CheckpointManager`'s; every generation an entry
    names is pinned (``lightning-<file>-<hash>``) so retention never prunes
    what Lightning still points at. ``last_restore`` holds the
    :class:`~trainstate.RestoreInfo` of the last load.

    An entry is written after its generation's commit (it must never name
    what does not exist), and ModelCheckpoint writes the top-k file before
    ``last.ckpt``: a kill in between left a generation no ``last*.ckpt``
    named, and every restart with ``ckpt_path="last"`` trained from step 0
    into :class:`~trainstate.ExistingRun`. So the name Lightning searches for
    is written *before* the commit and made valid *by* it: a symbolic link
    ``last.trainstate-gen-<step>.ckpt`` -> ``gen-<step>``, which that search
    takes (any existing ``last*.ckpt``) from the rename that commits the
    generation on, and not before. A kill anywhere in a save leaves no new
    generation and no valid new link, or both. One link per directory stays,
    to the newest generation; it loads as ``last.ckpt`` would. A generation
    also records the path it was saved for, so a top-k name such a kill lost
    is written again when the resumed state refers to it.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, keep_last: int | None = None,
                 retention: Retention | None = None, digest: str = "blake3", verify: str = "fast",
                 signing_key: SigningKey | bytes | str | None = None,
                 full_every: int | None = DEFAULT_FULL_EVERY):
        self.directory = None if directory is None else os.path.abspath(local_path(directory))
        self._options: dict[str, Any] = {"keep_last": keep_last, "retention": retention, "digest": digest,
                                         "verify": verify, "signing_key": signing_key, "full_every": full_every}
        self._manager: CheckpointManager | None = None
        self._run: str | None = None
        self._holder = LightningCheckpoint()
        self._state = TrainState(lightning=self._holder, capture_global_rngs=False)  # the callback owns RNG
        self._published: _Published | None = None
        self._resumed_at: int | None = None  # the step last loaded, until the first save after it
        self.last_restore: RestoreInfo | None = None

    # Lightning's interface -----------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Publish ``checkpoint`` as the generation of its global step, then point ``path`` at it."""
        if storage_options is not None:
            raise InvalidType("TrainStateCheckpointIO takes no storage_options; configure the run directory "
                              "through TrainStateCheckpointIO(...) instead")
        target = os.path.abspath(local_path(path))
        step = checkpoint.get("global_step") if isinstance(checkpoint, dict) else None
        if type(step) is not int or step < 0:
            raise InvalidArgument(f"a Lightning checkpoint carries its global_step as a non-negative int; got "
                                  f"{step!r} for {target}")
        if "optimizer_states" not in checkpoint:
            raise InvalidArgument(
                f"{target}: a weights-only Lightning checkpoint (ModelCheckpoint(save_weights_only=True)) is not a "
                "restart point and TrainStateCheckpointIO does not store one; save full checkpoints, or export "
                "weights from a generation with `trainstate export`")
        manager = self._open(self.directory or self._run or os.path.dirname(target))
        skeleton = encode(checkpoint, "lightning", TensorTable())  # refuses what no save could store, by key path
        info, overrides = self._already_published(step, skeleton, target)
        if info is None:
            info = self._publish(manager, checkpoint, step, target)
            self._published = _Published(step, self._run, info, skeleton)
        assert self._run is not None
        entry = Entry(os.path.relpath(self._run, os.path.dirname(target)), info.name, info.manifest_digest, step,
                      overrides)
        # Pinned before the entry exists, so no entry ever names a generation retention could prune.
        manager.pin(pin_name(os.path.relpath(target, self._run)), info.name)
        write_durably(target, entry_bytes(entry))
        settle_bridges(os.path.dirname(target), self._run, info.name)

    def _already_published(self, step: int, skeleton: Any, target: str) -> tuple[GenerationInfo | None, tuple]:
        """The generation this plugin just published, when ``checkpoint`` is its state again (ModelCheckpoint's
        ``last.ckpt`` after its top-k file), with the paths that changed as the entry's overrides."""
        last = self._published
        if last is None or last.step != step or last.run != self._run:
            return None, ()
        try:
            overrides = same_state_overrides(last.skeleton, skeleton, last.info.name)
        except GenerationExists as exc:  # another state at this step (a save after fit): a revision
            log.info("%s: %s; publishing it as a revision of that step", target, str(exc).split(". ")[0])
            return None, ()
        log.info("%s names %s, which already holds global step %d: no second generation written", target,
                 last.info.name, step)
        return last.info, overrides

    def _publish(self, manager: CheckpointManager, checkpoint: dict[str, Any], step: int,
                 target: str) -> GenerationInfo:
        """Publish ``checkpoint`` as a new generation recording ``target``; Lightning finds it from its commit on."""
        assert self._run is not None
        self._holder.value = {**checkpoint, PUBLISHED_FOR: os.path.relpath(target, self._run)}
        self._state.next_update = step
        self._leave_abandoned_timeline(manager)
        bridge = bridge_ahead(manager.store.generations(), os.path.dirname(target), self._run, step)
        try:
            return manager.save(self._state)
        except ExistingRun as exc:
            raise ExistingRun(f"{exc} With Lightning: resume with trainer.fit(..., ckpt_path=\"last\"), or "
                              f"ckpt_path={self._run!r} (the run directory: its recovery point, even when no "
                              "last.ckpt names it), or give ModelCheckpoint another dirpath.") from None
        finally:
            self._holder.value = None
            if bridge is not None and not os.path.exists(bridge):  # nothing was committed: the link names nothing
                unlink_durably([bridge])

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """The checkpoint dict of the generation ``path`` names, verified (``weights_only`` is moot: no pickle).

        ``path`` may also be the run directory: its recovery point loads even
        when no ``.ckpt`` entry names it. A ``last.trainstate-gen-….ckpt``
        link loads as the ``last*.ckpt`` entry beside it would, or the
        recovery point when there is none yet.
        """
        target = os.path.abspath(local_path(path))
        entry, manager, wanted = self._resolve(target)
        info = self._restore(manager, wanted, target)
        checkpoint, self._holder.value = self._holder.value, None
        if not isinstance(checkpoint, dict):
            raise CorruptGeneration(info.generation.name, "holds no Lightning checkpoint")
        published_for = checkpoint.pop(PUBLISHED_FOR, None)
        if entry is not None and info.generation.name == entry.generation:
            if info.generation.manifest_digest == entry.manifest_digest:
                apply_overrides(checkpoint, entry.overrides, target)
            else:
                log.warning("%s: %s was published again since this entry was written; loaded the verified one "
                            "there now", target, entry.generation)
        self._name_again(manager, info.generation, published_for, checkpoint)
        self._published = None
        self._resumed_at = info.generation.next_update
        return _to_device(checkpoint, map_location)

    def _resolve(self, target: str) -> tuple[Entry | None, CheckpointManager, str | None]:
        """What ``target`` loads: its entry (if any), its run's manager, the generation it wants (None: the
        recovery point, as for ``last*.ckpt``)."""
        if bridged(os.path.basename(target)) and os.path.islink(target):
            beside = last_entry(os.path.dirname(target))
            if beside is None:  # a kill before the first last.ckpt: the run the link points into
                generation = os.path.normpath(os.path.join(os.path.dirname(target), os.readlink(target)))
                return None, self._open(os.path.dirname(generation)), None
            target = beside
        if os.path.isdir(target):  # the run directory itself: its recovery point, with or without any entry
            return None, self._open(target), None
        entry = read_entry(target)
        manager = self._open(os.path.normpath(os.path.join(os.path.dirname(target), entry.run)))
        return entry, manager, None if is_last(os.path.basename(target)) else entry.generation

    def _name_again(self, manager: CheckpointManager, generation: GenerationInfo, published_for: Any,
                    checkpoint: dict[str, Any]) -> None:
        """Write again the entry (the path ``generation`` records) that a kill lost between its commit and it:
        only where no file is, when the loaded state refers to it (or its ``best_model_path`` would name a
        missing file), and when this process can take the run's lock (a ``validate`` beside a fit cannot)."""
        if type(published_for) is not str or self._run is None:
            return
        path = os.path.normpath(os.path.join(self._run, published_for))
        if os.path.lexists(path) or path not in {os.path.abspath(p) for p in referenced_paths(checkpoint)}:
            return
        try:
            manager.store.lock()
        except (DirectoryLocked, ReadOnlyDirectory) as exc:
            log.info("%s is missing; not written again by this process: %s", path, exc)
            return
        manager.pin(pin_name(published_for), generation.name)
        write_durably(path, entry_bytes(Entry(os.path.relpath(self._run, os.path.dirname(path)), generation.name,
                                              generation.manifest_digest, generation.next_update)))
        log.warning("%s was lost by a kill between the commit of %s and its entry; written again", path,
                    generation.name)

    def remove_checkpoint(self, path: Any) -> None:
        """Drop the entry at ``path`` and its pin; retention prunes the generation once nothing keeps it.

        The entry is first renamed out of Lightning's sight (``.<name>.trainstate-removing``), then
        unpinned, then deleted; a removal a crash interrupted is finished when the run is next opened.
        """
        target = os.path.abspath(local_path(path))
        try:
            with open(target, "rb") as stream:
                head = stream.read(MAX_ENTRY_BYTES + 1)
        except (FileNotFoundError, IsADirectoryError):
            return
        directory = os.path.dirname(target)
        if not looks_like_entry(head):  # not ours (a file from before): removed as TorchCheckpointIO would
            os.unlink(target)
            fsync_dir(directory)
            return
        try:
            self._open(os.path.normpath(os.path.join(directory, parse_entry(head, target).run)))
        except CorruptGeneration as exc:
            log.info("%s: %s", target, exc)
        aside = os.path.join(directory, f".{os.path.basename(target)}{_REMOVING}")
        os.replace(target, aside)
        fsync_dir(directory)
        self._finish_removal(aside)

    def _finish_removal(self, aside: str) -> None:
        directory = os.path.dirname(aside)
        original = os.path.join(directory, os.path.basename(aside)[1:-len(_REMOVING)])
        try:
            with open(aside, "rb") as stream:
                entry = parse_entry(stream.read(MAX_ENTRY_BYTES + 1), aside)
            run = os.path.normpath(os.path.join(directory, entry.run))
            self._open(run).unpin(pin_name(os.path.relpath(original, run)))
        except (CorruptGeneration, PinNotFound) as exc:
            log.info("%s: no pin to drop (%s)", original, exc)
        try:
            os.unlink(aside)
        except FileNotFoundError:
            return  # finished already (opening another run directory finishes its interrupted removals)
        fsync_dir(directory)

    def teardown(self) -> None:
        """Release the run directory (Lightning calls this when a fit, validate or test ends)."""
        if self._manager is not None:
            manager, self._manager = self._manager, None
            manager.close()

    # helpers -------------------------------------------------------------------
    def _open(self, run: str) -> CheckpointManager:
        run = os.path.abspath(run)
        if self._manager is not None and self._run == run:
            return self._manager
        self.teardown()
        os.makedirs(run, exist_ok=True)
        self._manager, self._run = CheckpointManager(run, **self._options), run
        for aside in sorted(glob.glob(os.path.join(glob.escape(run), f".*.ckpt{_REMOVING}"))):
            log.info("finishing the removal of %s, which a crash interrupted", aside)
            self._finish_removal(aside)
        for tmp in sorted(glob.glob(os.path.join(glob.escape(run), f".*.ckpt{TMP}*"))):
            log.info("removing %s, an entry a crash left half-written (never named by Lightning)", tmp)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # the run's lock is held: no other writer of entries here
        return self._manager

    def _leave_abandoned_timeline(self, manager: CheckpointManager) -> None:
        """The first save after loading an older checkpoint forks the run: newer entries no longer pin.

        Their generations belong to the timeline this fit left; CheckpointManager
        sets each aside (as evidence, never deleted) when the new timeline
        reaches its step, which a pin would refuse. A load without a save
        after it (validate, test) changes nothing.
        """
        resumed_at, self._resumed_at = self._resumed_at, None
        if resumed_at is None:
            return
        for pin, generation in sorted(manager.pins().items()):
            parsed = parse_generation_name(generation)
            if pin.startswith("lightning-") and parsed is not None and parsed[0] > resumed_at:
                manager.unpin(pin)
                log.warning("unpinned %s (%s): this fit resumed from step %d, leaving that timeline", generation,
                            pin, resumed_at)

    def _restore(self, manager: CheckpointManager, wanted: str | None, target: str) -> RestoreInfo:
        """``wanted`` verified and loaded, or else what restore chooses (the pointer, then the newest that verifies)."""
        rejected: tuple[Rejection, ...] = ()
        if wanted is not None:
            try:
                info = manager.restore(self._state, generation=wanted)
                if info is not None:
                    self.last_restore = info
                    return info
            except (CorruptGeneration, GenerationNotFound) as exc:
                rejected = (Rejection(wanted, str(exc)),)
                log.warning("%s names %s, which does not verify (%s); falling back to the newest generation that "
                            "does", target, wanted, exc)
        info = manager.restore(self._state)
        if info is None:
            raise NoValidGeneration(manager.store.location, [*rejected, Rejection(target, "names a generation, but "
                                                                                          "the run holds none")])
        self.last_restore = dataclasses.replace(info, rejected=rejected + info.rejected)
        return self.last_restore


class TrainStateCallback(Callback):
    """Saves every RNG stream with each Lightning checkpoint and restores them where training resumes.

    >>> trainer = L.Trainer(callbacks=[TrainStateCallback(rngs={"noise": noise_generator}), ModelCheckpoint(...)])

    ``rngs`` names generators your step draws from beyond the global ones
    (``torch.Generator``, NumPy ``Generator``/``RandomState``,
    ``random.Random``). The saved record is validated when the checkpoint
    loads (a missing or different generator raises before anything changes)
    and applied at the first training batch after it, so nothing Lightning
    does while starting up (building loaders, a sanity check) shifts the
    streams ``training_step`` draws from; a fit resumed from its final step
    has no batch left, and gets them when it ends.
    """

    def __init__(self, rngs: Mapping[str, rng_mod.Generator] | None = None):
        if rngs is not None and not isinstance(rngs, Mapping):
            raise InvalidType(f"rngs must be a mapping of names to generators, not a {type(rngs).__qualname__}")
        self.rngs: dict[str, rng_mod.Generator] = dict(rngs or {})
        for name, generator in self.rngs.items():
            rng_mod.check_generator(name, generator)
        self._pending: dict[str, Any] | None = None
        self._loaded = False
        self.restore_warnings: list[str] = []

    def state_dict(self) -> dict[str, Any]:
        return {"rng": rng_mod.capture(self.rngs, include_globals=True)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("rng") if isinstance(state_dict, dict) else None
        if not isinstance(saved, dict):
            raise CorruptGeneration("callbacks.TrainStateCallback", "holds no RNG record")
        self.restore_warnings = rng_mod.validate(saved, self.rngs, restore_globals=True)
        for message in self.restore_warnings:
            log.warning("%s", message)
        self._pending, self._loaded = saved, True

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if getattr(trainer, "ckpt_path", None) and not self._loaded:
            warnings.warn(ContinuationWarning(
                f"resumed from {trainer.ckpt_path}, which holds no TrainStateCallback state (saved without the "
                "callback): the RNG streams start where this process left them, not where the run stopped"),
                stacklevel=2)
        for loader in _leaves(getattr(trainer, "train_dataloader", None)):
            if not (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict",
                                                                                         None))):
                warnings.warn(ContinuationWarning(
                    f"the train dataloader ({type(loader).__qualname__}) keeps no position (no state_dict/"
                    "load_state_dict): a resume restarts its epoch. Use trainstate.ResumableLoader"), stacklevel=2)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._apply_pending()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """A fit resumed from its final step trains no batch: the streams still end where the run stopped."""
        self._apply_pending()

    def _apply_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            rng_mod.apply_validated(pending, self.rngs, restore_globals=True)


def _leaves(loaders: Any) -> list[Any]:
    """The dataloaders inside what ``trainer.train_dataloader`` returns (one, or a list/tuple/dict of them)."""
    if loaders is None:
        return []
    if isinstance(loaders, Mapping):
        return [leaf for v in loaders.values() for leaf in _leaves(v)]
    if isinstance(loaders, (list, tuple)):
        return [leaf for v in loaders for leaf in _leaves(v)]
    return [loaders]


def _to_device(value: Any, map_location: Any) -> Any:
    if map_location is None:
        return value
    if not isinstance(map_location, (str, torch.device)):
        raise InvalidType("TrainStateCheckpointIO.load_checkpoint takes map_location as a device (or its name)")
    if isinstance(value, torch.Tensor):
        return value.to(map_location)
    if type(value) is dict:
        return {k: _to_device(v, map_location) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_to_device(v, map_location) for v in value)
    return value


def _register_with_pytorch_lightning() -> None:
    """The standalone ``pytorch_lightning`` package has its own CheckpointIO ABC: register there too."""
    standalone = sys.modules.get("lightning_fabric.plugins")  # imported by pytorch_lightning; never imported here
    StandaloneCheckpointIO = getattr(standalone, "CheckpointIO", None)
    if StandaloneCheckpointIO is not None and StandaloneCheckpointIO is not CheckpointIO:
        StandaloneCheckpointIO.register(TrainStateCheckpointIO)


_register_with_pytorch_lightning()
