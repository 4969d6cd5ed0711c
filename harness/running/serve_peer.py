"""llama.cpp's server under the load `python -m harness.serve` puts on ours (`serve.peer=llama.cpp`,
`make serve-peer`).

`llama-server` is built once from the llama.cpp sources that the pinned `llama-cpp-python` sdist vendors
(the `peers` extra's pin in pyproject.toml: downloaded from PyPI, built with cmake under the suite's cache,
about 10 minutes on 2 cores), with `llama-quantize`, which requantizes the model's GGUF to F32 (the run's
dtype must be float32: ours then decodes the same weights in the same precision). At each load of
`serve:` the server starts on loopback with `concurrency` parallel slots (continuous batching, its
default), the run's threads, a context of `concurrency` x the longest request, and decodes the same
requests `harness.serve` builds (the chat template's token ids, the same new tokens at most, greedy),
sent by the client with at most `concurrency` in flight (a closed loop's as a slot frees, an open loop's at
its arrival time), streamed: a request's TTFT is its first streamed token's time from when it was sent (an
open loop's arrival), its TPOT and latency as ours. Two decoders,
each at every load, AR and the method alternately first: its autoregressive decoding (`ar`) and its
n-gram self-speculation (`SPECULATION`, prompt lookup as PLD's: no draft model). τ is its tokens per
target step, from the server's draft counts. Points go to `serve/llama.cpp/...` as `harness.serve`'s do,
so the serving report shows its speculation beside its own AR; each request's tokens are kept (greedy:
comparable with our AR's on the same requests).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from harness.running import busy
from harness.running.datasets import load_questions
from harness.running.environment import environment
from harness.running.prompts import ChatTemplate
from harness.running.run import BASELINE, Benchmark, run_settings
from harness.running.serve import build_requests, measure_points, point_record, request_row
from methods.engine.storage import cache_root
from methods.models.loading import gguf_source, load_tokenizer
from methods.models.specs import PROJECT_ROOT as REPO
from methods.models.specs import ModelSpec

log = logging.getLogger("harness")
SPECULATION = "ngram-simple"
# llama.cpp's n-gram self-speculation at PLD's lookup (3-gram) and a draft of up to 8 tokens
SPECULATION_FLAGS = ("--spec-type", SPECULATION, "--spec-ngram-simple-size-n", "3",
                     "--spec-ngram-simple-size-m", "8")
STARTUP_SECONDS = 120


class PeerUnavailable(RuntimeError):
    """The peer cannot run here; the message is the one-line reason."""


def pinned_version() -> str:
    """llama-cpp-python's version pinned by the `peers` extra (pyproject.toml)."""
    found = re.search(r'"llama-cpp-python==([\w.]+)"', (REPO / "pyproject.toml").read_text())
    if not found:
        raise PeerUnavailable("pyproject.toml pins no llama-cpp-python version")
    return found[1]


def build_tools(version: str | None = None) -> Path:
    """The folder holding `llama-server` and `llama-quantize`, built once from the pinned sdist's llama.cpp."""
    version = version or pinned_version()
    root = cache_root() / "llama.cpp" / version
    source = root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    bin_dir = source / "build" / "bin"
    if (bin_dir / "llama-server").is_file() and (bin_dir / "llama-quantize").is_file():
        return bin_dir
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise PeerUnavailable(f"building llama.cpp needs {' and '.join(missing)} (Debian: cmake, g++)")
    root.mkdir(parents=True, exist_ok=True)
    if not source.is_dir():
        log.info("downloading llama-cpp-python %s's sdist from PyPI (llama.cpp's sources)", version)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", str(root)], check=True)
        with tarfile.open(root / f"llama_cpp_python-{version}.tar.gz") as sdist:
            sdist.extractall(root, filter="data")
    log.info("building llama-server and llama-quantize in %s (cmake, about 10 minutes on 2 cores)", source / "build")
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_SERVER=ON",
             "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_NATIVE=ON"]
    subprocess.run(["cmake", "-S", str(source), "-B", str(source / "build"), *flags], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(source / "build"), "--target", "llama-server", "llama-quantize",
                    "-j", str(os.cpu_count() or 1)], check=True, stdout=subprocess.DEVNULL)
    return bin_dir


def tool_env(tools: Path) -> dict:
    """The environment the tools run in: their shared libraries (ggml, llama) beside them."""
    return {**os.environ, "LD_LIBRARY_PATH": ":".join(filter(None, (str(tools), os.environ.get("LD_LIBRARY_PATH"))))}


