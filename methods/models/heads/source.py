"""Where a method's draft head comes from: a released checkpoint (Hub id or folder) or random weights."""

from __future__ import annotations

from ..specs import ModelSpec
from .random_init import random_head_folder


def head_spec(params: dict, context, kind: str) -> ModelSpec:
    """Where a method's draft head comes from: `method.head` when given, else the model config's
    `drafts.<kind>`. `{path: ...}` is a Hub id or folder in the released format;
    `{random_init: seed}` writes randomly initialized weights in that format once (cached) and
    loads them through the same loader: exact decoding, near-zero acceptance."""
    spec = dict(params.get("head") or context.draft_spec(kind, params.get("name", kind)))
    if spec.get("random_init") is not None:
        folder = random_head_folder(kind, context.target_model, int(spec["random_init"]))
        return ModelSpec(path=str(folder), override_hint="method.head.path")
    return ModelSpec.from_mapping(spec, override_hint="method.head.path")
