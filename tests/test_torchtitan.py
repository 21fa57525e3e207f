"""trainstate inside the real torchtitan (0.3.0): the llama3 debug model on CPU, gloo, FSDP2, under torchrun.

Every launch runs ``tests/titan_launch.py`` (torchtitan's ``train.main`` with
the CPU patches, an attention dropout so that training draws random numbers,
and a record of each step's global loss as ``float.hex``). The launches are
shared by the tests through module fixtures:

- the reference: an uninterrupted run with trainstate's checkpointer
  (blocking saves every 2 steps);
- the drill: the same command with background saves, SIGKILLed
  (torchrun and every rank) at random moments, some inside saves, and
  relaunched until done; every loss recorded after a resume, and the final
  generation, equal the reference's bit for bit;
- the control: torchtitan's own checkpointer killed once and relaunched:
  the step it repeats after the resume differs from the first time it ran
  (the seed is set again at start; no RNG is saved), and its load calls
  pickle;
- damage: a flipped bit in the reference's last generation: the relaunch
  passes over it, resumes from the step before, calls neither pickle nor
  ``torch.load`` while loading, and trains the same losses again;
- resharding: FSDP2 x TP at 4 ranks, restored at 2 (FSDP2): model,
  optimizer and scheduler bitwise;
- the doctor: ``trainstate doctor RUN@4 --launch CMD`` runs the job's own
  torchrun line per role and finds nothing on every rank; its control (torch
  seeded again after the restore) is named at the first draws.

Knobs: ``TRAINSTATE_TITAN_KILLS`` (default 2), ``TRAINSTATE_KILL_SEED``.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

import trainstate as ts  # noqa: E402
from titan_harness import (build_assets, checkpoint_flags, kill_titan, launch_titan, losses, start_titan,  # noqa: E402
                           titan_args, titan_command, wait_for_step)
from trainstate import cli  # noqa: E402
from trainstate.tools.doctor import render  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 10
INTERVAL = 2
KILLS = int(os.environ.get("TRAINSTATE_TITAN_KILLS", "2"))
SEED = int(os.environ.get("TRAINSTATE_KILL_SEED") or random.SystemRandom().randrange(2**31))
MODULE = "trainstate.integrations.torchtitan"
ENV = {"TITAN_DROPOUT": "0.1"}


def _args(out: Path, assets, run: Path, *extra: str, module: str = MODULE, steps: int = STEPS) -> list[str]:
    return titan_args(out, assets, steps=steps, module=module,
                      extra=[*checkpoint_flags(run, interval=INTERVAL), *extra])


def _audit(out: Path, ranks: int = 2) -> list[dict]:
    return [json.loads((out / "audit" / f"audit-rank{r}.json").read_text()) for r in range(ranks)]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_assets(tmp_path_factory.mktemp("titan-assets"))


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("titan-reference")
    launched = launch_titan(out, _args(out, assets, out / "run"), env=ENV)
    launched.ok()
    steps = losses(out)
    assert [s for s, _ in steps] == list(range(1, STEPS + 1)), steps
    return out, dict(steps)


@pytest.fixture(scope="module")
def drill(assets, tmp_path_factory):
    """KILLS launches SIGKILLed at a random moment after a random step (background saves), then one to the end."""
    out = tmp_path_factory.mktemp("titan-drill")
    rng = random.Random(SEED)
    args = _args(out, assets, out / "run", "--checkpoint.async_mode", "async")
    kills = []
    for _ in range(KILLS):
        before = len(losses(out))
        proc, marker = start_titan(out, args, env=ENV)
        step = rng.randint(3, STEPS - 1)  # step 3 recorded: the save at 2 was made (its publication may run on)
        try:
            wait_for_step(proc, out, step, since=before)
            time.sleep(rng.uniform(0.0, 0.8))  # a step with its save takes about 0.5 s: some kills land inside
        finally:
            kill_titan(proc, marker)
        kills.append(step)
    finished = launch_titan(out, args, env={**ENV, "TITAN_PICKLE_AUDIT": str(out / "audit")})
    finished.ok()
    return out, kills, finished


def test_a_killed_torchtitan_run_resumes_every_loss_bitwise(reference, drill):
    _, expected = reference
    out, kills, finished = drill
    recorded = losses(out)
    context = f"seed {SEED}, kills after steps {kills}"
    assert {s for s, _ in recorded} == set(range(1, STEPS + 1)), context
    resumed = [(s, v) for s, v in recorded if v != expected[s]]
    assert resumed == [], (context, resumed)
    assert len(recorded) > STEPS or KILLS == 0, (context, "no kill made the run repeat a step")
    log = (out / "torchrun.log").read_text()
    assert "resumed from gen-" in log, context  # a launch continued from a generation, not from the start


def test_the_drill_ends_in_the_reference_state_and_loads_without_pickle(reference, drill):
    ref, _ = reference
    out, kills, _ = drill
    report = ts.diff(str(ref / "run"), str(out / "run"))
    assert report.identical, (SEED, kills, [(c.name, c.summary) for c in report.categories if c.summary])
    assert all(a["calls"] == 0 for a in _audit(out)), _audit(out)


def test_control_torchtitans_checkpointer_resumes_a_different_run_and_unpickles(assets, tmp_path_factory):
    """Killed once after step 7 is recorded (its step-6 checkpoint exists), relaunched: step 7 runs again with
    the seed set at start instead of the RNG it had, so its loss differs; the load called pickle."""
    out = tmp_path_factory.mktemp("titan-control")
    args = _args(out, assets, out / "ckpt", "--checkpoint.keep_latest_k", "0", module="llama3", steps=8)
    proc, marker = start_titan(out, args, env=ENV)
    try:
        wait_for_step(proc, out, 7, since=0)
    finally:
        kill_titan(proc, marker)
    launch_titan(out, args, env={**ENV, "TITAN_PICKLE_AUDIT": str(out / "audit")}).ok()
    recorded = losses(out)
    sevens = [v for s, v in recorded if s == 7]
    assert len(sevens) == 2 and sevens[0] != sevens[1], recorded
    assert all(a["calls"] > 0 for a in _audit(out)), _audit(out)


def test_a_flipped_bit_in_the_last_generation_falls_back_and_trains_the_same_losses(assets, reference, capsys):
    ref, expected = reference
    run = ref / "run"
    last = run / f"gen-{STEPS:012d}"
    shard = max(last.glob("shard-*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    assert cli.main(["verify", str(run), "--json"]) == 1  # the damage is there to find
    capsys.readouterr()
    before = len(losses(ref))
    launched = launch_titan(ref, _args(ref, assets, run), env={**ENV, "TITAN_PICKLE_AUDIT": str(ref / "audit")})
    launched.ok()
    assert f"passed over gen-{STEPS:012d}" in launched.log, launched.log[-3000:]
    assert f"resumed from gen-{STEPS - INTERVAL:012d}" in launched.log
    again = losses(ref)[before:]
    assert [s for s, _ in again] == [STEPS - 1, STEPS] and all(v == expected[s] for s, v in again), again
    assert all(a["calls"] == 0 for a in _audit(ref)), _audit(ref)


def test_fsdp2_by_tp_at_four_ranks_reshards_exactly_onto_two(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("titan-reshard")
    four = out / "four"
    launch_titan(four, _args(four, assets, out / "run", "--parallelism.tensor_parallel_degree", "2", steps=4),
                 ranks=4, env=ENV).ok()
    two = out / "two"
    args = _args(two, assets, out / "run", "--checkpoint.exclude_from_loading", "dataloader",
                 "--checkpoint.allow_changes", "world_size", steps=4)
    launched = launch_titan(two, args, env={**ENV, "TITAN_SAVE_AFTER_LOAD": str(out / "loaded")})
    launched.ok()
    report = ts.diff(str(out / "run"), str(out / "loaded"))
    same = {c.name: not c.summary.split(":", 1)[-1].strip().startswith("DIFFERENT") for c in report.categories}
    assert same["model"] and same["optimizer"] and same["scheduler"], [(c.name, c.summary) for c in report.categories]
    assert not same["contract"]  # the world size, accepted


def test_the_tools_read_a_torchtitan_run(drill, capsys):
    out, _, _ = drill
    run = str(out / "run")
    for command in (["ls", run], ["verify", run], ["inspect", run], ["diff", f"{run}@{STEPS - INTERVAL}", run]):
        code = cli.main([*command, "--json"])
        said = json.loads(capsys.readouterr().out)
        assert code in (0, 1) if command[0] == "diff" else code == 0, (command, said)
        if command[0] == "verify":
            assert said["failures"] == [] and len(said["verified"]) >= 2, said
        if command[0] == "inspect":
            assert {"lr_scheduler", "train_state"} <= set(said["components"]), said
            assert set(said["sharded"]["components"]) == {"model", "optimizer"}, said["sharded"]
            assert said["sharded"]["per_rank"] == ["dataloader"] and said["sharded"]["world_size"] == 2
            assert said["clocks"]["next_update"] == STEPS, said
        if command[0] == "diff":
            assert said["first"] is not None  # two updates apart: the model moved


DOCTOR_AT = 4


def _doctor_command(assets, out: Path, **env: str) -> list[str]:
    return titan_command(out, _args(out, assets, out / "unused"), env={**ENV, **env})


def test_the_doctor_replays_a_torchtitan_resume_on_every_rank(assets, reference, tmp_path, capsys):
    """Three launches of the job's own command: step 5 restored twice from the reference run's step 4, and
    replayed from the start: every stage identical on both ranks, the run directory untouched."""
    out, _ = reference
    run = out / "run"
    before = sorted(p.name for p in run.iterdir())
    command = _doctor_command(assets, tmp_path / "launch")
    code = cli.main(["doctor", f"{run}@{DOCTOR_AT}", "--launch", " ".join(command), "--timeout", "300", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    assert report["identical"] and report["reproducible"] is True and report["first"] is None, report["diagnosis"]
    assert report["update"] == DOCTOR_AT
    stages = {c["name"]: c for c in report["stages"]}
    assert stages["state"]["tensors"] > 0 and stages["updated"]["tensors"] > 0
    for stage, least in (("batch", 2), ("rng", 6), ("loss", 2), ("grads", 2), ("lr", 4)):
        assert stages[stage]["tensors"] >= least, (stage, stages[stage])  # both ranks recorded it
    assert "rng.torch_cpu" in " ".join(report["drawn"]["resumed"]), report["drawn"]  # the dropout draws
    assert sorted(p.name for p in run.iterdir()) == before  # the doctor wrote nothing into the run


def test_control_the_doctor_names_a_reseeded_stream_at_its_first_draws(assets, reference, tmp_path):
    """Negative control: the resumed launch seeds torch again after the restore (as a checkpointer without RNG
    state would): the state restored is identical, the first draws are not, and the doctor says so."""
    out, _ = reference
    command = _doctor_command(assets, tmp_path / "launch", TITAN_RESEED_AFTER_LOAD="1")
    report = ts.doctor(f"{out / 'run'}@{DOCTOR_AT}", launch=command, repeat=False, timeout_s=300)
    assert not report.identical and report.first == "rng", render(report)
    paths = [e.path for e in report.stage("rng").entries]
    assert "torch_cpu[rank0]" in paths and "torch_cpu[rank1]" in paths, paths
    assert "not in the checkpoint" in report.diagnosis


def _hf_config(assets) -> dict:
    """The debug model (torchtitan's llama3 'debugmodel' flavor) as a Hugging Face LlamaConfig."""
    from torchtitan.models.llama3 import model_registry

    model = model_registry("debugmodel").model
    attention, rope = model.layers[0].attention, model.layers[0].attention.rope
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": model.dim,
            "num_hidden_layers": len(model.layers), "num_attention_heads": attention.n_heads,
            "num_key_value_heads": attention.n_kv_heads or attention.n_heads,
            "intermediate_size": model.layers[0].feed_forward.w1.out_features, "vocab_size": model.vocab_size,
            "rms_norm_eps": model.norm.eps, "max_position_embeddings": 2048, "tie_word_embeddings": False,
            "rope_theta": rope.theta, "rope_scaling": {
                "rope_type": "llama3", "factor": rope.scaling_factor, "low_freq_factor": rope.low_freq_factor,
                "high_freq_factor": rope.high_freq_factor,
                "original_max_position_embeddings": rope.original_max_position_embeddings},
            "torch_dtype": "float32"}


