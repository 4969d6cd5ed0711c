"""The `Decoder` interface, its outputs, the registry, and the loop every lossless method shares.

    prefill(prompt)                       -> target KV, first token (TTFT ends here)
    start(state, prefill)                 # the drafter's own prefill
    repeat until the stopping rule fires:
        tree   = propose(state, root, n)  # the method's own part: a draft tree rooted at the last token
        out    = target.verify(tree)      # one forward over the tree
        result = accept(state, tree, out) # greedy | speculative sampling over the tree
        target.commit(path)               # keep the accepted path's KV only
        state.emit(tokens)                # output, stopping rule, statistics
        advance(state, tree, result, out) # the drafter follows the accepted path
    finish(state)

`state` is the sequence's `DecodeState` (its prompt and output, sampling, generator, statistics and
drafter): the call's state is passed to the method, never kept on the decoder, so that the batched
loop (`batched.py`) runs the same calls on one state per sequence. A method subclasses
`DraftVerifyDecoder` and writes `propose` (and `start`/`advance` when it keeps state); AR is the
method that proposes nothing.
"""

from __future__ import annotations

import importlib
import pkgutil
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

import torch

from .engine.acceptance import (
    Acceptance,
    chosen_margins,
    greedy_accept_logits,
    greedy_batch_pending,
    greedy_pending,
    read_together,
    sample_accept,
    sample_pending,
)
from .engine.params import ConfigError, Settings
from .engine.runner import ForwardOutput, ModelRunner
from .engine.sampling import SamplingConfig, logits_to_probs, sample
from .engine.sizing import VERIFY_BUDGET, batch_draft_tokens, relative, tree_budget
from .engine.static_trees import NAMED_TREES, StaticTree
from .engine.stopping import StopCondition
from .engine.tree import Tree
from .engine.vocab import DraftVocabulary
from .models.specs import ModelSpec


