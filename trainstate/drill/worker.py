"""The drill worker: a small run with every kind of restart state, resumed from disk.

Run as ``python -m trainstate.drill worker --dir D --total N --every K``; see
the package docstring for the lines it prints.

With ``--loader-workers W`` each batch comes from a :class:`~trainstate.ResumableLoader`
(``W`` DataLoader worker processes, forked from the drill worker, persistent,
prefetching) over a small map-style dataset augmented per sample from
:func:`~trainstate.sample_generator`; the loader is the TrainState component
``loader``. The worker then also appends the sample ids of every update to
``D/consumed_ids.log`` (see :class:`IdsLog`). Its DataLoader workers
redirect their output to ``D/loader-workers.log``; they inherit the open log,
which lets the parent find any that outlive a kill
(:func:`trainstate.drill.launch.processes_holding`).

With ``--async-save`` every save is ``ckpt.save(state, blocking=False)``: the
worker prints ``saving <n>``, ``staged <n>`` when the call returns and trains
on while the generation is written, and ``saved <n>`` once it sees that save
published (see :class:`_AsyncSaver`). ``--slow-fsync MS`` slows every file
fsync, as a slow disk would, so that saves overlap several updates. Neither
is part of the contract: such a run must end bitwise equal to a blocking one.

With ``--mirror URL`` the manager uploads every generation to that object
store (``mirror=``; options from :func:`mirror_options`) and the worker prints
``uploaded <n>`` when the remote ``latest`` reaches update ``n``.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import random
import sys
import zlib
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset
from ..state import snapshot
from ..errors import InvalidArgument, TrainStateError
from ..asyncsave import SaveHandle
from ..data.loader import ResumableLoader
from ..storage.local import LocalStore
from .surroundings import SlowFsync, Uploads, mirror_options
from ..manager import CheckpointManager
from ..data.samplerng import sample_generator
from ..state.train_state import TrainState


DRAWS_FILE = "next_draws.json"
IDS_LOG = "consumed_ids.log"  # with a loader: the sample ids of every update, one line each
LOADER_LOG = "loader-workers.log"  # with a loader: what DataLoader worker processes print


IN_FEATURES, OUT_FEATURES = 64, 32


FORGET_CHOICES = ("python", "numpy_global", "torch_cpu", "data", "noise", "optimizer", "scheduler", "scaler",
                  "loader", "weights-only")  # "loader": the data position (only with --loader-workers)


class DrillError(TrainStateError):
    """The drill itself could not run (a worker crashed or hung, a directory was not empty)."""


@dataclass(frozen=True)
class DrillConfig:
    """What the worker trains; the reference and the interrupted run must share it."""

    total: int
    every: int
    seed: int = 0
    width: int = 384
    batch: int = 128
    # None: batches drawn from a generator in the step (no loader). An int: batches come
    # from a ResumableLoader with that many DataLoader worker processes (0: in-process).
    loader_workers: int | None = None
    # How the worker saves, not what it trains (neither is part of the contract, so a run saved in
    # the background must end bitwise equal to a blocking one): ``save(blocking=False)``, and a
    # slower disk (every file fsync takes this many milliseconds longer) so saves overlap training.
    async_save: bool = False
    slow_fsync_ms: int = 0
    mirror: str | None = None  # an object-store URL the manager mirrors every generation to (mirror=)
    full_every: int | None = None  # incremental generations (full_every=); adds a frozen 1.2 MB component to link

    def __post_init__(self) -> None:
        for name in ("total", "every", "width", "batch"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise InvalidArgument(f"DrillConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.loader_workers is not None and (type(self.loader_workers) is not int or self.loader_workers < 0):
            raise InvalidArgument(f"DrillConfig.loader_workers must be None or an int >= 0, got {self.loader_workers!r}")
        if type(self.async_save) is not bool:
            raise InvalidArgument(f"DrillConfig.async_save must be a bool, got {self.async_save!r}")
        if type(self.slow_fsync_ms) is not int or self.slow_fsync_ms < 0:
            raise InvalidArgument(f"DrillConfig.slow_fsync_ms must be an int >= 0, got {self.slow_fsync_ms!r}")
        if self.full_every is not None and (type(self.full_every) is not int or self.full_every < 1):
            raise InvalidArgument(f"DrillConfig.full_every must be None or an int >= 1, got {self.full_every!r}")
        if self.mirror is not None and not isinstance(self.mirror, str):
            raise InvalidArgument(f"DrillConfig.mirror must be None or a URL, got {self.mirror!r}")

    def argv(self) -> list[str]:
        loader = [] if self.loader_workers is None else ["--loader-workers", str(self.loader_workers)]
        saving = (["--async-save"] if self.async_save else []) + (
            ["--slow-fsync", str(self.slow_fsync_ms)] if self.slow_fsync_ms else []) + (
            ["--mirror", self.mirror] if self.mirror else []) + (
            ["--full-every", str(self.full_every)] if self.full_every else [])
        return ["--total", str(self.total), "--every", str(self.every), "--seed", str(self.seed),
                "--width", str(self.width), "--batch", str(self.batch), *loader, *saving]

    def contract(self) -> dict[str, Any]:
        """The experiment contract. Without a loader exactly as before; the worker count is not part of it
        (index-addressed augmentation makes the data independent of it), nor is how the worker saves."""
        config = asdict(self)
        del config["loader_workers"], config["async_save"], config["slow_fsync_ms"], config["mirror"]
        if config["full_every"] is None:
            del config["full_every"]  # (contracts recorded before it existed stay the same)
        if self.loader_workers is None:
            return {"config": config}
        return {"config": config, "data": {"dataset": "drill-synthetic-v1", "samples": dataset_size(self)}}


# data (with --loader-workers) --------------------------------------------------
def dataset_size(cfg: DrillConfig) -> int:
    """Five batches an epoch, the last one half full: resumes land mid-epoch and on epoch boundaries."""
    return 5 * cfg.batch - cfg.batch // 2


class SyntheticDataset(Dataset):
    """A map-style dataset: a fixed table of features, augmented per sample.

    The augmentation (a random scale, noise, one feature dropped) draws only
    from :func:`~trainstate.sample_generator` (a torch and a Python stream),
    so it is the same whichever worker process loads a sample and however
    many it loaded before. The id of every sample travels with it, so the
    step can check and log what it really trained on.
    """

    def __init__(self, size: int, seed: int):
        self.features = torch.randn(size, IN_FEATURES, generator=torch.Generator().manual_seed(seed + 3))

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int) -> dict[str, Any]:
        draws = torch.randn(IN_FEATURES + 1, generator=sample_generator(index))
        x = self.features[int(index)] * (1.0 + 0.25 * torch.tanh(draws[0])) + 0.05 * draws[1:]
        x[sample_generator(index, stream="drop", kind="python").randrange(IN_FEATURES)] = 0.0
        return {"id": int(index), "x": x}


class _LoaderWorkerInit:
    """``worker_init_fn``: send the worker's output to ``D/loader-workers.log`` and record its pid there.

    A forked DataLoader worker inherits the drill worker's stdout, the pipe the
    parent reads progress lines from; one that outlived a SIGKILLed parent
    would hold that pipe open, and the parent would wait for its end.
    """

    def __init__(self, directory: str | Path):
        self.path = str(Path(directory) / LOADER_LOG)

    def __call__(self, worker_id: int) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, f"worker {worker_id} pid {os.getpid()} parent {os.getppid()}\n".encode())
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)


def build_loader(cfg: DrillConfig, directory: str | Path | None = None) -> ResumableLoader:
    """The drill's ResumableLoader: shuffled, ``cfg.loader_workers`` forked workers, persistent, prefetching."""
    kwargs: dict[str, Any] = {"num_workers": cfg.loader_workers}
    if cfg.loader_workers:
        kwargs.update(persistent_workers=True, prefetch_factor=2, multiprocessing_context="fork",
                      worker_init_fn=None if directory is None else _LoaderWorkerInit(directory))
    return ResumableLoader(SyntheticDataset(dataset_size(cfg), cfg.seed), batch_size=cfg.batch, seed=cfg.seed + 4,
                           shuffle=True, **kwargs)


