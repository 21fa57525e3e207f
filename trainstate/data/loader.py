"""ResumableLoader: a DataLoader whose position is part of the restart state.

The position is ``(epoch, cursor)``: the epoch and the number of its batches
the training loop has *received*. It is counted where batches leave the
iterator, not where the sampler produced them, so batches that workers have
prefetched but the loop has not taken are neither skipped nor repeated on
resume. The batches of an epoch come from :mod:`trainstate.data.order` (a function
of the seed and the epoch), so a resumed run rebuilds the same plan and
starts the sampler at the cursor.
"""

from __future__ import annotations

import logging
import multiprocessing
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from ..errors import (AbandonedIteratorWarning, ContinuationWarning, DataMismatch, InvalidArgument, InvalidType,
                      StaleIterator)
from . import continuation
from .continuation import with_algorithm
from .facade import EpochSampler, abandoned_message, batch_indices, build_batch
from .order import DEFAULT_ORDER, ORDERS, SORT_V1, Plan, derive, ids_digest
from .samplerng import SampleIndex
from .workers import EndWithParent, WatchGlobalDraws

log = logging.getLogger("trainstate")

_FORBIDDEN = {
    "sampler": "the loader builds its own sampler from seed, epoch and rank",
    "batch_sampler": "the loader builds its own batch sampler from seed, epoch and rank",
    "shuffle": None,  # handled: our own keyword
    "generator": "worker seeds are derived from (seed, epoch) so that they do not consume the training RNG",
}
_POSITION_KEYS = ("epoch", "cursor", "samples_seen", "tokens_seen")


class _EpochBatches(torch.utils.data.Sampler):
    """The batch sampler handed to DataLoader: this epoch's batches, from the cursor on.

    It stays in the main process; each ``iter()`` (also a persistent-workers
    reset) reads the epoch and start that the loader prepared.
    """

    def __init__(self) -> None:
        self.epoch, self.seed, self.batches, self.start = 0, 0, [], 0

    def prepare(self, epoch: int, seed: int, batches: Sequence[np.ndarray], start: int) -> None:
        self.epoch, self.seed, self.batches, self.start = epoch, seed, batches, start

    def __iter__(self) -> Iterator[list[SampleIndex]]:
        epoch, seed, batches = self.epoch, self.seed, self.batches
        for i in range(self.start, len(batches)):
            yield batch_indices(batches, i, epoch, seed)

    def __len__(self) -> int:
        return len(self.batches) - self.start