@dataclass
class DecodeStats:
    new_tokens: int = 0
    steps: int = 0  # target forward passes, prefill included (= len(accepted_lengths))
    accepted_lengths: list[int] = field(default_factory=list)  # tokens emitted by each forward, the prefill's first
    # the prefill counts as a decoding step (AR, as Spec-Bench's baseline counts it); else the
    # prefill's token is folded into the first verification's accept length (Spec-Bench's EAGLE and
    # Medusa scripts). `decoding_steps`, `accept_lengths` and τ follow: docs/benchmarks.md, "τ".
    prefill_step: bool = False
    # per generated token, from the target forward that chose it: the chosen token's logit minus the
    # best other token's (the row's top-2 gap when it chose its argmax, negative when it did not);
    # the fidelity check classifies a divergence from AR with it (harness/stats.py, `fidelity`)
    logit_margins: list[float] = field(default_factory=list)
    drafted_tokens: int = 0  # draft tokens proposed (tree nodes other than roots)
    accepted_drafts: int = 0  # draft tokens accepted
    # per draft position d (index d-1): steps whose tree reached depth d, steps in which a depth-d
    # candidate was tested (all depths before it accepted), and steps in which one was accepted
    position_proposed: list[int] = field(default_factory=list)
    position_tested: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    ttft: float = 0.0  # seconds from the call to the first token
    total_time: float = 0.0  # seconds for the whole call
    # seconds per phase, covering total_time: prefill, draft (draft model and tree building),
    # verify (target forward), accept, commit (cache), other (the loop's own overhead)
    phase_time: dict[str, float] = field(default_factory=dict)
    stop_reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # method-specific statistics

    @property
    def decoding_steps(self) -> int:
        """Spec-Bench's decoding steps: the verifications (target forwards after the prefill), or
        every forward for a decoder whose prefill is a step (AR); a turn that ended at the
        prefill's token has one step."""
        return self.steps if self.prefill_step or self.steps <= 1 else self.steps - 1

    @property
    def accept_lengths(self) -> list[int]:
        """Spec-Bench's accept lengths, one per decoding step, summing to `new_tokens`: the
        prefill's token is folded into the first verification's (as `decoding_steps` counts)."""
        lengths = list(self.accepted_lengths)
        if self.prefill_step or len(lengths) <= 1:
            return lengths
        return [lengths[0] + lengths[1], *lengths[2:]]

    @property
    def tau(self) -> float:
        """Mean accepted tokens (Spec-Bench's): new tokens per decoding step."""
        return self.new_tokens / self.decoding_steps if self.decoding_steps else 0.0

    def count_step(self, tree_depth: int, path_children: list[bool], accepted_depth: int) -> None:
        """One verification: the tree's depth, whether each node of the accepted path had
        children (then the next depth was tested), and how many draft tokens were accepted."""
        while len(self.position_proposed) < tree_depth:
            for counts in (self.position_proposed, self.position_tested, self.position_accepted):
                counts.append(0)
        for depth in range(tree_depth):
            self.position_proposed[depth] += 1
        for depth, tested in enumerate(path_children):
            if tested:
                self.position_tested[depth] += 1
                self.position_accepted[depth] += int(depth < accepted_depth)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DecodeState:
    """One sequence's decoding: the loop's per-call state, handed to the method at every call
    (`start`, `propose`, `advance`, `finish`) instead of being kept on the decoder. At batch size B
    the loop (`methods/batched.py`) holds B of them, one per sequence; alone, one."""

    index: int  # the sequence's row in its batch (0 alone): which per-sequence drafter it drafts with
    prompt: list[int]
    stop: StopCondition
    sampling: SamplingConfig
    generator: torch.Generator | None
    stats: DecodeStats
    tokens: list[int] = field(default_factory=list)  # the output so far
    sequence: list[int] = field(default_factory=list)  # prompt and output; the last token is not in the target KV
    draft: Any = None  # the method's drafter for this sequence (`DraftVerifyDecoder.draft_state`): a draft LM, a head
    batch: int = 1  # the sequences verified together this step (`methods/batched.py` sets it)
    values: dict[str, Any] = field(default_factory=dict)  # the method's own per-sequence values (SpS's heuristic γ)

    def emit(self, emitted: Sequence[int], margins: Sequence[float]) -> tuple[int, str] | None:
        """The step's tokens and their margins appended; the stopping rule's verdict on them (None: go on).
        The step's accepted length is what the rule kept of them."""
        checked = len(self.tokens)
        self.tokens.extend(emitted)
        self.sequence.extend(emitted)
        self.stats.logit_margins.extend(margins)
        done = self.stop.cut(self.tokens, checked)
        self.stats.accepted_lengths.append(len(emitted) if done is None else done[0] - checked)
        return done

    def conclude(self, done: tuple[int, str]) -> "DecodeOutput":
        """The output, cut where the stopping rule said, with its statistics."""
        keep, self.stats.stop_reason = done
        del self.tokens[keep:]
        del self.stats.logit_margins[keep:]
        self.stats.new_tokens = len(self.tokens)
        self.stats.steps = len(self.stats.accepted_lengths)
        return DecodeOutput(tokens=self.tokens, stats=self.stats)


@dataclass
class DecodeOutput:
    tokens: list[int]  # generated token ids (EOS / stop-string token included when it stopped there)
    stats: DecodeStats


class Decoder(ABC):
    """A decoding method. `generate` runs one prompt (batch 1) and returns tokens and statistics."""

    name: ClassVar[str]
    lossless: ClassVar[bool] = True  # reproduces AR's greedy tokens and sampling distribution

    def __init__(self, target: ModelRunner, sizing: dict | None = None):
        self.target = target
        self.sizing = sizing  # how an `auto` size was derived from the machine profile (None: not `auto`)

    @abstractmethod
    def generate(
        self,
        prompt: Sequence[int],
        stop: StopCondition,
        sampling: SamplingConfig = SamplingConfig(),
        generator: torch.Generator | None = None,
    ) -> DecodeOutput: ...

    def describe(self) -> dict[str, Any]:
        """Method parameters for the results record."""
        return {"method": self.name, "lossless": self.lossless, **({"sizing": self.sizing} if self.sizing else {})}


# ------------------------------------------------------------------------------------------
# Registry: methods are chosen by name


