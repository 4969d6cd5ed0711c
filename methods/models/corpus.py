"""The suite's own draft-training corpus, shared by the recipes that train drafts (`harness/training/`) and the
methods that build a file from it (REST's datastore, SAM-Decoding's static automaton):

- the prompt recipe (`training_prompts`): seeded prompts drawn from `corpus_prompts.yaml` and the Python standard
  library's own text, so that the same call writes the same prompts on any machine with the same Python;
- the corpus manifest (`drafts/<model>/corpus.json`, written by `python -m harness.training data`) and the token
  sequences it names (`corpus_entries`): the target's answers where they are on this machine, else the prompts
  regenerated from the recipe and checked against the manifest's checksum;
- the file a method builds from them once and caches (`corpus_file`), or the one a setting names (`configured_file`).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import random
import re
from pathlib import Path
from pydoc_data.topics import topics

import yaml

from ..engine.storage import cache_root
from .specs import PROJECT_ROOT, ModelSpec

# ------------------------------------------------------------------------------------------
# The prompt recipe

# the subjects and templates the prompts are drawn from (data, written for this suite; order matters)
MATERIAL = yaml.safe_load((Path(__file__).with_name("corpus_prompts.yaml")).read_text(encoding="utf-8"))
SUBJECTS, OPEN_TEMPLATES, MATH_TEMPLATES = MATERIAL["subjects"], MATERIAL["open_templates"], MATERIAL["math_templates"]
NAMES, ITEMS, LANGUAGES = MATERIAL["names"], MATERIAL["items"], MATERIAL["languages"]
CODE_TEMPLATES, PASSAGE_TEMPLATES = MATERIAL["code_templates"], MATERIAL["passage_templates"]
SAMPLED_SHARE = 0.2  # prompts answered by sampling at T = 1 (diversity); the rest greedily


def _math_prompt(rng: random.Random) -> str:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(3, 60), rng.randint(2, 12), rng.randint(1, 9)
    return rng.choice(MATH_TEMPLATES).format(name=name, item=item, a=a, b=b, c=c, ac=a * c, c7=c * 7, abc=a * b + c,
                                             a20=a + 20, bc=b + c, goal=a + b * (c + 3))


def _stdlib_functions() -> list[tuple[str, str]]:
    """(qualified name, first docstring line) of public standard-library functions."""
    found = []
    for module_name in ("string", "textwrap", "statistics", "itertools", "functools", "os.path", "shutil",
                        "json", "math", "random", "bisect", "heapq", "difflib", "fnmatch", "calendar",
                        "base64", "colorsys", "operator", "zlib", "glob", "html", "urllib.parse"):
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not callable(obj):
                continue
            doc = inspect.getdoc(obj) or ""
            line = doc.strip().splitlines()[0] if doc.strip() else ""
            if 20 <= len(line) <= 160 and not line.startswith(name + "("):
                found.append((f"{module_name}.{name}", line))
    return found


def _passages(min_chars: int = 250, max_chars: int = 650) -> list[str]:
    """Paragraph groups from the Python language reference that ships with CPython."""
    passages = []
    for text in topics.values():
        chunk = ""
        for paragraph in re.split(r"\n\s*\n", text):
            paragraph = " ".join(paragraph.split())
            if len(chunk) + len(paragraph) > max_chars and len(chunk) >= min_chars:
                passages.append(chunk.strip())
                chunk = ""
            chunk += paragraph + "\n"
        if len(chunk) >= min_chars:
            passages.append(chunk.strip()[:max_chars])
    return passages


KINDS = {"open": 30, "math": 12, "code": 16, **{k: 7 for k in PASSAGE_TEMPLATES}}  # weights (percent)


def training_prompts(n: int, seed: int = 0) -> list[dict]:
    """`n` distinct prompts (id, kind, text, mode), seeded, across the kinds of `KINDS`; `mode` is
    "sample" for a `SAMPLED_SHARE` of them (answered at T = 1) and "greedy" otherwise."""
    rng = random.Random(seed)
    functions, passages = _stdlib_functions(), _passages()
    kinds, weights = list(KINDS), list(KINDS.values())
    prompts, seen, misses = [], set(), 0
    while len(prompts) < n:
        kind = rng.choices(kinds, weights)[0]
        if kind == "open":
            s, t = rng.sample(SUBJECTS, 2)
            text = rng.choice(OPEN_TEMPLATES).format(s=s, t=t)
        elif kind == "math":
            text = _math_prompt(rng)
        elif kind == "code":
            qualified, line = rng.choice(functions)
            text = rng.choice(CODE_TEMPLATES).format(q=qualified, line=line)
        else:
            passage = rng.choice(passages)
            if kind == "translate":  # a short piece: the model translates a paragraph, not a page
                passage = passage.split("\n")[0][:500]
            text = PASSAGE_TEMPLATES[kind].format(p=passage, lang=rng.choice(LANGUAGES))
        mode = "sample" if rng.random() < SAMPLED_SHARE else "greedy"
        if text in seen:
            misses += 1
            if misses > 50 * n:
                raise ValueError(f"only {len(prompts)} distinct prompts could be made; asked for {n}")
            continue
        seen.add(text)
        prompts.append({"id": f"p{len(prompts):05d}", "kind": kind, "text": text, "mode": mode})
    return prompts


# ------------------------------------------------------------------------------------------
# The manifest and the files built from the corpus


def resolve_path(path: str) -> Path:
    """A file setting's path (REST's datastore, SAM's static automaton); relative ones from the working folder,
    else from the project root."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or p.exists() else PROJECT_ROOT / p