def _distributed_default(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return (torch.distributed.get_rank() if rank is None else rank,
                torch.distributed.get_world_size() if world_size is None else world_size)
    return (0 if rank is None else rank), (1 if world_size is None else world_size)


class ResumableLoader:
    """A data loader (built on ``torch.utils.data.DataLoader``) that resumes mid-epoch, bitwise.

    Register it in the :class:`~trainstate.TrainState` like any component::

        loader = ts.ResumableLoader(dataset, batch_size=32, seed=1234, shuffle=True,
                                    num_workers=2, persistent_workers=True)
        state = ts.TrainState(model=model, optimizer=opt, data=loader)
        ckpt.restore(state)
        while state.next_update < total_updates:
            for batch in loader:          # the rest of the current epoch
                ...
                state.next_update += 1

    Iterating yields the rest of the current epoch from the cursor; the epoch
    advances when its last batch is handed out. A batch counts as consumed
    once an iterator hands it out (that is what makes a resume exact), so
    ``next(iter(loader))`` uses up a batch: a new iterator continues after it,
    with an :class:`~trainstate.errors.AbandonedIteratorWarning` unless a save
    came in between. :meth:`peek` looks at the next batch without consuming
    it. DataLoader's ``batch_size``, ``dataset``, ``drop_last`` and
    ``num_workers`` are there; ``sampler.set_epoch(e)`` is a no-op for the
    loader's own epoch and refuses any other (the loader keeps its epoch
    itself), and ``len(sampler)`` is this rank's samples per epoch. The order of each epoch is a
    function of ``(seed, epoch)``; ``rank``/``world_size`` (default: from
    ``torch.distributed`` when initialised) shard it like
    ``DistributedSampler``, with ``uneven="pad"`` (repeat the first indices so
    every rank gets as many) or ``"drop"`` (drop the tail). ``drop_last`` drops
    an incomplete last batch. Other keyword arguments go to ``DataLoader``
    (``num_workers``, ``prefetch_factor``, ``persistent_workers``,
    ``collate_fn``, ``pin_memory``, ``worker_init_fn``, ...).

    ``order`` names the algorithm of each epoch's order: ``"feistel-v1"``
    (computed per position, O(batch) at any epoch start or resume) or
    ``"splitmix64-sort-v1"`` (sorts the whole epoch; every run before
    feistel-v1). Left at None, a new run uses ``"feistel-v1"`` and a restored
    run keeps the algorithm its checkpoint recorded. A
    :class:`~trainstate.Mixture` dataset interleaves its sources instead.

    ``__getitem__`` receives a :class:`~trainstate.SampleIndex`; pass it to
    :func:`~trainstate.sample_generator` for augmentation that is identical
    after a resume. ``count_tokens(batch) -> int`` keeps a token clock counted
    at consumption. ``on_mismatch`` (``"error"`` or ``"warn"``) says what
    happens when the first batch after a restore is not the one the checkpoint
    recorded.
    """

    def __init__(self, dataset: Any, batch_size: int = 1, *, seed: int, shuffle: bool = True,
                 drop_last: bool = False, rank: int | None = None, world_size: int | None = None,
                 uneven: str = "pad", count_tokens: Callable[[Any], int] | None = None,
                 on_mismatch: str = "error", order: str | None = None, **loader_kwargs: Any):
        for key, why in _FORBIDDEN.items():
            if key in loader_kwargs:
                raise InvalidType(f"ResumableLoader does not take {key}=: {why or 'pass it as a keyword of its own'}")
        if loader_kwargs.get("in_order") is False:
            raise InvalidArgument("in_order=False hands out batches in completion order, so the position counted at "
                             "consumption would not say which samples were used; leave in_order at True")
        if on_mismatch not in ("error", "warn"):
            raise InvalidArgument(f"on_mismatch must be 'error' or 'warn', got {on_mismatch!r}")
        try:
            length = len(dataset)
        except TypeError:
            raise InvalidType(f"the dataset ({type(dataset).__qualname__}) has no __len__; ResumableLoader needs a "
                            "map-style dataset (for an IterableDataset, keep the position in the dataset itself)"
                            ) from None
        if order is not None and order not in ORDERS:
            raise InvalidArgument(f"order must be one of {', '.join(map(repr, sorted(ORDERS)))} or None (the "
                                  f"default for a new run, the checkpoint's on resume), got {order!r}")
        rank, world_size = _distributed_default(rank, world_size)
        source = dataset.sample_order(seed, bool(shuffle)) if callable(getattr(dataset, "sample_order", None)) \
            else None
        self.plan = Plan(length, batch_size, seed, bool(shuffle), bool(drop_last), rank, world_size, uneven,
                         order or DEFAULT_ORDER, source)
        self._order_chosen = order is not None  # else a restore adopts the checkpoint's algorithm
        self._reweight: list | None = None  # saved mixture weights whose change the restore allowed
        self._rebatch: int | None = None  # the saved batch size whose change the restore allowed
        if self.plan.batches_per_epoch() == 0:
            raise InvalidArgument(f"an epoch of {length} samples over {world_size} rank(s) gives no batch of "
                             f"{batch_size} (drop_last={drop_last}); use a smaller batch_size")
        self.count_tokens = count_tokens
        self.on_mismatch = on_mismatch
        self.epoch = 0
        self.cursor = 0
        self.start = 0  # global offset into this epoch's order where this run's batches begin (after a regroup)
        self.samples_seen = 0
        self.tokens_seen = 0
        self.last_ids: np.ndarray | None = None  # sample ids of the batch last handed out
        self._global_draws_seen = False
        self._expected: dict[str, Any] | None = None  # next batch recorded by the restored generation
        self._resumed_mid_stream = False
        self._warnings: list[str] = []  # what continues only statistically since the last restore
        self._warned_draws = False
        self._active, self._live = None, None  # the newest iterator's token; its DataLoader iterator (weak)
        self._cache: tuple[tuple, Sequence[np.ndarray]] | None = None
        self._sampler = _EpochBatches()
        self._taken = 0  # batches of this epoch handed out by the latest iterator and not yet saved
        self.dataset = dataset  # the caller's, as DataLoader.dataset; workers see a wrapper
        workers = loader_kwargs.get("num_workers", 0)
        self._flag = None
        if workers:
            context = loader_kwargs.get("multiprocessing_context")
            ctx = multiprocessing.get_context(context) if isinstance(context, (str, type(None))) else context
            self._flag = ctx.RawValue("b", 0)
            dataset = WatchGlobalDraws(dataset, self._flag)
            loader_kwargs["worker_init_fn"] = EndWithParent(loader_kwargs.get("worker_init_fn"))
        self.loader = DataLoader(dataset, batch_sampler=self._sampler, **loader_kwargs)

    # iteration ---------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return self.plan.batches_per_epoch()

    def epoch_batches(self, epoch: int) -> Sequence[np.ndarray]:
        """The sample ids of every batch of ``epoch`` on this rank: a lazy sequence (no data is loaded)."""
        start = self.start if epoch == self.epoch else 0
        if self._cache is None or self._cache[0] != (epoch, start, self.plan):
            self._cache = ((epoch, start, self.plan), self.plan.batches(epoch, start))
        return self._cache[1]

    batch_size = property(lambda self: self.plan.batch_size, doc="Samples per batch on this rank, as DataLoader's.")
    drop_last = property(lambda self: self.plan.drop_last, doc="Whether an incomplete last batch is dropped.")
    num_workers = property(lambda self: self.loader.num_workers, doc="The DataLoader's worker processes.")
    # Made per access: a stored one would put the loader in a cycle, and gc frees a cycle's workers seconds late.
    sampler = property(EpochSampler, doc="What a DistributedSampler answers, from the loader (``set_epoch``, ...).")

    def close(self) -> None:
        """Stop the DataLoader's worker processes now (persistent ones too); a later ``iter()`` starts new ones."""
        iterators = {id(i): i for i in (self.loader._iterator, self._live and self._live()) if i is not None}
        self.loader._iterator, self._live, self._active = None, None, None  # an older iterator is stale from now
        for iterator in iterators.values():
            getattr(iterator, "_shutdown_workers", lambda: None)()

    def __iter__(self) -> Iterator[Any]:
        if self._taken:
            self._warn_abandoned()
        token = object()
        self._active = token
        epoch, batches = self.epoch, self.epoch_batches(self.epoch)
        self._sampler.prepare(epoch, self.plan.seed, batches, self.cursor)
        # Worker seeds (and a num_workers=0 loader's base seed) come from this
        # generator, not from torch's global one, which the training step owns.
        self.loader.generator = torch.Generator().manual_seed(derive("workers", self.plan.seed, epoch) >> 1)
        it = iter(self.loader)
        self._live = weakref.ref(it)  # for close(); a weak one, so a dropped iteration still ends its workers
        return self._consume(token, epoch, batches, it)

    def _consume(self, token: object, epoch: int, batches: list[np.ndarray], it: Iterator[Any]) -> Iterator[Any]:
        while True:
            # Checked before taking a batch: with persistent workers every iter() of the DataLoader returns the
            # same underlying iterator, so a stale one would take the live one's next batch.
            if self._active is not token:
                raise StaleIterator("this ResumableLoader iterator is stale: the loader was iterated again or "
                                   "restored since it started; take batches from the newest iterator only")
            try:
                batch = next(it)
            except StopIteration:
                break
            if self.epoch != epoch or self.cursor >= len(batches):
                raise DataMismatch("the DataLoader yielded more batches than the epoch plan holds")
            ids = batches[self.cursor]
            if self._expected is not None:
                self._check_expected(epoch, self.cursor, ids)
            self.cursor += 1
            self._taken += 1
            self.samples_seen += len(ids)
            if self.count_tokens is not None:
                self.tokens_seen += int(self.count_tokens(batch))
            self.last_ids = ids
            if self.cursor == len(batches):
                self.epoch, self.cursor, self.start, self._taken = epoch + 1, 0, 0, 0
            self._note_global_draws()
            yield batch
        if self._active is token and self.epoch == epoch:
            raise DataMismatch(f"the DataLoader stopped after batch {self.cursor} of {len(batches)} in epoch {epoch}")

    def peek(self) -> Any:
        """The batch the next iteration hands out first, without consuming it.

        Position, epoch and every RNG stay as they were (see
        :func:`~trainstate.data.facade.build_batch`). Use it where a DataLoader
        script peeks with ``next(iter(loader))``, which here consumes a batch.
        """
        indices = batch_indices(self.epoch_batches(self.epoch), self.cursor, self.epoch, self.plan.seed)
        return build_batch(self.dataset, indices, self.loader.collate_fn)

    def _warn_abandoned(self) -> None:
        taken, self._taken = self._taken, 0
        message = abandoned_message(self.epoch, self.cursor, taken)
        warnings.warn(message, AbandonedIteratorWarning, stacklevel=3)
        log.warning("%s", message)

    def replay(self, epoch: int = 0) -> Iterator[Any]:
        """Iterate all of ``epoch`` without moving the position: for a fixed validation pass.

        The same batches, and the same per-sample generators, every time.
        Combine with :func:`~trainstate.evaluating` so the pass consumes no
        training RNG.
        """
        batches = self.epoch_batches(epoch)
        self._active = None  # a training iterator cannot continue across a replay of the same sampler
        self._sampler.prepare(epoch, self.plan.seed, batches, 0)
        self.loader.generator = torch.Generator().manual_seed(derive("workers", self.plan.seed, epoch) >> 1)
        yield from self.loader

    # position ----------------------------------------------------------------
    def next_batch(self) -> dict[str, Any]:
        """Where the next batch comes from, with the fingerprint of its sample ids."""
        ids = self.epoch_batches(self.epoch)[self.cursor]
        return {"epoch": self.epoch, "cursor": self.cursor, "size": len(ids),
                "ids_digest": ids_digest(self.epoch, self.cursor, ids)}

    def data_position(self) -> dict[str, Any]:
        """Recorded in each generation's manifest and shown by ``trainstate inspect``."""
        return {"epoch": self.epoch, "cursor": self.cursor, "batches_per_epoch": len(self),
                "samples_seen": self.samples_seen, "tokens_seen": self.tokens_seen,
                "next_batch": self.next_batch()["ids_digest"]}

    def data_contract(self) -> dict[str, Any]:
        """What gives the position its meaning; part of the experiment contract as ``loader.<name>``."""
        return self.plan.as_dict()

    def state_dict(self) -> dict[str, Any]:
        """The position (epoch, cursor, counters), the plan and the next batch's fingerprint, as a component."""
        self._taken = 0  # saved: the batches handed out so far are recorded as used
        saved = {"epoch": self.epoch, "cursor": self.cursor, "samples_seen": self.samples_seen,
                 "tokens_seen": self.tokens_seen, "plan": self.plan.as_dict(), "next_batch": self.next_batch(),
                 "worker_global_draws": self._global_draws()}
        if self.start:  # only after a reshard to another world size or a change of batch size, mid-epoch
            saved["start"] = self.start
        if self.plan.source is not None and len(self.plan.source.segments) > 1:  # after a mixture reweight
            saved["mixture_segments"] = self.plan.source.saved_segments()
        return saved

    def check_state_dict(self, saved: Any) -> None:
        """Raise :class:`DataMismatch` if ``saved`` cannot be this loader's position; changes nothing."""
        if type(saved) is not dict or not all(type(saved.get(k)) is int and saved[k] >= 0 for k in _POSITION_KEYS):
            raise DataMismatch(f"not a ResumableLoader state: expected non-negative ints {_POSITION_KEYS}")
        plan = saved.get("plan")
        if type(plan) is not dict:
            raise DataMismatch("the saved loader state has no plan")
        plan = with_algorithm(plan)
        resumed, reweighted = self._resumed_plan(saved)
        if self._rebatching(plan):  # the position is checked in its own batches; load_state_dict regroups it
            resumed = replace(resumed, batch_size=plan["batch_size"])
        live = resumed.as_dict()
        if reweighted:  # allowed by the restore: the new weights continue the saved position
            plan = {**plan, "mixture": {**plan["mixture"], "weights": live["mixture"]["weights"]}}
        changed = [f"{k}: checkpoint {plan.get(k)!r}, this run {live.get(k)!r}" for k in sorted(set(live) | set(plan))
                   if plan.get(k) != live.get(k)]
        if changed:
            raise DataMismatch(
                "the data plan differs from the checkpoint's, so its position would name other samples: "
                + "; ".join(changed) + ". Construct the loader with the saved values to resume; a deliberate "
                "change needs a new run (warm_start the weights).")
        start = saved.get("start", 0)
        if type(start) is not int or not 0 <= start < self.plan.dataset_len:
            raise DataMismatch(f"malformed epoch start {start!r:.40}")
        batches = resumed.batches_per_epoch(start)
        if saved["cursor"] >= batches:
            raise DataMismatch(f"cursor {saved['cursor']} is not below the {batches} batches of the epoch")
        expected = saved.get("next_batch")
        if type(expected) is not dict or (expected.get("epoch"), expected.get("cursor")) != (
                saved["epoch"], saved["cursor"]):
            raise DataMismatch("the saved next-batch fingerprint does not match the saved position")

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from a saved position (``check_state_dict`` refuses one that does not fit this loader).

        After a restore that allowed a change of batch size
        (``allow_changes=["loader.<name>.batch_size"]``) the saved position is
        continued from the samples consumed, in batches of this loader's size.
        """
        self.check_state_dict(saved)
        regrouped = []
        if self._rebatching(saved["plan"]):
            plan, _ = self._resumed_plan(saved)
            position = (saved["epoch"], saved["cursor"], saved.get("start", 0))
            saved, regrouped = continuation.continued(plan, saved["plan"], position, saved["samples_seen"],
                                                      saved["tokens_seen"], bool(saved.get("worker_global_draws")))
        self.plan, reweighted = self._resumed_plan(saved)
        self._reweight, self._rebatch = None, None
        self.epoch, self.cursor, self.start = saved["epoch"], saved["cursor"], saved.get("start", 0)
        self.samples_seen, self.tokens_seen = saved["samples_seen"], saved["tokens_seen"]
        # after an allowed reweight the next batch is deliberately another one than the checkpoint recorded
        self._expected = None if reweighted else dict(saved["next_batch"])
        self._active, self._taken = None, 0
        self._warnings = regrouped
        self._warned_draws = False
        self._global_draws_seen = bool(saved.get("worker_global_draws"))
        workers = self.loader.num_workers
        self._resumed_mid_stream = bool(workers) and (self.cursor > 0 or self.start > 0
                                                           or self.loader.persistent_workers)
        self._note_global_draws()

    def resharded_state(self, saved: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
        """This loader's state continuing a run saved at another world size, and what continues inexactly.

        ``saved`` holds every old rank's state. All ranks consumed the same
        number of batches of the same epoch, so the samples consumed are a
        prefix of the epoch's global order; the returned state continues it
        from there, sharded over this loader's world size. Exact when the
        global batch size (per-rank batch size times world size) is
        unchanged: the same samples in the same order, grouped into the same
        updates (an epoch's short last update, when the dataset length is not
        a multiple of the global batch, is padded or dropped for the new
        ranks). Otherwise the samples still come in the same order, grouped
        into updates of another size. Changes nothing; ``load_state_dict``
        applies it. The contract decides which batch sizes may change
        (:func:`trainstate.state.contract.check`).
        """
        if not saved or not all(type(s) is dict for s in saved):
            raise DataMismatch("no saved loader positions to reshard from")
        if type(saved[0].get("plan")) is not dict:
            raise DataMismatch("the saved loader state has no plan")
        try:
            plan, reweighted = self._resumed_plan(saved[0])  # adopted order; a mixture's segments
        except (KeyError, TypeError):
            raise DataMismatch("not ResumableLoader states") from None
        position, samples, tokens = continuation.common_position(saved, plan.as_dict(), reweighted)
        return continuation.continued(plan, with_algorithm(saved[0]["plan"]), position, samples // plan.world_size,
                                      tokens // plan.world_size, any(s.get("worker_global_draws") for s in saved))

    def settle_contract(self, saved: Any, allowed: Callable[[str], bool] | None = None) -> None:
        """Called by a restore before it compares contracts, with this loader's saved plan.

        A loader whose ``order`` was left at None takes the algorithm the
        checkpoint recorded, so a run saved under ``splitmix64-sort-v1``
        continues with it; a saved plan without an algorithm name (written
        before there was a choice) is normalised, in place, to the sort.
        Every other difference is the contract's (and then
        :meth:`check_state_dict`'s) to refuse. ``allowed(key)`` says whether
        the restore's ``allow_changes`` accept a change of plan key ``key``.
        """
        self._rebatch = None
        if type(saved) is not dict:
            return
        if "algorithm" not in saved:  # written before the algorithm was named: normalised where it lies
            saved["algorithm"] = SORT_V1
        self.plan = self._plan_for(saved)
        mixture = saved.get("mixture")
        if self.plan.source is not None and type(mixture) is dict and allowed is not None \
                and allowed("mixture.weights") and mixture.get("weights") != list(self.plan.source.weights):
            self._reweight = mixture.get("weights")  # load_state_dict starts a segment with this run's weights
        batch = saved.get("batch_size")
        if allowed is not None and allowed("batch_size") and type(batch) is int and 0 < batch != self.plan.batch_size:
            self._rebatch = batch  # load_state_dict continues the position in batches of this run's size

    def _rebatching(self, saved_plan: dict[str, Any]) -> bool:
        """Whether ``saved_plan`` differs in the batch size the restore allowed to change, at this world size (at
        another, :meth:`resharded_state` continues the position)."""
        return self._rebatch is not None and saved_plan.get("batch_size") == self._rebatch \
            and saved_plan.get("world_size") == self.plan.world_size

    def _resumed_plan(self, saved: dict[str, Any]) -> tuple[Plan, bool]:
        """The plan that continues ``saved`` (adopted order, mixture segments), and whether it reweights."""
        plan = self._plan_for(with_algorithm(saved["plan"]))
        source, mixture = plan.source, saved["plan"].get("mixture")
        if source is None or type(mixture) is not dict:
            return plan, False
        try:
            old = replace(source, weights=tuple(mixture["weights"]), segments=())
            if saved.get("mixture_segments") is not None:
                old = old.with_segments(saved["mixture_segments"])
                source = source.with_segments(saved["mixture_segments"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DataMismatch(f"malformed saved mixture state: {exc}") from None
        if self._reweight is None or self._reweight != mixture["weights"] or list(source.weights) == mixture["weights"]:
            return replace(plan, source=source), False
        consumed = saved.get("start", 0) + saved["cursor"] * saved["plan"]["batch_size"] * saved["plan"]["world_size"]
        return replace(plan, source=old.reweighted(saved["epoch"] * source.length + consumed, source.weights)), True

    def _plan_for(self, saved: dict[str, Any]) -> Plan:
        """This loader's plan, with the saved order algorithm when this run left ``order`` at None."""
        algorithm = saved.get("algorithm")
        if self._order_chosen or algorithm not in ORDERS or algorithm == self.plan.algorithm:
            return self.plan
        if self.plan.source is not None and algorithm == SORT_V1:
            return self.plan  # a mixture's plan never recorded the sort; the comparison names the difference
        return replace(self.plan, algorithm=algorithm)

    # checks ------------------------------------------------------------------
    def _check_expected(self, epoch: int, cursor: int, ids: np.ndarray) -> None:
        expected = self._expected
        got = ids_digest(epoch, cursor, ids)
        if (expected["epoch"], expected["cursor"], expected.get("ids_digest")) == (epoch, cursor, got):
            self._expected = None
            return
        message = (f"the first batch after restore (epoch {epoch}, batch {cursor}, {len(ids)} samples, sample-id "
                   f"fingerprint {got}) is not the one the checkpoint recorded (epoch {expected['epoch']}, batch "
                   f"{expected['cursor']}, {expected.get('size')} samples, fingerprint {expected.get('ids_digest')}): "
                   "the data pipeline changed (dataset, order, seed, batch size or world size)")
        if self.on_mismatch == "warn":
            self._expected = None
            self._warnings.append(message)
            warnings.warn(message, ContinuationWarning, stacklevel=3)
            log.warning("%s", message)
            return
        raise DataMismatch(message)  # and again on every try, until the loader is rebuilt or restored

    def _global_draws(self) -> bool:
        return self._global_draws_seen or bool(self._flag is not None and self._flag.value)

    def restore_warnings(self) -> list[str]:
        """What continues only statistically since the last restore (also warned once, as it is found)."""
        return list(self._warnings)

    def _note_global_draws(self) -> None:
        if self._warned_draws or not self._resumed_mid_stream or not self._global_draws():
            return
        self._warned_draws = True
        message = ("the dataset draws from the DataLoader workers' global RNG (random, numpy.random or torch), "
                   "and this run resumed in the middle of a worker stream: those draws continue statistically, "
                   "not bitwise. Draw per-sample randomness from ts.sample_generator(index) for a bitwise resume.")
        self._warnings.append(message)
        warnings.warn(message, ContinuationWarning, stacklevel=3)
        log.warning("%s", message)