def f32_gguf(tools: Path, source: Path) -> Path:
    """`source` requantized to F32 by llama.cpp's own `llama-quantize`, made once under the suite's cache."""
    target = cache_root() / "gguf" / f"{source.stem}-{source.stat().st_size}.F32.gguf"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        subprocess.run([str(tools / "llama-quantize"), "--allow-requantize", str(source), str(partial), "F32"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=tool_env(tools))
        partial.rename(target)
    return target


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`llama-server` on loopback for one load, stopped on exit."""

    def __init__(self, tools: Path, gguf: Path, slots: int, context: int, threads: int, flags=()):
        self.port, self.tools = free_port(), tools
        self.command = [str(tools / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                        "-np", str(slots), "-c", str(slots * context), "-t", str(threads), "-tb", str(threads),
                        "--no-webui", "--log-disable", *flags]

    def __enter__(self) -> Server:
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        env=tool_env(self.tools))
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PeerUnavailable(f"llama-server exited ({self.process.returncode}): "
                                      f"{self.process.stderr.read().strip().splitlines()[-1:]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise PeerUnavailable(f"llama-server not ready after {STARTUP_SECONDS} s")

    def __exit__(self, *_) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def complete(port: int, prompt: list[int], max_new_tokens: int, began: float) -> dict:
    """One greedy completion from the llama.cpp server on `port`, streamed: its tokens, the seconds from
    `began` to its first and its last token, and how many drafted tokens the server accepted."""
    body = {"prompt": prompt, "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1, "stream": True,
            "cache_prompt": False, "return_tokens": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise PeerUnavailable(f"llama-server answered {response.status}: {response.read()[:200]!r}")
    tokens, first, timings = [], None, {}
    for line in response:
        if not line.startswith(b"data: "):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("tokens") and first is None:
            first = time.perf_counter() - began
        tokens += chunk.get("tokens") or []
        timings = chunk.get("timings") or timings
        if chunk.get("stop"):
            break
    latency = time.perf_counter() - began
    conn.close()
    return {"tokens": tokens, "ttft": latency if first is None else first, "latency": latency,
            "accepted": int(timings.get("draft_n_accepted") or 0)}


def serve_load(port: int, requests, questions) -> tuple[list[dict], float]:
    """The requests sent to the server on `port` (a closed loop's as one in flight ends, an open loop's at its
    arrival time), at most the load's concurrency in flight; their rows and the wall time until the last
    one finished."""
    permits = threading.Semaphore(requests.concurrency)
    results: dict[int, dict] = {}
    errors: list[BaseException] = []
    start = time.perf_counter()

    def one(index: int) -> None:
        request = requests.requests[index]
        time.sleep(max(0.0, requests.due_at(index) - (time.perf_counter() - start)))
        with permits:  # a closed loop's request is sent now (its TTFT counts from here); an open loop's arrived
            began = time.perf_counter() if request.arrival is None else start + request.arrival
            try:
                results[index] = complete(port, request.prompt, request.stop.max_new_tokens, began)
            except BaseException as err:  # noqa: BLE001 (re-raised below, in the caller's thread)
                errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in requests.order]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    rows = []
    for i, request in enumerate(requests.requests):
        out = results[i]
        steps = max(1, len(out["tokens"]) - out["accepted"])
        rows.append(request_row(i, questions[i % len(questions)].question_id, request.arrival, out["ttft"],
                                out["latency"], out["tokens"], len(out["tokens"]) / steps))
    return rows, wall


def serve_peer(cfg: DictConfig) -> list[dict]:
    """llama.cpp's AR and n-gram speculation at every load of the run, on the requests `harness.serve` builds."""
    bench = Benchmark(cfg)
    if str(cfg.dtype) not in ("float32", "auto"):
        raise ValueError(f"dtype={cfg.dtype}: llama.cpp's server runs the F32 GGUF here; valid: float32")
    spec = ModelSpec.from_mapping(cfg.model)
    source = gguf_source(spec)  # a Hub model without a GGUF: refused here, before anything builds
    questions = load_questions(cfg.dataset, cfg.limit)
    bench.dtype = "float32"
    settings = {**run_settings(cfg, bench, questions, "float32"),
                "serve": OmegaConf.to_container(cfg.serve, resolve=True),
                "method": {"name": f"llama.cpp {SPECULATION}", "version": pinned_version(),
                           "speculation": list(SPECULATION_FLAGS)}}
    settings.pop("drafts", None)
    threads = int(cfg.threads or os.cpu_count() or 1)
    state = {}

    def prepare() -> dict:
        tools = build_tools()
        state["tools"], state["gguf"] = tools, f32_gguf(tools, source)
        bench.tokenizer = load_tokenizer(spec)
        bench.template = ChatTemplate.for_model(cfg.model, bench.tokenizer)
        return {"engine": {"peer": "llama.cpp llama-server", "version": settings["method"]["version"],
                           "gguf": state["gguf"].name, "threads": threads}}

    def measure(name: str, load: dict) -> dict:
        requests = build_requests(bench, questions, load, int(cfg.serve.requests), int(cfg.seed), None)
        flags = () if name == BASELINE else SPECULATION_FLAGS
        with Server(state["tools"], state["gguf"], requests.concurrency, requests.positions() + 16, threads,
                    flags) as server:
            warm = requests.requests[0]
            complete(server.port, warm.prompt, min(32, warm.stop.max_new_tokens), time.perf_counter())
            before = busy.snapshot([server.process.pid])  # the server's CPU time is the measurement's own
            rows, wall = serve_load(server.port, requests, questions)
            machine = busy.state(before, busy.snapshot([server.process.pid]))
        return {"speculate_up_to": None, **point_record(name, rows, wall, machine)}

    return measure_points(cfg, "llama.cpp", [BASELINE, SPECULATION], settings, environment(bench.device), prepare,
                          measure)
