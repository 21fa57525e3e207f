"""On an object store a part's bytes are stored once, however many generations name it (issue 51, item 2).

A linked part is a reference, carried by the commit record, to the object its
bytes were first uploaded as (``trainstate.storage.objectrefs``); retention
keeps an object while a kept generation names or references it, by a sweep
that derives liveness from what it lists. A LoRA-shaped run (a 4 MiB frozen
base, adapters trained with AdamW) saved 20 times with ``keep_last=3``,
straight on S3 (moto and SeaweedFS) and through a mirror: the store holds the
base twice (its two copies) plus what the kept generations changed, a fresh
machine restores bitwise, ``trainstate verify`` passes, and nothing is left
behind once no generation references it. A save whose commit never lands
(killed between its references and its record) leaves nothing that the next
save's cleanup does not remove, and removes nothing a kept generation needs.
"""

from __future__ import annotations

import time

import pytest
import torch

import trainstate as ts
from trainstate import cli
from objectservers import moto_server, s3_server, seaweed_server  # noqa: F401  (fixtures)

pytest.importorskip("obstore")


def _state(seed: int = 0) -> ts.TrainState:
    torch.manual_seed(seed)
    base = torch.nn.ModuleList(torch.nn.Linear(512, 512, bias=False) for _ in range(4)).requires_grad_(False)
    adapters = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(512, 8) * 0.01) for _ in range(8))
    model = torch.nn.ModuleDict({"base": base, "adapters": adapters})
    return ts.TrainState(model=model, optimizer=torch.optim.AdamW(adapters.parameters(), lr=1e-3))


def _step(state: ts.TrainState) -> dict[str, torch.Tensor]:
    model, opt = state["model"], state["optimizer"]
    x = torch.randn(2, 512)
    for i, layer in enumerate(model["base"]):
        x = layer(x) + (x @ model["adapters"][2 * i]) @ model["adapters"][2 * i + 1].T
    x.square().mean().backward()
    opt.step()
    opt.zero_grad()
    state.next_update += 1
    return {k: v.clone() for k, v in model.state_dict().items()}


def _base_bytes(state: ts.TrainState) -> int:
    return sum(p.nbytes for p in state["model"]["base"].parameters())


def _stored(server, bucket: str, prefix: str) -> dict[str, int]:
    """Every object under the run's prefix, with its size, as the server lists it."""
    from trainstate.storage.objects import ObjectStore

    store = ObjectStore(server.url(bucket, prefix), storage_options=server.storage_options())
    return store.client.listing("")


def _run_url(server) -> tuple[str, str, dict]:
    """A fresh bucket, the run's URL in it and the options to reach it."""
    bucket = server.make_bucket()
    return bucket, server.url(bucket, "run"), server.storage_options()


def _saves(ckpt: ts.CheckpointManager, state: ts.TrainState, saved: dict, count: int) -> None:
    """``count`` updates, each saved; the values each generation holds, by name, into ``saved``."""
    for _ in range(count):
        values = _step(state)
        saved[ckpt.save(state).name] = values


def _verify(server, monkeypatch, capsys, url: str) -> int:
    for name, value in (("AWS_ENDPOINT_URL", server.endpoint), ("AWS_ACCESS_KEY_ID", server.access_key),
                        ("AWS_SECRET_ACCESS_KEY", server.secret_key), ("AWS_REGION", server.region),
                        ("AWS_ALLOW_HTTP", "true")):
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    return cli.main(["verify", url])


@pytest.mark.parametrize("control", [False, True], ids=["referenced", "control-uploaded-again"])
def test_twenty_saves_store_the_base_twice_plus_what_changed(s3_server, monkeypatch, capsys, control):
    """20 saves, ``keep_last=3``, straight on S3: the store holds at most 2x the base (the part and its spare)
    plus every kept generation's own files; the newest restores bitwise on a fresh machine, every generation
    verifies, and no object is held by nothing. Control: a link that uploads again (no reference) stores the
    base twice per kept generation."""
    from trainstate.storage.objects import ObjectStaging

    if control:
        monkeypatch.setattr(ObjectStaging, "link", lambda self, file, generation, record: None)
    bucket, url, options = _run_url(s3_server)
    state, saved = _state(), {}
    with ts.CheckpointManager(url, keep_last=3, storage_options=options) as ckpt:
        _saves(ckpt, state, saved, 20)
        kept = ckpt.generations()
        left = ckpt.store.leftovers()
    base = _base_bytes(state)
    stored = _stored(s3_server, bucket, "run")
    parts = sum(size for key, size in stored.items() if "/part-" in key)
    if control:
        assert parts >= 2 * len(kept) * base, (parts, base)
        return
    assert len(kept) == 3 and left == []
    assert parts <= 2 * base + 4096 and sum(stored.values()) <= 2 * base + 3 * (1 << 20), (parts, stored)
    fresh = _state(seed=9)
    with ts.CheckpointManager(url, storage_options=options) as ckpt:
        assert ckpt.restore(fresh).generation.name == kept[0]
    assert all(torch.equal(v, saved[kept[0]][k]) for k, v in fresh["model"].state_dict().items())
    assert _verify(s3_server, monkeypatch, capsys, url) == 0


