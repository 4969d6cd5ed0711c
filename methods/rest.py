"""REST: retrieval-based speculative decoding (He et al., NAACL 2024; FasterDecoding/REST,
`rest/model/utils.py` `generate_candidates_and_draft_buffer`, `llm_judge/gen_model_answer_rest.py`).

Upstream's calls: a datastore built from a corpus (`draftretriever.Writer`, one entry per tokenized
message) is searched (`Reader.search`) with the last `span` tokens of prompt + output, `span` =
`max_token_span` (16) down to 2, the first span with any draft winning, asking for `num_draft` (64)
nodes; the returned paths are merged into a draft tree rooted at the last token (cut to `num_draft`
nodes: the library's own cut is best effort) and verified by the shared loop: greedy match, or
rejection sampling with the draft as point masses (lossless at any temperature). `num_draft: auto`
is this machine's verify budget less the root (upstream's 64 without a machine profile). Nothing
retrieved: the step is an AR step (upstream then guesses token id 100 as a one-token draft; that
guess is left out here).

The library is PyPI's `draftretriever` 0.1.1 (pinned; 0.1.0 is the same design), published by ADED
(liuxukun2000/ADED) from REST's: NOT REST's suffix array over the corpus (REST's
`DraftRetriever/src/lib.rs` counts the `long` tokens after up to `k` matches and keeps the most
frequent prefixes). Its sdist's `src/lib.rs`: the Writer stores, per pair of tokens, the
probabilities of the token after them in the corpus (entries under 3 tokens add nothing); the
Reader keeps each pair's 12 likeliest successors and, at every search, adds 0.04 to each trigram of
the query's last 16 tokens (so the reader learns the decoded text, for the decoder's lifetime); the
draft is 150 Monte Carlo tree search rollouts of 4 tokens from the query's last two tokens
(`src/mcts_sub.rs`), drawn from an unseeded random generator: `k` (`matches`) and `long`
(`continuation`) are not read, and the drafts differ from run to run, and with them a seeded
sampled answer (never the greedy tokens).

Batch size B > 1: each sequence searches with its own text and keeps its counters in its
`DecodeState`; the reader is the decoder's one, as across prompts, so its table also learns from
the sequences decoded beside it.

The datastore (`method.datastore`):
- `auto` on a model with a datastore in its config (`datastores.rest: <file>`): that file.
- `auto` on the embedded model (a corpus manifest `drafts/<model>/corpus.json`): built once from the
  suite's own draft-training corpus and cached under the suite's cache folder: the target's answers
  (`data/distill/<model>/answers.jsonl`, prompt and answer ids) where that file is on this machine
  with the manifest's checksum, else the corpus's prompts regenerated from its recipe (checked
  against the manifest's `prompts_sha256`), each tokenized with the target's tokenizer as upstream
  tokenizes a message (`tokenizer.encode(text)`).
- a file: a draftretriever index, e.g. upstream's ShareGPT datastore for Vicuna, built by
  `python -m methods.rest --tokenizer lmsys/vicuna-7b-v1.3 --sharegpt ShareGPT_V4.3_unfiltered_cleaned_split.json
  --out datastore_chat_small.idx` (upstream's `datastore/get_datastore_chat.py`).

`python -m methods.rest --model smollm2-135m` (`make rest-datastore`) builds the embedded one ahead.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from .base import BuildContext, register
from .engine.tree import Tree
from .loop import DraftVerifyDecoder
from .models.corpus import configured_file, corpus_entries, corpus_file, manifest, resolve_path
from .pld import trie
from .settings.params import Check, ConfigError, Settings, integer, one_of, setting
from .settings.sizing import Sizing

UPSTREAM_DRAFT = 64  # upstream's --num-draft
MIN_TOKEN_SPAN = 2  # upstream: token_spans = range(2, max_token_span + 1), longest first
MAX_CHUNK_LEN = 512 * 1024 * 1024  # upstream's Writer(max_chunk_len=512 * 1024 * 1024)
SHAREGPT_COMMAND = ("python -m methods.rest --tokenizer <the model's Hub id or folder> --sharegpt "
                    "ShareGPT_V4.3_unfiltered_cleaned_split.json --out <file>.idx")


def file_value(value) -> bool:
    """A file setting's value (REST's datastore, SAM's static automaton): a non-empty string."""
    return isinstance(value, str) and bool(value)


