"""`python -m harness.serve` (`make serve-bench`): speculation under load, with continuous batching.

One point is a decoder (AR, or the method) at one load: a closed loop at concurrency c (c clients, each
sending its next request when its previous one ended: c decode at once and the next joins when one
ends), or an open loop (requests arrive as a Poisson process of `serve.rate` per second, seeded, at most
the largest concurrency at once, the others waiting for room). A point decodes `serve.requests`
requests, the dataset's first turns (the questions after `limit` and `dataset.categories`, cycled when
fewer), through `DraftVerifyDecoder.serve`; AR and the method run each load back to back, alternately
first, on the same requests. A method that learns across prompts (Suffix Decoding's cache, Token
Recycling's matrix, REST's reader) starts each point as built, as a server started for that load: its
requests draft from the answers of earlier requests of the point, never from another point's answers
of the same requests.

Per request: TTFT (from when it was sent to its first token: in a closed loop when it joined, in an open
loop its arrival, the wait for room included), TPOT (the time after the first token per further token),
end-to-end latency (from the same start), new tokens and τ. Per point: output
tokens/s over the point's wall time and the percentiles (p50, p90, p99) of the three latencies, with
the machine's load over the point (the busy flag). Points are appended as they finish to
`<results_dir>/<model>/<dataset>/serve/<method>/<hardware>-<dtype>-<hash>/points.jsonl`; the same
command resumes, skipping the points already there (a folder measured with other hardware, software
or decoding code is refused, as `harness.run` refuses it).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
import zlib

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from harness.running import busy
from harness.running.datasets import load_questions
from harness.running.environment import environment, hardware_key, hardware_slug
from harness.running.prompts import Message
from harness.running.results import RunFolder, settings_hash, write_json
from harness.running.run import BASELINE, Benchmark, run_settings
from harness.running.validate import validate
from methods.engine.native import dtype_name
from methods.requests import Request, Requests, poisson_arrivals

log = logging.getLogger("harness")
PERCENTILES = (50, 90, 99)


def loads(cfg: DictConfig) -> list[dict]:
    """The loads of the run, in order: each concurrency (closed loop), or one open loop at the rate."""
    levels = [int(c) for c in cfg.serve.concurrency]
    if cfg.serve.rate:
        return [{"loop": "open", "rate": float(cfg.serve.rate), "concurrency": max(levels)}]
    return [{"loop": "closed", "concurrency": c} for c in levels]


def point_key(name: str, load: dict) -> str:
    return f"{name}@" + ",".join(f"{k}={v}" for k, v in sorted(load.items()))


def build_requests(bench: Benchmark, questions, load: dict, count: int, seed: int,
                   speculate_up_to: int | None) -> Requests:
    """`count` requests from the questions' first turns (cycled), each with its own seeded generator
    (its sampled tokens do not depend on the load), each sent when the batch has room (closed) or arriving
    as a Poisson process (open)."""
    arrivals = poisson_arrivals(count, load["rate"], seed) if load["loop"] == "open" else [None] * count
    requests = []
    for i in range(count):
        question = questions[i % len(questions)]
        limit = bench.max_new_tokens_for(question.category)
        prompt = bench.template.prompt_ids([Message("user", bench.user_turn(question.turns[0], limit))])
        generator = torch.Generator(device=bench.device).manual_seed(
            zlib.crc32(f"{seed}/{question.question_id}/{i}".encode()))
        requests.append(Request(prompt, bench.template.stop_condition(limit), bench.sampling, generator, arrivals[i]))
    return Requests(requests, load["concurrency"], speculate_up_to)


def percentiles(values: list[float]) -> dict:
    return {f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES} if values else {}


def measure_point(bench: Benchmark, name: str, requests: Requests, questions) -> dict:
    """One decoder at one load: its requests served, timed, with the machine's load over them."""
    decoder = bench.decoders[name]
    before = busy.snapshot()
    start = time.perf_counter()
    outputs = decoder.serve(requests)
    wall = time.perf_counter() - start
    machine = busy.state(before, busy.snapshot())
    rows = []
    for i, (request, out) in enumerate(zip(requests.requests, outputs)):
        stats = out.stats
        rows.append(request_row(i, questions[i % len(questions)].question_id, request.arrival, stats.ttft,
                                stats.total_time, out.tokens, stats.tau))
    return point_record(name, rows, wall, machine)


def request_row(index: int, question_id, arrival: float, ttft: float, latency: float, tokens: list[int],
                tau: float) -> dict:
    """One request's record: TTFT and end-to-end latency from its arrival, TPOT after its first token."""
    tpot = (latency - ttft) / (len(tokens) - 1) if len(tokens) > 1 else None
    return {"request": index, "question_id": question_id, "arrival": arrival, "ttft": ttft, "tpot": tpot,
            "latency": latency, "new_tokens": len(tokens), "tau": tau, "output_ids": tokens}


