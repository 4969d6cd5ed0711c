"""The llama.cpp serving peer's client (harness/running/serve_peer.py) against a server that speaks
llama-server's streamed `/completion` (server-task.cpp: `data: {json}` events with `tokens`, `stop` and,
last, `timings` with `draft_n_accepted`); and, where the suite's build of llama-server is in the cache,
the real server decoding the embedded model."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from harness.running.serve_peer import complete, serve_load
from methods.engine.stopping import StopCondition
from methods.requests import Request, Requests

STEP = 0.02  # seconds per streamed event


class FakeLlamaServer(BaseHTTPRequestHandler):
    """Streams each prompt's tokens reversed, two per event (a draft accepted per step), and counts how many
    completions run at once."""

    running = 0
    most = 0
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] and body["return_tokens"] and body["temperature"] == 0
        with self.lock:
            type(self).running += 1
            type(self).most = max(type(self).most, type(self).running)
        tokens = list(reversed(body["prompt"]))[:body["n_predict"]]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(0, len(tokens), 2):
            time.sleep(STEP)
            self.wfile.write(f"data: {json.dumps({'tokens': tokens[i:i + 2], 'stop': False})}\n\n".encode())
            self.wfile.flush()
        with self.lock:
            type(self).running -= 1
        last = {"tokens": [], "stop": True, "timings": {"draft_n": len(tokens), "draft_n_accepted": len(tokens) // 2}}
        self.wfile.write(f"data: {json.dumps(last)}\n\n".encode())

    def log_message(self, *_):
        pass


@pytest.fixture
def fake_server():
    FakeLlamaServer.running = FakeLlamaServer.most = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeLlamaServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


def test_a_streamed_completion_has_its_tokens_first_token_time_and_accepted_drafts(fake_server):
    began = time.perf_counter()
    out = complete(fake_server, [5, 6, 7, 8, 9, 10], 4, began)
    assert out["tokens"] == [10, 9, 8, 7] and out["accepted"] == 2
    assert STEP * 0.9 <= out["ttft"] < out["latency"] and out["latency"] >= 2 * STEP * 0.9


def test_the_load_keeps_at_most_its_concurrency_in_flight_and_times_each_request_from_when_it_was_sent(
        fake_server):
    """Six requests at concurrency 2: never more than two at the server, three rounds of two. A closed loop's
    request is sent as a slot frees, so its TTFT is its own first event; an open loop's arrived at 0, and the
    last to get a slot waited for two others, which its TTFT counts. τ from the accepted drafts."""
    prompts = [[i, i + 1, i + 2, i + 3] for i in range(0, 60, 10)]
    questions = [SimpleNamespace(question_id=q) for q in range(3)]
    for arrival in (None, 0.0):
        FakeLlamaServer.most = 0
        requests = Requests([Request(p, StopCondition(max_new_tokens=4), arrival=arrival) for p in prompts], 2)
        rows, wall = serve_load(fake_server, requests, questions)
        assert FakeLlamaServer.most == 2
        assert [row["output_ids"] for row in rows] == [list(reversed(p)) for p in prompts]
        assert [row["question_id"] for row in rows] == [0, 1, 2, 0, 1, 2]
        assert all(row["tau"] == 2.0 and row["ttft"] < row["latency"] <= wall for row in rows)
        assert wall >= 3 * (2 * STEP) * 0.9  # three rounds of two
        waited = max(row["ttft"] for row in rows)
        if arrival is None:
            assert waited < 2 * STEP  # one event after it was sent
        else:
            assert waited >= 2 * (2 * STEP) * 0.9  # waited for two completions of two events


def test_a_measured_servers_cpu_time_is_not_other_work():
    """A process spinning on a core beside the measurement is other work (the machine busy), unless it is
    the server being measured (its pid handed to the snapshots): then its CPU time is the point's own."""
    import subprocess
    import sys

    from methods.machine.load import process_cpu, snapshot, state

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        plain, measured = snapshot(), snapshot([spinner.pid])
        time.sleep(1.0)
        other, own = state(plain, snapshot()), state(measured, snapshot([spinner.pid]))
        assert process_cpu(spinner.pid) > 0.5
    finally:
        spinner.kill()
        spinner.wait()
    assert other["other_cores"] >= 0.6 and other["busy"]
    assert own["other_cores"] <= other["other_cores"] - 0.5
    assert process_cpu(spinner.pid) == 0.0  # gone
