"""Sizes from the machine profile: `auto` picks what the measured latency curve says fits, an
explicit value wins, and every choice is recorded with the numbers behind it."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from methods.base import BuildContext, get_method
from methods.engine.runner import ModelRunner
from methods.engine.static_trees import MEDUSA_MC_SIM_7B_63, StaticTree
from methods.machine.curves import forward_latency
from methods.machine.profile import MachineProfile
from methods.settings.sizing import batch_draft_tokens, chain_length, tree_budget, verify_cost, verify_costs
from tests.conftest import tiny_model

FLAT = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0, 32: 1.0, 64: 1.0}  # a GPU-like curve
CPU = {1: 1.0, 2: 1.1, 4: 1.15, 8: 1.25, 16: 1.6, 32: 2.3, 64: 4.6}  # a 2-core CPU's


def test_tree_budget_follows_the_curve():
    assert tree_budget(FLAT) == 64
    assert tree_budget(CPU) == 9  # v(9) = 1.25 + 0.35 / 8 < 1.3 < v(10)
    assert tree_budget({1: 1.0, 2: 2.0, 4: 4.0}) == 2
    assert verify_cost(CPU, 12) == pytest.approx(1.425) and verify_cost(CPU, 128) == pytest.approx(9.2)


def test_a_dip_in_the_measured_curve_does_not_size_a_larger_draft():
    """One run's curve had t(16) under t(9) (noise: 1.24 against 1.33): sizing on it took 17 tokens,
    and the run verified at 1.73 AR steps. The envelope keeps each size at least as costly as every
    smaller one, so the budget stops where the curve first crosses it."""
    dipped = {1: 1.0, 2: 1.164, 4: 1.052, 8: 1.185, 9: 1.329, 12: 1.512, 16: 1.24, 24: 1.563}
    assert tree_budget(dipped) == 8  # v(8) = 1.185 <= 1.3 < v(9); not 17 through the dip at 16
    assert verify_cost(dipped, 16) == pytest.approx(1.512) and verify_cost(dipped, 4) == pytest.approx(1.164)
    assert verify_cost(CPU, 12) == pytest.approx(1.425)  # a rising curve is its own envelope


def test_batch_draft_tokens_shrink_as_the_batch_grows():
    """B sequences verify B x (n + 1) rows: the draft is the most n within the budget of AR's forward at B."""
    assert batch_draft_tokens(CPU, 1) == tree_budget(CPU) - 1 == 8
    assert batch_draft_tokens(CPU, 4) == 2  # v(12) = 1.425 <= 1.3 v(4) = 1.495 < v(16) = 1.6
    assert batch_draft_tokens(CPU, 8) == 1  # v(16) = 1.6 <= 1.625 < v(24)
    assert batch_draft_tokens(FLAT, 8) == 64  # a flat curve: the batch changes nothing
    assert batch_draft_tokens({1: 1.0, 2: 2.0, 4: 4.0}, 4) == 1  # at least one draft token


def test_eagle2s_adaptive_size_reads_a_verify_table_made_once_per_batch_size(monkeypatch):
    """The adaptive size weighs every candidate count each step: it reads t(B n) / B from a table made
    once per curve and batch size (`verify_times`), and chooses what the interpolated curve chooses."""
    from types import MethodType

    from methods.eagle import dynamic

    made = []
    monkeypatch.setattr(dynamic, "verify_costs", lambda curve, tokens: made.append(len(tokens)) or verify_costs(
        curve, tokens))
    stub = type("Stub", (), {})()
    stub.verify_seconds, stub.total_tokens, stub.draft_seconds = {n: 0.01 * v for n, v in CPU.items()}, 64, 0.003
    stub.verify_tables = {}
    for name in ("adaptive_size", "verify_time", "verify_times"):
        setattr(stub, name, MethodType(getattr(dynamic.Eagle2Decoder, name), stub))
    probabilities = [0.9 ** i for i in range(1, 64)]
    for batch in (1, 2, 4, 1, 2, 4):
        one = 0.01 / batch

        def rate(n):
            return (1 + sum(probabilities[:n])) / (0.003 + verify_cost(CPU, batch * (n + 1)) * one)
        assert stub.adaptive_size(probabilities, True, batch) == max(range(64), key=rate)
        assert stub.verify_time(9, batch) == pytest.approx(verify_cost(CPU, 9 * batch) * one)
    assert len(made) == 3  # one table per batch size


