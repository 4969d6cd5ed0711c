"""`make headline`: every method on one model over Spec-Bench, one results folder per method, then
the report and the figures of exactly those runs.

    python -m harness.headline [--config conf/headline/smollm2-135m.yaml] [--limit N] [override ...]

The config names the model, the question selection, the shared settings and, per method, the
overrides that fit this model and hardware (tree sizes, drafts). Each run answers every question
with AR and its method side by side (its own paired baseline), and every run is resumable:
rerunning after an interruption continues where it stopped. Extra `key=value` arguments are Hydra
overrides applied to every run (e.g. `dtype=float32`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]


def run_overrides(config, extra: list[str] = (), limit: int | None = None) -> dict[str, list[str]]:
    """Per method, the Hydra overrides of its run."""
    from methods.base import available_methods

    methods = OmegaConf.to_container(config.methods, resolve=True) if config.get("methods") else {}
    if not methods:
        raise ValueError(f"headline config names no methods; give `methods:` with some of {', '.join(available_methods())}")
    unknown = sorted(set(methods) - set(available_methods()))
    if unknown:
        raise ValueError(f"headline config names unknown methods {unknown}; valid: {', '.join(available_methods())}")
    shared = [f"model={config.model}", f"dataset={config.dataset}",
              f"limit={limit if limit is not None else config.limit}", f"max_new_tokens={config.max_new_tokens}",
              f"results_dir={config.results_dir}", *config.get("overrides", [])]
    given = {o.split("=", 1)[0] for o in extra}
    shared = [o for o in shared if o.split("=", 1)[0] not in given] + list(extra)  # the command line wins
    return {method: [f"method={method}", *shared, *(overrides or [])] for method, overrides in methods.items()}


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=overrides)


def main(argv=None) -> int:
    from harness import figures, report
    from harness.run import run

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "conf" / "headline" / "smollm2-135m.yaml")
    parser.add_argument("--limit", type=int, default=None, help="questions (stratified); default: the config's")
    parser.add_argument("--only", nargs="+", default=None, help="run these methods of the config only")
    parser.add_argument("--figures", type=Path, default=None, help="figures folder; default: the config's")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. dtype=float32")
    args = parser.parse_args(argv)
    config = OmegaConf.load(args.config)
    runs = run_overrides(config, args.overrides, args.limit)
    if args.only:
        missing = sorted(set(args.only) - set(runs))
        if missing:
            raise SystemExit(f"--only {missing}: not in {args.config}; its methods: {', '.join(runs)}")
        runs = {m: o for m, o in runs.items() if m in args.only}
    folders = {}
    for method, overrides in runs.items():
        print(f"== {method}: {' '.join(overrides)}", flush=True)
        cfg = compose(overrides)
        summary = run(cfg)
        folders[method] = summary["results"]
    results = Path(cfg.results_dir)
    report.main([str(results), "--out", str(results / "report")])
    figures.main([str(results), "--out", str(args.figures or config.figures_dir)])
    print(json.dumps(folders, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
