"""The on-disk format page is a specification someone can use: its reader, run with trainstate unimportable,
verifies and decodes generations trainstate wrote (a multi-chunk tensor file, each digest algorithm) and fails
on a flipped byte; its field and tag tables list exactly what the code writes.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest
import torch
from docsite import page, runnable

import trainstate as ts
from trainstate.format import codec
from trainstate.format.manifest import Manifest, Pointer

# The reader runs in a fresh interpreter in which `import trainstate` fails: it must need nothing of ours.
HARNESS = """
import sys
sys.modules["trainstate"] = None
exec(compile(open(sys.argv[1]).read(), "format.md", "exec"))
import json, torch
print(json.dumps({"generation": manifest["generation"], "clocks": state["clocks"],
                  "weights": {k: v.tolist() for k, v in weights.items()}}))
"""


def save_run(directory, digest: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(1100, 1000)  # 4.4 MB of weights: the tensor file spans two 4 MiB chunks
    state = ts.TrainState(model=model, contract={"config": {"digest": digest}})
    with ts.CheckpointManager(directory / "runs" / "exp1", digest=digest) as ckpt:
        ckpt.restore(state)
        state.next_update = 7
        ckpt.save(state)
    return model


def read(tmp_path) -> subprocess.CompletedProcess:
    (tmp_path / "reader.py").write_text(runnable("read-without-trainstate"))
    (tmp_path / "harness.py").write_text(HARNESS)
    return subprocess.run([sys.executable, str(tmp_path / "harness.py"), str(tmp_path / "reader.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("digest", ["xxh3-chunked", "blake3-chunked", "sha256"])
def test_the_reader_on_the_format_page_reads_a_generation_without_trainstate(tmp_path, digest):
    model = save_run(tmp_path, digest)
    done = read(tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["generation"] == "gen-000000000007" and out["clocks"]["next_update"] == 7
    assert sorted(out["weights"]) == ["bias", "weight"]
    for name, value in model.state_dict().items():
        assert torch.equal(torch.tensor(out["weights"][name]), value), name
    manifest = json.loads((tmp_path / "runs" / "exp1" / "gen-000000000007" / "manifest.json").read_text())
    assert manifest["digest_algorithm"] == digest
    if digest.endswith("-chunked"):
        assert len(next(f for f in manifest["files"] if f["name"] == "tensors.safetensors")["chunks"]) == 2


def test_the_reader_refuses_a_flipped_byte(tmp_path):
    save_run(tmp_path, "xxh3-chunked")
    tensors = tmp_path / "runs" / "exp1" / "gen-000000000007" / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-100] ^= 1  # in the second chunk
    tensors.write_bytes(bytes(data))
    done = read(tmp_path)
    assert done.returncode != 0 and "AssertionError: tensors.safetensors" in done.stderr


def table_rows(markdown: str, heading: str) -> list[str]:
    """The first column of the first table under ``heading``, without its backticks."""
    section = markdown.split(f"\n{heading}\n", 1)[1]
    table = re.search(r"^\|.*?(?=^[^|])", section, re.M | re.S)[0]
    return [re.sub(r"^\| `?([^`|]+?)`? \|.*", r"\1", row) for row in table.splitlines()[2:]]


def test_the_tables_list_exactly_what_the_code_writes():
    text = page("format.md")
    manifest = {f.name for f in dataclasses.fields(Manifest)} | {"format", "self_digest", "signature"}
    assert sorted(table_rows(text, "## The manifest: `manifest.json`")) == sorted(manifest)
    pointer = {f.name for f in dataclasses.fields(Pointer)} | {"format", "signature"}
    assert sorted(table_rows(text, "## The pointer: `latest`")) == sorted(pointer)
    tags = table_rows(text, "## `state.json`: structure, clocks, RNG, contract")
    assert sorted(tags) == sorted(codec._TAGS)


def test_a_field_missing_from_a_table_is_seen():
    text = ("# Page\n\n## Fields\n\nSome text.\n\n"
            "| field | meaning |\n|---|---|\n| `kind` | full |\n| `run` | id |\n\nAfter.\n")
    assert table_rows(text, "## Fields") == ["kind", "run"]
    assert sorted(table_rows(text, "## Fields")) != sorted({"kind", "run", "shares"})
