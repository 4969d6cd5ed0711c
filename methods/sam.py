"""SAM-Decoding (Hu et al., arXiv 2411.10666; hyx1999/SAM-Decoding @ 18c41f0): drafts from suffix automata.

Two suffix automata (upstream's `DynSAM` and `StaticSAM`, ported state for state): a static one over a
corpus, built once, and a dynamic one over this prompt and output, extended by every accepted token
in amortized O(1). Each keeps a cursor, the longest suffix of the text that it holds; the root (the
last token, not yet in the target's cache) is looked up from the cursor without moving it. The static
match length is lowered by `len_bias` (5), so a corpus match must be that much longer to win.

* `auxiliary: none` (upstream's `samd_sam_only`): the dynamic automaton's match wins ties. Its draft
  is the chain that follows the match's first occurrence in the text, `1 + int(alpha x match length)`
  tokens with the root, at most `n_predicts` (60); the static one's is a tree grown best-first by
  counts from the matched state (a child's probability is its end-position count over its parent's,
  at most `static_top_k` (8) children per node and nodes per depth), as many nodes.
* `auxiliary: eagle2` (upstream's `samd` with `tree_method=eagle2`, the leaderboard's SAM-Decoding
  [EAGLE2]): when the longer match (static biased) reaches `len_threshold` (5) tokens, the chain after
  its first occurrence (`n_predicts` = 40 tokens with the root; the dynamic automaton climbs to a
  shorter match whose first occurrence leaves that many tokens after it), else EAGLE-2's dynamic tree
  from the suite's EAGLE head. The head follows every accepted path whichever drafter proposed.
  Upstream pads a short chain with token 0 up to `n_predicts`; here the chain ends where the text ends
  (the padding is never a continuation, only rows to verify).

`n_predicts: auto` is this machine's verify budget (the machine profile's latency curve, as the trees'
`auto`); upstream's 40 (with an auxiliary) or 60 (without) when there is no profile.

The static corpus (`method.static`): `auto` is the model config's `datastores.sam` file where it names
one (as REST's `datastores.rest`), else the corpus REST uses, the suite's draft-training corpus,
each record's prompt and answer one text as upstream's `tools/gen_sam_alpaca.py` joins them, every
text ended by EOS, then every token of the vocabulary on its own (upstream appends them so that every
token has a state); built once (a minute on a CPU, logged) and cached as arrays. `none` is upstream's
`NullStaticSAM` (its README's advice for models the corpus's answers did not come from). A file is
one built by `python -m methods.sam --tokenizer <model> --sharegpt <json> --out <file>.npz`.
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .base import BuildContext, get_method, register
from .engine.tree import Tree
from .engine.vocab import draft_vocab_setting
from .loop import DraftVerifyDecoder
from .models.corpus import configured_file, corpus_entries, corpus_file, manifest, resolve_path
from .models.heads.source import head_setting
from .pld import trie
from .rest import file_value, sharegpt_entries
from .settings.params import Check, ConfigError, Settings, integer, number, one_of, setting
from .settings.sizing import Sizing

UPSTREAM_PREDICTS = {"none": 60, "eagle2": 40}  # samd_sam_only's max_predicts; samd's n_predicts
AUXILIARIES = ("none", "eagle2")
AUXILIARY_KEYS = ("total_tokens", "depth", "top_k", "draft_vocab", "head")  # SAM's settings that are EAGLE-2's


@dataclass(frozen=True)
class SamSettings(Settings):
    """SAM-Decoding: drafts from suffix automata over this prompt and output (dynamic) and over a corpus
    (static), the longest suffix match winning; with auxiliary=eagle2 EAGLE-2's tree when neither match
    reaches len_threshold tokens (the leaderboard's SAM-Decoding[EAGLE2]). total_tokens, depth, top_k,
    draft_vocab and head are the auxiliary EAGLE-2's (method=eagle2's keys)."""

    paper = "Hu et al. 2024 (hyx1999/SAM-Decoding)"
    batchable = True  # the dynamic automaton and the static cursor are in each sequence's DecodeState
    size_setting, size_recorded, size_label = "n_predicts", "predicts", "draft length with the root"

    auxiliary: str = setting("none", one_of(*AUXILIARIES),
                             "none = upstream's samd_sam_only; eagle2 = samd with tree_method=eagle2 (the EAGLE head "
                             "drafts when the match is short)")
    static: str = setting("auto", Check(file_value, "auto, none or a file written by python -m methods.sam"),
                          "auto = the suite's draft-training corpus (REST's), built once and cached; none = no static "
                          "automaton (upstream's NullStaticSAM); or a file")
    n_predicts: int | str = setting("auto", one_of("auto") | integer(1),
                                    "most tokens a draft verifies, the root included: auto = this machine's verify "
                                    "budget (upstream's 40 with an auxiliary, 60 without, when no profile)")
    len_threshold: int = setting(5, integer(0), "with an auxiliary: the match length from which the automaton drafts")
    len_bias: int = setting(5, integer(0), "subtracted from the static match length before the two are compared")
    alpha: float = setting(4.0, number(0.0), "without an auxiliary: draft tokens = 1 + int(alpha x match length)")
    static_top_k: int = setting(8, integer(1), "without an auxiliary: the static tree's children per node and "
                                               "nodes per depth (upstream's K)")
    total_tokens: int | str = setting("adaptive", one_of("adaptive", "auto") | integer(2),
                                      "auxiliary=eagle2: EAGLE-2's total_tokens")
    depth: int = setting(5, integer(0), "auxiliary=eagle2: EAGLE-2's depth")
    top_k: int = setting(10, integer(1), "auxiliary=eagle2: EAGLE-2's top_k")
    draft_vocab: int | str = draft_vocab_setting()
    head: dict | None = head_setting("eagle")

    def check_model(self, model: dict) -> None:
        if self.auxiliary == "eagle2" and not (self.head or (model.get("drafts") or {}).get("eagle")):
            raise ConfigError("model", model.get("name"), "a model with drafts.eagle for method.auxiliary=eagle2 "
                              "(or give method.head.path=<hub id or folder>)")
        if self.static not in ("auto", "none"):
            if not resolve_path(self.static).is_file():
                raise ConfigError("method.static", self.static, "auto, none or an existing file (build one: "
                                  "python -m methods.sam --help)")
        elif self.static == "auto" and not (model.get("datastores") or {}).get("sam") \
                and manifest(model.get("name")) is None:
            raise ConfigError("model", model.get("name"), f"a model with a static corpus for SAM: model "
                              f"{model.get('name')} has none; pass method.static=none, or build one with "
                              "python -m methods.sam --tokenizer <model> --sharegpt <json> --out <file>.npz and "
                              "pass method.static=<file> or set the model config's datastores.sam")


# ------------------------------------------------------------------------------------------
# The suffix automaton, as upstream's (samd/sam/dyn_sam.py, static_sam.py)


def transfer(automaton, index: int, length: int, token: int) -> tuple[int, int]:
    """Upstream's `transfer_state`: from the state of the longest suffix held, follow `token`
    (climbing suffix links until a state has it); (0, 0) when no suffix does."""
    link, lengths = automaton.link, automaton.length
    child = automaton.child(index, token)
    while index != 0 and child < 0:
        index = int(link[index])
        length = int(lengths[index])
        child = automaton.child(index, token)
    if child >= 0:
        return child, length + 1
    return 0, 0


class SuffixAutomaton:
    """A growing suffix automaton over a text (`tokens`, 1-based as upstream's `input_ids`, slot 0 a
    placeholder): per state its transitions, suffix link, longest length and first end position
    (upstream's `min_endpos`); and a cursor (the state and length of the longest suffix of the text that
    the automaton held before the text's last token was added: upstream's `cur_index`, `cur_length`)."""

    def __init__(self):
        self.next: list[dict[int, int]] = [{}]
        self.link, self.length, self.endpos = [-1], [0], [0]
        self.clone = [True]  # whether a state was split off another (it has no position of its own)
        self.tokens: list[int] = [-1]
        self.last = 0
        self.cursor = (0, 0)

    def __len__(self) -> int:
        return len(self.tokens) - 1

    def child(self, index: int, token: int) -> int:
        return self.next[index].get(token, -1)

    def _extend(self, token: int) -> None:
        """Upstream's `add_state`: the text's new last position (already in `tokens`)."""
        nexts, link, length, endpos = self.next, self.link, self.length, self.endpos
        cur = len(nexts)
        nexts.append({})
        link.append(-1)
        length.append(length[self.last] + 1)
        endpos.append(len(self.tokens) - 1)
        self.clone.append(False)
        p = self.last
        while p != -1 and token not in nexts[p]:
            nexts[p][token] = cur
            p = link[p]
        if p == -1:
            link[cur] = 0
        else:
            q = nexts[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # upstream's deepcopy of q: its transitions, link and first end position
                clone = len(nexts)
                nexts.append(dict(nexts[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                endpos.append(endpos[q])
                self.clone.append(True)
                while p != -1 and nexts[p].get(token) == q:
                    nexts[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur

    def add(self, tokens) -> None:
        """Upstream's `add_tokens`: per token, the cursor follows it, then the automaton takes it."""
        for token in tokens:
            token = int(token)
            self.cursor = transfer(self, *self.cursor, token)
            self.tokens.append(token)
            self._extend(token)

    def lookup(self, token: int) -> tuple[int, int]:
        """The state and length of the longest suffix of text + `token` that the automaton holds."""
        return transfer(self, *self.cursor, token)

    def counts(self) -> list[int]:
        """Every state's end-position count (upstream's StaticSAM `cnt_endpos`, which it adds up along the
        suffix links at every token: the same numbers, summed once by decreasing length)."""
        count = [0 if clone else 1 for clone in self.clone]
        count[0] = 0
        for state in sorted(range(1, len(count)), key=self.length.__getitem__, reverse=True):
            if self.link[state] > 0:
                count[self.link[state]] += count[state]
        return count

    def freeze(self) -> "FrozenAutomaton":
        """The automaton as arrays (a static corpus's: kept in a file), with every state's end-position
        count and its top children by count (upstream's `init_topk_next`: the transitions in the order they
        were made, stably sorted by count, the first `FrozenAutomaton.TOP`)."""
        count = self.counts()
        states = len(self.next)
        sizes = [len(n) for n in self.next]
        offsets = np.zeros(states + 1, dtype=np.int64)
        offsets[1:] = np.cumsum(sizes)
        edge_tokens, edge_targets, top_tokens, top_targets = [], [], [], []
        top_offsets = np.zeros(states + 1, dtype=np.int64)
        for state, edges in enumerate(self.next):
            for token in sorted(edges):
                edge_tokens.append(token)
                edge_targets.append(edges[token])
            best = sorted(edges.items(), key=lambda item: count[item[1]], reverse=True)[:FrozenAutomaton.TOP]
            top_tokens += [t for t, _ in best]
            top_targets += [s for _, s in best]
            top_offsets[state + 1] = top_offsets[state] + len(best)
        array = lambda values, dtype=np.int32: np.asarray(values, dtype=dtype)  # noqa: E731
        return FrozenAutomaton(link=array(self.link), length=array(self.length), endpos=array(self.endpos),
                               count=array(count), offsets=offsets, edge_tokens=array(edge_tokens),
                               edge_targets=array(edge_targets), top_offsets=top_offsets,
                               top_tokens=array(top_tokens), top_targets=array(top_targets),
                               tokens=array(self.tokens))


