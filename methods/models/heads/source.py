"""Where a method's draft head comes from: a released checkpoint (Hub id or folder) or random weights."""

from __future__ import annotations

from ...settings.params import mapping, null, setting
from ..specs import ModelSpec
from .random_init import random_head_folder


def head_setting(kind: str):
    """`method.head` of a method with draft heads of `kind` (the model config's `drafts.<kind>`)."""
    return setting(None, null() | mapping(),
                   f"null = the model's drafts.{kind}; or {{path: <hub id or folder>}} (released format) or "
                   f"{{random_init: <seed>}}")


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
