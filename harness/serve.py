"""`python -m harness.serve` (what `make serve-bench` calls): see `harness/running/serve.py`; with
`serve.peer=llama.cpp` (`make serve-peer`), `harness/running/serve_peer.py`."""

import os
import sys

import hydra
from omegaconf import DictConfig

from harness.running.run import USER_ERRORS
from harness.running.serve import serve
from harness.running.serve_peer import PeerUnavailable, serve_peer
from harness.running.validate import validate
from methods.models.specs import PROJECT_ROOT as REPO


@hydra.main(version_base="1.3", config_path=str(REPO / "conf"), config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        if cfg.serve.peer:
            validate(cfg)
            serve_peer(cfg)
        else:
            serve(cfg)
    except (*USER_ERRORS, PeerUnavailable) as err:
        if os.environ.get("DECODEBENCH_DEBUG"):
            raise
        print(f"error: {err} (DECODEBENCH_DEBUG=1 shows the traceback)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
