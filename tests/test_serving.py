"""Continuous batching (`DraftVerifyDecoder.serve`, `methods/requests.py`): requests join the batch as
they arrive and the batch has room; each decodes the tokens it decodes alone, greedy and seeded."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from methods.base import batchable_methods
from methods.engine.runner import ModelRunner
from methods.engine.sampling import SamplingConfig
from methods.engine.stopping import StopCondition
from methods.engine.tree import Tree
from methods.requests import Request, Requests, poisson_arrivals
from tests.test_batched import every_batchable, sampled_batchable, target  # noqa: F401 (fixtures)
from tests.test_harness import questions_file, tiny_model_dir  # noqa: F401 (fixtures)

LENGTHS, LIMITS = [3, 30, 11, 19, 7, 24], [24, 9, 30, 17, 5, 20]


def workload(vocab: int = 32) -> tuple[list[list[int]], list[StopCondition]]:
    """Six prompts of 3 to 30 tokens with different max_new_tokens: sequences leave at different steps."""
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in LENGTHS]
    return prompts, [StopCondition(limit) for limit in LIMITS]


@pytest.mark.parametrize("method", batchable_methods())
def test_every_batchable_method_serves_each_request_its_tokens_alone(every_batchable, method):  # noqa: F811
    """Greedy, closed loop at concurrency 2 and 3 over six requests (each joins when one leaves), and an
    open loop whose requests arrive while others decode: every request's tokens are its tokens alone."""
    make = every_batchable[method]
    prompts, stops = workload()
    alone = [make().generate(p, s).tokens for p, s in zip(prompts, stops)]
    for concurrency in (2, 3):
        outs = make().serve(Requests([Request(p, s) for p, s in zip(prompts, stops)], concurrency))
        assert [out.tokens for out in outs] == alone, f"concurrency {concurrency}"
    arrivals = [0.0, 0.0, 0.05, 0.1, 0.1, 0.3]
    outs = make().serve(Requests([Request(p, s, arrival=a) for p, s, a in zip(prompts, stops, arrivals)], 4))
    assert [out.tokens for out in outs] == alone, "open loop"


@pytest.mark.parametrize("method", batchable_methods())
def test_a_request_longer_than_the_first_batch_joins_every_drafter(every_batchable, method):  # noqa: F811
    """A request whose prompt is longer than the first batch's reservation by more than its spare room joins
    later: every cache (the target's, a batch drafter's) holds it, and it decodes its tokens alone."""
    make = every_batchable[method]
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 32, (n,), generator=generator).tolist() for n in (5, 8, 600)]
    stops = [StopCondition(limit) for limit in (6, 9, 12)]
    alone = [make().generate(p, s).tokens for p, s in zip(prompts, stops)]
    outs = make().serve(Requests([Request(p, s) for p, s in zip(prompts, stops)], 2))
    assert [out.tokens for out in outs] == alone


# methods whose drafts depend on the answers finished before a request joined (upstream's state that persists
# across requests): greedy tokens equal alone (above), seeded samples need not
PERSISTS = {"recycling": "Token Recycling's adjacency matrix persists across requests (upstream's): a request's "
                         "drafts, hence its draws, depend on the answers finished before it joined"}


def served_sampled() -> list:
    return [pytest.param(m.values[0], marks=pytest.mark.skip(reason=PERSISTS[m.values[0]]))
            if not m.marks and m.values[0] in PERSISTS else m
            for m in map(lambda p: p if hasattr(p, "values") else pytest.param(p), sampled_batchable())]


@pytest.mark.parametrize("method", served_sampled())
def test_every_batchable_method_serves_each_request_its_seeded_samples(every_batchable, method):  # noqa: F811
    """Seeded sampling at concurrency 3: each request draws from its own generator what it draws alone."""
    make = every_batchable[method]
    prompts, stops = workload()
    sampling = SamplingConfig(temperature=0.8)
    alone = [make().generate(p, s, sampling, torch.Generator().manual_seed(i)).tokens
             for i, (p, s) in enumerate(zip(prompts, stops))]
    requests = [Request(p, s, sampling, torch.Generator().manual_seed(i))
                for i, (p, s) in enumerate(zip(prompts, stops))]
    assert [out.tokens for out in make().serve(Requests(requests, 3))] == alone


