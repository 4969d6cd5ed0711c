"""A causal LM and its KV cache: the target side of the engine (and the draft LMs of SpS/MCSD).

    runner.prefill(prompt)     -> logits after the last prompt token; the cache holds the prompt
    runner.verify(tree)        -> logits and hidden states of every tree node, in ONE forward with
                                  the ancestors-and-self mask and positions = cache length + depth
    runner.commit(path)        -> keep only the path's KV entries, contiguous after the prefix
    runner.rollback(length)    -> plain truncation

Models are `transformers` models (Llama, Qwen2, Mistral, ...). Llama-family decoders run on the
engine's own forward over the model's weights (`fused.py`: fused projections, one attention call,
fewer small ops; `decoder="transformers"` for the stock one); others call the `transformers`
decoder stack. Either way with a custom float mask and explicit position ids, and the LM head only
on the positions whose logits are needed. Given the machine profile (`methods/machine/profile.py`),
every linear runs through the machine's linear path (`linear.py`: the fastest measured formulation
per weight shape and token count; `skinny_gemm="off"` for stock `F.linear`); given none, the runner
measures nothing and runs stock `F.linear`.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .fused import DECODER_MODES, fused_decoder, unsupported
from .graphs import BUCKETS, StaticSteps, check_compile, graph_mode
from .kv_cache import BatchKVCache, TreeKVCache
from .linear import LinearPath
from .native import precision
from .tree import Tree, attention_mask, batch_mask

# positions reserved past prompt + max new tokens: room for a verification's rows (every default
# tree, window and block of the suite fits; a larger one grows the cache, counted in its `regrowths`)
ROOM = 256
SKINNY_GEMM_MODES = ("auto", "off")
STOCK = LinearPath(None)  # stock `F.linear`: a runner without a machine profile, or `skinny_gemm=off`
NO_PROFILE = ("no machine profile given: stock kernels, and upstream's fixed sizes for `auto`; pass "
              "profile=MachineProfile(device) (methods/machine/profile.py) for measured ones, as the harness does")
_SAID: list = []  # NO_PROFILE is logged once per process
log = logging.getLogger(__name__)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [n, V] fp32 (only the positions asked for)
    hidden: torch.Tensor  # [n, H] last hidden state after the final norm (the LM head's input)
    # [n, len(layers) * H] the hidden states entering the decoder layers named by `capture_inputs`
    # (EAGLE-3's features), concatenated in that order; None when none were asked for
    layers: torch.Tensor | None = None


@contextmanager
def layer_inputs(decoder, layers: Sequence[int]):
    """Within the block, collect the hidden state entering each `decoder.layers[i]`, i in `layers`:
    yields a dict i -> [batch, n, H] that the forward fills (forward pre-hooks, removed on exit)."""
    captured: dict[int, torch.Tensor] = {}

    def hook(index: int):
        def pre(module, args, kwargs):
            captured[index] = args[0] if args else kwargs["hidden_states"]
        return pre

    handles = [decoder.layers[i].register_forward_pre_hook(hook(i), with_kwargs=True) for i in layers]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


class ModelRunner:
    """`profile`: the machine profile (`methods/machine/profile.py`) whose measured linear plan the
    runner's linears take (the shapes it lacks are measured there, and logged); None: stock `F.linear`,
    nothing measured."""

    def __init__(self, model, skinny_gemm: str = "auto", decoder: str = "auto", cuda_graphs: str = "auto",
                 profile=None, compile: str = "off"):
        if decoder not in DECODER_MODES:
            raise ValueError(f"engine.decoder={decoder!r}; valid: {', '.join(DECODER_MODES)}")
        if skinny_gemm not in SKINNY_GEMM_MODES:
            raise ValueError(f"engine.skinny_gemm={skinny_gemm!r}; valid: {', '.join(SKINNY_GEMM_MODES)}")
        self.model = model
        self.skinny_gemm = skinny_gemm
        self.profile = profile
        self.decoder_mode = decoder
        # why the stock forward runs instead of the fused one (None: the fused one runs)
        self.unfused_reason = "engine.decoder=transformers" if decoder == "transformers" else unsupported(model)
        self.fused = None if self.unfused_reason else fused_decoder(model)
        self.linear = self._linear_path(model, *self._fused_linears())
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.precision = precision(model)  # the dtype's name, or bf16w (fp32 tensors of bf16 values)
        self.vocab_size = self.lm_head.out_features
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.cache = TreeKVCache()
        self.forward_passes = 0  # target forwards since the last reset (the steps of τ)
        self.vocabulary = None  # a DraftVocabulary: a draft LM's logits over a subset only (vocab.py)
        self.feature_layers: tuple[int, ...] = ()  # decoder layers whose inputs forward() also returns
        # row counts a verification is padded to (the smallest that holds it), so that its forward takes
        # one of a few static shapes (a CUDA graph per bucket); None: every verification its own size
        self.verify_buckets: tuple[int, ...] | None = None
        # `engine.cuda_graphs` (graphs.py): forwards over a reserved cache run as static steps, captured
        # as CUDA graphs on a GPU ('graphs') or eagerly ('eager'); 'off': the ordinary forward
        self.cuda_graphs = cuda_graphs
        self.graph_mode = graph_mode(cuda_graphs, self.device) if self.fused is not None else "off"
        # `engine.compile` (graphs.py): torch.compile's mode for the static computations (None: not compiled)
        self.compile_mode = compile
        self.compiled = check_compile(compile, self.graph_mode)
        self.static = None if self.graph_mode == "off" else StaticSteps(self, self.graph_mode == "graphs",
                                                                        self.compiled)
        if self.static is not None:
            self.verify_buckets = BUCKETS
        self._reserved: TreeKVCache | None = None  # the last reserved cache, reused while it is large enough

    def restrict_vocabulary(self, vocabulary) -> None:
        """Project onto `vocabulary`'s tokens only (a draft LM's FR-Spec subset): -inf elsewhere."""
        self.vocabulary = vocabulary
        if vocabulary is not None:
            self.cover(vocabulary.head(self.lm_head.weight))

    def capture_inputs(self, layers: Sequence[int]) -> None:
        """Also return, as `ForwardOutput.layers`, the hidden states entering these decoder layers
        (EAGLE-3 reads three). Hooks exist only during this runner's forwards, and only when asked:
        a runner that captures nothing (AR, every other method) runs exactly as before."""
        count = len(self.decoder.layers)
        if any(not 0 <= i < count for i in layers):
            raise ValueError(f"layers {list(layers)}: the target has {count} decoder layers")
        self.feature_layers = tuple(layers)

    def engine_settings(self) -> dict:
        """What a runner a method builds beside this one (a draft LM's, LazyLLM's pruning runner) takes
        from it: the linear path mode, the forward, the static steps and their compilation, and the
        machine profile (`ModelRunner(model, **...)`)."""
        return {"skinny_gemm": self.skinny_gemm, "decoder": self.decoder_mode, "cuda_graphs": self.cuda_graphs,
                "compile": self.compile_mode, "profile": self.profile}

    def cover(self, *modules) -> None:
        """Route other modules this runner drives (draft heads) through its linear path too (the profile
        measures the shapes it lacks)."""
        self.linear = self._linear_path(self.model, *self._fused_linears(), *modules)

    def _linear_path(self, *modules) -> LinearPath:
        if self.skinny_gemm == "off":
            return STOCK
        if self.profile is None:
            if not _SAID:
                _SAID.append(True)
                log.info(NO_PROFILE)
            return STOCK
        return self.profile.linear_path(modules)

    def _fused_linears(self) -> list:
        return self.fused.linears if self.fused else []

    # ---------------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Positions held in the KV cache."""
        return self.cache.get_seq_length()

    def reset(self) -> None:
        self.cache = TreeKVCache()
        self.forward_passes = 0

    def reserve(self, positions: int) -> None:
        """Before an answer that commits at most `positions` positions (prompt + max new tokens), on
        an empty runner: every KV buffer allocated once at positions + ROOM and the RoPE table as
        long, so that nothing the forward reads or writes moves during the answer."""
        if self.length:
            raise RuntimeError("reserve on a non-empty cache; call reset() first")
        # the same buffers (and captured steps) for the next answer while they are large enough
        self.cache = self._reserved = TreeKVCache.reserved(self._reserved, self._capacity(positions))

    def _capacity(self, positions: int) -> int:
        """The capacity reserved for `positions` committed positions: positions + ROOM, rounded up to
        a multiple of ROOM (the next answer likely fits too); the RoPE table made as long."""
        needed = -(-(positions + ROOM) // ROOM) * ROOM
        if self.fused is not None:
            self.fused.rope.reserve(needed, self.dtype, self.device)  # (a table already that long is kept)
        return needed

    def reserve_batch(self, batch: int, positions: int, *, batch_cache: bool = False, slots: int | None = None) -> None:
        """Before decoding `batch` sequences together (the loop, `methods/loop.py`), each committing at
        most `positions` positions. One sequence: the batch-1 cache (`reserve`: its buffers, static
        steps and CUDA graphs kept for the next answer). More, `batch_cache` (a drafter of a batch
        that has drained to one sequence) or `slots` (continuous batching: up to that many sequences
        at once, joining with `join_rows`): a `BatchKVCache` allocated once at positions + ROOM, the
        RoPE table as long."""
        if batch == 1 and not batch_cache and slots is None:
            self.reset()
            self.reserve(positions)
            return
        self.cache = BatchKVCache(batch, self._capacity(positions), len(self.decoder.layers), slots)
        self.forward_passes = 0

    def prefill_rows(self, states: Sequence, prefill: Callable | None = None) -> list[ForwardOutput]:
        """Prefill each sequence (`reserve_batch` first) with `prefill(state)` (default: the prompt,
        `state.prompt`, through `prefill`), one at a time: alone into the batch-1 cache; in a batch, each
        into a scratch cache whose KV is then copied into its row of the batch cache
        (`BatchKVCache.load_row`): the same forward, the same bits as alone, no padding to the longest
        prompt. Each output has its prompt's last logits and every position's hidden state (and
        captured layers)."""
        prefill = prefill or (lambda state: self.prefill(state.prompt))
        batch = self.cache
        if not isinstance(batch, BatchKVCache):
            if len(states) != 1 or self.length:
                raise RuntimeError("prefill_rows needs an empty cache with one row per prompt; call reserve_batch()")
            return [prefill(states[0])]
        if len(states) != len(batch.lengths) or batch.get_seq_length():
            raise RuntimeError("prefill_rows needs an empty BatchKVCache with one row per prompt; call reserve_batch()")
        return self._prefill_into(batch, states, prefill, lambda row, scratch: batch.load_row(row, scratch))

    def join_rows(self, states: Sequence, prefill: Callable | None = None) -> list[ForwardOutput]:
        """Sequences join a batch already decoding (continuous batching; `reserve_batch` with `slots`):
        each prefilled alone, as `prefill_rows` does, into a new last row of the batch cache
        (`BatchKVCache.add_sequence`), in order. The others' rows are untouched."""
        batch = self.cache
        if not isinstance(batch, BatchKVCache):
            raise RuntimeError("join_rows needs a BatchKVCache; call reserve_batch(..., slots=...)")
        prefill = prefill or (lambda state: self.prefill(state.prompt))
        return self._prefill_into(batch, states, prefill, lambda row, scratch: batch.add_sequence(scratch))

    def _prefill_into(self, batch: BatchKVCache, states: Sequence, prefill: Callable, place: Callable) -> list:
        """Each state prefilled alone into a scratch batch-1 cache, then `place(row, scratch)` copies it in."""
        scratch, outputs = TreeKVCache(max(len(s.prompt) for s in states)), []
        try:
            for row, state in enumerate(states):
                scratch.clear()
                self.cache = scratch
                outputs.append(prefill(state))
                place(row, scratch)
        finally:
            self.cache = batch
        return outputs

    def commit_batch(self, start: int, paths: Sequence[Sequence[int]]) -> None:
        """After `forward_batch` at cache length `start`: sequence b keeps the KV of its rows `paths[b]`."""
        if isinstance(self.cache, BatchKVCache):
            self.cache.commit_batch(start, paths)
        else:
            self.commit(start, paths[0])

    def keep_sequences(self, kept: Sequence[int]) -> None:
        """Only the sequences of rows `kept` go on (in that order): the others left the batch."""
        if not isinstance(self.cache, BatchKVCache):
            raise RuntimeError("keep_sequences needs a batch cache (reserve_batch with more than one sequence)")
        self.cache.keep_sequences(kept)

    def check_room(self, needed: int) -> None:
        if self.max_positions and needed > self.max_positions:
            raise ValueError(
                f"sequence of {needed} positions exceeds the model's max_position_embeddings "
                f"({self.max_positions}); shorten the prompt or max_new_tokens"
            )

    @torch.inference_mode()
    def forward(
        self,
        tokens: Sequence[int] | torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        logits_for: slice | torch.Tensor | None = slice(None),
        bound: int | None = None,
        rows: tuple[Sequence[int], torch.Tensor] | None = None,
    ) -> ForwardOutput:
        """Append `tokens` to the cache. Without `positions`/`mask`: a causal continuation.
        `bound`: given `positions`, a host-side bound on them (none: they are read back once).
        `rows`: (depths, visibility among the new rows), host tensors, instead of `positions` and
        `mask`: what a static step (graphs.py) takes."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).view(1, -1)
        start = self.length
        n = ids.shape[1]
        self.check_room(start + n)
        static = self.static is not None and self.static.usable(n, start)
        if static and rows is None and positions is None and mask is None:
            rows = (range(n), torch.ones(n, n, dtype=torch.bool).tril_())
        if rows is not None:
            if static:
                return self._static_forward(ids, rows, start, logits_for)
            depths, visible = rows
            # `bound`: the depths' largest when they are on the host, else the rows' count (a bound, no read)
            bound = start + (n if isinstance(depths, torch.Tensor) else max(depths) + 1)
            positions = start + torch.as_tensor(depths, device=self.device)
            mask = None if n == 1 else attention_mask(visible, start, self.dtype, self.device)
        if positions is None:
            positions, bound = torch.arange(start, start + n, device=self.device), start + n
        if mask is None and n > 1 and start > 0:
            # Causal continuation over a non-empty cache: state the mask rather than rely on the
            # model's own construction from cache lengths.
            mask = attention_mask(torch.ones(n, n, dtype=torch.bool).tril_(), start, self.dtype, self.device)
        fused = self.fused is not None and (self.fused.window is None or start + n <= self.fused.window)
        capturing = layer_inputs(self.decoder, self.feature_layers) if self.feature_layers and not fused \
            else nullcontext({})
        with self.linear.active(), capturing as captured:
            if fused:
                hidden, captured = self.fused.forward(ids, positions.view(1, -1), mask, self.cache, self.feature_layers,
                                                      bound)
                hidden = hidden[0]  # [n, H]
            else:
                out = self.decoder(
                    input_ids=ids,
                    position_ids=positions.view(1, -1),
                    attention_mask=mask,
                    past_key_values=self.cache,
                    use_cache=True,
                )
                hidden = out.last_hidden_state[0]  # [n, H]
            logits = self.head_logits(hidden, logits_for)
            layers = torch.cat([captured[i][0] for i in self.feature_layers], -1) if self.feature_layers else None
        self.forward_passes += 1
        return ForwardOutput(logits=logits, hidden=hidden, layers=layers)

    @torch.inference_mode()
    def forward_batch(self, rows: Sequence[tuple]) -> ForwardOutput:
        """One forward over B sequences' new rows, sequence b's continuing row b of the
        `BatchKVCache` (`reserve_batch`; the prompts are prefilled one at a time, `prefill_rows`).
        `rows[b]` = (tokens, depths, visibility among them) as a tree's `forward_rows()` gives them (on
        the host or, for a `DeviceTree`, the device); a chain is the causal case. Sequence b's rows sit
        at positions lengths[b] + depth and see its own prefix and the rows their visibility names;
        the batch's rows are padded to the longest, padding rows see only themselves and every
        sequence's padding slots in the cache are masked out, so each row sees exactly what it sees
        alone (the native layer's attention walks only the keys a row sees: a short sequence does
        not read a long one's length). Logits [B, R, V], hidden [B, R, H] (and the captured layers'
        inputs [B, R, .]). Nothing is committed (`BatchKVCache.commit_batch`)."""
        cache, device = self.cache, self.device
        if not isinstance(cache, BatchKVCache) and len(rows) == 1:  # one sequence: the batch-1 forward
            out = self.verify_rows(*rows[0])
            return ForwardOutput(out.logits[None], out.hidden[None], None if out.layers is None else out.layers[None])
        if not isinstance(cache, BatchKVCache) or len(rows) != len(cache.lengths):
            raise RuntimeError("forward_batch needs a BatchKVCache with one sequence per row set; call reserve_batch()")
        sizes = [len(tokens) for tokens, _, _ in rows]
        width = max(sizes)
        ids = torch.nn.utils.rnn.pad_sequence([torch.as_tensor(t, dtype=torch.long, device=device) for t, _, _ in rows],
                                              batch_first=True)
        depths = torch.nn.utils.rnn.pad_sequence([torch.as_tensor(d, dtype=torch.long, device=device)
                                                  for _, d, _ in rows],
                                                 batch_first=True)
        own = torch.eye(width, dtype=torch.bool, device=device).repeat(len(rows), 1, 1)  # padding rows: themselves
        for b, (_, _, visible) in enumerate(rows):
            own[b, : sizes[b], : sizes[b]] = torch.as_tensor(visible, device=device)
        return self.forward_rows(ids, depths, own)

    @torch.inference_mode()
    def forward_rows(self, ids: torch.Tensor, depths: torch.Tensor, visible: torch.Tensor, tree: int = 0,
                     logits_at: torch.Tensor | None = None, reach: int | None = None) -> ForwardOutput:
        """Rows [B, n] of B sequences appended after the `BatchKVCache`'s filled length: row i of
        sequence b (token ids[b, i]) at position lengths[b] + depths[b, i], seeing b's committed slots,
        the `tree` slots just before the new rows as visible[b, i, :tree] says (a draft tree's earlier
        levels) and the new rows as its last n columns say. `logits_at` [B]: logits of that row of each
        sequence only ([B, 1, V]); else of every row. `reach`: a bound on the depths known on the host
        (none: the rows' count, a tree's; nothing is read back). It runs the fused forward (the native
        layer where it applies) or the stock decoder; never a static step. Nothing is committed."""
        cache, device = self.cache, self.device
        if not isinstance(cache, BatchKVCache) or ids.shape[0] != len(cache.lengths):
            raise RuntimeError("a batch forward needs a BatchKVCache with one row per sequence; call reserve_batch()")
        batch, width = ids.shape
        start, reach = self.length, width if reach is None else reach
        self.check_room(max(cache.lengths) + reach)
        lengths = torch.tensor(cache.lengths, device=device)
        positions = lengths[:, None] + depths  # [B, n]
        mask = batch_mask(lengths, start - tree, visible, self.dtype)  # each sequence's own slots, then the rest
        fused = self.fused is not None and (self.fused.window is None or start + width <= self.fused.window)
        capturing = layer_inputs(self.decoder, self.feature_layers) if self.feature_layers and not fused \
            else nullcontext({})
        with self.linear.active(), capturing as captured:
            if fused:
                hidden, captured = self.fused.forward(ids, positions, mask, cache, self.feature_layers,
                                                      max(cache.lengths) + reach)
            else:
                hidden = self.decoder(input_ids=ids, position_ids=positions, attention_mask=mask,
                                      past_key_values=cache, use_cache=True).last_hidden_state
            if logits_at is None:
                logits = self.head_logits(hidden.flatten(0, 1), slice(None)).view(batch, width, -1)
            else:
                logits = self.head_logits(hidden[torch.arange(batch, device=device), logits_at], slice(None))[:, None]
            layers = torch.cat([captured[i] for i in self.feature_layers], -1) if self.feature_layers else None
        self.forward_passes += 1
        return ForwardOutput(logits=logits, hidden=hidden, layers=layers)

    def _static_forward(self, ids, rows, start: int, logits_for) -> ForwardOutput:
        depths, visible = rows
        with self.linear.active():
            hidden, captured = self.static.step(ids.shape[1]).run(ids, depths, visible, start)
            logits = self.head_logits(hidden, logits_for)
        layers = torch.cat([captured[i] for i in self.feature_layers], -1) if self.feature_layers else None
        self.forward_passes += 1
        return ForwardOutput(logits=logits, hidden=hidden, layers=layers)

    def head_logits(self, hidden: torch.Tensor, logits_for) -> torch.Tensor | None:
        """The LM head over the rows `logits_for` selects of `hidden` (in the draft vocabulary where one is set;
        None selects none)."""
        if logits_for is None:
            return None
        if self.vocabulary is not None:
            return self.vocabulary.project(hidden[logits_for], self.lm_head.weight)
        return self.lm_head(hidden[logits_for]).float()

    def prefill(self, prompt: Sequence[int], *, all_logits: bool = False) -> ForwardOutput:
        """Fill the cache with the prompt; logits of the last position only, unless asked."""
        if self.length:
            raise RuntimeError("prefill on a non-empty cache; call reset() first")
        return self.forward(prompt, logits_for=slice(None) if all_logits else slice(-1, None))

    def verify(self, tree: Tree) -> ForwardOutput:
        """One forward over all tree nodes; node i sees the prefix, its ancestors and itself. A tree's
        `extra_rows` follow its nodes in the same forward (their logits after the nodes')."""
        return self.verify_rows(*tree.forward_rows())

    def verify_rows(self, tokens, depths, visible: torch.Tensor) -> ForwardOutput:
        """`verify` over rows as a tree's `forward_rows()` gives them: tokens, depths from the root and
        their [T, T] visibility; padded to the next verify bucket where buckets are set (CUDA graphs)."""
        rows = len(tokens)
        padded = self._bucket(rows)
        if padded > rows:  # padding rows: token 0 at the root's position, each seeing only itself
            tokens, depths = torch.as_tensor(tokens), torch.as_tensor(depths)  # (on the host, or a DeviceTree's device)
            tokens = torch.cat([tokens, tokens.new_zeros(padded - rows)])
            depths = torch.cat([depths, depths.new_zeros(padded - rows)])
            grown = torch.eye(padded, dtype=torch.bool, device=visible.device)
            grown[:rows, :rows] = visible
            visible = grown
        out = self.forward(tokens, rows=(depths, visible))
        if padded == rows:
            return out
        # the padding rows' KV sits after every tree row: `commit` keeps tree nodes only, so it goes
        return ForwardOutput(out.logits[:rows], out.hidden[:rows], None if out.layers is None else out.layers[:rows])

    def _bucket(self, rows: int) -> int:
        if not self.verify_buckets:
            return rows
        return next((size for size in sorted(self.verify_buckets) if size >= rows), rows)

    def commit(self, start: int, path: Sequence[int]) -> None:
        """After `verify` at cache length `start`, keep the KV of tree nodes `path` only."""
        self.cache.commit(start, path)

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)
