"""scripts/gpu_stage.py: the payload a GPU session stages (the drafts and the packages a machine without network
cannot install) splits into parts of a given size, each checked on arrival, and joins into the same files."""

from __future__ import annotations

import importlib.util
import os

import pytest

from harness import REPO

spec = importlib.util.spec_from_file_location("gpu_stage", REPO / "scripts" / "gpu_stage.py")
gpu_stage = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_stage)


def test_parts_round_trip_with_checksums(tmp_path, monkeypatch):
    here = tmp_path / "here"
    files = {f"drafts/m/{name}": os.urandom(size) for name, size in (("a.bin", 150_000), ("b.bin", 90_000))}
    for name, data in files.items():
        (here / name).parent.mkdir(parents=True, exist_ok=True)
        (here / name).write_bytes(data)
    package = tmp_path / "site-packages" / "fakepkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))

    stage = here / ".gpu-stage"
    manifest = gpu_stage.pack(gpu_stage.payload(here, ("drafts",), ("fakepkg",)), stage, part_mib=0.1)
    parts = manifest["parts"]
    assert len(parts) >= 3 and all(p["bytes"] <= 0.1 * 2**20 for p in parts)
    gpu_stage.hide(here, stage, ("drafts",))
    assert not (here / "drafts").exists()  # the tree that travels leaves the drafts behind

    there = tmp_path / "there"
    staged = there / ".gpu-staged"
    with pytest.raises(SystemExit, match="nothing received yet"):
        gpu_stage.unpack(staged, there)
    for part in parts[:-1]:  # one call each, the part carried
        gpu_stage.receive(stage / part["name"], staged)
    with pytest.raises(SystemExit, match=f"not received yet: {parts[-1]['name']}"):
        gpu_stage.unpack(staged, there)
    gpu_stage.receive(stage / parts[-1]["name"], staged)
    good = (staged / parts[0]["name"]).read_bytes()
    (staged / parts[0]["name"]).write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(SystemExit, match="checksum"):
        gpu_stage.unpack(staged, there)
    (staged / parts[0]["name"]).write_bytes(good)
    assert gpu_stage.unpack(staged, there) == ["drafts", "site"]
    assert all((there / name).read_bytes() == data for name, data in files.items())
    assert (staged / "site" / "fakepkg" / "__init__.py").read_text() == "VALUE = 1\n"

    gpu_stage.restore(here, stage, ("drafts",))
    assert all((here / name).read_bytes() == data for name, data in files.items())
