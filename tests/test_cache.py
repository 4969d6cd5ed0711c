"""The suite keeps what it derives (profiles, the native library, random heads) in its own cache
directory: a test run leaves the user's ~/.cache/decodebench as it found it."""

from __future__ import annotations

from methods.engine.runner import ModelRunner
from methods.engine.storage import cache_root
from methods.machine.profile import MachineProfile
from methods.models.heads.random_init import random_head_folder
from tests.conftest import cache_listing, tiny_model


def test_the_suites_own_writes_go_to_its_cache_not_the_users(suite_cache):
    user, suite = suite_cache
    before = cache_listing(user)
    assert cache_root() == suite != user
    target = tiny_model("llama", seed=90, vocab_size=48, hidden=32, layers=1)
    profile = MachineProfile("cpu")
    runner = ModelRunner(target, skinny_gemm="auto", profile=profile)  # the plan (and the native library it times)
    profile.latency_curve(runner, "cache-test", sizes=(1, 2), repeats=1)
    random_head_folder("medusa", target, seed=90)
    written = cache_listing(suite)
    assert any(p.startswith("profiles/") and "/linear-float32.json" in p for p in written)
    assert any(p.startswith("profiles/") and "/curve-cache-test-" in p for p in written)
    assert any(p.startswith("heads/medusa-random-h32-v48-seed90/") for p in written)
    assert cache_listing(user) == before
    for marker in (user / "gguf").glob("*/source.json"):  # dequantized models: read through links, never made again
        assert (suite / "gguf" / marker.parent.name).resolve() == marker.parent.resolve()