def _endless(loader: ResumableLoader) -> Any:
    """Batches across epochs: each pass continues the loader from its position (mid-epoch after a restore)."""
    while True:
        yield from loader


def _take(batches: Any, loader: ResumableLoader) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The next batch and its sample ids, checked against the ids the loader says it handed out."""
    batch = next(batches)
    ids = batch["id"].tolist()
    if loader.last_ids is None or ids != loader.last_ids.tolist():
        raise DrillError(f"the DataLoader delivered samples {ids[:8]}... but the loader's plan says "
                         f"{None if loader.last_ids is None else loader.last_ids.tolist()[:8]}...")
    return batch, ids


def _shutdown_loader(loader: ResumableLoader) -> None:
    """Stop persistent DataLoader workers now: a worker forked by the zygote ends with os._exit, which
    skips the DataLoader's own clean-up (its workers would linger until they notice the parent is gone)."""
    iterator = getattr(loader.loader, "_iterator", None)
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()


class IdsLog:
    """Appends ``<update> <id> <id> ... <crc32>`` for every update to ``D/consumed_ids.log``.

    Each start first writes ``resume <next_update> <crc32>``: entries for
    later updates were made by work that no checkpoint kept, and the
    updates are about to be redone. A kill can cut the last line; a start
    ends such a line before writing its own, and readers drop lines whose
    checksum fails (:func:`trainstate.drill.compare.read_consumed_ids`).
    Not fsynced: a killed process's writes survive in the page cache. The
    descriptor stays open for the whole run, so the DataLoader workers,
    forked after it opened, hold it too: a process that still holds the
    log after its run ended is a DataLoader worker that outlived it.
    """

    def __init__(self, path: str | Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if os.fstat(self.fd).st_size:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    os.write(self.fd, b"\n")  # end a line cut by a kill

    def _line(self, text: str) -> None:
        os.write(self.fd, f"{text} {zlib.crc32(text.encode()):08x}\n".encode())  # one write per line

    def resume(self, next_update: int) -> None:
        self._line(f"resume {next_update}")

    def entry(self, update: int, ids: list[int]) -> None:
        self._line(f"{update} " + " ".join(map(str, ids)))

    def close(self) -> None:
        os.close(self.fd)


# worker ------------------------------------------------------------------------
def build_model(cfg: DrillConfig) -> nn.Module:
    w = cfg.width
    return nn.Sequential(nn.Linear(IN_FEATURES, w), nn.BatchNorm1d(w), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(w, w), nn.LayerNorm(w), nn.ReLU(), nn.Linear(w, OUT_FEATURES))


def build(cfg: DrillConfig, directory: str | Path | None = None) -> TrainState:
    """A freshly seeded TrainState; identical in every process given ``cfg``.

    With ``cfg.loader_workers`` set it holds the loader as component ``loader``;
    ``directory`` (the run directory) is where its workers send their output.
    """
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.total, eta_min=1e-4)
    # A short growth interval and injected overflows (see train_step) keep the
    # scaler's scale and growth tracker moving, so a lost scaler state shows.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=7)
    rngs = {"data": torch.Generator().manual_seed(cfg.seed + 1), "noise": np.random.default_rng(cfg.seed + 2)}
    loader = {} if cfg.loader_workers is None else {"loader": build_loader(cfg, directory)}
    frozen = {} if cfg.full_every is None else {"frozen": Frozen(torch.randn(300_000))}
    return TrainState(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, rngs=rngs,
                      contract=cfg.contract(), **loader, **frozen)


