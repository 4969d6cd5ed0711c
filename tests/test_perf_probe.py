"""`make perf`'s bandwidth probe: it streams at least what the engine's own GEMV streams on this
machine, and when it does not, no ratio to the roofline is printed and the note says which number
is wrong."""

from __future__ import annotations

from harness.perf.engine import print_curves, probe_shortfall
from methods.engine import native
from methods.machine.probes import read_bandwidth


def result(probe: float, gemm: float, t1: float = 0.010) -> dict:
    weights, bandwidth = 270e6, max(probe, gemm)  # the roofline's rate, as `harness.perf.engine.main` sets it
    return {"read_bandwidth_bytes_per_second": probe, "engine_gemm_bytes_per_second": gemm,
            "weight_bytes": weights, "roofline_seconds": weights / bandwidth,
            "forward_seconds_by_tokens": {"auto": {1: t1, 2: 1.1 * t1}},
            "floor_seconds_by_tokens": {1: weights / bandwidth, 2: weights / bandwidth},
            "one_token_forward_breakdown": {"auto": {"t1_seconds": t1, "gemm_seconds": 0.8 * t1,
                                                     "gemm_bytes_per_second": gemm, "without_gemms_seconds": 0.2 * t1,
                                                     "aten_calls": 100}}}


def test_a_probe_below_the_engine_is_named_and_no_ratio_exceeds_one(capsys, monkeypatch):
    monkeypatch.setattr("harness.perf.engine.SIZES", (1, 2))
    truthful = result(probe=40e9, gemm=30e9, t1=0.012)
    assert probe_shortfall(truthful) is None
    print_curves(truthful)
    shown = capsys.readouterr().out
    assert "NOTE" not in shown and "probe 40.0 GB/s" in shown and "the engine's GEMMs 30.0 GB/s" in shown
    assert "75% of the roofline's bandwidth" in shown
    # the Xeon case: the probe read 9.8 GB/s, the engine's GEMMs 21: a roofline from the probe would be 0.5x t(1)
    wrong = result(probe=9.8e9, gemm=21e9, t1=0.0317)
    assert "probe understates" in probe_shortfall(wrong)
    print_curves(wrong)
    shown = capsys.readouterr().out
    assert "NOTE: the engine's GEMMs streamed 21.0 GB/s, more than the probe's 9.8 GB/s" in shown
    assert "at 21.0 GB/s" in shown and "100% of the roofline's bandwidth" in shown
    ratio = float(shown.split("t(1) = ")[-1].split("x the roofline")[0])
    assert ratio >= 1.0


def test_the_probe_streams_with_every_thread_past_the_cache(monkeypatch):
    """The probe reads through the native multi-accumulator stream where it builds (torch's `sum`
    elsewhere), over a buffer of at least 512 MB and four times the last-level cache, best of its reads."""
    seen = []
    monkeypatch.setattr("methods.machine.probes.l3_bytes", lambda: 256 << 20)
    monkeypatch.setattr(native, "unavailable_reason", lambda: None)
    monkeypatch.setattr(native, "stream_read", lambda x: seen.append(x.numel()) or 0.0)
    assert read_bandwidth(repeats=3) > 0
    assert seen == [(1024 << 20) // 4] * 4  # 4 x 256 MB of L3, one warm-up and three timed reads
    seen.clear()
    monkeypatch.setattr("methods.machine.probes.l3_bytes", lambda: None)
    read_bandwidth(repeats=1)
    assert seen == [(512 << 20) // 4] * 2
