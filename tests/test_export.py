"""`trainstate export` / `ts.export`: release weights from a verified generation, and nothing else."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as load_file_bytes, load_file, load_model

import trainstate as ts
from trainstate.cli.main import main
from trainstate.storage.posix import PosixOps
from trainstate.tools.export import parse_size, plan_shards, shard_header, shard_names


class TinyGPT(torch.nn.Module):
    """GPT-2's tie: the output projection is the token embedding."""

    def __init__(self, vocab: int = 50, dim: int = 16):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.wpe = torch.nn.Embedding(8, dim)
        self.ln_f = torch.nn.LayerNorm(dim)
        self.blocks = torch.nn.Sequential(*(torch.nn.Linear(dim, dim) for _ in range(3)))
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.register_buffer("mask", torch.tril(torch.ones(8, 8, dtype=torch.bool)))


class Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.register_buffer("keep", torch.tensor([True, False, True]))


def _fresh(cls, seed):
    torch.manual_seed(seed)
    return cls()


def _run(tmp_path, model, *, update=10, tokens=12345, metrics=None, contract=None):
    run = tmp_path / "run"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if isinstance(model, Norm):
        model.bn(model.fc(torch.randn(5, 4)))  # moves BatchNorm's running stats
    state = ts.TrainState(model=model, optimizer=opt, contract=contract or {})
    with ts.CheckpointManager(run) as ckpt:
        ckpt.restore(state)
        state.next_update, state.tokens_seen = update, tokens
        info = ckpt.save(state, metrics=metrics)
    return run, info


def test_tied_gpt_exports_once_and_load_model_reties_bitwise(tmp_path):
    trained = _fresh(TinyGPT, 0)
    run, gen = _run(tmp_path, trained)
    info = ts.export(run, tmp_path / "out")
    assert info.generation == gen.name and info.files == ("model.safetensors",) and info.shards == 1
    assert dict(info.tied) == {"lm_head.weight": ("wte.weight",)}  # the name save_model keeps
    path = tmp_path / "out" / "model.safetensors"
    with safe_open(path, "pt") as f:
        assert "wte.weight" not in f.keys() and f.metadata()["wte.weight"] == "lm_head.weight"
        assert f.metadata()["format"] == "pt"
    fresh = _fresh(TinyGPT, 1)
    assert not torch.equal(fresh.wte.weight, trained.wte.weight)
    missing, unexpected = load_model(fresh, path)
    assert not missing and not unexpected
    assert fresh.lm_head.weight.data_ptr() == fresh.wte.weight.data_ptr()
    for name, value in trained.state_dict().items():
        got = fresh.state_dict()[name]
        assert got.dtype == value.dtype and torch.equal(got.view(-1).view(torch.uint8) if got.is_floating_point()
                                                        else got, value.view(-1).view(torch.uint8)
                                                        if value.is_floating_point() else value), name
    # weights only: nothing of the optimizer, RNG or clocks
    assert sorted(load_file(path)) == sorted(k for k in trained.state_dict() if k != "wte.weight")


def test_bf16_casts_floats_only(tmp_path):
    trained = _fresh(Norm, 0)
    run, _ = _run(tmp_path, trained)
    info = ts.export(run, tmp_path / "out", dtype="bf16")
    assert info.dtype == "bfloat16"
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert saved["bn.num_batches_tracked"].dtype == torch.int64 and int(saved["bn.num_batches_tracked"]) == 1
    assert saved["keep"].dtype == torch.bool and saved["keep"].tolist() == [True, False, True]
    for name in ("fc.weight", "fc.bias", "bn.weight", "bn.running_mean", "bn.running_var"):
        assert saved[name].dtype == torch.bfloat16
        assert torch.equal(saved[name], trained.state_dict()[name].to(torch.bfloat16)), name