def point_record(name: str, rows: list[dict], wall: float, machine: dict) -> dict:
    """A point: the decoder's output tokens/s over the point's wall time, the percentiles of its requests'
    latencies, their mean τ, the machine's load, and every request's record."""
    tokens = sum(row["new_tokens"] for row in rows)
    return {
        "decoder": name, "wall_time": wall, "output_tokens_per_second": tokens / wall, "new_tokens": tokens,
        "ttft": percentiles([r["ttft"] for r in rows]),
        "tpot": percentiles([r["tpot"] for r in rows if r["tpot"] is not None]),
        "latency": percentiles([r["latency"] for r in rows]),
        "tau": statistics.mean(r["tau"] for r in rows), "machine": machine, "busy": busy.is_busy(machine),
        "requests": rows,
    }


def serve(cfg: DictConfig) -> list[dict]:
    """Every point of the run not yet in its folder, measured and appended; returns them all."""
    validate(cfg)
    bench = Benchmark(cfg)
    bench.choose_dtype()
    questions = load_questions(cfg.dataset, cfg.limit)
    precision = dtype_name(bench.dtype)
    settings = {**run_settings(cfg, bench, questions, precision),
                "serve": OmegaConf.to_container(cfg.serve, resolve=True)}

    def prepare() -> dict:
        bench.load()
        if cfg.warmup:
            log.info("warming up: %d untimed generation(s) per decoder", cfg.warmup)
            bench.warm_up(questions[0])
        return {"engine": bench.engine_record()}

    def measure(name: str, load: dict) -> dict:
        limit = cfg.serve.speculate_up_to if name != BASELINE else None
        bench.decoders[name].reset()  # a point drafts from no other point's answers
        requests = build_requests(bench, questions, load, int(cfg.serve.requests), int(cfg.seed), limit)
        return {"speculate_up_to": requests.speculate_up_to, **measure_point(bench, name, requests, questions)}

    return measure_points(cfg, cfg.method.name, bench.names, settings, environment(bench.device), prepare, measure)


def measure_points(cfg: DictConfig, method: str, names: list[str], settings: dict, env: dict, prepare, measure
                   ) -> list[dict]:
    """The points of a serving run (`names` at each load) not yet in its folder, `measure(name, load)`d and
    appended one by one, after `prepare()` (what it returns joins environment.json); returns them all.
    The folder: `<results_dir>/<model>/<dataset>/serve/<method>/<hardware>-<dtype>-<settings hash>`."""
    root = f"{cfg.results_dir}/{cfg.model.name}/{cfg.dataset.name}/serve/{method}"
    folder = RunFolder(f"{root}/{hardware_slug(env)}-{settings['dtype']}-{settings_hash(settings)}", names)
    points_file = folder.path / "points.jsonl"
    key = hardware_key(env)
    folder.check(key, resume=bool(cfg.resume), measured=[points_file])
    done = {}
    if cfg.resume and points_file.is_file():
        for line in points_file.read_text().splitlines():
            point = json.loads(line)
            done[point_key(point["decoder"], point["load"])] = point
    todo = [(load, name) for load in loads(cfg) for name in names if point_key(name, load) not in done]
    log.info("results in %s: %d points, %d already measured", folder.path, len(done) + len(todo), len(done))
    if not todo:
        return list(done.values())
    record = prepare()
    folder.path.mkdir(parents=True, exist_ok=True)
    write_json(folder.path / "environment.json", {**env, "dtype": settings["dtype"], **record, **key})
    write_json(folder.path / "settings.json", settings)
    if not cfg.resume:
        points_file.unlink(missing_ok=True)
    for index, load in enumerate(loads(cfg)):
        order = [n for n in names if point_key(n, load) not in done]
        if index % 2:
            order.reverse()  # AR first at even loads, the method first at odd ones
        for name in order:
            point = {"load": load, **measure(name, load)}
            with open(points_file, "a") as f:
                f.write(json.dumps(point) + "\n")
            done[point_key(name, load)] = point
            log.info("%s, %s: %.1f tokens/s, TTFT p50 %.0f ms, TPOT p50 %.1f ms, tau %.2f%s", name, load,
                     point["output_tokens_per_second"], 1000 * point["ttft"]["p50"],
                     1000 * point["tpot"].get("p50", float("nan")), point["tau"], ", BUSY" if point["busy"] else "")
    return list(done.values())
