"""Lightning fits for tests/test_lightning.py, run as real processes that are really SIGKILLed.

``python tests/lightning_child.py PLAN.json RESULTS.json``: imports Lightning
once (slow here: tens of seconds), then forks one worker per start of each
run (the runs side by side, the starts of a run in order), so every start is
its own process that builds its objects and restores from disk exactly as a
fresh interpreter would; only the imports are shared. A start with a kill
point SIGKILLs itself there (``os.kill(getpid(), SIGKILL)``: no handler, no
flush, no cleanup): at the end of a given training step before that step's
checkpoint, or at the n-th ``fsync`` of the start, which lands inside a save.
Every start calls ``trainer.fit(..., ckpt_path="last")``. Checks that need
Lightning but no fit run here too, in
this process; their outcomes go to RESULTS.json for the test to assert on.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import trainstate as ts

FRAMEWORKS_AT_IMPORT = sorted(m for m in ("lightning", "pytorch_lightning", "lightning_fabric") if m in sys.modules)

import lightning.pytorch as L  # noqa: E402  (after the check above, on purpose)
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from trainstate.integrations.lightning import TrainStateCallback, TrainStateCheckpointIO  # noqa: E402
from trainstate.integrations.lightning_entry import pin_name  # noqa: E402
from forkjobs import fork_call  # noqa: E402

MAX_STEPS = 20
EVERY = 3  # ModelCheckpoint(every_n_train_steps=EVERY): saves at 3, 6, ..., 18


class Points(torch.utils.data.Dataset):
    """64 fixed points; per-sample noise from the loader's sample generator (the same after any resume)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 4, generator=g), torch.randn(64, generator=g)

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index):
        noise = 0.01 * torch.randn(4, generator=ts.sample_generator(index))
        return self.x[index] + noise, self.y[index]


class Net(L.LightningModule):
    """Dropout (torch's global RNG), a named noise generator, NumPy and Python draws: every stream matters."""

    def __init__(self, noise: torch.Generator, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters(ignore=["noise"])
        self.noise = noise
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        import random

        import numpy as np

        x, y = batch
        jitter = torch.randn(x.shape, generator=self.noise) * 0.01
        scale = 1.0 + 1e-3 * (random.random() + float(np.random.rand()))
        return ((self.net(x + jitter).squeeze(1) * scale - y) ** 2).mean()

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 7, gamma=0.5)}