@dataclass
class BuildContext:
    """What a method factory may need besides its own parameters."""

    target_model: Any  # the target's transformers model
    model_name: str
    model_config: dict  # the model's config entry (`drafts`: method kind -> draft spec, ...)
    # the machine profile (`methods/machine/profile.py`) `auto` sizes are read from; None: upstream's fixed sizes
    profile: Any = None

    @property
    def drafts(self) -> dict:
        return self.model_config.get("drafts") or {}

    def draft_spec(self, kind: str, method: str) -> dict:
        spec = (self.drafts or {}).get(kind)
        if not spec:
            have = ", ".join(k for k, v in (self.drafts or {}).items() if v) or "none"
            raise ValueError(
                f"method {method!r} needs a {kind} draft, but model {self.model_name!r} names none "
                f"(drafts it has: {have}); add `drafts.{kind}` to conf/model/{self.model_name}.yaml "
                f"or pass method.draft.path=/path/to/draft"
            )
        return dict(spec)

    def latency_curve(self, target) -> dict[int, float] | None:
        """The target's forward-latency curve from the machine profile (measured once, cached); None
        without a profile."""
        return self.profile.latency_curve(target, self.model_name) if self.profile is not None else None

    def tree_budget(self, target, what: str, fixed: int) -> tuple[int, dict]:
        """`auto` tree sizes: the most tokens one verification may hold on this machine; `fixed`
        (upstream's size, in the same unit) without a machine profile."""
        curve = self.latency_curve(target)
        if curve is None:
            return fixed, {what: "auto", "verify_tokens": fixed, "profile": "none: upstream's size"}
        budget = tree_budget(curve)
        return budget, {what: "auto", "verify_tokens": budget, "verify_budget_t1": VERIFY_BUDGET,
                        "curve_t1": {n: round(v, 3) for n, v in relative(curve).items()}}

    def static_tree(self, params: dict, target, published: str, max_depth: int | None = None):
        """`method.tree`: a built-in name or a list of paths; `auto` is the `published` tree (paths
        deeper than `max_depth` left out) cut, in its own order, to this machine's tree budget (whole
        without a machine profile). Returns the tree and, for `auto`, how it was sized."""
        tree = params.get("tree", "auto")
        if tree != "auto":
            return StaticTree.build(tree), None
        paths = [p for p in NAMED_TREES[published] if max_depth is None or len(p) <= max_depth]
        budget, sizing = self.tree_budget(target, "tree", len(paths) + 1)
        chosen = StaticTree.build(paths, nodes=budget - 1)
        return chosen, {**sizing, "chosen": f"{published}, first {len(chosen) - 1} nodes"}

    def draft_vocabulary(self, params: dict, projection_rows: int | None = None):
        """The FR-Spec subset a draft proposes from (`engine/vocab.py`), or None for the full vocabulary.
        `method.draft_vocab`: `auto` (the model config's `draft_vocabulary.size` when it names a
        token-frequency file, else the full vocabulary), `full`, or a number of tokens. The model
        config's `draft_vocabulary.dtype: bfloat16` rounds the drafts' copy of those lm_head rows to
        bf16 values in an fp32 run, as the drafts are stored."""
        choice = params.get("draft_vocab", "auto")
        setting = self.model_config.get("draft_vocabulary") or {}
        if choice in (None, "full") or (choice == "auto" and not setting.get("frequencies")):
            return None
        size = setting.get("size") if choice == "auto" else choice
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"method.draft_vocab={choice!r}; valid: auto, full, or a positive number of tokens")
        if not setting.get("frequencies"):
            raise ValueError(f"method.draft_vocab={size}: model {self.model_name!r} names no token-frequency file; "
                             "set model.draft_vocabulary.frequencies=/path/to/frequencies.json or "
                             "method.draft_vocab=full")
        file = ModelSpec.from_mapping({"path": setting["frequencies"]}).path
        config = self.target_model.config
        full = self.target_model.get_output_embeddings().out_features
        eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        rows_dtype = {None: None, "bfloat16": torch.bfloat16}[setting.get("dtype")]  # checked by the harness
        vocabulary = DraftVocabulary.most_frequent(file, size, full, always=tuple(t for t in eos if t is not None),
                                                   rows_dtype=rows_dtype)
        if projection_rows is not None and projection_rows < full:  # a draft LM with a shorter vocabulary
            vocabulary = vocabulary.subset(vocabulary.ids[vocabulary.ids < projection_rows])
        return vocabulary


