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

A plan with ``"mode": "kill_points"`` (tests/test_lightning_kill_points.py)
runs the drill of issue 48 instead: 24 steps, a top-2 ModelCheckpoint every 3
steps with ``save_last=True``; an uninterrupted reference traces which fsyncs
each save spans, then one killed start per fsync of the saves at steps 3 and
6, each followed by a restart with ``ckpt_path="last"``.
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

import trainstate.integrations.lightning as plugin_module  # noqa: E402
from trainstate.integrations.lightning import TrainStateCallback, TrainStateCheckpointIO  # noqa: E402
from trainstate.integrations.lightning_entry import pin_name  # noqa: E402
from forkjobs import fork_call, warm_imports  # noqa: E402

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
        loss = ((self.net(x + jitter).squeeze(1) * scale - y) ** 2).mean()
        self.log("loss", loss)  # what a top-k ModelCheckpoint monitors
        return loss

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


def kill_at_entry(name: str) -> None:
    """SIGKILL this process as it renames the entry ``name`` into place: its generation committed and pinned, the
    entry written to a temporary file and fsynced, the name not there yet."""
    real = os.replace

    def replace(src, dst, **kwargs):
        if os.path.basename(dst) == name:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(src, dst, **kwargs)

    os.replace = replace


def trace_saves(trace: list) -> None:
    """Record the fsyncs each save spans (numbered from this process's first), for choosing kill points."""
    real_fsync, real_save, count = os.fsync, TrainStateCheckpointIO.save_checkpoint, [0]

    def fsync(fd):
        count[0] += 1
        return real_fsync(fd)

    def save(self, checkpoint, path, storage_options=None):
        first = count[0] + 1
        real_save(self, checkpoint, path, storage_options)
        trace.append({"file": os.path.basename(path), "step": checkpoint["global_step"], "fsyncs": [first, count[0]]})

    os.fsync, TrainStateCheckpointIO.save_checkpoint = fsync, save


def old_ordering() -> None:
    """Negative control: the code before issue 48, with no link written ahead of a commit and none kept after it."""
    plugin_module.bridge_ahead = lambda *args: None
    plugin_module.settle_bridges = lambda *args: None


def no_renaming() -> None:
    """Negative control: a top-k name a kill lost is not written again when its generation loads, and a fit
    resumed from its final step leaves the RNG streams as its start-up left them (the code before issue 48)."""
    TrainStateCheckpointIO._name_again = lambda self, *args: None
    TrainStateCallback.on_fit_end = lambda self, trainer, pl_module: None


def last_found(directory: str) -> list[str]:
    """What ``ckpt_path="last"`` would load from, by Lightning's own search (existing ``last*.ckpt``)."""
    found = ModelCheckpoint(dirpath=directory)._find_last_checkpoints(None)
    return sorted(os.path.basename(p) for p in found if os.path.exists(p))


def fit(start: dict) -> None:
    """One start of a run: build everything, fit to its max_steps from ``last``, write the final state."""
    torch.set_num_threads(1)
    trace: list = []
    for flag, patch in (("old_ordering", old_ordering), ("no_renaming", no_renaming)):
        if start.get(flag):
            patch()
    if start.get("trace"):
        trace_saves(trace)
    if start.get("kill_fsync"):
        kill_at_fsync(start["kill_fsync"])
    if start.get("kill_entry"):
        kill_at_entry(start["kill_entry"])
    L.seed_everything(1234, verbose=False)
    noise = torch.Generator().manual_seed(5)
    model = Net(noise)
    loader = ts.ResumableLoader(Points(), batch_size=8, seed=7, shuffle=True)
    plugin = TrainStateCheckpointIO()
    top_k = {"save_top_k": start["top_k"], "monitor": "loss"} if start.get("top_k") else {}
    checkpoints = ModelCheckpoint(dirpath=start["dir"], every_n_train_steps=EVERY, save_last=True, **top_k)
    callbacks = [KillAtStep(start.get("kill_step")), checkpoints]
    if start["callback"]:
        callbacks.insert(0, TrainStateCallback(rngs={"noise": noise}))
    trainer = L.Trainer(max_steps=start.get("max_steps", MAX_STEPS), enable_progress_bar=False, logger=False,
                        accelerator="cpu", devices=1, enable_model_summary=False, default_root_dir=start["dir"],
                        plugins=[plugin], callbacks=callbacks)
    try:
        trainer.fit(model, train_dataloaders=loader, ckpt_path="last")
    except Exception as exc:  # reported for the test (a negative control expects ExistingRun)
        Path(start["out"] + ".json").write_text(json.dumps({
            "error": type(exc).__name__, "message": str(exc), "global_step": trainer.global_step,
            "restored": plugin.last_restore.generation.name if plugin.last_restore else None}))
        raise
    restored = plugin.last_restore.generation.name if plugin.last_restore else None
    final = {f"model.{k}": v for k, v in model.state_dict().items()}
    for pid, moments in trainer.optimizers[0].state_dict()["state"].items():
        final.update({f"opt.{pid}.{k}": torch.as_tensor(v) for k, v in moments.items()})
    final["loader"] = torch.tensor([loader.epoch, loader.cursor, loader.samples_seen])
    final["rng.torch"] = torch.get_rng_state()
    torch.save(final, start["out"])
    mc = checkpoints.state_dict()  # the checkpoint files Lightning's state refers to (the oracle: not the plugin's)
    named = [*mc["best_k_models"], mc["best_model_path"], mc["kth_best_model_path"], mc["last_model_path"]]
    paths = {p: os.path.exists(p) for p in named if p}
    Path(start["out"] + ".json").write_text(json.dumps({"restored": restored, "global_step": trainer.global_step,
                                                        "trace": trace, "referenced": paths}))