def manifest(model_name: str | None) -> dict | None:
    """The corpus manifest of the suite's own draft-training corpus for this model, if any."""
    file = PROJECT_ROOT / "drafts" / str(model_name) / "corpus.json"
    return json.loads(file.read_text()) if model_name and file.is_file() else None


def corpus_entries(model_name: str, tokenizer, joined: bool = False) -> tuple[str, list[list[int]]]:
    """The suite's draft-training corpus for `model_name` as token-id sequences, and what it was:
    the target's answers (prompt ids, answer ids; `joined`: one sequence per record, as SAM-Decoding's
    recipe joins prompt and response) where `data/distill/<model>/answers.jsonl` is here
    with the manifest's checksum, else the corpus's prompts regenerated from its recipe (their
    checksum checked against the manifest) and encoded as upstream encodes a message."""
    record = manifest(model_name)
    if record is None:
        raise ValueError(f"model {model_name!r} has no corpus manifest drafts/{model_name}/corpus.json")
    answers = PROJECT_ROOT / record["file"]
    if answers.is_file() and hashlib.sha256(answers.read_bytes()).hexdigest() == record["sha256"]:
        entries = []
        for line in answers.read_text().splitlines():
            record = json.loads(line)
            ids, start = record["ids"], record["answer_start"]
            entries += [ids] if joined else [ids[:start], ids[start:]]
        return f"answers {record['sha256'][:12]}", entries
    command = record.get("command", "").split()
    seed = int(command[command.index("--seed") + 1]) if "--seed" in command else 0
    prompts = training_prompts(int(record["prompts"]), seed)
    digest = hashlib.sha256("".join(json.dumps(p) + "\n" for p in prompts).encode()).hexdigest()
    if record.get("prompts_sha256") and digest != record["prompts_sha256"]:
        raise ValueError(f"the regenerated training prompts do not match drafts/{model_name}/corpus.json "
                         f"(sha256 {digest[:12]} != {record['prompts_sha256'][:12]})")
    return f"prompts {digest[:12]}", [tokenizer.encode(p["text"]) for p in prompts]


def corpus_file(kind: str, suffix: str, model_name: str, model_config: dict, build, log=print,
                version: tuple = ()) -> Path:
    """The model's own `kind` file (REST's datastore, SAM's static automaton) from its draft-training corpus
    (the manifest `drafts/<model>/corpus.json`): its answers where they are on this machine, else its
    prompts. Built once by `build(tokenizer, path, log)` and cached under the suite's cache folder, named
    by the manifest, the source and `version`."""
    from .loading import load_tokenizer  # lazy: the tokenizer, only when the file is first built

    record = manifest(model_name)
    answers = resolve_path(record["file"]) if record else None
    source = "answers" if answers is not None and answers.is_file() else "prompts"
    key = hashlib.sha256(json.dumps([record, source, *version], sort_keys=True).encode()).hexdigest()[:12]
    path = cache_root() / kind / f"{model_name}-{source}-{key}{suffix}"
    if path.is_file():
        return path
    log(f"{kind}: building the {model_name} {kind} file from its draft-training corpus ({source}), once; "
        f"cached at {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    build(load_tokenizer(ModelSpec.from_mapping(model_config)), path, log)
    return path


def configured_file(kind: str, setting: str, model_name: str, model_config: dict, embedded) -> Path:
    """A file setting's path: an explicit file; `auto`: the model config's `datastores.<kind>`, else
    `embedded(model_name, model_config)` (the model's own, `corpus_file`)."""
    if setting != "auto":
        return resolve_path(setting)
    configured = (model_config.get("datastores") or {}).get(kind)
    return resolve_path(configured) if configured else embedded(model_name, model_config)
