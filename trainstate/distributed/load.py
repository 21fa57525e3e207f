"""The multi-rank restore, top to bottom.

1. **choose**: rank 0 orders the candidates (the pointer, then newest
   first, with the rollback and run checks of a single process) and names
   them one at a time; every rank opens and holds every file of the
   candidate, checks its structure and digests its share of the files; all
   agree. A damaged generation on any rank makes every rank pass over it
   together.
2. **check**, before any live object changes: the contract (with the world
   size), the components, the RNG records; all ranks agree.
3. **load**: the sharded part through DCP (reading the held files, so what
   loads is what was verified: in place, into the live tensors where the state dict holds them), then
   ``set_model_state_dict`` (for a module only where the load did not write its tensors in place) /
   ``set_optimizer_state_dict``; then everything else, RNG last.

At another world size (``allow_changes=["world_size"]``) the model and
optimizer reshard exactly through DCP; a :class:`~trainstate.ResumableLoader`
continues the same global sample order; per-rank RNG streams cannot be mapped
onto other ranks, so they are left as they are and the continuation is
reported as statistical.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

from ..errors import (CheckpointFailed, CorruptGeneration, NoValidGeneration, PointerRollback, Rejection,
                      StateMismatch, TrainStateError)
from ..records import GenerationInfo, RestoreInfo
from ..format.manifest import MAX_DCP_METADATA_BYTES
from ..lifecycle.candidates import Candidates, candidates, check_run, expected_run
from ..restore import HeldFiles, continue_lineage
from ..state.usable import mark_unusable, mark_usable, telling_unusable, unusable
from ..state import contract as contract_mod
from ..state import snapshot
from ..state.train_state import TrainState
from ..storage.chunked import Progress
from ..storage.fetched import Fetched
from ..storage.verify import decode_verified, read_json_file, verify_generation
from .capture import contract_fields, loaded_in_place, sharded_state
from .commit import share_of, verify_share
from .group import Ranks
from .payload import check_sharded, merge, rank_record, sharded_record
from .planner import LoadPlanner
from .share import fetch_share, problem_of, raise_unavailable
from .storage import DCP_METADATA, Reader, metadata_from_json

log = logging.getLogger("trainstate")


class _Partial:
    """``state`` without its sharded components (and, at another world size, without its RNG streams)."""

    def __init__(self, state: TrainState, sharded: Iterable[str], keep_rng: bool = True):
        sharded = set(sharded)
        object.__setattr__(self, "_state", state)
        object.__setattr__(self, "components", {n: c for n, c in state.components.items() if n not in sharded})
        object.__setattr__(self, "rngs", state.rngs if keep_rng else {})
        object.__setattr__(self, "capture_global_rngs", state.capture_global_rngs and keep_rng)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._state, name, value)

    def modules(self) -> dict[str, torch.nn.Module]:
        return {n: c for n, c in self.components.items() if isinstance(c, torch.nn.Module)}


def restore(state: TrainState, ranks: Ranks, store: Any, key: Any, *, generation: str | None = None,
            allow_changes: Iterable[str] = (), statistical_cuda: bool = False, one_pass: bool = True
            ) -> tuple[RestoreInfo | None, tuple[Rejection, ...]]:
    """Every rank calls it; see the module docstring. ``one_pass=False`` (``restore(in_place=False)``): every
    shard is digested before anything loads, then read again by DCP, so that damage found anywhere leaves every
    live tensor as it was (twice the reads)."""
    allow = [allow_changes] if isinstance(allow_changes, str) else list(allow_changes)
    remote = getattr(store, "remote", False)
    held = Fetched(store) if remote else HeldFiles(store)
    if remote:  # a shard that one rank alone reads whole: read as it loads, one pass (share.fetch_share)
        held.offers_direct = one_pass
    failed: list[Rejection] = []  # generations whose one-pass load found damage after the choice
    with untouched_unless_loaded(state) as loading:
        try:
            while True:
                templates = _templates(state) if remote else None
                with telling_unusable(state, failed, held.location):
                    chosen, rejected = _choose(held, ranks, key, generation, templates, failed, one_pass)
                rejected = tuple(failed) + rejected
                if chosen is None:
                    return None, rejected
                loading()
                try:
                    return _load(state, chosen, rejected, held, ranks, allow, statistical_cuda, templates), rejected
                except Damaged as exc:
                    _loaded_damage(state, chosen[0].manifest.generation, exc, failed)
                    if generation is not None:
                        raise NoValidGeneration(held.location, failed, unusable=unusable(state)) from None
        finally:
            held.close()


class Damaged(CorruptGeneration):
    """A shard failed its chunk digests while DCP loaded it (on some rank): every rank passes over the generation."""

    def __init__(self, generation: str, reason: str, live_changed: bool):
        super().__init__(generation, reason)
        self.generation, self.reason, self.live_changed = generation, reason, live_changed


def _loaded_damage(state: TrainState, name: str, exc: Damaged, failed: list[Rejection], again: bool = False) -> None:
    """Damage found while loading ``name``: rejected (in ``failed``), or with ``again`` read once more from other
    sources (a tiered restore); live tensors that took verified bytes of it make the state unusable until a load
    completes."""
    if exc.live_changed:
        mark_unusable(state, f"restoring {name} failed after verified chunks were loaded into live tensors "
                             f"({exc.reason})")
    if again:
        log.warning("%s: %s; reading it again through the nodes' copies", name, exc.reason)
        return
    failed.append(Rejection(name, exc.reason))
    log.warning("rejected %s while loading it (%s); %s", name, exc.reason,
                "live tensors hold part of it: the state is unusable unless another generation loads completely"
                if exc.live_changed else "no live tensor had changed")


def _templates(state: TrainState) -> dict | None:
    """The DCP state dict this rank will load into (to plan which pieces it reads); None if it cannot be built
    (the checks before loading say why). Building it gives a fresh optimizer its state (torch's
    ``_init_optim_state`` steps it with zero gradients): call it inside :func:`untouched_unless_loaded`."""
    try:
        return sharded_state(state)[0]
    except (TrainStateError, RuntimeError, ValueError, KeyError, TypeError, AssertionError):
        return None


@contextlib.contextmanager
def untouched_unless_loaded(state: TrainState) -> Iterator[Callable[[], None]]:
    """A restore that loads nothing (no generation, or none verified) leaves a fresh optimizer fresh: planning
    the reads builds its state (step counts of 1, zero moments), which the next update would then continue from.
    The block calls the yielded function once loading begins; until then an optimizer that had no state gets
    none back."""
    fresh = [c for c in state.components.values() if isinstance(c, torch.optim.Optimizer) and not c.state]
    began = []
    try:
        yield lambda: began.append(True)
    finally:
        if not began:
            for optimizer in fresh:
                optimizer.state.clear()


# 1. choose ---------------------------------------------------------------------------------------------------
def _choose(held: HeldFiles | Fetched, ranks: Ranks, key: Any, generation: str | None,
            templates: dict | None = None, skip: list[Rejection] = (), one_pass: bool = True
            ) -> tuple[Any, tuple[Rejection, ...]]:
    order, error = None, None
    if ranks.rank == 0:
        try:
            order = Candidates((generation,), None, (), frozenset(), run=expected_run(held, key)) if generation \
                else candidates(held, key)
        except TrainStateError as exc:
            error = exc
    plan = None
    if ranks.rank == 0:
        plan = {"error": f"{type(error).__name__}: {error}", "rollback": isinstance(error, PointerRollback)} \
            if error else {"names": [n for n in order.names if n not in {r.generation for r in skip}], "run": order.run,
                           "rejected": [[r.generation, r.reason] for r in order.rejected]}
    plan = ranks.broadcast(plan, "choose")
    if "error" in plan:
        if error is not None:
            raise error
        raise (PointerRollback(plan["error"]) if plan["rollback"] else CheckpointFailed("choose", {0: plan["error"]}))
    rejected = [Rejection(g, r) for g, r in plan["rejected"]]
    for name in plan["names"]:
        pointer = order.pointer if order is not None and name == order.pointer_generation else None
        verified, parts, problem = _check_candidate(held, name, pointer, plan["run"], ranks, key, templates,
                                                    one_pass)
        failed = agree_on(ranks, problem, lambda: continue_lineage(held, verified.manifest), parts)
        if not failed:
            return (verified, parts), tuple(rejected)
        rejected.append(Rejection(name, "; ".join(f"rank {r}: {t}" for r, t in failed.items())))
    if not plan["names"] and not rejected and not skip:
        return None, ()
    raise NoValidGeneration(held.location, list(skip) + rejected)


def agree_on(ranks: Ranks, problem: str, lineage: Callable[[], list], parts: dict | None) -> dict[int, str]:
    """Every rank's verdict on one candidate, decided by rank 0 (two rounds, O(1) bytes per rank: the problems
    gathered to rank 0, its verdict broadcast): ``{}`` when every rank can load it, with rank 0's continued
    lineage in ``parts["lineage"]``; else the ranks' problems (damage: the next candidate is tried). A mismatch
    with a live state ("!" problems) raises :class:`StateMismatch`, a store that did not answer
    :class:`StorageUnavailable`, on every rank."""
    problems = ranks.gather(problem, "verify")
    verdict = None
    if ranks.rank == 0:
        failed = {r: text for r, text in enumerate(problems) if text}
        fatal = [t[1:] for t in failed.values() if t.startswith("!")]
        verdict = {"fatal": fatal[0]} if fatal else {"failed": dict(list(failed.items())[:64])} if failed else {}
        if not verdict:
            try:
                verdict["lineage"] = lineage()
            except (TrainStateError, OSError) as exc:
                verdict = {"failed": {0: problem_of(exc)}}
    verdict = ranks.broadcast(verdict, "verify")
    if "fatal" in verdict:
        raise StateMismatch(verdict["fatal"])
    failed = {int(r): t for r, t in verdict.get("failed", {}).items()}
    raise_unavailable(failed)
    if not failed and parts is not None:
        parts["lineage"] = verdict["lineage"]
    return failed


def _check_candidate(held: HeldFiles | Fetched, name: str, pointer: Any, run: str | None, ranks: Ranks, key: Any,
                     templates: dict | None, one_pass: bool = False) -> tuple[Any, Any, str]:
    """This rank's check of one candidate: ``(verified, parts, problem)``; a problem starting with "!" is a
    mismatch with the live state (fatal), any other is damage (the next candidate is tried)."""
    verified, parts, problem = None, None, ""
    try:
        verified = verify_generation(held, name, pointer, content=False, key=key)
        check_run(verified.manifest, run)
        if not verified.manifest.ranks:
            raise StateMismatch(f"{name} was written by a single process; restore it without torchrun (or "
                                "save it again from a multi-rank run)")
        if not isinstance(held, Fetched):
            # this rank's share held open (each file by one rank: a file gone is found before anything loads,
            # with O(files / N) opens a rank, not every file of the generation on every rank); what else it
            # reads (the global files, other ranks' shards its load plan meets) is held from its first read on
            for record in share_of(verified.manifest, ranks):
                held.open(name, record.name).close()
            # the shards' chunks are verified as DCP loads them (one pass, storage.Reader); the rest here
            verify_share(held, verified.manifest, ranks, skip=_loaded_verified(verified.manifest) if one_pass else ())
    except (CorruptGeneration, OSError) as exc:
        problem = problem_of(exc)
    except StateMismatch as exc:
        problem = f"!{exc}"
    if isinstance(held, Fetched):  # remote: every rank's share downloaded once, together (collective)
        problem, ok = fetch_share(held, verified.manifest if verified else None, ranks, templates, problem)
        if not ok:
            return verified, None, problem
    if not problem:
        try:
            parts = _read(held, verified.manifest, ranks)
            # the shards verified as DCP loads them: of held files, every chunked one (one pass); of fetched ones,
            # those read as they load (a rank's own shard; a tiered view's node's); the rest were verified already
            parts["verify_shards"] = frozenset(held.direct) if isinstance(held, Fetched) else \
                frozenset(_loaded_verified(verified.manifest) if one_pass else ())
        except (CorruptGeneration, OSError) as exc:
            problem = problem_of(exc)
        except StateMismatch as exc:
            problem = f"!{exc}"
    return verified, parts, problem


# 2. check, 3. load ------------------------------------------------------------------------------------------
def _read(held: HeldFiles, manifest: Any, ranks: Ranks | None) -> dict:
    """Every small file this rank needs (``ranks`` None: every rank's), parsed and decoded: damage here is
    damage to the generation."""
    name = manifest.generation
    payload = decode_verified(held, manifest)
    sharded = sharded_record(payload, name)
    saved_world = sharded["world_size"]
    wanted = [ranks.rank] if ranks is not None and saved_world == ranks.world_size else list(range(saved_world))
    records = {r: rank_record(held, manifest, r) for r in wanted}
    decoded = held.metadata if isinstance(held, Fetched) else None  # decoded by the fetch that planned the reads
    metadata = decoded[1] if decoded and decoded[0] == name else \
        metadata_from_json(read_json_file(held, manifest, DCP_METADATA, MAX_DCP_METADATA_BYTES), f"{name}/{DCP_METADATA}",
                           {f.name for f in manifest.files if f.name.startswith("shard-")}, lazy=ranks is not None)
    return {"payload": payload, "sharded": sharded, "records": records, "metadata": metadata}


def check_whole(store: Any, manifest: Any, key: Any = None) -> dict:
    """Without a process group, what a multi-rank restore at any world size reads, checked: every file's
    digest, ``state.json``, every rank's record and DCP's metadata decoded. Returns the global payload.

    For the commands that read a run (``ls``, ``verify``...): choosing a recovery
    point needs no ranks, only the same checks the ranks would make together.
    """
    verify_generation(store, manifest.generation, content=True, key=key)  # every byte, the shards too
    return _read(store, manifest, None)["payload"]


def _load(state: TrainState, chosen: Any, rejected: tuple[Rejection, ...], held: HeldFiles, ranks: Ranks,
          allow: list[str], statistical_cuda: bool, templates: dict | None = None) -> RestoreInfo:
    """Check, load and apply the chosen generation. ``templates``: the live state's DCP view as planning built it
    (:func:`_templates`: the same tensors), else built here."""
    verified, parts = chosen
    manifest = verified.manifest
    name = manifest.generation
    payload, sharded, metadata = parts["payload"], parts["sharded"], parts["metadata"]
    error: BaseException | None = None
    warnings: list[str] = []
    accepted: list = []
    try:
        state.settle_contract(payload["contract"]["fields"], allow)
        accepted = contract_mod.check(payload["contract"]["fields"], contract_fields(state, ranks.world_size),
                                      name, allow)
        check_sharded(state, sharded["components"], name)
        same_world = sharded["world_size"] == ranks.world_size
        merged, notes = merge(state, payload, sharded, parts["records"], ranks.rank, same_world)
        warnings += notes
        view = _Partial(state, sharded["components"], keep_rng=same_world)
        snapshot.check_components(view, merged, name)
        checked = snapshot.check_before_load(view, merged, statistical_cuda=statistical_cuda)
    except TrainStateError as exc:
        error = exc
    ranks.check("check", error)  # every check passed on every rank before any live object changes
    templates = templates if templates is not None else sharded_state(state)[0]
    progress = Progress()
    verify = parts["verify_shards"]
    reader = Reader(held, name, metadata, {f.name: f.size for f in manifest.files}, manifest if verify else None,
                    progress, only=verify)
    planned = held.planned if isinstance(held, Fetched) else None

    def apply() -> None:
        for component, described in sharded["components"].items():
            if described["kind"] == "module":
                module = state.components[component]
                if loaded_in_place(module, templates[component]):
                    continue
                if component in state.own_keys:  # the keys it gave: its own load_state_dict takes them back
                    module.load_state_dict(templates[component])
                else:
                    set_model_state_dict(module, templates[component])
            else:
                set_optimizer_state_dict(state.components[described["owner"]], state.components[component],
                                         templates[component])
        warnings.extend(snapshot.apply(view, merged, statistical_cuda=statistical_cuda, checked=checked))

    def share() -> list[int]:  # the bytes this rank took from each source (a tiered view's; else none)
        sources = held.sources() if hasattr(held, "sources") else {}
        return [sources.get(where, 0) for where in SOURCES]

    def changed(reason: str) -> None:  # the load failed on some rank (not damage) after live tensors changed
        mark_unusable(state, f"restoring {name} failed after live tensors took part of it ({reason})")

    shared = _load_checked(templates, reader, ranks, name, progress,
                           planned[1] if planned and planned[0] == name else None, apply, share, changed)
    mark_usable(state)  # every component loaded completely from one verified generation
    if accepted:
        state.history.append({"event": "contract_change", "restored_from": name, "next_update": state.next_update,
                              "changes": [{"field": c.field, "old": c.old, "new": c.new} for c in accepted]})
    for component in state.components.values():
        report = getattr(component, "restore_warnings", None)
        warnings += list(report()) if callable(report) else []
    state.parent = name
    state.lineage = parts["lineage"]
    info = RestoreInfo(GenerationInfo.from_verified(held, verified), rejected, tuple(accepted), tuple(warnings))
    if not hasattr(held, "sources"):
        return info  # the bytes every rank took from its own node, from peers and from the remote (tiers)
    return dataclasses.replace(info, sources=dict(zip(SOURCES, shared)))


SOURCES = ("local", "peer", "remote")


def _loaded_verified(manifest: Any) -> set[str]:
    """The shard files whose chunks the load verifies as it reads them (so the choice need not read them)."""
    return {f.name for f in manifest.files if f.name.startswith("shard-") and f.chunks}


def _load_checked(templates: dict, reader: Reader, ranks: Ranks, name: str, progress: Progress,
                  planned: LoadPlanner | None = None, apply: Callable[[], None] | None = None,
                  share: Callable[[], Any] | None = None, changed: Callable[[str], None] | None = None) -> list[Any]:
    """``dcp.load`` through the verifying reader, each rank its own part; where it loaded without error,
    ``apply()`` (the live objects take the rest) and ``share()`` (a list of counts); then one round sums every
    rank's outcome flags and counts (returned: the counts summed over the ranks; 8 bytes per flag and count, the
    failures' texts follow in a second round only where some rank failed). Damage found on any rank raises
    :class:`Damaged` on every rank, any
    other failure :class:`CheckpointFailed` (a rank's own typed error on that rank), after ``changed(reason)``
    where live tensors of some rank already took part of the generation (a read that failed halfway).

    DCP's collective planning is skipped (``no_dist``): a load plan is each rank's own (the default planner's
    global step passes the plans through, and the reader adds nothing), so its two rounds of pickled plans
    decided nothing. The one round after it decides together, as DCP's would have. A rank applies before it
    learns the others' outcome: its live tensors already hold its loaded part by then, so a failure elsewhere
    leaves it no less changed (reported as changed, so the state is unusable unless another generation loads).
    """
    damage, failure, trouble, own, applied, shared = "", "", "", None, False, None
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": each rank's part
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(templates, storage_reader=reader, planner=LoadPlanner(reuse=planned), no_dist=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - every rank learns it below, none is left waiting
        failures = getattr(exc, "failures", None)  # DCP wraps this rank's error (a CheckpointException)
        own = next(iter(failures.values())) if isinstance(failures, dict) and failures else exc
        own = own[0] if isinstance(own, tuple) else own  # (exception, traceback)
        if isinstance(own, CorruptGeneration):
            damage = str(own)
        else:
            failure = f"{type(own).__name__}: {own}"
    if not damage and not failure:
        try:
            applied = True
            if apply is not None:
                apply()
            shared = share() if share is not None else None
        except (TrainStateError, RuntimeError, ValueError, KeyError, OSError) as exc:
            own = StateMismatch(f"loading {name} failed after the checks passed ({type(exc).__name__}: {exc}); "
                                "live objects may hold part of it: rebuild them before restoring again")
            trouble = f"{type(own).__name__}: {own}"[:2000]
    summed = ranks.sum([int(bool(damage or failure or trouble)), int(bool(progress.live_changed or applied)),
                        *(shared if shared is not None else [0] * len(SOURCES))], "load")
    if not summed[0]:
        return summed[2:]
    live = summed[1] > 0
    reports = ranks.all_gather([damage, failure, trouble], "load")  # some rank failed: every rank learns how
    damaged = [f"rank {r}: {text}" for r, (text, *_) in enumerate(reports) if text]
    if damaged:
        raise Damaged(name, "; ".join(damaged), live)
    for index, phase in ((1, "load"), (2, "apply")):
        failed = {r: report[index] for r, report in enumerate(reports) if report[index]}
        if failed:
            if changed is not None and live:
                changed("; ".join(f"rank {r}: {text}" for r, text in failed.items())[:2000])
            if isinstance(own, TrainStateError):
                raise own
            raise CheckpointFailed(phase, failed) from own
    return []