def run_start(start: dict) -> dict:
    """Fork a worker for ``start``; report how it ended and where it restored from."""
    _, status = fork_call(lambda: fit(start), start.get("log"))  # the worker
    out = {"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
           "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}
    if os.path.exists(start["out"] + ".json"):
        out.update(json.loads(Path(start["out"] + ".json").read_text()))
    return out


def entries(directory: str) -> dict:
    """Each .ckpt file's entry, as JSON (the links that let ``ckpt_path="last"`` find the run: see bridges)."""
    return {p.name: json.loads(p.read_bytes()) for p in sorted(Path(directory).glob("*.ckpt")) if not p.is_symlink()}


def bridges(directory: str) -> dict:
    """Each ``last.trainstate-gen-….ckpt`` link and what it points to."""
    return {p.name: os.readlink(p) for p in sorted(Path(directory).glob("*.ckpt")) if p.is_symlink()}


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
                   "entries": {name: entry["generation"] for name, entry in entries(str(fork)).items()},
                   "bridges": bridges(str(fork))}

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


def drill(work: Path, name: str, kill: dict, restarts: int = 1, **flags) -> list[dict]:
    """A start of the issue-48 drill killed as ``kill`` says, then ``restarts`` starts with ``ckpt_path="last"``.

    Each start's report adds the generations and Lightning's last checkpoints
    it left behind.
    """
    base = {"dir": str(work / name), "callback": True, "max_steps": 24, "top_k": 2, "log": str(work / f"{name}.log"),
            **flags}
    starts = [{**base, **kill, "out": str(work / f"{name}-0.pt")}]
    starts += [{**base, "out": str(work / f"{name}-{i}.pt")} for i in range(1, restarts + 1)]
    reports = []
    for start in starts:
        report = run_start(start)
        report["generations"] = sorted(p.name for p in Path(base["dir"]).glob("gen-*"))
        report["last_found"] = last_found(base["dir"])
        reports.append({**report, "out": start["out"]})
    return reports


def kill_points(work: Path) -> dict:
    """The reference fit, then a killed start and a restart for every fsync of the saves at steps 3 and 6."""
    warm_imports()  # the first optimizer step's lazy imports, once, not in every worker
    reference = drill(work, "reference", {}, restarts=0, trace=True)[0]
    trace = json.loads(Path(reference["out"] + ".json").read_text())["trace"]
    points = [n for save in trace if save["step"] in (3, 6) for n in range(save["fsyncs"][0], save["fsyncs"][1] + 1)]
    top_k_file = next(s["file"] for s in trace if s["step"] == 24 and not s["file"].startswith("last"))
    runs = {f"fsync-{n}": ({"kill_fsync": n}, {}) for n in points}
    runs.update({  # a kill after the first commit, before any entry: the crash loop of issue 48 with the old order
        "control-old-order": ({"kill_entry": next(s["file"] for s in trace if s["step"] == 3)}, {"old_ordering": True}),
        "final-top-k": ({"kill_entry": top_k_file}, {}),  # the last save's generation committed, its top-k name not
        "control-final-top-k": ({"kill_entry": top_k_file}, {"no_renaming": True})})
    with ThreadPoolExecutor(2) as pool:
        done = {name: pool.submit(drill, work, name, kill, 2 if name == "control-old-order" else 1, **flags)
                for name, (kill, flags) in runs.items()}
    return {"reference": reference, "trace": trace, "points": points,
            "runs": {name: future.result() for name, future in done.items()}}


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    work = Path(plan["work"])
    if plan.get("mode") == "kill_points":
        Path(sys.argv[2]).write_text(json.dumps(kill_points(work), indent=1, default=str))
        return
    results: dict = {"frameworks_at_import": FRAMEWORKS_AT_IMPORT, "runs": {}}
    with ThreadPoolExecutor(len(plan["runs"])) as pool:  # the runs side by side, each run's starts in order
        done = {name: pool.submit(lambda starts: [run_start(start) for start in starts], starts)
                for name, starts in plan["runs"].items()}
    results["runs"] = {name: future.result() for name, future in done.items()}
    results["entries"] = {name: entries(starts[0]["dir"]) for name, starts in plan["runs"].items()}
    results["bridges"] = {name: bridges(starts[0]["dir"]) for name, starts in plan["runs"].items()}
    results["hidden"] = {name: sorted(p.name for p in Path(starts[0]["dir"]).glob(".*.ckpt*"))
                         for name, starts in plan["runs"].items()}
    results["generations"] = {name: sorted(p.name for p in Path(starts[0]["dir"]).glob("gen-*"))
                              for name, starts in plan["runs"].items()}
    results["checks"] = checks(work, plan["runs"]["killed"][0]["dir"])
    Path(sys.argv[2]).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