def test_chain_length_trades_acceptance_against_draft_and_verify_cost():
    cheap_flat, _ = chain_length(FLAT, draft_cost=0.02, alpha=0.8)
    costly_cpu, record = chain_length(CPU, draft_cost=0.3, alpha=0.5)
    assert cheap_flat >= 6 and costly_cpu <= 2
    assert record["alpha"] == 0.5 and set(record["expected_tokens_per_t1"]) == set(range(1, 9))
    assert chain_length(CPU, 0.1, 0.9)[0] > chain_length(CPU, 0.1, 0.3)[0]


def test_static_tree_prefix_keeps_the_published_order():
    tree = StaticTree.build("medusa_mc_sim_7b_63", nodes=5)
    assert [list(p) for p in sorted(tree.paths)] == sorted(MEDUSA_MC_SIM_7B_63[:5])


@pytest.mark.parametrize("method, params, key", [
    ("sps", {"draft": {"target_layers": 1}}, "gamma"), ("mcsd", {"draft": {"target_layers": 1}}, "k_config"),
    ("jacobi", {}, "block_size"), ("pld", {}, "num_draft"), ("sam", {"static": "none"}, "n_predicts"),
])
def test_auto_sizes_come_from_the_cached_profile_and_explicit_values_win(tmp_path, monkeypatch, method, params, key):
    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path))
    target = tiny_model("llama", seed=70, vocab_size=32, layers=2)
    context = BuildContext(target, "tiny", {}, MachineProfile("cpu"))
    decoder = get_method(method)(ModelRunner(target), {"name": method, **params}, context)
    sizing = decoder.describe()["sizing"]
    assert sizing[key] == "auto" and ("chosen" in sizing or "alpha_measured" in sizing)
    curves = list((tmp_path / "profiles").glob("*/curve-tiny-*.json"))
    assert len(curves) == 1  # measured once, cached ...
    before = curves[0].stat().st_mtime_ns
    get_method(method)(ModelRunner(target), {"name": method, **params}, context)
    assert curves[0].stat().st_mtime_ns == before  # ... and reused
    # an `auto` size also cuts each draft at batch size B > 1 (`Sizing.cut`, methods/loop.py): a chain's
    # length, Jacobi's new blocks, MCSD's tree (`batch_k_config`), all by the same cut
    assert decoder.sizing.curve is not None and decoder.sizing.cut(1) is None
    assert decoder.sizing.cut(4) is not None
    explicit = {"sps": {"gamma": 2}, "mcsd": {"k_config": [2, 1]}, "jacobi": {"block_size": 3}, "pld": {"num_draft": 3},
                "sam": {"n_predicts": 5}}[method]
    decoder = get_method(method)(ModelRunner(target), {"name": method, **params, **explicit}, context)
    assert "sizing" not in decoder.describe() and decoder.sizing.cut(4) is None