@dataclass(frozen=True)
class RestSettings(Settings):
    """REST's calls (the text's last 16 tokens down to 2, num_draft nodes) on the pinned draftretriever
    0.1.1, which is ADED's, not REST's suffix array: a trigram table of the corpus, which every search
    also adds the text to, and Monte Carlo tree search rollouts of 4 tokens from an unseeded random
    generator (drafts differ from run to run; greedy tokens do not). The embedded model's datastore
    is built on first use from the suite's draft-training corpus and cached; other models need one
    (python -m methods.rest --help)."""

    paper = "He et al. 2024 (FasterDecoding/REST)"
    batchable = True  # each sequence's search reads its own text; its counters are in its DecodeState
    size_setting, size_recorded, size_label = "num_draft", "draft_nodes", "draft tree nodes"

    datastore: str = setting("auto", Check(file_value, "auto or a draftretriever datastore file"),
                             "auto = the model config's datastores.rest, or the embedded model's own (built once, "
                             "cached); or a file")
    num_draft: int | str = setting("auto", one_of("auto") | integer(1),
                                   "most draft nodes (draftretriever's choices): auto = this machine's verify budget "
                                   "less the root (upstream's --num-draft 64 without a machine profile)")
    max_token_span: int = setting(16, integer(MIN_TOKEN_SPAN),
                                  "upstream's --max-token-span 16: the longest suffix searched (then shorter, to 2)")
    continuation: int = setting(10, integer(1), "draftretriever's long (upstream keeps its 10): tokens read after "
                                                "each match; the pinned 0.1.1 does not read it")
    matches: int = setting(5000, integer(1), "draftretriever's k (upstream keeps its 5000): matches read per "
                                             "datastore chunk; the pinned 0.1.1 does not read it")

    def check_model(self, model: dict) -> None:
        if self.datastore != "auto":
            path = resolve_path(self.datastore)
            if not path.is_file():
                raise ConfigError("method.datastore", self.datastore,
                                  f"an existing datastore (there is no datastore file {path}); "
                                  f"build one: {SHAREGPT_COMMAND}")
            return
        if (model.get("datastores") or {}).get("rest") or manifest(model.get("name")) is not None:
            return
        raise ConfigError("model", model.get("name"), f"a model with a REST datastore: model {model.get('name')} "
                          f"has no REST datastore; build one with upstream's recipe ({SHAREGPT_COMMAND}) and pass "
                          "method.datastore=<file>")


# ------------------------------------------------------------------------------------------
# Datastores


def write_datastore(path: Path, entries) -> dict:
    """A draftretriever index at `path` from token-id sequences (upstream's Writer calls); returns its
    counts. Written to a temporary name first, so that a killed build leaves no half file."""
    import draftretriever  # lazy: draftretriever (REST's index), only where a datastore is written

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    # upstream's max_chunk_len; 0.1.1's wrapper takes it as vocab_size, which its writer never reads
    writer = draftretriever.Writer(str(tmp), MAX_CHUNK_LEN)
    count = tokens = 0
    for ids in entries:
        if ids:
            writer.add_entry([int(t) for t in ids])
            count, tokens = count + 1, tokens + len(ids)
    writer.finalize()
    tmp.replace(path)
    return {"entries": count, "tokens": tokens, "bytes": path.stat().st_size}


def embedded_datastore(model_name: str, model_config: dict, log=print) -> Path:
    """The model's own datastore, built from its draft-training corpus on first use and cached."""
    def build(tokenizer, path, log):
        what, entries = corpus_entries(model_name, tokenizer)
        counts = write_datastore(path, entries)
        log(f"REST: datastore from {what}: {counts['entries']:,} sequences, {counts['tokens']:,} tokens, "
            f"{counts['bytes'] / 2**20:.1f} MiB")

    return corpus_file("rest", ".idx", model_name, model_config, build, log)


def datastore_path(settings: RestSettings, model_name: str, model_config: dict) -> Path:
    settings.check_model({**model_config, "name": model_name})
    return configured_file("rest", settings.datastore, model_name, model_config, embedded_datastore)


def retrieve(reader, sequence, settings: RestSettings, num_draft: int | None = None) -> list[list[int]]:
    """Upstream's retrieval: the longest span (max_token_span .. 2) of the text's end with a draft;
    its paths (draftretriever pads them with -2), padding stripped. `num_draft`: the nodes
    kept (None: the settings' number, upstream's 64 for `auto`)."""
    choices = num_draft if num_draft is not None else \
        (settings.num_draft if isinstance(settings.num_draft, int) else UPSTREAM_DRAFT)
    for span in range(settings.max_token_span, MIN_TOKEN_SPAN - 1, -1):
        paths = reader.search(list(sequence[-span:]), k=settings.matches, choices=choices,
                              long=settings.continuation)[0]
        if paths:
            return [[t for t in path if t != -2] for path in paths]
    return []