def test_export_to_hugging_face_safetensors_that_transformers_loads(drill, assets, tmp_path, capsys):
    """Hugging Face names through torchtitan's own state-dict adapter: transformers loads every weight, none
    missing or left over, and torchtitan's adapter maps them back to the generation's tensors bitwise."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from trainstate.integrations.torchtitan import hf_mapping

    out, _, _ = drill
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_hf_config(assets)))
    hf, raw = tmp_path / "hf", tmp_path / "raw"
    assert cli.main(["export", str(out / "run"), str(hf), "--hf-config", str(config),
                     "--mapping", "trainstate.integrations.torchtitan:hf_mapping"]) == 0
    assert cli.main(["export", str(out / "run"), str(raw)]) == 0
    capsys.readouterr()
    model, info = LlamaForCausalLM.from_pretrained(str(hf), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        logits = model(torch.arange(16).unsqueeze(0)).logits
    assert torch.isfinite(logits).all()
    exported, stored = load_file(str(hf / "model.safetensors")), load_file(str(raw / "model.safetensors"))
    state = json.loads((out / "run" / f"gen-{STEPS:012d}" / "state.json").read_text())
    back = hf_mapping(state).adapter.from_hf(dict(exported))
    assert set(back) == set(stored) and all(torch.equal(back[k], stored[k]) for k in stored)