@pytest.mark.parametrize("method, params, key, fixed", [
    ("sps", {"draft": {"target_layers": 1}}, "gamma", 4),
    ("mcsd", {"draft": {"target_layers": 1}}, "k_config", [4, 2, 1]),
    ("jacobi", {}, "block_size", 16), ("lookahead", {"window": "auto", "guess": "auto"}, "window", 15),
    ("recycling", {"tree": "auto"}, "tree", None), ("medusa", {"head": {"random_init": 0}}, "tree", None),
    ("pld", {}, "draft_tokens", 10), ("sam", {"static": "none"}, "predicts", 60),
])
def test_without_a_profile_nothing_is_measured_and_auto_takes_upstreams_size(tmp_path, monkeypatch, method, params,
                                                                              key, fixed):
    """A runner and a method built with no machine profile time nothing (every timing function of the
    profile package raises here) and write nothing; `auto` is upstream's fixed size, said in the record."""
    from methods.machine import curves, plan

    def forbidden(*args, **kwargs):
        raise AssertionError("measured without a machine profile")

    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path))
    for module, name in ((curves, "forward_latencies"), (plan, "measure_plan")):
        monkeypatch.setattr(module, name, forbidden)
    target = tiny_model("llama", seed=70, vocab_size=32, layers=2)
    runner = ModelRunner(target)
    assert runner.linear.plan is None  # stock F.linear
    decoder = get_method(method)(runner, {"name": method, **params}, BuildContext(target, "tiny", {}))
    described = decoder.describe()
    if fixed is not None:
        assert described[key] == fixed
    if method != "sps":
        assert described["sizing"]["profile"].startswith("none")
    assert not (tmp_path / "profiles").exists()


def test_latency_curve_cache_is_per_model_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path))
    small, large = tiny_model("llama", seed=1, hidden=32, layers=1), tiny_model("llama", seed=1, hidden=64, layers=1)
    profile = MachineProfile("cpu")
    profile.latency_curve(ModelRunner(small), "tiny", sizes=(1, 2), repeats=1)
    profile.latency_curve(ModelRunner(large), "tiny", sizes=(1, 2), repeats=1)
    assert len(list((tmp_path / "profiles").glob("*/curve-tiny-*.json"))) == 2


def test_sps_auto_gamma_follows_the_acceptance_it_measures():
    """A draft that accepts far less than its model card says gets shorter chains as the run goes."""
    from methods.engine.stopping import StopCondition
    from methods.sps import SpeculativeSamplingDecoder, auto_gamma

    target = tiny_model("llama", seed=71, vocab_size=256, layers=2)
    stranger = tiny_model("llama", seed=72, vocab_size=256, layers=1)  # an unrelated draft: accepts ~nothing
    decoder = SpeculativeSamplingDecoder(ModelRunner(target), stranger, gamma=auto_gamma(CPU, cost=0.05, alpha=0.9))
    assert decoder.gamma >= 4
    decoder.generate([1, 2, 3, 4, 5], StopCondition(60))
    sizing = decoder.describe()["sizing"]
    assert sizing["alpha_measured"] < 0.5 and decoder.gamma <= 2
    assert sum(sizing["steps_by_gamma"].values()) > 10 and min(sizing["steps_by_gamma"]) <= 2


def test_the_latency_curve_is_timed_as_verification_runs_warmed_up_and_interleaved(monkeypatch):
    """A forward of n tokens is timed as a verification of a chain runs it (its rows' depths and
    visibility: the masked attention path for n > 1, a static step where the runner has them), over
    a reserved cache. Each size runs once untimed, then the sizes alternate round by round: a curve
    measured in sequence, cold, made t(1) 1.6x an AR step on the embedded model and the trees twice
    too big; each sample is the second of two forwards of its size (timed after a 64-token forward,
    t(1) read 10% above an AR step's)."""
    runner = ModelRunner(tiny_model("llama", seed=1, hidden=32, layers=1))
    calls = []
    forward = runner.forward

    def recording(tokens, **kwargs):
        rows = kwargs.get("rows")
        chain = rows is not None and list(rows[0]) == list(range(len(tokens))) and \
            torch.equal(rows[1], torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril())
        calls.append((len(tokens), chain, runner.cache.capacity is not None))
        return forward(tokens, **kwargs)

    monkeypatch.setattr(runner, "forward", recording)
    seconds = forward_latency(runner, (1, 2, 4), prefix_length=8, repeats=2)
    # warm-up, 2 rounds; each time the second of two forwards of one size (as a decoding loop runs them)
    assert [c for c in calls if c[0] != 8] == [(1, True, True)] * 2 + [(2, True, True)] * 2 + [(4, True, True)] * 2 \
        + [(1, True, True)] * 2 + [(2, True, True)] * 2 + [(4, True, True)] * 2 \
        + [(1, True, True)] * 2 + [(2, True, True)] * 2 + [(4, True, True)] * 2
    assert set(seconds) == {1, 2, 4} and runner.length == 0