# A factory builds a decoder: factory(target: ModelRunner, settings: <the method's Settings>, context: BuildContext)
DecoderFactory = Callable[..., Decoder]
_REGISTRY: dict[str, DecoderFactory] = {}
_SETTINGS: dict[str, type[Settings]] = {}


def register(name: str, settings: type[Settings] = Settings) -> Callable[[DecoderFactory], DecoderFactory]:
    """Register a method's factory by name, with the class of its settings (`engine/params.py`): the
    harness checks a run's `method.*` keys against it before loading any model, and the factory gets
    the checked settings, defaults filled in."""
    def wrap(factory: DecoderFactory) -> DecoderFactory:
        if name in _REGISTRY:
            raise ValueError(f"method {name!r} registered twice")
        _REGISTRY[name] = factory
        _SETTINGS[name] = settings
        return factory

    return wrap


def method_settings(name: str) -> type[Settings]:
    """The settings class a method registered with (ConfigError for an unknown method)."""
    methods = available_methods()
    if name not in _REGISTRY:
        raise ConfigError("method", name, ", ".join(methods))
    return _SETTINGS[name]


def check_method_params(name: str, params: dict) -> None:
    """Raise ConfigError naming the key, the bad value and the valid ones (unknown method included)."""
    method_settings(name).from_params(params)


ENTRY_POINTS = "decodebench.methods"  # the entry-point group of methods from other packages


def available_methods() -> list[str]:
    """Every registered method: each module or package beside this one registers the methods it holds
    on import (a method file; a family's package, `eagle/`, whose `__init__` imports its registering
    modules; the shared machinery, `engine/`, `machine/` and `models/`, holds none), and so does each module an
    installed distribution names in the entry-point group `decodebench.methods`."""
    for module in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if module.name != "base" and not module.name.startswith("_"):
            importlib.import_module(f"{__package__}.{module.name}")
    for entry in entry_points(group=ENTRY_POINTS):
        try:
            entry.load()
        except Exception as err:
            raise ImportError(
                f"the {ENTRY_POINTS} entry point {entry.name} = {entry.value} "
                f"(from {entry.dist.name if entry.dist else 'an installed package'}) fails to import: {err}"
            ) from err
    return sorted(_REGISTRY)


def get_method(name: str) -> DecoderFactory:
    """The method's factory over a config's `method.*` keys: they are checked and turned into the
    method's settings first."""
    methods = available_methods()
    if name not in _REGISTRY:
        raise KeyError(f"unknown method {name!r}; valid methods: {', '.join(methods)}")
    factory, settings = _REGISTRY[name], _SETTINGS[name]

    def build(target, params: dict | None = None, context: BuildContext | None = None) -> Decoder:
        return factory(target, settings.from_params(params or {}), context)

    return build


# ------------------------------------------------------------------------------------------
# The shared loop


class PhaseClock:
    """Accumulates wall time per phase; synchronizes CUDA so GPU work lands in its phase."""

    def __init__(self, device: torch.device, phases: dict[str, float]):
        self.cuda = device.type == "cuda"
        self.phases = phases
        self.last = self.now()

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def lap(self, phase: str) -> None:
        now = self.now()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now


def logit_margins(rows: torch.Tensor, chosen: Sequence[int]) -> list[float]:
    """Per logits row [n, V] and the token it chose: the chosen token's logit minus the best other
    token's. When the row chose its argmax (greedy), this is the row's top-2 gap; a negative value
    means the row preferred another token by that much. One topk(2) on rows already computed."""
    return chosen_margins(rows, torch.as_tensor(list(chosen), device=rows.device)).tolist()


