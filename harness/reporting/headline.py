"""`make headline`: every method on one model over Spec-Bench, one results folder per method, then
the report and the figures of exactly those runs.

    python -m harness.headline [--config conf/headline/smollm2-135m.yaml] [--limit N] [override ...]

The config names the model, the question selection, the shared settings and, per method, the
overrides that fit this model and hardware (tree sizes, drafts). Each run answers every question
with AR and its method side by side (its own paired baseline), and every run is resumable:
rerunning after an interruption continues where it stopped. Extra `key=value` arguments are Hydra
overrides applied to every run (e.g. `dtype=float32`).

A config may state what it `requires:` (`device: cuda`, `gpu_memory_gib`, `why`), as the published
settings do (`conf/headline/vicuna-7b-specbench.yaml`: Vicuna-7B in fp16): without it, the headline
refuses in one line before anything loads. Every run's composed config is validated before the first
run starts (`--check`: only that). Where the run set's settings match a published setting
(`docs/published/`), the report prints our numbers beside the published ones (`harness/reporting/published.py`).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf

from methods.models.specs import PROJECT_ROOT as REPO


def run_overrides(config, extra: list[str] = (), limit: int | None = None) -> dict[str, list[str]]:
    """Per run, its Hydra overrides. A run is named by its method, or `<method>@<variant>` for a second
    run of one method with other settings (`sam@eagle2: [method.auxiliary=eagle2]`)."""
    from methods.base import available_methods  # lazy: torch (via methods) after the GPU check

    methods = OmegaConf.to_container(config.methods, resolve=True) if config.get("methods") else {}
    if not methods:
        raise ValueError(
            f"headline config names no methods; give `methods:` with some of {', '.join(available_methods())}"
        )
    unknown = sorted({run.split("@", 1)[0] for run in methods} - set(available_methods()))
    if unknown:
        raise ValueError(f"headline config names unknown methods {unknown}; valid: {', '.join(available_methods())}")
    value = lambda v: "null" if v is None else v  # noqa: E731  (limit: null = all questions)
    shared = [f"model={config.model}", f"dataset={config.dataset}",
              f"limit={value(limit if limit is not None else config.limit)}",
              f"max_new_tokens={value(config.max_new_tokens)}",
              f"results_dir={config.results_dir}", *config.get("overrides", [])]
    given = {o.split("=", 1)[0] for o in extra}
    shared = [o for o in shared if o.split("=", 1)[0] not in given] + list(extra)  # the command line wins
    return {run: [f"method={run.split('@', 1)[0]}", *shared, *(overrides or [])] for run, overrides in methods.items()}


def gpu_memory_gib() -> float | None:
    """Memory of the first visible CUDA (or ROCm) GPU in GiB; None when there is none. Without a GPU
    driver on the machine this answers without importing torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return None
    if not (os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/kfd") or glob.glob("/dev/nvidia[0-9]*")):
        return None
    import torch  # lazy: torch (via methods) after the GPU check

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def unmet_requirement(config, name: str) -> str | None:
    """One line saying what this machine lacks for the config's `requires:`, or None."""
    requires = config.get("requires") or {}
    if requires.get("device") != "cuda":
        return None
    need = float(requires.get("gpu_memory_gib") or 0)
    have = gpu_memory_gib()
    if have is not None and have >= need:
        return None
    here = "no CUDA GPU here" if have is None else f"this GPU has {have:.0f} GiB"
    why = f" ({requires['why']})" if requires.get("why") else ""
    return (f"headline {name} needs a CUDA GPU with at least {need:g} GiB{why}; {here}. On a CPU it would take "
            f"days: run it on a GPU machine, or `make headline` for the CPU reference run (the embedded model)")


def compose(overrides: list[str]):
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=overrides)


def report_and_draw(results: Path, runs: list, figures_dir) -> None:
    """The report (`results/report/`) and the figures of the tables holding the answers of `runs` (the
    headline's run folders): the other run sets under `results` (another CPU class, another number of
    questions) keep their files as they are."""
    from harness.reporting import figures, report  # lazy: torch (via methods) after the GPU check

    ran = ["--tables-of", *map(str, runs)]
    report.main([str(results), "--out", str(results / "report"), *ran])  # the comparison with a published setting too
    figures.main([str(results), "--out", str(figures_dir), *ran])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "conf" / "headline" / "smollm2-135m.yaml")
    parser.add_argument("--limit", type=int, default=None, help="questions (stratified); default: the config's")
    parser.add_argument("--only", nargs="+", default=None, help="run these methods of the config only")
    parser.add_argument("--figures", type=Path, default=None, help="figures folder; default: the config's")
    parser.add_argument("--check", action="store_true",
                        help="compose and validate every run's config, then stop (on any machine)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. dtype=float32")
    args = parser.parse_args(argv)
    config = OmegaConf.load(args.config)
    unmet = unmet_requirement(config, args.config.stem)
    if unmet and not args.check:  # before anything imports torch or loads a model
        print(unmet, file=sys.stderr)
        return 2
    runs = run_overrides(config, args.overrides, args.limit)
    if args.only:
        missing = sorted(set(args.only) - set(runs))
        if missing:
            raise SystemExit(f"--only {missing}: not in {args.config}; its methods: {', '.join(runs)}")
        runs = {m: o for m, o in runs.items() if m in args.only}

    from harness.running.validate import validate  # lazy: torch (via methods) after the GPU check

    configs = {}
    for method, overrides in runs.items():  # every run's config, before the first run loads a model
        try:
            configs[method] = compose(overrides)
            validate(configs[method])
        except (HydraException, ValueError) as err:  # ConfigError is a ValueError
            print(f"headline {args.config.stem}, method {method}: {' '.join(str(err).split())}", file=sys.stderr)
            return 2
    if args.check:  # composes and validates on any machine; says what a run would need
        print("\n".join(f"{method}: {' '.join(overrides)}" for method, overrides in runs.items()))
        if unmet:
            print(f"(--check only) {unmet}", file=sys.stderr)
        return 0
    from harness.running.results import FolderMismatch  # lazy: torch (via methods) after the GPU check
    from harness.running.run import run  # lazy: torch (via methods) after the GPU check
    from harness.stats import fidelity_failure  # lazy: torch (via methods) after the GPU check

    folders, failures = {}, []
    for method, overrides in runs.items():
        print(f"== {method}: {' '.join(overrides)}", flush=True)
        try:
            summary = run(configs[method])
        except FolderMismatch as err:  # e.g. the committed reference run, measured by an older engine
            print(f"headline {args.config.stem}, method {method}: {err} (for the headline: "
                  f"python -m harness.headline --config {args.config} resume=false)", file=sys.stderr)
            return 2
        folders[method] = summary["results"]
        failures += [failure] if (failure := fidelity_failure(summary)) else []
    report_and_draw(Path(configs[method].results_dir), list(folders.values()), args.figures or config.figures_dir)
    print(json.dumps(folders, indent=2))
    for failure in failures:  # every run, report and figure is written first; then the headline fails
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