def machine_load(monkeypatch, busy: bool):
    """/proc/stat as it reads while other processes use far more than the whole machine, or nothing."""
    from methods.machine import load

    ticks = itertools.count(1)
    monkeypatch.setattr(load, "_proc_stat", (lambda: (1e4 * next(ticks), 0.0, 1e4 * next(ticks))) if busy else
                        (lambda: (0.0, 0.0, 1.0)))


def test_every_run_measures_its_curve_once_and_keeps_the_history_with_its_spread(tmp_path, monkeypatch, caplog):
    """The curve is this run's (a new profile measures it again; one profile once), stored with the load
    it was measured under after the curves of the runs before it; the log says how this run's compares."""
    import logging

    caplog.set_level(logging.INFO, logger="methods.machine.profile")
    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path))
    runner = ModelRunner(tiny_model("llama", seed=73, hidden=32, layers=1))
    machine_load(monkeypatch, busy=True)
    profile = MachineProfile("cpu")
    first = profile.latency_curve(runner, "tiny", sizes=(1, 2), repeats=1)
    (file,) = (tmp_path / "profiles").glob("*/curve-tiny-*.json")
    (run,) = json.loads(file.read_text())["runs"]
    assert run["busy"] and {"other_cores", "steal", "load_before", "at", "seconds"} <= set(run)
    assert "forward latency at 1, 2 tokens was measured beside other work" in caplog.text
    assert "profiling this machine for this run" in caplog.text and "the first run measured here" in caplog.text
    assert profile.used()[str(file)]["quiet"] is False
    mtime = file.stat().st_mtime_ns
    assert profile.latency_curve(runner, "tiny", sizes=(1,), repeats=1) == {1: first[1]}  # this run's, not again
    assert file.stat().st_mtime_ns == mtime
    machine_load(monkeypatch, busy=False)
    for _ in range(2):  # the next runs: measured again, each after the ones before
        profile = MachineProfile("cpu")
        profile.latency_curve(runner, "tiny", sizes=(1, 2), repeats=1)
        assert profile.used()[str(file)]["quiet"] is True
    runs = json.loads(file.read_text())["runs"]
    assert [r["busy"] for r in runs] == [True, False, False]
    assert "the 2 run(s) before it here: t(1) " in caplog.text and " v(2) " in caplog.text
    from methods.machine import profile as profile_module

    monkeypatch.setattr(profile_module, "CURVE_HISTORY", 2)
    MachineProfile("cpu").latency_curve(runner, "tiny", sizes=(1, 2), repeats=1)
    assert len(json.loads(file.read_text())["runs"]) == 2  # the last CURVE_HISTORY kept


def test_a_linear_plan_measured_beside_other_work_is_measured_again_by_the_next_run(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path))
    model = tiny_model("llama", seed=74, vocab_size=40, hidden=32, layers=1)
    profile = MachineProfile("cpu")
    file = profile.folder / "linear-float32.json"
    machine_load(monkeypatch, busy=True)
    profile.linear_path([model])
    assert [r["busy"] for r in json.loads(file.read_text())["load"]] == [True]
    assert profile.used()[str(file)]["quiet"] is False
    machine_load(monkeypatch, busy=False)
    profile = MachineProfile("cpu")
    profile.linear_path([model])
    (record,) = json.loads(file.read_text())["load"]  # measured again, whole
    assert not record["busy"]
    mtime = file.stat().st_mtime_ns
    profile = MachineProfile("cpu")
    path = profile.linear_path([model])  # quiet: kept
    assert file.stat().st_mtime_ns == mtime and path.plan.kernels
    assert profile.used()[str(file)] == {"measured": record["at"], "quiet": True, "max_other_cores": 0.0}