class FrozenAutomaton:
    """A built suffix automaton as arrays (a static corpus's, shared by every sequence; the cursor is the
    sequence's): transitions sorted by token per state, and each state's top children by count."""

    TOP = 8  # upstream's init_topk_next(k=8)
    FIELDS = ("link", "length", "endpos", "count", "offsets", "edge_tokens", "edge_targets", "top_offsets",
              "top_tokens", "top_targets", "tokens")

    def __init__(self, **arrays):
        for name in self.FIELDS:
            setattr(self, name, arrays[name])

    def __len__(self) -> int:
        return len(self.tokens) - 1

    def child(self, index: int, token: int) -> int:
        lo, hi = int(self.offsets[index]), int(self.offsets[index + 1])
        j = lo + int(np.searchsorted(self.edge_tokens[lo:hi], token))
        return int(self.edge_targets[j]) if j < hi and self.edge_tokens[j] == token else -1

    def top_children(self, index: int, k: int) -> list[tuple[int, int]]:
        lo = int(self.top_offsets[index])
        hi = min(int(self.top_offsets[index + 1]), lo + k)
        return list(zip(self.top_tokens[lo:hi].tolist(), self.top_targets[lo:hi].tolist()))

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **{name: getattr(self, name) for name in self.FIELDS})
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "FrozenAutomaton":
        with np.load(path) as arrays:
            return cls(**{name: arrays[name] for name in cls.FIELDS})