def test_a_mirror_stores_the_base_twice_on_the_remote(tmp_path, moto_server):
    """A local run (``keep_last=3``) mirrored to S3 (the mirror's retention keeps 3 as well): after 20 saves the
    remote holds the base's two copies once each, plus what the kept generations changed, and a fresh machine
    restores the newest bitwise from the remote alone."""
    bucket = moto_server.make_bucket()
    mirror, options = moto_server.url(bucket, "mirror"), moto_server.storage_options()
    state, saved = _state(), {}
    with ts.CheckpointManager(tmp_path / "local", keep_last=3, mirror=mirror, mirror_options=options,
                              mirror_retention=ts.Retention(keep_last=3)) as ckpt:
        for _ in range(20):
            values = _step(state)
            saved[ckpt.save(state).name] = values
            deadline = time.monotonic() + 60
            while ckpt.status().mirror.remote_update != state.next_update and time.monotonic() < deadline:
                time.sleep(0.05)
    stored = _stored(moto_server, bucket, "mirror")
    parts = sum(size for key, size in stored.items() if "/part-" in key)
    assert parts <= 2 * _base_bytes(state) + 4096, (parts, sorted(stored))
    fresh = _state(seed=9)
    with ts.CheckpointManager(tmp_path / "fresh", mirror=mirror, mirror_options=options) as ckpt:
        name = ckpt.restore(fresh).generation.name
    assert name == max(saved) and all(torch.equal(v, saved[name][k]) for k, v in fresh["model"].state_dict().items())


def test_objects_go_when_no_kept_generation_references_them(moto_server):
    """``keep_last=2``: the generation that uploaded the base is pruned and its objects stay (two later ones
    reference them); once the base itself changes, and the generations referencing the old copies are pruned
    too, the old copies are deleted: nothing is held by nothing."""
    bucket, url, options = _run_url(moto_server)
    state = _state()
    with ts.CheckpointManager(url, keep_last=2, storage_options=options) as ckpt:
        for _ in range(4):
            _step(state)
            ckpt.save(state)
        first = {k for k in _stored(moto_server, bucket, "run") if "/part-" in k}
        assert "gen-000000000001" not in ckpt.generations() and all("gen-000000000001-" in k for k in first)
        with torch.no_grad():
            state["model"]["base"][0].weight.add_(1.0)  # the base changes: new parts, written afresh
        for _ in range(3):
            _step(state)
            ckpt.save(state)
        assert ckpt.store.leftovers() == []
    now = {k for k in _stored(moto_server, bucket, "run") if "/part-" in k}
    assert not first & now and len(now) == 2  # the new base's two copies alone


def test_a_save_cut_before_its_commit_leaves_nothing_the_next_cleanup_misses(moto_server, monkeypatch):
    """A save whose references are staged but whose commit record never lands, and whose own cleanup never runs
    (as a SIGKILL would leave it): the next manager's first save removes its objects and references, keeps
    every object a kept generation references, and every kept generation restores bitwise."""
    from trainstate.storage.objects import ObjectStaging

    bucket, url, options = _run_url(moto_server)
    state, saved = _state(), {}
    with ts.CheckpointManager(url, keep_last=5, storage_options=options) as ckpt:
        _saves(ckpt, state, saved, 2)
        with monkeypatch.context() as patch:
            def killed(self):
                raise ts.TrainStateError("killed before the commit")
            patch.setattr(ObjectStaging, "commit", killed)
            patch.setattr(ObjectStaging, "abort", lambda self: None)
            _step(state)
            with pytest.raises(ts.TrainStateError):
                ckpt.save(state)
    assert any(k.startswith("refs/") for k in _stored(moto_server, bucket, "run"))
    with ts.CheckpointManager(url, keep_last=5, storage_options=options) as ckpt:
        ckpt.restore(state)
        values = _step(state)
        saved[ckpt.save(state).name] = values
        assert ckpt.store.leftovers() == []
    stored = _stored(moto_server, bucket, "run")
    assert not any(k.startswith(("refs/", "staging/")) for k in stored), sorted(stored)
    for name, values in saved.items():
        fresh = _state(seed=9)
        with ts.CheckpointManager(url, storage_options=options) as ckpt:
            assert ckpt.restore(fresh, generation=name).generation.name == name
        assert all(torch.equal(v, values[k]) for k, v in fresh["model"].state_dict().items()), name
