"""The Spec-Bench question set (480 questions, 13 categories), shipped in data/spec_bench/.

    python -m data_scripts.spec_bench            # download it again into data/spec_bench/ and verify it
    python -m data_scripts.spec_bench --check    # verify the shipped file (offline)

Source: hemingkx/Spec-Bench on GitHub (the file is not on the Hugging Face Hub), pinned to the
commit the shipped copy was taken from, and checked against its sha256 (data/spec_bench/README.md).
"""

from __future__ import annotations

import argparse
import hashlib
import urllib.request
from pathlib import Path

COMMIT = "fd2c1cd7d2201ef71db4c5f4e455008f017967bf"  # 2025-04-22
URL = f"https://raw.githubusercontent.com/hemingkx/Spec-Bench/{COMMIT}/data/spec_bench/question.jsonl"
SHA256 = "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04"  # of the file at that commit
SHIPPED = Path(__file__).resolve().parents[1] / "data" / "spec_bench" / "question.jsonl"


def check(data: bytes, what: str) -> str:
    """The sha256 of `data`; raises SystemExit when it is not Spec-Bench's."""
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"spec_bench: {what} has sha256 {digest}, expected {SHA256}")
    return digest


def fetch(out: Path = SHIPPED, url: str = URL) -> Path:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            data = response.read()
    except OSError as err:
        raise SystemExit(
            f"spec_bench: could not download {url} ({err}). The suite ships the file as {SHIPPED} "
            f"(`git checkout -- {SHIPPED.relative_to(SHIPPED.parents[2])}` restores it), "
            f"or pass dataset.path=/path/to/question.jsonl"
        ) from None
    check(data, "the downloaded file")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=SHIPPED)
    parser.add_argument("--check", action="store_true", help="verify the file at --out, download nothing")
    args = parser.parse_args(argv)
    if args.check:
        if not args.out.is_file():
            raise SystemExit(f"spec_bench: {args.out} does not exist")
        print(f"{args.out}: sha256 {check(args.out.read_bytes(), str(args.out))} (Spec-Bench {COMMIT[:7]})")
        return
    out = fetch(args.out)
    print(f"wrote {out}: sha256 {SHA256} (Spec-Bench {COMMIT[:7]})")


if __name__ == "__main__":
    main()