# ------------------------------------------------------------------------------------------
# Drafts


def chain(automaton, index: int, n: int, climb: bool = False) -> list[int]:
    """Upstream's `gen_draft` of a sequence: the (at most n - 1) tokens after the first occurrence of the
    matched state's text. `climb` (the dynamic automaton with an auxiliary: upstream's `to_anc`) first
    moves to shorter suffixes while the first occurrence leaves fewer than n tokens after it."""
    if climb and index != 0:
        end = len(automaton)
        while automaton.link[index] != 0 and n > end - automaton.endpos[index]:
            index = int(automaton.link[index])
    first = int(automaton.endpos[index])
    return [int(t) for t in automaton.tokens[first + 1:first + n]]


class _Candidate:
    """A heap entry of the static tree's best-first search, ordered by probability only (as upstream's
    `SearchItem(order=True)` with its other fields `compare=False`), so ties pop as upstream's do."""

    __slots__ = ("prob", "token", "index", "parent", "depth")

    def __init__(self, prob, token, index, parent, depth):
        self.prob, self.token, self.index, self.parent, self.depth = prob, token, index, parent, depth

    def __lt__(self, other):
        return self.prob < other.prob


def count_tree(automaton: FrozenAutomaton, index: int, root: int, n: int, k: int, max_depth: int) -> Tree:
    """samd_sam_only's static draft: from the matched state, the n most probable nodes best-first, a
    child's probability its end-position count over its parent's, at most k children per node and k nodes
    per depth (draft depths beyond `max_depth` left out: the answer ends first)."""
    heap = [_Candidate(-1.0, root, index, -1, 0)]
    tokens, parents, per_depth = [], [], {}
    while len(tokens) != n and heap:
        item = heapq.heappop(heap)
        if item.depth > max_depth or per_depth.get(item.depth, 0) + 1 > k:
            continue
        per_depth[item.depth] = per_depth.get(item.depth, 0) + 1
        node = len(tokens)
        tokens.append(item.token)
        parents.append(item.parent)
        if len(tokens) == n:
            break
        total = int(automaton.count[item.index])
        for token, child in automaton.top_children(item.index, k):
            heapq.heappush(heap, _Candidate(item.prob * int(automaton.count[child]) / total, token, child, node,
                                            item.depth + 1))
    return Tree(torch.tensor(tokens), parents)


