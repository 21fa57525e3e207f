"""One ``trainstate doctor`` process: build fresh objects, reach update k, run it once, record what it saw and did.

Run as ``python -m trainstate.tools.doctorrun JOB.json`` by :func:`trainstate.tools.doctor.doctor` (never
imported by it), so every role starts in a fresh interpreter: nothing of the parent (its RNG, imports,
threads, DataLoader workers) reaches what is compared. Call order:

1. import the factory and the step (``module:function``); ``state = factory()``; hooks are attached now, so
   batches are seen however early the step creates its iterator;
2. reach update k: restore a generation (``job["generation"]``), or replay: start from the factory's fresh
   state (``job["replay_from"] == "start"``) or from a restored earlier generation, and run the step until
   ``state.next_update == k``, without a restart;
3. save the state before the update as a generation in ``OUT/before`` (the parent compares it with ``ts.diff``);
4. peek the first draws of every RNG stream, on copies (the live streams are never drawn from);
5. run the step once, recording: each ``ResumableLoader`` batch handed out (sample ids and tensors), each
   registered module's first forward input, each optimizer's LR and gradients when it steps, the loss; and
   whether the update drew from each RNG stream (its state just before and just after the step, in this
   process: a stream the update never moved cannot explain a drift, however it differs from the reference);
6. record the LR each group holds after the update; save the state as ``OUT/after``;
7. write ``OUT/record.safetensors``: every observation as a tensor, the rest in its JSON metadata. No pickle.

A failure is written to ``OUT/error.json`` (type and message) and the process exits 1.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from ..data.loader import ResumableLoader
from ..errors import InvalidArgument
from ..format import signing
from ..lifecycle.rehearsal import load_factory
from ..manager import CheckpointManager
from ..restore import restore
from ..state import rng as rngstate
from ..state.train_state import TrainState
from ..storage.locate import open_existing

DRAWS = 4  # first draws peeked per RNG stream


class Recorder:
    """Hooks on the live objects; they record only while ``on`` (the one update being diagnosed)."""

    def __init__(self, state: TrainState):
        self.on = False
        self.tensors: dict[str, torch.Tensor] = {}
        self.values: dict[str, str] = {}
        self._seen: set[str] = set()
        self._names = {id(p): f"{m}.{n}" for m, module in state.modules().items()
                       for n, p in module.named_parameters(remove_duplicate=False)}
        for name, component in state.components.items():
            if isinstance(component, ResumableLoader):
                self._watch_loader(name, component)
            elif isinstance(component, torch.nn.Module):
                component.register_forward_pre_hook(self._forward_hook(name), with_kwargs=True)
            elif isinstance(component, torch.optim.Optimizer):
                component.register_step_pre_hook(self._step_hook(name))

    def _watch_loader(self, name: str, loader: ResumableLoader) -> None:
        consume = getattr(loader, "_consume", None)  # every iterator the step creates passes its batches here
        if consume is None:  # another loader version: the model's first input still shows the batch
            return
        taken = [0]

        def watched(*args: Any) -> Any:
            for batch in consume(*args):
                if self.on:
                    prefix = f"batch/{name}/{taken[0]}"
                    taken[0] += 1
                    self.tensors[f"{prefix}/ids"] = torch.as_tensor(np.asarray(loader.last_ids, dtype=np.int64))
                    self.add(f"{prefix}/bytes", batch)
                yield batch

        loader._consume = watched

    def _forward_hook(self, name: str) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if self.on and f"fwd.{name}" not in self._seen:  # the first forward call of the update
                self._seen.add(f"fwd.{name}")
                self.add(f"batch/input.{name}/args", list(args))
                if kwargs:
                    self.add(f"batch/input.{name}/kwargs", kwargs)
        return hook

    def _step_hook(self, name: str) -> Callable:
        def hook(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
            if not self.on or f"opt.{name}" in self._seen:
                return
            self._seen.add(f"opt.{name}")
            self.tensors[f"lr/{name}/used"] = lrs(optimizer)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for i, p in enumerate(params):
                where = f"grads/{self._names.get(id(p), f'{name}.params[{i}]')}"
                if p.grad is None:
                    self.values[where] = "no gradient"
                else:
                    self.tensors[where] = local(p.grad).detach().cpu().clone()
        return hook

    def add(self, name: str, value: Any) -> None:
        """A batch or input, flattened: tensors (and arrays) by path, anything else by its repr."""
        if isinstance(value, torch.Tensor):
            self.tensors[name] = local(value).detach().cpu().clone().contiguous()
        elif isinstance(value, np.ndarray) and value.dtype != object:
            self.tensors[name] = torch.from_numpy(np.ascontiguousarray(value).copy())
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                self.add(f"{name}.{i}", item)
        elif isinstance(value, dict):
            for key, item in value.items():
                self.add(f"{name}.{key}", item)
        else:
            self.values[name] = repr(value)[:1000]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a distributed tensor (a DTensor's local shard); any other tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def lrs(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    return torch.tensor([float(g["lr"]) for g in optimizer.param_groups], dtype=torch.float64)


def peek_draws(state: TrainState) -> dict[str, torch.Tensor]:
    """The next ``DRAWS`` values of every stream, drawn from copies: the live generators do not move."""
    out = {}
    r = random.Random()
    r.setstate(random.getstate())
    out["rng/python"] = torch.tensor([r.random() for _ in range(DRAWS)], dtype=torch.float64)
    legacy = np.random.RandomState()
    legacy.set_state(np.random.get_state())
    out["rng/numpy_global"] = torch.from_numpy(legacy.random_sample(DRAWS))
    out["rng/torch_cpu"] = torch.rand(DRAWS, dtype=torch.float64, generator=_copy_torch(torch.default_generator))
    # the stream of the device this process draws on, once it has initialized CUDA (as the checkpoint records
    # it): drawing on every visible device would create a context on each, in every child the doctor runs
    in_use = torch.cuda.is_available() and torch.cuda.is_initialized()
    for i in [torch.cuda.current_device()] if in_use else []:
        g = torch.Generator(device=f"cuda:{i}")
        g.set_state(torch.cuda.get_rng_state(i))
        out[f"rng/torch_cuda.{i}"] = torch.rand(DRAWS, dtype=torch.float64, generator=g, device=f"cuda:{i}").cpu()
    for name, rng in state.rngs.items():
        out[f"rng/named.{name}"] = _draw_copy(rng)
    return out


def _copy_torch(g: torch.Generator) -> torch.Generator:
    copy = torch.Generator(device=g.device)
    copy.set_state(g.get_state())
    return copy


def _draw_copy(rng: Any) -> torch.Tensor:
    if isinstance(rng, torch.Generator):
        return torch.rand(DRAWS, dtype=torch.float64, generator=_copy_torch(rng), device=rng.device).cpu()
    if isinstance(rng, np.random.Generator):
        bits = type(rng.bit_generator)()
        bits.state = rng.bit_generator.state
        return torch.from_numpy(np.random.Generator(bits).random(DRAWS))
    if isinstance(rng, np.random.RandomState):
        copy = np.random.RandomState()
        copy.set_state(rng.get_state())
        return torch.from_numpy(copy.random_sample(DRAWS))
    copy = random.Random()
    copy.setstate(rng.getstate())
    return torch.tensor([copy.random() for _ in range(DRAWS)], dtype=torch.float64)


def stream_digests(state: TrainState) -> dict[str, str]:
    """A digest of each RNG stream's state, by the name ``ts.diff`` gives it (``rng.python``, ``rng.named.X``).

    The global streams are judged whether or not the state captures them: the update may draw from them
    either way. CUDA streams count as one (``rng.torch_cuda``), as the checkpoint records them."""
    captured = rngstate.capture(state.rngs, include_globals=True)
    named = captured.pop("named")
    streams = {f"rng.{k}": v for k, v in captured.items() if k != "torch_cuda" or v}
    streams.update({f"rng.named.{k}": v for k, v in named.items()})
    return {name: _digest(value) for name, value in streams.items()}


def _digest(value: Any) -> str:
    """Stable across two calls in one process: the bytes of every array, the repr of every other leaf."""
    h = hashlib.sha256()

    def feed(node: Any) -> None:
        if isinstance(node, torch.Tensor):
            h.update(node.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(node, np.ndarray):
            h.update(np.ascontiguousarray(node).tobytes())
        elif isinstance(node, dict):
            for key in sorted(node, key=str):
                h.update(repr(key).encode())
                feed(node[key])
        elif isinstance(node, (list, tuple)):
            h.update(f"[{len(node)}".encode())
            for item in node:
                feed(item)
        else:
            h.update(repr(node).encode())
        h.update(b";")

    feed(value)
    return h.hexdigest()


def drawn_from(before: dict[str, str], after: dict[str, str]) -> dict[str, bool]:
    """Per stream, whether the update moved it (a stream present on one side only counts as moved)."""
    return {name: before.get(name) != after.get(name) for name in list(before) + [n for n in after
                                                                                 if n not in before]}


def one_update(state: TrainState, step: Callable[[TrainState], Any]) -> Any:
    """The step runs one update; ``next_update`` is advanced here when the step did not advance it."""
    before = state.next_update
    loss = step(state)
    if state.next_update == before:
        state.next_update += 1
    return loss


def _save(state: TrainState, directory: Path) -> None:
    with CheckpointManager(directory, preflight=False) as ckpt:
        ckpt.save(state, include_grads=state.pending_gradients)  # a step that accumulates: its gradients too


def _reach(job: dict[str, Any], state: TrainState, step: Callable) -> list[str]:
    """Bring ``state`` to update ``job["update"]``: restore it, or replay to it. Returns the restore's warnings."""
    notes: list[str] = []
    generation = job["generation"] if job["generation"] is not None else job["replay_from"]
    if generation not in (None, "start"):
        store = open_existing(job["run"])
        info, _ = restore(store, state, key=signing.resolve(None, store.location), generation=generation)
        notes += list(info.warnings) if info is not None else []
    if state.next_update > job["update"]:
        raise InvalidArgument(f"the replay starts at update {state.next_update}, after update {job['update']}")
    while state.next_update < job["update"]:
        one_update(state, step)
    return notes