class Frozen:
    """Weights no update changes (a frozen base): an incremental run links their file from save to save."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight}

    def load_state_dict(self, value: dict[str, torch.Tensor]) -> None:
        self.weight.copy_(value["weight"])


def train_step(state: TrainState, cfg: DrillConfig, batch: dict[str, torch.Tensor] | None = None) -> float:
    """One update that draws from every random source, so any stream restored wrong changes the weights.

    Without ``batch`` the inputs are drawn from the ``data`` generator; with a
    loader's batch they are its features plus a little noise from that generator.
    """
    model, optimizer, scaler = state["model"], state["optimizer"], state["scaler"]
    if batch is None:
        x = torch.randn(cfg.batch, IN_FEATURES, generator=state.rngs["data"])
    else:
        x = batch["x"] + 0.01 * torch.randn(batch["x"].shape, generator=state.rngs["data"])
    n = x.shape[0]
    noise = state.rngs["noise"].normal(0.0, 0.1, (n, OUT_FEATURES)).astype(np.float32)
    y = torch.tanh(2 * x[:, :OUT_FEATURES]) + torch.from_numpy(noise)
    weights = torch.from_numpy(np.random.uniform(0.5, 1.5, n).astype(np.float32))
    overflow = random.random() < 0.05 and state.next_update > 0  # the first step must be a real one
    model.train()  # dropout draws from torch's global CPU generator
    loss = (((model(x) - y) ** 2).mean(dim=1) * weights).mean()
    scaler.scale(loss * math.inf if overflow else loss).backward()
    scaler.step(optimizer)  # skipped on overflow; the scaler then backs off
    scaler.update()
    state["scheduler"].step()
    optimizer.zero_grad(set_to_none=True)
    state.tokens_seen += n
    state.counters["overflows"] = state.counters.get("overflows", 0) + int(overflow)
    value = loss.item()
    if value < state.facts.get("best_loss", math.inf):
        state.facts["best_loss"] = value
    return value


def next_draws(state: TrainState) -> dict[str, list[int]]:
    """The next values of every random stream: equal only if every stream was restored exactly."""
    return {
        "python": [random.getrandbits(64) for _ in range(4)],
        "numpy_global": np.random.randint(0, 2**62, 4, dtype=np.int64).tolist(),
        "numpy_generator:noise": state.rngs["noise"].integers(0, 2**62, 4).tolist(),
        "torch_cpu": torch.randint(0, 2**62, (4,)).tolist(),
        "torch_generator:data": torch.randint(0, 2**62, (4,), generator=state.rngs["data"]).tolist(),
    }


def probe(state: TrainState, cfg: DrillConfig, batch: dict[str, torch.Tensor] | None = None) -> dict[str, str]:
    """One more update in memory, then a digest of the whole state.

    The final generation may have been written by an earlier process; this
    checks what the last process actually holds in its live objects (with a
    loader, ``batch`` is the next batch it hands out).
    """
    loss = train_step(state, cfg, batch)
    skeleton, tensors = snapshot.capture(state)
    digest = hashlib.sha256(snapshot.state_json(skeleton))
    for name in sorted(tensors):
        digest.update(tensors[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return {"loss": float.hex(loss), "state_sha256": digest.hexdigest()}


def _fresh_states(state: TrainState) -> dict[str, Any]:
    """Copies of everything as built, for the negative control (``--forget``)."""
    return {"components": {n: copy.deepcopy(c.state_dict()) for n, c in state.components.items()},
            "python": random.getstate(), "numpy_global": np.random.get_state(),
            "torch_cpu": torch.get_rng_state(), "data": state.rngs["data"].get_state(),
            "noise": copy.deepcopy(state.rngs["noise"].bit_generator.state)}


def _forget(state: TrainState, what: str, fresh: dict[str, Any]) -> None:
    """Undo part of a restore, as a buggy resume would, so the comparison must fail."""
    names = FORGET_CHOICES[:-1] if what == "weights-only" else (what,)
    for name in names:
        if name in fresh["components"]:
            state[name].load_state_dict(copy.deepcopy(fresh["components"][name]))
        elif name == "loader":
            continue  # no loader in this run
        elif name == "python":
            random.setstate(fresh["python"])
        elif name == "numpy_global":
            np.random.set_state(fresh["numpy_global"])
        elif name == "torch_cpu":
            torch.set_rng_state(fresh["torch_cpu"])
        elif name == "data":
            state.rngs["data"].set_state(fresh["data"])
        else:
            state.rngs["noise"].bit_generator.state = copy.deepcopy(fresh["noise"])


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()  # the parent times its kills by these lines


def _save(ckpt: CheckpointManager, state: TrainState, saver: _AsyncSaver | None, uploads: Uploads) -> None:
    if saver is not None:
        saver.save(state)
    else:
        _say(f"saving {state.next_update}")
        ckpt.save(state)
        _say(f"saved {state.next_update}")
    uploads.wanted(state.next_update)


class _AsyncSaver:
    """``--async-save``: each save is ``ckpt.save(state, blocking=False)``, and training goes on while it is written.

    Lines: ``saving <n>`` right before the call, ``staged <n>`` when it returns
    (an owned copy exists; the live objects change from the next update on),
    and ``saved <n>`` once the handle reports the generation published. The
    worker looks after every update and every save (the writer publishes in
    order), and waits for every save still in flight before its final probe. A
    failed background save raises here, so the worker never reports it saved.
    """

    def __init__(self, ckpt: CheckpointManager):
        self._ckpt = ckpt
        self._pending: deque[tuple[int, SaveHandle]] = deque()

    def save(self, state: TrainState) -> None:
        _say(f"saving {state.next_update}")
        handle = self._ckpt.save(state, blocking=False)  # waits here while max_in_flight saves are in flight
        _say(f"staged {state.next_update}")
        self._pending.append((state.next_update, handle))
        self.poll()

    def poll(self, block: bool = False) -> None:
        while self._pending and (block or self._pending[0][1].done()):
            update, handle = self._pending.popleft()
            handle.wait()
            _say(f"saved {update}")

    def finish(self) -> None:
        self.poll(block=True)


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
    os.replace(tmp, path)  # a kill mid-write must not leave a truncated file behind


def worker_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    cfg = DrillConfig(args.total, args.every, args.seed, args.width, args.batch, args.loader_workers,
                      bool(getattr(args, "async_save", False)), getattr(args, "slow_fsync_ms", 0) or 0,
                      getattr(args, "mirror", None), getattr(args, "full_every", None))
    state = build(cfg, args.dir)
    loader: ResumableLoader | None = state.components.get("loader")
    fresh = _fresh_states(state) if args.forget else None
    if args.wait_for_go:
        # Imports and build (AdamW's first param group imports torch._dynamo) take
        # seconds; the parent starts the next worker early and lets it go only
        # after the previous one is dead and the directory has been checked.
        _say("ready")
        if sys.stdin.readline().strip() != "go":
            return 3
    slow = {"store": LocalStore(args.dir, ops=SlowFsync(cfg.slow_fsync_ms / 1000))} if cfg.slow_fsync_ms else {}
    mirror = {} if cfg.mirror is None else {"mirror": cfg.mirror, "mirror_options": mirror_options()}
    with CheckpointManager(args.dir, keep_last=args.keep_last, full_every=cfg.full_every, **slow, **mirror) as ckpt:
        saver = _AsyncSaver(ckpt) if cfg.async_save else None
        info = ckpt.restore(state)
        uploads = Uploads(ckpt if cfg.mirror else None, _say)
        if info is None:
            _say("fresh")
        else:
            rejected = ",".join(r.generation for r in info.rejected) or "-"
            _say(f"restored {info.generation.name} next_update={state.next_update} rejected={rejected} "
                 f"identical={int(info.identical_continuation)}")
            uploads.wanted(state.next_update)
            if fresh is not None:
                _forget(state, args.forget, fresh)
        batches = ids_log = None
        if loader is not None:
            ids_log = IdsLog(Path(args.dir) / IDS_LOG)  # opened before the DataLoader forks its workers
            ids_log.resume(state.next_update)
            batches = _endless(loader)
        _say(f"training {state.next_update}")
        while state.next_update < cfg.total:
            batch, ids = _take(batches, loader) if loader is not None else (None, None)
            train_step(state, cfg, batch)
            state.next_update += 1
            if ids_log is not None:
                ids_log.entry(state.next_update, ids)
            _say(f"step {state.next_update}")
            if saver is not None:
                saver.poll()
            uploads.poll()
            if state.next_update % cfg.every == 0:
                _save(ckpt, state, saver, uploads)
        # the final save, also when the restore landed on the final update: then it writes nothing, but moves
        # latest to the generation a kill cut between its commit and its pointer move (restore rolled forward)
        _save(ckpt, state, saver, uploads)
        if saver is not None:
            saver.finish()  # the final generation is published before the probe below
    uploads.poll()  # close waited for the uploads
    draws = next_draws(state)
    record: dict[str, Any] = {"next_update": state.next_update, "draws": draws}
    if loader is not None:
        position = loader.data_position()
        batch, ids = _take(batches, loader)
        record["loader"] = {"position": position, "probe_ids": ids}
        record["probe"] = probe(state, cfg, batch)
        _shutdown_loader(loader)
        ids_log.close()
    else:
        record["probe"] = probe(state, cfg)
    _write_json(Path(args.dir) / DRAWS_FILE, record)
    _say(f"done {state.next_update}")
    return 0