def test_requests_are_taken_by_arrival_as_the_batch_has_room():
    stop = StopCondition(4)
    queue = Requests([Request([1], stop, arrival=a) for a in (0.5, 0.0, 0.2, 0.2)], concurrency=2)
    assert queue.positions() == 5
    assert queue.due(0.0, 2) == [1] and queue.due(0.3, 1) == [2] and queue.next_arrival() == 0.2
    assert queue.due(0.3, 0) == [] and queue.due(0.3, 5) == [3] and queue.due(0.4, 5) == []
    assert queue.next_arrival() == 0.5 and queue.due(0.5, 1) == [0] and queue.next_arrival() is None
    times = poisson_arrivals(2000, rate=4.0, seed=1)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps) and abs(sum(gaps) / len(gaps) - 0.25) < 0.02
    assert poisson_arrivals(5, 4.0, seed=1) == times[:5]
    with pytest.raises(ValueError, match="concurrency=0"):
        Requests([Request([1], stop)], 0)
    with pytest.raises(ValueError, match="rate=0"):
        poisson_arrivals(3, 0)


def test_serving_records_each_requests_latency_from_its_arrival(every_batchable):  # noqa: F811
    """Open loop: a request that arrives while the batch is full waits, and its TTFT counts from its
    arrival and covers the wait. Closed loop: a request is sent as the batch has room, so its TTFT is its
    own prefill, shorter than the decoding of the one before it. Each total time ends after its first token."""
    make = every_batchable["ar"]
    prompts, stops = workload()
    outs = make().serve(Requests([Request(p, StopCondition(20), arrival=0.0) for p in prompts[:3]], 1))
    first, second, third = (out.stats for out in outs)
    assert 0 < first.ttft < second.ttft < third.ttft  # each waited for the one before it
    assert second.ttft > first.total_time
    closed = [out.stats for out in make().serve(Requests([Request(p, StopCondition(20)) for p in prompts[:3]], 1))]
    assert all(0 < stats.ttft < closed[0].total_time - closed[0].ttft for stats in closed[1:])
    for stats in (first, second, third, *closed):
        assert stats.ttft < stats.total_time and stats.new_tokens == 20


@pytest.mark.parametrize("joined", [True, False], ids=["joined", "per-layer"])
def test_a_sequence_joins_a_batch_cache_in_a_row_of_its_own(target, joined):  # noqa: F811
    """A batch cache made for 2 sequences: after a verification, a third sequence joins (the buffers made
    larger: a copy), one leaves, a fourth joins; each row then holds its sequence's KV as the batch-1
    cache holds it."""
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15], [16, 17]]
    batched = ModelRunner(target)
    batched.reserve_batch(0, 64, slots=2)
    state = [SimpleNamespace(prompt=p) for p in prompts]
    batched.join_rows(state[:2])
    cache = batched.cache
    if not joined:
        cache.regrowths = 1  # as after a layer grew past the joined buffers
    start = batched.length
    batched.forward_batch([Tree.chain(torch.tensor(c)).forward_rows() for c in ([3, 4, 5], [10, 1])])
    batched.commit_batch(start, [[0, 1], [0]])
    batched.join_rows(state[2:3])
    assert cache.lengths == [5, 8, 5] and (cache.slots == 4) == joined
    cache.keep_sequences([0, 2])
    batched.join_rows(state[3:])
    assert cache.lengths == [5, 5, 2] and (cache.joined is not None) == joined
    histories = {0: ([3, 4, 5], [0, 1]), 2: None, 3: None}
    for row, b in enumerate([0, 2, 3]):
        alone = ModelRunner(target)
        alone.reserve(64)
        alone.prefill(prompts[b])
        if histories[b]:
            chain, path = histories[b]
            start = alone.length
            alone.verify(Tree.chain(torch.tensor(chain)))
            alone.commit(start, path)
        for mine, theirs in zip(cache.layers, alone.cache.layers):
            torch.testing.assert_close(mine.key_buffer[row, :, : alone.length], theirs.keys[0])
            torch.testing.assert_close(mine.value_buffer[row, :, : alone.length], theirs.values[0])