def run(job: dict[str, Any]) -> None:
    out = Path(job["out"])
    factory, step = load_factory(job["factory"]), load_factory(job["step"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = factory()
        if not isinstance(state, TrainState):
            raise InvalidArgument(f"the factory {job['factory']} returned a {type(state).__qualname__}, "
                                  "not a TrainState")
        recorder = Recorder(state)
        notes = _reach(job, state, step)
        _save(state, out / "before")
        draws = peek_draws(state)
        streams = stream_digests(state)
        recorder.on = True
        loss = one_update(state, step)
        recorder.on = False
        drawn = drawn_from(streams, stream_digests(state))  # now: the save below is no draw of the update's
        _save(state, out / "after")
    for name, component in state.components.items():
        if isinstance(component, torch.optim.Optimizer):
            recorder.tensors[f"lr/{name}/after"] = lrs(component)
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        loss = torch.tensor(loss, dtype=torch.float64)
    recorder.add("loss/value", loss)
    tensors = {**draws, **recorder.tensors}
    for message in [str(w.message) for w in caught if issubclass(w.category, UserWarning)]:
        if message not in notes:
            notes.append(message)
    meta = {"role": job["role"], "update": job["update"], "values": recorder.values, "notes": notes,
            "streams": drawn, "order": list(tensors)}
    save_file(tensors, str(out / "record.safetensors"), metadata={"doctor": json.dumps(meta)})


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    try:
        run(job)
    except Exception as exc:  # reported to the parent with its type; the parent raises it as an error
        detail = "".join(traceback.format_exception(exc)[-3:])
        (Path(job["out"]) / "error.json").write_text(json.dumps(
            {"type": type(exc).__name__, "message": str(exc)[:2000], "where": detail[-2000:]}))
        return 1
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.exit(code)