class RestDecoder(DraftVerifyDecoder):
    name = "rest"

    def __init__(self, target, datastore: Path | str, settings: RestSettings = RestSettings(),
                 num_draft: int | Sizing | None = None):
        """`num_draft`: the draft's nodes (`method.num_draft` settled: a `Sizing`; None: the settings'
        number, upstream's 64 when they say `auto`)."""
        if num_draft is None:
            num_draft = settings.num_draft if isinstance(settings.num_draft, int) else UPSTREAM_DRAFT
        super().__init__(target, Sizing.of(num_draft))
        self.settings, self.datastore = settings, Path(datastore)
        self.reset()

    def reset(self) -> None:
        """A fresh reader of the datastore: none of the trigrams it learnt from decoded text."""
        import draftretriever  # lazy: draftretriever, only where a datastore is read

        self.reader = draftretriever.Reader(str(self.datastore))

    def describe(self):
        return {**super().describe(), **self.settings.to_dict(), "draft_nodes": self.sizing.value,
                "datastore_file": str(self.datastore),
                "datastore_bytes": self.datastore.stat().st_size}

    def propose(self, state, root: int, budget: int) -> Tree:
        if budget <= 0:
            return Tree.root(root)
        paths = retrieve(self.reader, state.sequence, self.settings, self.sizing.value)
        counts = state.values.setdefault("retrievals", [0, 0])  # this sequence's retrievals, and those that matched
        counts[0] += 1
        counts[1] += bool(paths)
        nodes = self.sizing.value if state.cut is None else min(self.sizing.value, state.cut)
        return trie(root, [path[:budget] for path in paths], nodes=nodes)

    def finish(self, state) -> None:
        retrievals, hits = state.values.get("retrievals", (0, 0))
        state.stats.extra["match_rate"] = hits / retrievals if retrievals else 0.0


@register("rest", settings=RestSettings)
def build(target, settings: RestSettings, context: BuildContext) -> RestDecoder:
    path = datastore_path(settings, context.model_name, context.model_config)
    return RestDecoder(target, path, settings, context.draft_tokens(target, "num_draft", settings.num_draft,
                                                                    UPSTREAM_DRAFT))


# ------------------------------------------------------------------------------------------
# python -m methods.rest: build a datastore


def sharegpt_entries(file: Path, tokenizer):
    """Upstream's small chat datastore: every message of every ShareGPT conversation, encoded."""
    for conversation in json.loads(Path(file).read_text()):
        for message in conversation["conversations"]:
            yield tokenizer.encode(message["value"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Build a REST datastore (a draftretriever index).")
    parser.add_argument("--model", default=None, help="a suite model with a corpus manifest (drafts/<model>/"
                        "corpus.json): build its cached datastore from the suite's draft-training corpus")
    parser.add_argument("--tokenizer", default=None, help="with --sharegpt: the target's Hub id or folder")
    parser.add_argument("--sharegpt", type=Path, default=None,
                        help="upstream's recipe: a ShareGPT JSON (Aeala/ShareGPT_Vicuna_unfiltered)")
    parser.add_argument("--out", type=Path, default=None, help="with --sharegpt: the datastore file to write")
    args = parser.parse_args(argv)
    if args.sharegpt:
        if not (args.tokenizer and args.out):
            parser.error("--sharegpt needs --tokenizer and --out")
        from .models.loading import load_tokenizer  # lazy: the tokenizer, only for the command-line datastore build
        from .models.specs import ModelSpec  # lazy: the tokenizer, only for the command-line datastore build

        tokenizer = load_tokenizer(ModelSpec(path=args.tokenizer))
        counts = write_datastore(args.out, sharegpt_entries(args.sharegpt, tokenizer))
        print(f"{args.out}: {counts['entries']:,} sequences, {counts['tokens']:,} tokens, "
              f"{counts['bytes'] / 2**20:.1f} MiB; run with method=rest method.datastore={args.out}")
        return
    from omegaconf import OmegaConf  # lazy: omegaconf, only for the command-line datastore build

    from .models.specs import model_config  # lazy: the model configs, only for the command-line datastore build

    name = args.model or "smollm2-135m"
    path = embedded_datastore(name, OmegaConf.to_container(model_config(name), resolve=True),
                              log=lambda line: print(line, file=sys.stderr))
    print(f"{path} ({path.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