# a drafter that keeps a cache in step with the target runs nothing on a step that drafts nothing: the
# batch's draft cache is never made when no step drafts (the draft LM's, EAGLE's head's)
DEFERS = {"sps": lambda d: d.batch_draft.runner is None, "mcsd": lambda d: d.batch_draft.runner is None,
          **{m: lambda d: d.batch_draft.cache is None for m in ("eagle", "eagle2", "eagle3")}}


@pytest.mark.parametrize("method", batchable_methods())
def test_load_aware_speculation_drafts_nothing_above_its_batch_size(every_batchable, method):  # noqa: F811
    """`speculate_up_to` (arctic-inference's `disable_by_batch_size`): at 0 no step drafts a token, and each
    verify forward holds one row per running sequence, as AR's (no draft, no Lookahead window); at 1, steps
    draft only while one sequence decodes; at 2 (three at once), nothing is drafted while three decode and a
    batch of two drafts once the queue is empty (a draft LM catching up on what it missed). Each request's
    greedy tokens are its tokens alone."""
    make = every_batchable[method]
    prompts, stops = workload()
    alone = [make().generate(p, s).tokens for p, s in zip(prompts, stops)]
    for limit in (0, 1, 2):
        decoder, rows = make(), []
        forward = decoder.target.forward_batch

        def counting(batch_rows, *args, **kwargs):
            rows.extend(len(tokens) for tokens, _, _ in batch_rows)
            return forward(batch_rows, *args, **kwargs)

        decoder.target.forward_batch = counting
        outs = decoder.serve(Requests([Request(p, s) for p, s in zip(prompts, stops)], 3, speculate_up_to=limit))
        assert [out.tokens for out in outs] == alone, f"speculate_up_to={limit}"
        if limit == 0:
            assert sum(out.stats.drafted_tokens for out in outs) == 0 and set(rows) == {1}, rows
            if method in DEFERS:  # and no drafter work at all: its draft catches up when drafting resumes
                assert DEFERS[method](decoder)
        if limit == 2 and method in DEFERS:
            assert sum(out.stats.drafted_tokens for out in outs) > 0


def test_serve_bench_measures_each_point_once_and_resumes(tiny_model_dir, questions_file, tmp_path):  # noqa: F811
    """`python -m harness.serve` on a tiny model: AR and PLD at concurrency 1 and 2, per request TTFT, TPOT,
    latency and tokens; each request's tokens the same at every load and for AR and PLD (greedy, lossless);
    a rerun measures nothing again; the report writes its table and figures."""
    from harness.reporting.serving import find_serve_runs
    from harness.reporting.serving import main as report
    from harness.running.serve import serve
    from tests.test_harness import config, tiny_overrides

    overrides = tiny_overrides(tiny_model_dir, questions_file, tmp_path, "method=pld", "serve.concurrency=[1,2]",
                               "serve.requests=4")
    points = serve(config(*overrides))
    assert sorted((p["decoder"], p["load"]["concurrency"]) for p in points) == [("ar", 1), ("ar", 2), ("pld", 1),
                                                                                ("pld", 2)]
    tokens = {(p["decoder"], p["load"]["concurrency"]): [r["output_ids"] for r in p["requests"]] for p in points}
    assert len({str(t) for t in tokens.values()}) == 1
    for point in points:
        assert len(point["requests"]) == 4 and point["output_tokens_per_second"] > 0
        assert point["ttft"]["p50"] <= point["latency"]["p50"] and point["tpot"]["p50"] > 0
    assert serve(config(*overrides)) and len(find_serve_runs([tmp_path])) == 1  # resumed: nothing measured again
    run = find_serve_runs([tmp_path])[0]
    assert len((run / "points.jsonl").read_text().splitlines()) == 4
    assert report([str(tmp_path), "--out", str(tmp_path / "report"), "--plots", str(tmp_path / "plots")]) == 0
    assert list((tmp_path / "plots").rglob("throughput_vs_concurrency.png"))