@dataclass
class SamState:
    """One sequence's automata: the dynamic one over its prompt and output (all but the root), and its
    cursor in the static one."""

    dynamic: SuffixAutomaton
    static_cursor: tuple[int, int] = (0, 0)
    # steps by the drafter that proposed: the dynamic automaton, the static one, the auxiliary, nothing
    drafts: dict = field(default_factory=lambda: dict.fromkeys(("dynamic", "static", "auxiliary", "none"), 0))
    matched: int = 0  # summed length of the winning match over the automaton's drafts


class SamDecoder(DraftVerifyDecoder):
    name = "sam"

    def __init__(self, target, static: FrozenAutomaton | None, settings: SamSettings = SamSettings(),
                 predicts: int | Sizing = UPSTREAM_PREDICTS["none"], auxiliary=None):
        """`predicts`: the most tokens a draft holds with its root (`method.n_predicts` settled: a `Sizing`)."""
        super().__init__(target, Sizing.of(predicts))
        if (auxiliary is None) != (settings.auxiliary == "none"):
            raise ValueError(f"method.auxiliary={settings.auxiliary} needs {'no' if auxiliary is None else 'an'} "
                             "auxiliary decoder")
        self.static, self.settings, self.auxiliary = static, settings, auxiliary

    def describe(self):
        """SAM's settings, the auxiliary's only with one (EAGLE-2's own record: its draft vocabulary, its
        resolved size); the static automaton's size nested (out of the tables' labels)."""
        settings = self.settings.to_dict()
        if self.auxiliary is None:
            settings = {k: v for k, v in settings.items() if k not in AUXILIARY_KEYS}
        else:
            settings.update({k: v for k, v in self.auxiliary.describe().items() if k in AUXILIARY_KEYS})
        static = {"tokens": len(self.static), "states": len(self.static.link)} if self.static is not None else None
        auxiliary = self.auxiliary.sizing.describe() if self.auxiliary else None
        sizing = {"auxiliary_sizing": auxiliary} if auxiliary else {}
        return {**super().describe(), **settings, "predicts": self.sizing.value, "static_automaton": static, **sizing}

    def draft_state(self, index: int):
        return self.auxiliary.draft_state(index) if self.auxiliary else None

    def start(self, state, prefill) -> None:
        state.values["sam"] = SamState(SuffixAutomaton())
        if self.auxiliary:
            self.auxiliary.start(state, prefill)

    def advance(self, state, tree, acceptance, verified) -> None:
        if self.auxiliary:  # the head follows every accepted path, whichever drafter proposed it
            self.auxiliary.advance(state, tree, acceptance, verified)

    def propose(self, state, root: int, budget: int) -> Tree:
        sam: SamState = state.values["sam"]
        # the automata hold everything but the root (upstream's `update`): what joined the text since
        new = state.sequence[len(sam.dynamic):-1]
        sam.dynamic.add(new)
        index, match = sam.dynamic.lookup(root)
        static_index, static_match = 0, 0
        if self.static is not None:
            cursor = sam.static_cursor
            for token in new:
                cursor = transfer(self.static, *cursor, token)
            sam.static_cursor = cursor
            static_index, static_match = transfer(self.static, *cursor, root)
        static_match -= self.settings.len_bias
        s, n = self.settings, self.sizing.value
        if state.cut is not None:  # a batch's cut, in nodes besides the root
            n = min(n, 1 + state.cut)
        if budget <= 0:
            kind, tree = "none", Tree.root(root)
        elif self.auxiliary is not None:  # samd: the automaton from len_threshold on, else the auxiliary's tree
            if max(match, static_match) < s.len_threshold:
                sam.drafts["auxiliary"] += 1
                return self.auxiliary.propose(state, root, budget)
            if match >= static_match:
                kind, tree = "dynamic", trie(root, [chain(sam.dynamic, index, n, climb=True)[:budget]])
            else:
                kind, tree = "static", trie(root, [chain(self.static, static_index, n)[:budget]])
        elif match >= static_match:  # samd_sam_only: the dynamic chain, or the static count tree
            kind = "dynamic"
            tree = trie(root, [chain(sam.dynamic, index, min(n, 1 + int(match * s.alpha)))[:budget]])
        else:
            kind = "static"
            tree = count_tree(self.static, static_index, root, min(n, 1 + int(static_match * s.alpha)),
                              s.static_top_k, budget)
        if len(tree) == 1:
            kind = "none"
        sam.drafts[kind] += 1
        sam.matched += {"dynamic": match, "static": static_match + s.len_bias}.get(kind, 0)
        return tree

    def finish(self, state) -> None:
        sam: SamState | None = state.values.get("sam")
        if sam is None:
            return
        retrieved = sam.drafts["dynamic"] + sam.drafts["static"]
        state.stats.extra.update({"drafts_by": dict(sam.drafts),
                                  "mean_match_length": sam.matched / retrieved if retrieved else 0.0})