def test_the_summary_names_a_busy_profile_that_sized_the_run():
    from harness.stats import summarize
    from harness.stats.text import format_summary

    records = [{"question_id": 1, "category": "c", "choices": [{
        "new_tokens": [4], "wall_time": [1.0], "decoding_steps": [4], "accept_lengths": [1] * 4,
        "output_ids": [[1, 2, 3, 4]],
        "stats": [{"ttft": 0.1, "drafted_tokens": 0, "accepted_drafts": 0, "position_proposed": [],
                   "position_tested": [],
                   "position_accepted": [], "phase_time": {}}]}]}]
    profiles = {"/c/profiles/m/linear-float32.json": {"measured": "2025-01-01T00:00:00+00:00", "quiet": True,
                                                      "max_other_cores": 0.0},
                "/c/profiles/m/curve-x-1-float32-auto.json": {"measured": "2025-01-01T00:00:00+00:00", "quiet": False,
                                                              "max_other_cores": 1.2}}
    text = format_summary(summarize("ar", records, None, {"dtype": "float32", "engine": {"profiles": profiles}}))
    assert (
        "BUSY PROFILE: curve-x-1-float32-auto.json measured beside other work" in text and "linear-float32" not in text
    )
    profiles["/c/profiles/m/curve-x-1-float32-auto.json"]["quiet"] = True
    assert "BUSY PROFILE" not in format_summary(summarize("ar", records, None,
                                                          {"dtype": "float32", "engine": {"profiles": profiles}}))


@pytest.mark.parametrize("method, params", [
    ("lazyllm", {"schedule": [[1, 0.5]]}), ("sps", {"gamma": 2, "draft": {"target_layers": 1}}),
    ("mcsd", {"k_config": [2, 1], "draft": {"target_layers": 1}}), ("medusa", {"head": {"random_init": 0}}),
    ("eagle2", {"head": {"random_init": 0}, "total_tokens": 8}), ("ar", {}),
])
def test_every_runner_a_method_builds_takes_the_runs_profile(method, params):
    """The runners a method makes for itself (LazyLLM's pruning runner, a draft LM's) run on the run's
    machine profile, as the target does: one without it would run stock kernels (LazyLLM did, at 0.29x)."""
    from methods.engine.runner import ModelRunner as Runner

    target = tiny_model("llama", seed=70, vocab_size=32, layers=4)
    profile = MachineProfile("cpu")
    decoder = get_method(method)(Runner(target, profile=profile), {"name": method, **params},
                                 BuildContext(target, "tiny", {}, profile))
    runners = [value for value in vars(decoder).values() if isinstance(value, Runner)]
    runners += [d.runner for d in getattr(decoder, "lane_drafts", [])]
    assert runners and all(r.profile is profile and r.linear.plan is not None for r in runners)


def test_the_summary_states_the_curve_that_sized_the_draft():
    """A run's printout says which v(n) of its own curve sized its `auto` draft, up to the size chosen."""
    from harness.stats.text import sizing_curve_line

    sizing = {"num_draft": "auto", "verify_tokens": 4, "verify_budget_t1": 1.3,
              "curve_t1": {"1": 1.0, "2": 1.02, "4": 1.2, "8": 1.5}}
    assert sizing_curve_line({"method_config": {"sizing": sizing}}) == (
        "sized by this run's latency curve, v(n) = t(n)/t(1): v(2) 1.02, v(4) 1.20; auto chose 4 tokens per "
        "verification (the most at v(n) <= 1.3)")
    adaptive = {"total_tokens": "adaptive", "seconds_by_size": {"1": 0.01, "2": 0.011, "16": 0.02, "32": 0.03}}
    assert sizing_curve_line({"method_config": {"sizing": adaptive}}) == (
        "sized by this run's latency curve, v(n) = t(n)/t(1): v(2) 1.10, v(16) 2.00")
    assert sizing_curve_line({"method_config": {"gamma": 4}}) is None and sizing_curve_line({}) is None