def test_serve_bench_resumes_after_a_crash_and_reports_each_policy(  # noqa: F811
        tiny_model_dir, questions_file, tmp_path, monkeypatch):  # noqa: F811
    """A run that dies in its third point keeps the two it finished: the rerun measures only the other two. A
    second run of the same method with load-aware speculation is its own folder, and the summary table names
    each run's policy beside AR at each load."""
    import harness.running.serve as serving_run
    from harness.reporting.serving import find_serve_runs, summary_figures, summary_table
    from harness.running.results import FolderMismatch
    from tests.test_harness import config, tiny_overrides

    overrides = tiny_overrides(tiny_model_dir, questions_file, tmp_path, "method=pld", "serve.concurrency=[1,2]",
                               "serve.requests=3")
    measure, measured = serving_run.measure_point, []

    def dies_third(bench, name, requests, questions):
        if len(measured) == 2:
            raise KeyboardInterrupt
        measured.append((name, requests.concurrency))
        return measure(bench, name, requests, questions)

    monkeypatch.setattr(serving_run, "measure_point", dies_third)
    with pytest.raises(KeyboardInterrupt):
        serving_run.serve(config(*overrides))
    first = list(measured)
    monkeypatch.setattr(serving_run, "measure_point", measure)
    points = serving_run.serve(config(*overrides))
    assert len(points) == 4 and {(p["decoder"], p["load"]["concurrency"]) for p in points[:2]} == set(first)
    run = find_serve_runs([tmp_path])[0]
    assert len((run / "points.jsonl").read_text().splitlines()) == 4  # the first two were not measured again
    env = json.loads((run / "environment.json").read_text())
    (run / "environment.json").write_text(json.dumps({**env, "cpu": "another CPU"}))
    with pytest.raises(FolderMismatch, match="another CPU"):  # never mixed with points measured elsewhere
        serving_run.serve(config(*overrides))
    (run / "environment.json").write_text(json.dumps(env))
    serving_run.serve(config(*overrides, "serve.speculate_up_to=1"))
    serving_run.serve(config(*tiny_overrides(tiny_model_dir, None, tmp_path, "method=pld", "dataset=needle",
                                             "dataset.lengths=[100]", "dataset.per_length=2",
                                             "serve.concurrency=[1,2]", "serve.requests=2")))
    runs = find_serve_runs([tmp_path])
    assert len(runs) == 3
    text = summary_table(runs)
    sections = re.split(r"^\*\*(.+)\.\*\*$", text, flags=re.M)
    tables = dict(zip(sections[1::2], sections[2::2]))  # a table each, pld beside AR at both loads
    assert sorted(tables) == ["needle ≈100 tokens, always speculating", "spec_bench, always speculating",
                              "spec_bench, drafting nothing above 1 running sequence(s)"]
    assert all("| method | c = 1 | c = 2 |" in t and "| pld | " in t for t in tables.values())
    assert text.count("×**") == 6
    written = summary_figures(runs, tmp_path / "summary")
    assert {p.parent.name for p in written if p.suffix == ".png"} == {"spec_bench", "spec_bench-up-to-1", "needle-100"}


LEARNT = {"suffix": lambda decoder: len(decoder.cache.cached_requests),
          "recycling": lambda decoder: int(decoder.filled.sum())}


@pytest.mark.parametrize("method", sorted(LEARNT))
def test_a_method_that_learns_across_prompts_starts_every_point_afresh(  # noqa: F811
        tiny_model_dir, questions_file, tmp_path, monkeypatch, method):  # noqa: F811
    """Suffix Decoding's cache and Token Recycling's matrix learn from every answer; a serving point of the
    method starts with neither learnt (no point drafts from another point's answers of the same requests),
    and learns within the point."""
    import harness.running.serve as serving_run
    from tests.test_harness import config, tiny_overrides

    overrides = tiny_overrides(tiny_model_dir, questions_file, tmp_path, f"method={method}",
                               "serve.concurrency=[1,2]", "serve.requests=3")
    measure, learnt = serving_run.measure_point, []

    def noting(bench, name, requests, questions):
        decoder = bench.decoders[name]
        if name == method:
            learnt.append(LEARNT[method](decoder))
        point = measure(bench, name, requests, questions)
        if name == method:
            learnt.append(LEARNT[method](decoder))
        return point

    monkeypatch.setattr(serving_run, "measure_point", noting)
    serving_run.serve(config(*overrides))
    assert learnt[0] == learnt[2] == 0 and learnt[1] > 0 and learnt[3] > 0, learnt