def test_sharded_export_loads_back_complete(tmp_path):
    trained = _fresh(TinyGPT, 0)
    run, _ = _run(tmp_path, trained)
    info = ts.export(run, tmp_path / "out", max_shard_size=1500)
    out = tmp_path / "out"
    assert info.shards > 2 and info.files == tuple(shard_names(info.shards))
    assert info.files[0] == f"model-00001-of-{info.shards:05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"} and set(index["weight_map"].values()) == set(info.files)
    merged = {}
    for file in info.files:
        part = load_file(out / file)
        assert all(index["weight_map"][k] == file for k in part)
        merged.update(part)
    assert index["metadata"]["total_size"] == info.total_bytes == sum(t.nbytes for t in merged.values())
    fresh = _fresh(TinyGPT, 1)
    missing, unexpected = fresh.load_state_dict(merged, strict=False)
    assert missing == ["wte.weight"] and not unexpected  # re-tied: it is lm_head.weight
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in trained.state_dict().items())
    assert fresh.wte.weight.data_ptr() == fresh.lm_head.weight.data_ptr()


def test_model_card_says_what_was_recorded_and_what_was_not(tmp_path):
    contract = {"data_manifest": "sha256:abc123", "config": {"lr": 1e-3}}
    run, gen = _run(tmp_path, _fresh(TinyGPT, 0), update=40, tokens=987654, metrics={"val_loss": 2.5},
                    contract=contract)
    ts.export(run, tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    manifest = json.loads((run / gen.name / "manifest.json").read_text())
    for needle in (gen.name, "Update: 40", "Tokens seen: 987654", manifest["contract_fingerprint"],
                   "sha256:abc123", f"`{torch.__version__}`", "at update 40", "val_loss: 2.5",
                   "lm_head.weight"):
        assert needle in card, needle
    for field in ("License", "Intended use", "Limitations", "Evaluation protocol"):
        assert f"- {field}: not recorded" in card


def test_model_card_claims_no_data_manifest_or_metrics_it_lacks(tmp_path):
    run, _ = _run(tmp_path, _fresh(Norm, 0))
    ts.export(run, tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "- Data manifest: not recorded" in card
    assert "(at update 10)\n\n- not recorded" in card


def test_a_generation_directory_and_the_cli(tmp_path, capsys):
    run, gen = _run(tmp_path, _fresh(TinyGPT, 0))
    rc = main(["export", str(run / gen.name), str(tmp_path / "out"), "--dtype", "fp16", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["generation"] == gen.name and report["dtype"] == "float16"
    assert load_file(tmp_path / "out" / "model.safetensors")["ln_f.weight"].dtype == torch.float16
    rc = main(["export", str(run), str(tmp_path / "other"), "--component", "nope"])
    assert rc == 1 and "no component 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


def test_never_overwrites_a_non_empty_out(tmp_path):
    run, _ = _run(tmp_path, _fresh(Norm, 0))
    out = tmp_path / "out"
    out.mkdir()
    ts.export(run, out)  # an empty directory is taken
    before = sorted(os.listdir(out))
    with pytest.raises(ts.GenerationExists, match="new path"):
        ts.export(run, out)
    assert sorted(os.listdir(out)) == before
    assert sorted(os.listdir(tmp_path)) == ["out", "run"]  # no staging left behind


def test_a_damaged_generation_is_refused(tmp_path):
    run, gen = _run(tmp_path, _fresh(Norm, 0))
    path = run / gen.name / "tensors.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ts.CorruptGeneration):
        ts.export(run / gen.name, tmp_path / "out")
    assert not (tmp_path / "out").exists()


class FailingFsync(PosixOps):
    def fsync(self, fd: int) -> None:
        raise OSError(5, "Input/output error")


def test_a_failed_fsync_publishes_nothing_and_cleans_up(tmp_path):
    run, _ = _run(tmp_path, _fresh(Norm, 0))
    with pytest.raises(OSError, match="Input/output"):
        ts.export(run, tmp_path / "out", ops=FailingFsync())
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_sizes_and_shard_planning_are_pure():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 << 20 and parse_size(100) == 100
    for bad in ("5 parsecs", "-1", 0):
        with pytest.raises(ts.InvalidArgument):
            parse_size(bad)
    assert plan_shards({"a": 6, "b": 6, "c": 20, "d": 1}, 10) == [["a"], ["b"], ["c"], ["d"]]
    assert plan_shards({"a": 4, "b": 4, "c": 4}, 8) == [["a", "b"], ["c"]]
    assert plan_shards({"a": 4, "b": 4}, None) == [["a", "b"]]
    assert shard_names(1) == ["model.safetensors"]


def test_a_streamed_header_is_the_safetensors_format():
    tensors = {"b": torch.arange(3, dtype=torch.int16), "a": torch.ones(2, 2), "c": torch.tensor(True)}
    header, order = shard_header({n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}, {"format": "pt", "x": "a"})
    assert order == ["a", "b", "c"] and len(header) % 8 == 0  # larger elements first: each tensor aligned
    data = header + b"".join(tensors[n].contiguous().numpy().tobytes() for n in order)
    with_lib = load_file_bytes(data)
    assert all(torch.equal(with_lib[n], t) for n, t in tensors.items()) and set(with_lib) == set(tensors)
    with pytest.raises(ts.InvalidArgument, match="--dtype"):
        shard_header({"z": (torch.float8_e8m0fnu, (2,))}, {})


def test_a_symlinked_or_file_out_and_a_missing_parent_are_refused(tmp_path):
    run, _ = _run(tmp_path, _fresh(Norm, 0))
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    (tmp_path / "file").write_text("x")
    for out in ("link", "file"):
        with pytest.raises(ts.GenerationExists, match="not a directory"):
            ts.export(run, tmp_path / out)
    with pytest.raises(ts.InvalidArgument, match="create it first"):
        ts.export(run, tmp_path / "missing" / "out")
    assert sorted(os.listdir(tmp_path)) == ["file", "link", "run", "target"] and not os.listdir(tmp_path / "target")


class Wrapped(torch.nn.Module):
    """Names as torch.compile (``_orig_mod.``) or DDP (``module.``) give them."""

    def __init__(self, attribute: str, inner: torch.nn.Module):
        super().__init__()
        setattr(self, attribute, inner)


def test_warm_start_from_an_export_reties_and_names_its_generation(tmp_path):
    trained = _fresh(TinyGPT, 0)
    run, gen = _run(tmp_path, trained)
    for out, shard in (("one", None), ("sharded", 1500)):
        ts.export(run, tmp_path / out, max_shard_size=shard, dtype="fp32")
        fresh = _fresh(TinyGPT, 1)
        info = ts.warm_start(tmp_path / out, fresh)
        assert info.complete and not info.renamed
        assert (info.generation.name, info.generation.kind, info.generation.next_update) == (gen.name, "export", 10)
        assert info.generation.manifest_digest == gen.manifest_digest
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in trained.state_dict().items())
        assert fresh.wte.weight.data_ptr() == fresh.lm_head.weight.data_ptr()


def test_warm_start_maps_compile_and_ddp_prefixes_with_a_report(tmp_path):
    trained = Wrapped("_orig_mod", _fresh(Norm, 0))
    run, _ = _run(tmp_path, trained)
    ts.export(run, tmp_path / "out")
    plain = _fresh(Norm, 1)
    info = ts.warm_start(tmp_path / "out", plain)
    assert info.complete and ("_orig_mod.fc.weight", "fc.weight") in info.renamed and "renamed" in info.describe()
    assert torch.equal(plain.fc.weight, trained._orig_mod.fc.weight)
    ddp = Wrapped("module", _fresh(Norm, 2))
    info = ts.warm_start(run, ddp)  # a generation, too
    assert info.complete and ("_orig_mod.bn.running_mean", "module.bn.running_mean") in info.renamed
    assert torch.equal(ddp.module.bn.running_mean, trained._orig_mod.bn.running_mean)


def test_warm_start_refuses_a_damaged_export(tmp_path):
    run, _ = _run(tmp_path, _fresh(Norm, 0))
    ts.export(run, tmp_path / "out")
    (tmp_path / "out" / "model.safetensors").write_bytes(b"\x00" * 7)
    with pytest.raises(ts.CorruptGeneration):
        ts.warm_start(tmp_path / "out", _fresh(Norm, 1))