# ------------------------------------------------------------------------------------------
# The static automaton


def build_static(entries, eos: int, vocab_size: int, log=print) -> FrozenAutomaton:
    """Upstream's `build_sam`: every text, then every token of the vocabulary alone, each ended by EOS
    (unless it ends with it), into one automaton."""
    from tqdm import tqdm  # lazy: the progress bar, only while a static automaton is built

    automaton = SuffixAutomaton()
    texts = list(entries) + [[token] for token in range(vocab_size)]
    started = time.perf_counter()
    for tokens in tqdm(texts, desc="SAM: static automaton", unit="text", mininterval=2.0):
        if tokens:
            automaton.add(tokens)
            if tokens[-1] != eos:
                automaton.add([eos])
    frozen = automaton.freeze()
    log(f"SAM: static automaton over {len(frozen):,} tokens ({len(frozen.link):,} states) in "
        f"{time.perf_counter() - started:.0f} s")
    return frozen


def embedded_static(model_name: str, model_config: dict, log=print) -> Path:
    """The embedded model's static automaton over its draft-training corpus, built on first use and cached."""
    def build(tokenizer, path, log):
        what, entries = corpus_entries(model_name, tokenizer, joined=True)
        build_static(entries, tokenizer.eos_token_id, len(tokenizer), log).save(path)
        log(f"SAM: static automaton from {what}: {path.stat().st_size / 2**20:.1f} MiB")

    return corpus_file("sam", ".npz", model_name, model_config, build, log, version=("sam-1",))


