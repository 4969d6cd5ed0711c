"""Download the Spec-Bench question set (480 questions, 13 categories) into data/spec_bench/.

    python -m data_scripts.spec_bench [--out data/spec_bench/question.jsonl]

Source: hemingkx/Spec-Bench on GitHub (the file is not on the Hugging Face Hub), pinned to the
commit the shared copy was taken from, and checked against its sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import urllib.request
from pathlib import Path

COMMIT = "fd2c1cd"
URL = f"https://raw.githubusercontent.com/hemingkx/Spec-Bench/{COMMIT}/data/spec_bench/question.jsonl"
SHA256_PREFIX = "4b6d33e7"  # of the file at that commit
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "data" / "spec_bench" / "question.jsonl"


def fetch(out: Path = DEFAULT_OUT, url: str = URL) -> Path:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            data = response.read()
    except OSError as err:
        raise SystemExit(
            f"spec_bench: could not download {url} ({err}). On a machine without internet, copy "
            f"question.jsonl from a Spec-Bench checkout to {out} or pass dataset.path=/path/to/question.jsonl"
        ) from None
    digest = hashlib.sha256(data).hexdigest()
    if not digest.startswith(SHA256_PREFIX):
        raise SystemExit(f"spec_bench: downloaded file has sha256 {digest}, expected {SHA256_PREFIX}...")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    print(f"wrote {fetch(args.out)}", file=sys.stderr)


if __name__ == "__main__":
    main()