class DraftVerifyDecoder(Decoder):
    """The draft -> verify -> accept -> commit loop. Subclasses supply the drafter: `propose` and, when
    it follows the accepted path, `start`/`advance`; each gets the sequence's `DecodeState`."""

    # whether the prefill counts as a decoding step in the records (`DecodeStats.prefill_step`)
    prefill_step: ClassVar[bool] = False
    # the latency curve an `auto` draft length was read from (None: an explicit size, or no profile): at
    # batch size B > 1 the batched loop cuts each greedy sequence's draft to `batch_budget(B)`
    batch_curve: dict[int, float] | None = None

    def describe(self) -> dict[str, Any]:
        """Besides the settings: the cut each batch size took (`batch_budget`), when the run drafted at
        batch sizes above 1 with an `auto` size (the record's own size is the batch-1 one)."""
        described = super().describe()
        budgets = self.__dict__.get("_batch_budgets")
        if budgets:
            described["batch_draft_tokens"] = {batch: budget for batch, (_, budget) in sorted(budgets.items())}
        return described

    def batch_budget(self, batch: int) -> int | None:
        """The most draft tokens per path a sequence drafts when `batch` sequences verify together: the
        machine's verify budget at B rows per draft token (`sizing.batch_draft_tokens`); None: no cut
        (batch size 1, or a size that is not `auto`)."""
        if batch <= 1 or self.batch_curve is None:
            return None
        # once per curve and batch size (the loop asks every step; the curve is set after construction)
        budgets = self.__dict__.setdefault("_batch_budgets", {})
        curve, budget = budgets.get(batch, (None, None))
        if curve is not self.batch_curve:
            budget = batch_draft_tokens(self.batch_curve, batch)
            budgets[batch] = self.batch_curve, budget
        return budget

    def draft_state(self, index: int) -> Any:
        """The drafter sequence `index` of a batch drafts with (`DecodeState.draft`): a method whose
        drafter keeps per-sequence state (a draft LM's KV cache, a head's) gives each index its own, made
        once and reused; index 0 is the one a single sequence uses."""
        return None

    def new_state(self, index: int, prompt: list[int], stop: StopCondition, sampling: SamplingConfig,
                  generator: torch.Generator | None) -> DecodeState:
        return DecodeState(index, prompt, stop, sampling, generator, DecodeStats(prefill_step=self.prefill_step),
                           sequence=list(prompt), draft=self.draft_state(index))

    def start(self, state: DecodeState, prefill: ForwardOutput) -> None:
        """Called once after the target's prefill and the first token (e.g. to prefill a draft model)."""

    @abstractmethod
    def propose(self, state: DecodeState, root: int, budget: int) -> Tree:
        """A tree rooted at `root` (the last emitted token) with at most `budget` draft tokens
        along any path (more would be cut by the stopping rule anyway)."""

    def propose_batch(self, states: Sequence[DecodeState], budgets: Sequence[int]) -> list[Tree]:
        """Every running sequence's draft of a batched step (`methods/batched.py`), `budgets[b]` its most
        draft tokens along a path: `propose` for each, one after another, unless the method drafts
        the batch at once (the EAGLE family's dynamic trees: one head forward for every sequence)."""
        return [self.propose(state, state.tokens[-1], budget) for state, budget in zip(states, budgets)]

    def advance(self, state: DecodeState, tree: Tree, acceptance: Acceptance, verified: ForwardOutput) -> None:
        """Called after each commit, so the drafter can follow the accepted path."""

    def finish(self, state: DecodeState) -> None:
        """After the sequence stopped: the method's own statistics into `state.stats.extra`."""

    def prefill(self, prompt: Sequence[int]) -> ForwardOutput:
        """The target's prefill; a prefill strategy (LazyLLM) overrides this."""
        return self.target.prefill(prompt)

    # --------------------------------------------------------------------------------------
    def generate(self, prompt, stop, sampling=SamplingConfig(), generator=None) -> DecodeOutput:
        prompt = list(prompt)
        if not prompt:
            raise ValueError("empty prompt")
        with self.target.linear.active():  # draft heads and models run on the same linear path
            return self._generate(self.new_state(0, prompt, stop, sampling, generator))

    def _generate(self, state: DecodeState) -> DecodeOutput:
        prompt, stop, stats = state.prompt, state.stop, state.stats
        self.target.reset()
        self.target.check_room(len(prompt) + stop.max_new_tokens)
        self.target.reserve(len(prompt) + stop.max_new_tokens)
        clock = PhaseClock(self.target.device, stats.phase_time)
        begin = clock.last

        first = self.prefill(prompt)
        if state.sampling.greedy:  # the token and its margin in one read, as every greedy step
            chosen = greedy_accept_logits(Tree(torch.zeros(1, dtype=torch.long), [-1]), first.logits[-1:])
            token, first_margins = chosen.next_token, chosen.margins
        else:
            token = sample(logits_to_probs(first.logits[-1], state.sampling), state.generator)
            first_margins = logit_margins(first.logits[-1:], [token])
        stats.ttft = clock.now() - begin
        clock.lap("prefill")
        done = state.emit([token], first_margins)
        self.start(state, first)
        clock.lap("draft")

        while done is None:
            tree = self.propose(state, token, stop.max_new_tokens - len(state.tokens) - 1)
            clock.lap("draft")
            prefix = self.target.length
            verified = self.target.verify(tree)
            clock.lap("verify")
            # extra rows are never accepted; at temperature 0 their argmax comes back with the step's read
            extra = verified.logits[len(tree):] if tree.extra_rows is not None else None
            acceptance = self._accept(state, tree, verified.logits[: len(tree)], extra)
            emitted = acceptance.emitted or tree.tokens[acceptance.path[1:]].tolist() + [acceptance.next_token]
            # the row of each accepted node chose the token after it: its accepted child, or the next token
            margins = acceptance.margins or logit_margins(verified.logits[acceptance.path], emitted)
            clock.lap("accept")
            self.target.commit(prefix, acceptance.path)
            clock.lap("commit")
            done = state.emit(emitted, margins)
            self.count_acceptance(stats, tree, acceptance)
            clock.lap("other")  # emitting, stop checks, statistics: the loop's own overhead
            if done is None:
                self.advance(state, tree, acceptance, verified)
                clock.lap("draft")
            token = acceptance.next_token

        output = state.conclude(done)
        self.finish(state)
        clock.lap("other")
        stats.total_time = clock.last - begin
        return output

    def _accept(self, state: DecodeState, tree: Tree, logits: torch.Tensor,
                extra: torch.Tensor | None = None) -> Acceptance:
        if state.sampling.greedy:
            return greedy_accept_logits(tree, logits, extra)
        return self.sample_accept(tree, logits_to_probs(logits, state.sampling), state.generator, logits=logits,
                                  extra=extra)

    def accept_batch(self, states: Sequence[DecodeState], trees: Sequence[Tree], logits: torch.Tensor) -> list:
        """Every sequence's rule on its own rows of `logits` [B, R, V], decided on the device, then one
        read for the batch (`methods/batched.py`). Greedy (the batch shares its sampling): one
        vectorized pass for the whole batch (`greedy_batch_pending`); sampled: each sequence's rule
        in turn, drawing from its own generator as it draws alone."""
        if all(state.sampling.greedy for state in states):
            pending = greedy_batch_pending(trees, logits)
            return pending.parse(pending.values.tolist())
        pending = []
        for row, (state, tree) in enumerate(zip(states, trees)):
            rows = logits[row, : len(tree)]
            pending.append(greedy_pending(tree, rows) if state.sampling.greedy else
                           self.sample_pending(tree, logits_to_probs(rows, state.sampling), state.generator,
                                               logits=rows))
        return read_together(pending)

    # Swappable so that tests can show a broken acceptor is caught.
    sample_accept = staticmethod(sample_accept)
    sample_pending = staticmethod(sample_pending)

    @staticmethod
    def count_acceptance(stats: DecodeStats, tree: Tree, acceptance: Acceptance) -> None:
        stats.drafted_tokens += len(tree) - 1
        stats.accepted_drafts += acceptance.accepted_drafts
        # a tree whose structure stayed on the device: read with the acceptance
        if acceptance.path_children is not None:
            stats.count_step(acceptance.tree_depth, acceptance.path_children, acceptance.accepted_drafts)
        else:
            stats.count_step(max(tree.depths), [bool(tree.children[n]) for n in acceptance.path],
                             acceptance.accepted_drafts)