class KillAtStep(L.Callback):
    """SIGKILL this process at the end of training step ``step``, before that step's checkpoint."""

    def __init__(self, step: int | None):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def kill_at_fsync(n: int) -> None:
    """SIGKILL this process at its n-th fsync: inside a save (a file, a directory, a pointer or an entry)."""
    real, count = os.fsync, [0]

    def fsync(fd):
        count[0] += 1
        if count[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(fd)

    os.fsync = fsync


def fit(start: dict) -> None:
    """One start of a run: build everything, fit to MAX_STEPS from ``last``, write the final state."""
    torch.set_num_threads(1)
    if start.get("kill_fsync"):
        kill_at_fsync(start["kill_fsync"])
    L.seed_everything(1234, verbose=False)
    noise = torch.Generator().manual_seed(5)
    model = Net(noise)
    loader = ts.ResumableLoader(Points(), batch_size=8, seed=7, shuffle=True)
    plugin = TrainStateCheckpointIO()
    callbacks = [KillAtStep(start.get("kill_step")),
                 ModelCheckpoint(dirpath=start["dir"], every_n_train_steps=EVERY, save_last=True)]
    if start["callback"]:
        callbacks.insert(0, TrainStateCallback(rngs={"noise": noise}))
    trainer = L.Trainer(max_steps=MAX_STEPS, enable_progress_bar=False, logger=False, accelerator="cpu", devices=1,
                        enable_model_summary=False, default_root_dir=start["dir"], plugins=[plugin],
                        callbacks=callbacks)
    trainer.fit(model, train_dataloaders=loader, ckpt_path="last")
    restored = plugin.last_restore.generation.name if plugin.last_restore else None
    final = {f"model.{k}": v for k, v in model.state_dict().items()}
    for pid, moments in trainer.optimizers[0].state_dict()["state"].items():
        final.update({f"opt.{pid}.{k}": torch.as_tensor(v) for k, v in moments.items()})
    final["loader"] = torch.tensor([loader.epoch, loader.cursor, loader.samples_seen])
    final["rng.torch"] = torch.get_rng_state()
    torch.save(final, start["out"])
    Path(start["out"] + ".json").write_text(json.dumps({"restored": restored}))


def run_start(start: dict) -> dict:
    """Fork a worker for ``start``; report how it ended and where it restored from."""
    _, status = fork_call(lambda: fit(start))  # the worker
    out = {"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
           "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}
    if os.path.exists(start["out"] + ".json"):
        out.update(json.loads(Path(start["out"] + ".json").read_text()))
    return out


def entries(directory: str) -> dict:
    """Each .ckpt file's entry, as JSON."""
    return {p.name: json.loads(p.read_bytes()) for p in sorted(Path(directory).glob("*.ckpt"))}


def checks(work: Path, chain_dir: str) -> dict:
    """Plugin behaviour that needs no fit: refusals, fallback on damage, removal."""
    out: dict = {}
    plugin = TrainStateCheckpointIO(work / "checks")

    def attempt(name, fn):
        try:
            out[name] = {"ok": repr(fn())[:200]}
        except Exception as exc:  # recorded for the test to assert on
            out[name] = {"error": type(exc).__name__, "message": str(exc),
                         "bases": [c.__name__ for c in type(exc).__mro__]}

    good = {"global_step": 1, "state_dict": {"w": torch.ones(2)}, "optimizer_states": [], "lr_schedulers": [],
            "loops": {}, "callbacks": {}, "epoch": 0}
    attempt("unencodable", lambda: plugin.save_checkpoint(
        {**good, "hyper_parameters": {"act": lambda x: x}}, str(work / "checks" / "bad.ckpt")))
    attempt("saved_after_refusal", lambda: plugin.save_checkpoint(good, str(work / "checks" / "a.ckpt")))
    changed = {**good, "state_dict": {"w": torch.ones(2)}, "loops": {"fit_loop": {"x": 1}}}
    attempt("changed_state_same_step", lambda: plugin.save_checkpoint(changed, str(work / "checks" / "b.ckpt")))
    out["revision"] = {"entries": {n: json.loads((work / "checks" / n).read_bytes())["generation"]
                                   for n in ("a.ckpt", "b.ckpt") if (work / "checks" / n).exists()},
                       "loaded": plugin.load_checkpoint(str(work / "checks" / "b.ckpt"))["loops"]}
    plugin.teardown()
    with ts.CheckpointManager(work / "checks") as ckpt:
        out["revision"]["latest"] = ckpt.latest()
    # A kill between the first publication and its entry leaves a generation that no .ckpt names.
    (work / "checks" / "a.ckpt").unlink()
    fresh = TrainStateCheckpointIO()
    attempt("fresh_into_existing_run", lambda: fresh.save_checkpoint({**good, "global_step": 2},
                                                                      str(work / "checks" / "c.ckpt")))
    attempt("load_run_directory", lambda: fresh.load_checkpoint(str(work / "checks"))["global_step"])
    attempt("save_after_directory_load", lambda: fresh.save_checkpoint({**good, "global_step": 2},
                                                                        str(work / "checks" / "c.ckpt")))
    fresh.teardown()
    torch.save({"state_dict": {}}, work / "checks" / "pickle.ckpt")
    attempt("pickle_refused", lambda: plugin.load_checkpoint(str(work / "checks" / "pickle.ckpt")))
    attempt("missing", lambda: plugin.load_checkpoint(str(work / "checks" / "nothere.ckpt")))
    plugin.teardown()
    # A removal interrupted after the entry went out of sight, before its pin was dropped: finished on open.
    interrupted = TrainStateCheckpointIO()
    removal = work / "removal"
    interrupted.save_checkpoint({**good, "global_step": 3}, str(removal / "d.ckpt"))
    interrupted.teardown()
    os.replace(removal / "d.ckpt", removal / ".d.ckpt.trainstate-removing")
    before = ts.CheckpointManager(removal).pins()
    (removal / ".e.ckpt.trainstate-tmp-0badc0de").write_bytes(b"{")  # an entry a kill cut short
    (removal / ".notes.trainstate-tmp-0badc0de").write_bytes(b"x")  # not an entry: not ours to remove
    resumed = TrainStateCheckpointIO()
    resumed.load_checkpoint(str(removal))
    out["stale_tmp"] = sorted(p.name for p in removal.glob(".*trainstate-tmp-*"))
    out["interrupted_removal"] = {"pinned_before": pin_name("d.ckpt") in before,
                                  "pinned_after": pin_name("d.ckpt") in resumed._manager.pins(),
                                  "aside_left": (removal / ".d.ckpt.trainstate-removing").exists()}
    resumed.teardown()

    # A train loader that keeps no position is named at train start.
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16)),
                                            batch_size=8)
        L.Trainer(max_steps=1, enable_progress_bar=False, logger=False, accelerator="cpu", devices=1,
                  enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(work / "plain"),
                  callbacks=[TrainStateCallback()]).fit(Net(torch.Generator()), train_dataloaders=plain)
    out["plain_loader_warnings"] = [str(w.message) for w in caught if w.category is ts.ContinuationWarning]

    # Resuming from an older checkpoint forks the run: the newer entries stop pinning, so the new timeline
    # can publish the steps again (their old generations are set aside as abandoned, not deleted).
    fork = work / "fork"
    first = TrainStateCheckpointIO()
    for step in (1, 2, 3):
        first.save_checkpoint({**good, "global_step": step}, str(fork / f"step={step}.ckpt"))
    first.teardown()
    again = TrainStateCheckpointIO()
    attempt("fork_load", lambda: again.load_checkpoint(str(fork / "step=1.ckpt"))["global_step"])
    attempt("fork_save", lambda: [again.save_checkpoint({**good, "global_step": step, "epoch": 1},
                                                        str(fork / f"again={step}.ckpt")) for step in (2, 3)])
    again.teardown()
    out["fork"] = {"abandoned": sorted(p.name.split(".")[0] for p in fork.glob("gen-*.abandoned-*")),
                   "entries": {p.name: json.loads(p.read_bytes())["generation"] for p in sorted(fork.glob("*.ckpt"))}}

    # A damaged newest generation: loading last.ckpt falls back to the newest generation that verifies.
    import shutil

    copy = work / "damaged"
    shutil.copytree(chain_dir, copy, symlinks=True)
    last = json.loads((copy / "last.ckpt").read_bytes())
    tensors = copy / last["generation"] / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0xFF
    tensors.chmod(0o644)
    tensors.write_bytes(bytes(data))
    loader = TrainStateCheckpointIO()
    loaded = loader.load_checkpoint(str(copy / "last.ckpt"))
    out["loader_state"] = loaded["loops"]["fit_loop"]["state_dict"].get("combined_loader")
    out["fallback"] = {"damaged": last["generation"], "loaded_step": loaded["global_step"],
                       "restored": loader.last_restore.generation.name,
                       "rejected": [r.generation for r in loader.last_restore.rejected]}
    loader.teardown()
    explicit = TrainStateCheckpointIO()
    loaded = explicit.load_checkpoint(str(copy / "epoch=2-step=18.ckpt"))
    out["fallback_explicit"] = {"loaded_step": loaded["global_step"],
                                "restored": explicit.last_restore.generation.name,
                                "rejected": [r.generation for r in explicit.last_restore.rejected]}
    explicit.teardown()

    # remove_checkpoint drops the entry and its pin, never the generation itself.
    remover = TrainStateCheckpointIO()
    names = sorted(p.name for p in copy.glob("epoch=*.ckpt"))
    remover.remove_checkpoint(str(copy / names[0]))
    manager = ts.CheckpointManager(copy)
    out["removed"] = {"entry_gone": not (copy / names[0]).exists(), "pins": manager.pins(),
                      "pin": pin_name(names[0]),
                      "generation_kept": (copy / last["generation"]).is_dir()}
    manager.close()
    remover.teardown()
    return out


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    work = Path(plan["work"])
    results: dict = {"frameworks_at_import": FRAMEWORKS_AT_IMPORT, "runs": {}}
    with ThreadPoolExecutor(len(plan["runs"])) as pool:  # the runs side by side, each run's starts in order
        done = {name: pool.submit(lambda starts: [run_start(start) for start in starts], starts)
                for name, starts in plan["runs"].items()}
    results["runs"] = {name: future.result() for name, future in done.items()}
    results["entries"] = {name: entries(starts[0]["dir"]) for name, starts in plan["runs"].items()}
    results["hidden"] = {name: sorted(p.name for p in Path(starts[0]["dir"]).glob(".*.ckpt*"))
                         for name, starts in plan["runs"].items()}
    results["generations"] = {name: sorted(p.name for p in Path(starts[0]["dir"]).glob("gen-*"))
                              for name, starts in plan["runs"].items()}
    results["checks"] = checks(work, plan["runs"]["killed"][0]["dir"])
    Path(sys.argv[2]).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