def static_automaton(settings: SamSettings, context: BuildContext) -> FrozenAutomaton | None:
    if settings.static == "none":
        return None
    settings.check_model({**context.model_config, "name": context.model_name})
    return FrozenAutomaton.load(configured_file("sam", settings.static, context.model_name, context.model_config,
                                                embedded_static))


@register("sam", settings=SamSettings)
def build(target, settings: SamSettings, context: BuildContext) -> SamDecoder:
    static = static_automaton(settings, context)
    predicts = context.sizing(target, "n_predicts", settings.n_predicts, UPSTREAM_PREDICTS[settings.auxiliary])
    if settings.n_predicts == "auto":
        predicts = predicts.choose(predicts.value, chosen=f"{predicts.value} tokens with the root")
    auxiliary = None
    if settings.auxiliary == "eagle2":  # method=eagle2 with SAM's keys for it, from the registry
        auxiliary = get_method("eagle2")(target, {"name": "eagle2", **{key: getattr(settings, key)
                                                                      for key in AUXILIARY_KEYS}}, context)
    return SamDecoder(target, static, settings, predicts, auxiliary)


# ------------------------------------------------------------------------------------------
# python -m methods.sam: build a static automaton


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Build SAM-Decoding's static suffix automaton (arrays, .npz).")
    parser.add_argument("--model", default=None, help="a suite model with a corpus manifest (drafts/<model>/"
                        "corpus.json): build its cached automaton from the suite's draft-training corpus")
    parser.add_argument("--tokenizer", default=None, help="with --sharegpt: the target's Hub id or folder")
    parser.add_argument("--sharegpt", type=Path, default=None, help="a ShareGPT-format JSON (conversations)")
    parser.add_argument("--out", type=Path, default=None, help="with --sharegpt: the .npz file to write")
    args = parser.parse_args(argv)
    log = lambda line: print(line, file=sys.stderr)  # noqa: E731
    if args.sharegpt:
        if not (args.tokenizer and args.out):
            parser.error("--sharegpt needs --tokenizer and --out")
        from .models.loading import load_tokenizer  # lazy: the tokenizer, only for the command-line build
        from .models.specs import ModelSpec  # lazy: the tokenizer, only for the command-line build

        tokenizer = load_tokenizer(ModelSpec(path=args.tokenizer))
        build_static(sharegpt_entries(args.sharegpt, tokenizer), tokenizer.eos_token_id, len(tokenizer),
                     log).save(args.out)
        print(f"{args.out}; run with method=sam method.static={args.out}")
        return
    from omegaconf import OmegaConf  # lazy: omegaconf, only for the command-line build

    from .models.specs import model_config  # lazy: the model configs, only for the command-line build

    name = args.model or "smollm2-135m"
    path = embedded_static(name, OmegaConf.to_container(model_config(name), resolve=True), log)
    print(f"{path} ({path.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
