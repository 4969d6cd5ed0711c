"""Training examples: the target's self-distilled answers (`data/distill/<model>/answers.jsonl`),
its hidden states for the head recipes (computed once in batches, cached on disk in 16 bits), held-out splits.

The hidden-state cache (`attach_hidden(..., cache=Path("hidden_states.pt"))`) is two files: the index
`hidden_states.pt` (the examples' lengths, a digest of their token ids, the dtype, and the target's
argmax at every position) and `hidden_states.pt.bin`, every example's [T, H] rows back to back in
float16 (bfloat16 if the target's hidden states exceed float16's range): 9,000 conversations x 290
tokens x 576 dims is 3 GB. The rows are memory-mapped, not read: an example's `hidden` is a view
that reads its rows from the page cache when a recipe touches it, so a process holds in RAM only
what it is using, and under torchrun a rank touches only its shard (`distributed.LaneSampler`).
Computing the cache writes the file as it goes (ranks write disjoint rows of the same file), and
journals each finished batch (`<cache>.partial.<rank>` + the argmax rows `<cache>.top.<rank>`): an
interrupted computation (hours for a large corpus on a CPU) resumes where it stopped when run
again with the same examples, fields, batch size and number of processes.
The machinery is `attach_states`, for any tensor per position: EAGLE-3 caches the inputs of three
layers beside the last hidden state with it (`eagle3.attach_features`; the index then names its
`kind` and `fields`, the columns each attribute reads).
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from . import distributed


@dataclass
class Example:
    ids: torch.Tensor  # [T] prompt + answer
    answer_start: int
    hidden: torch.Tensor | None = None  # [T, H] target's last hidden state (after the final norm); may be 16-bit
    top: torch.Tensor | None = None  # [T] the target's argmax at each position (predicts token t + 1)
    # [T, 3H] EAGLE-3: the inputs of the target's three feature layers; may be 16-bit
    features: torch.Tensor | None = None


def load_examples(file: Path) -> list[Example]:
    rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    return [Example(torch.tensor(r["ids"]), r["answer_start"]) for r in rows if len(r["ids"]) > r["answer_start"] + 2]


def _digest(examples: list[Example]) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(len(e.ids).to_bytes(4, "little"))
        h.update(e.ids.to(torch.int64).numpy().tobytes())
    return h.hexdigest()


_DTYPES = {"float16": (torch.float16, np.float16), "bfloat16": (torch.bfloat16, np.uint16)}
_HIDDEN = "hidden"  # the kind of attach_hidden's cache (an index without a `kind` is one)


def attach_from(cache: Path, examples: list[Example], kind: str, fields: dict[str, int]) -> bool:
    """Attach memory-mapped views of the cache when it holds exactly these examples and fields. A missing cache, or
    one torch cannot read back (truncated, not a torch archive, a pickle it refuses), is recomputed; any other error
    propagates."""
    try:
        index = torch.load(cache, weights_only=True)
    except FileNotFoundError:
        return False
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as err:  # unreadable: corrupt or truncated
        print(f"{cache}: unreadable cache ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
              "recomputing it", flush=True)
        return False
    if not isinstance(index, dict) or index.get("version") != 2 or index.get("digest") != _digest(examples):
        return False
    width = sum(fields.values())
    if index.get("kind", _HIDDEN) != kind or index.get("fields", {_HIDDEN: index["hidden_size"]}) != fields:
        return False
    torch_dtype, np_dtype = _DTYPES[index["dtype"]]
    lengths = index["lengths"].tolist()
    data = cache.with_name(cache.name + ".bin")
    if not data.is_file() or data.stat().st_size != sum(lengths) * width * 2 or index["hidden_size"] != width:
        return False
    rows = np.memmap(data, dtype=np_dtype, mode="c", shape=(sum(lengths), width))
    top = index["top"]
    start = 0
    for example, length in zip(examples, lengths):
        view = torch.from_numpy(rows[start:start + length])
        view = view.view(torch.bfloat16) if torch_dtype == torch.bfloat16 else view
        column = 0
        for name, size in fields.items():  # a view of the field's columns: nothing is read yet
            setattr(example, name, view[:, column:column + size])
            column += size
        example.top = top[start:start + length].long()
        start += length
    return True


def last_hidden(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = target.model(input_ids=ids).last_hidden_state.float()
    return hidden, hidden


@torch.no_grad()
def attach_hidden(target, examples: list[Example], cache: Path | None = None, progress: bool = False,
                  batch_tokens: int = 4096) -> None:
    """The target's last hidden states (`hidden`) and argmax (`top`) at every position of every
    example (EAGLE, Medusa and Hydra train on them). Computed in right-padded batches of about
    `batch_tokens` tokens (under torchrun each rank computes every world-th batch). Without a cache
    they stay in RAM as float32; with a `cache` file they are written in 16 bits and memory-mapped,
    and the next recipe reuses them when the examples match."""
    hidden_size = target.get_input_embeddings().embedding_dim
    attach_states(target, examples, last_hidden, {_HIDDEN: hidden_size}, _HIDDEN, cache, progress, batch_tokens)


@torch.no_grad()
def attach_states(target, examples: list[Example], compute, fields: dict[str, int], kind: str,
                  cache: Path | None = None, progress: bool = False, batch_tokens: int = 4096) -> None:
    """The cache machinery of `attach_hidden`, for any tensor per position: `compute(target, ids
    [B, W]) -> (rows [B, W, D], last hidden state [B, W, H])` (float32, right-padded ids); each
    example gets one attribute per `fields` entry (name -> its D columns, in order) and `top` (the
    target's argmax, from the last hidden state). `kind` names what `compute` computes: a cache of
    another kind, or of other examples, is recomputed. In RAM as float32 without a `cache`."""
    ctx = distributed.context()
    if cache is not None and attach_from(cache, examples, kind, fields):
        return
    width_d = sum(fields.values())
    lengths = [len(e.ids) for e in examples]
    offsets = np.cumsum([0] + lengths)
    batches = _length_batches(lengths, batch_tokens)
    mine = batches[ctx.rank::ctx.world] if cache is not None else batches
    rows = top_all = journal = None
    done: set[int] = set()
    if cache is not None:
        journal = _Journal(cache, ctx, {"digest": _digest(examples), "kind": kind, "fields": dict(fields),
                                        "batch_tokens": batch_tokens, "world": ctx.world})
        rows, done, peak = _open_rows(cache, journal, ctx, int(offsets[-1]), width_d)
        top_all = journal.top
        if done and progress:
            print(f"{cache}: resuming, {len(done)} of {len(mine)} batches already computed", flush=True)
    lm_head = target.get_output_embeddings()
    device = lm_head.weight.device
    todo = [chunk for number, chunk in enumerate(mine) if number not in done]
    numbers = [number for number in range(len(mine)) if number not in done]
    for number, (chunk, states, last) in zip(numbers, tqdm(
            _forward(target, examples, todo, lengths, compute, device), total=len(mine), initial=len(done),
            desc=f"target {kind}", unit="batch", disable=not progress)):
        for row, i in enumerate(chunk):
            h = states[row, :lengths[i]]
            top = torch.cat([lm_head(part.to(lm_head.weight.dtype)).argmax(-1)
                             for part in last[row, :lengths[i]].split(1024)]).cpu()
            h = h.cpu()
            if cache is None:
                h = h.clone()
                column = 0
                for name, size in fields.items():
                    setattr(examples[i], name, h[:, column:column + size])
                    column += size
                examples[i].top = top
            else:
                peak = max(peak, float(h.abs().max()))
                rows[offsets[i]:offsets[i + 1]] = h.to(torch.float16).numpy()
                top_all[offsets[i]:offsets[i + 1]] = top.to(torch.int32).numpy()
        if cache is not None:
            rows.flush()
            journal.finished(number, peak)
    if cache is None:
        return
    rows.flush()
    del rows
    top_all = torch.from_numpy(np.array(top_all))
    dtype = "float16"
    if max(distributed.gather_objects(peak)) > 60000:  # beyond float16: store bfloat16 instead
        dtype = "bfloat16"
        _convert_to_bf16(target, examples, cache, offsets, width_d, ctx, batches, lengths, compute)
    tops = distributed.gather_objects(top_all)
    if ctx.is_main:
        top_all = sum(t.long() for t in tops).to(torch.int32)  # each rank filled its own rows, zeros elsewhere
        index = {"version": 2, "digest": _digest(examples), "dtype": dtype, "hidden_size": width_d,
                 "lengths": torch.tensor(lengths), "top": top_all}
        if kind != _HIDDEN:  # attach_hidden's index stays as it was (caches written before still read)
            index |= {"kind": kind, "fields": dict(fields)}
        torch.save(index, cache)
    distributed.barrier()
    journal.remove()
    if not attach_from(cache, examples, kind, fields):
        raise RuntimeError(f"{cache}: the cache just written does not read back")


def _length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """The examples' indices, shortest first, in batches of about `batch_tokens` padded tokens."""
    batches, current = [], []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def _open_rows(cache: Path, journal: _Journal, ctx, positions: int, width_d: int) -> tuple[np.memmap, set[int], float]:
    """The cache's float16 rows, memory-mapped (created empty unless every rank can resume its journal), the
    batches already finished and the largest magnitude written so far."""
    resume = all(distributed.gather_objects(journal.readable(positions * width_d * 2)))
    if ctx.is_main and not resume:
        with open(cache.with_name(cache.name + ".bin"), "wb") as f:
            f.truncate(positions * width_d * 2)
    distributed.barrier()
    rows = np.memmap(cache.with_name(cache.name + ".bin"), dtype=np.float16, mode="r+", shape=(positions, width_d))
    done, peak = journal.start(resume, positions)
    return rows, done, peak


class _Journal:
    """One rank's progress on a cache being computed: the batches finished (a JSON file replaced
    atomically after each) and its argmax rows (an int32 memory-mapped file)."""

    def __init__(self, cache: Path, ctx, settings: dict):
        self.file = cache.with_name(f"{cache.name}.partial.{ctx.rank}")
        self.top_file = cache.with_name(f"{cache.name}.top.{ctx.rank}")
        self.data = cache.with_name(cache.name + ".bin")
        self.settings = settings
        self.done: list[int] = []
        self.top = None

    def readable(self, data_bytes: int) -> bool:
        """A journal of these settings, with its data and argmax files in place."""
        try:
            state = json.loads(self.file.read_text())
        except (OSError, ValueError):
            return False
        return (state.get("settings") == self.settings and self.data.is_file()
                and self.data.stat().st_size == data_bytes
                and self.top_file.is_file())

    def start(self, resume: bool, positions: int) -> tuple[set[int], float]:
        if resume:
            state = json.loads(self.file.read_text())
            self.done, peak = list(state["done"]), float(state["peak"])
            self.top = np.memmap(self.top_file, dtype=np.int32, mode="r+", shape=(positions,))
            return set(self.done), peak
        self.top = np.memmap(self.top_file, dtype=np.int32, mode="w+", shape=(positions,))
        self._write(0.0)
        return set(), 0.0

    def finished(self, batch: int, peak: float) -> None:
        self.top.flush()
        self.done.append(batch)
        self._write(peak)

    def _write(self, peak: float) -> None:
        temporary = self.file.with_name(self.file.name + ".tmp")
        temporary.write_text(json.dumps({"settings": self.settings, "done": self.done, "peak": peak}))
        temporary.replace(self.file)

    def remove(self) -> None:
        self.top = None
        for file in (self.file, self.top_file):
            file.unlink(missing_ok=True)


def _forward(target, examples, batches, lengths, compute, device):
    """(batch, rows, last hidden state) for each right-padded batch (the attention is causal: no mask needed)."""
    for chunk in batches:
        width = max(lengths[i] for i in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, i in enumerate(chunk):
            ids[row, :lengths[i]] = examples[i].ids
        states, last = compute(target, ids.to(device))
        yield chunk, states, last


def _convert_to_bf16(target, examples, cache, offsets, width_d, ctx, batches, lengths, compute) -> None:
    rows = np.memmap(cache.with_name(cache.name + ".bin"), dtype=np.uint16, mode="r+",
                     shape=(int(offsets[-1]), width_d))
    device = target.get_output_embeddings().weight.device
    for chunk, states, _ in _forward(target, examples, batches[ctx.rank::ctx.world], lengths, compute, device):
        states = states.cpu()  # recomputed: float16 overflowed
        for row, i in enumerate(chunk):
            rows[offsets[i]:offsets[i + 1]] = states[row,
                                                     :lengths[i]].to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    rows.flush()
    distributed.barrier()


def target_top(example: Example, lm_head) -> torch.Tensor:
    """[T] the target's argmax at each position (cached on the example; from its hidden states)."""
    if example.top is None:
        with torch.no_grad():
            device = lm_head.weight.device
            example.top = torch.cat([lm_head(part.to(device, lm_head.weight.dtype)).argmax(-1).cpu()
                                     for part in example.hidden.split(1024)])
    return example.top


def split(examples: list[Example], held_out: float, seed: int) -> tuple[list[Example], list[Example]]:
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_val = max(1, int(len(examples) * held_out)) if len(examples) > 1 else 0
    return [examples[i] for i in order[n_val:]], [examples[i] for i in order[:n_val]]


def feature_spread(examples: list[Example]) -> torch.Tensor:
    """[H] standard deviation of each dimension of the target's hidden states over the examples
    (streamed: float64 sums, the examples' rows are not concatenated)."""
    total = square = None
    count = 0
    for e in examples:
        h = e.hidden.double()
        total = h.sum(0) if total is None else total + h.sum(0)
        square = (h * h).sum(0) if square is None else square + (h * h).sum(0)
        count += h.shape[0]
    mean = total / count
    return ((square - count * mean * mean) / max(count - 1, 1)).clamp_min(0).sqrt().float()


def answer_mask(example: Example, offset: int) -> torch.Tensor:
    """[T - offset] bool: position t predicts token t + offset, which belongs to the answer."""
    t = torch.arange(len(example.ids) - offset)
    return t + offset >= example.answer_start


def pad_batch(examples: list[Example], hidden: bool = False, device: torch.device | str = "cpu"):
    """Right-padded ids [B, T] (pad 0), lengths [B], answer starts [B] and, with `hidden`, the hidden
    states [B, T, H] as float32 (zeros past each example's end), on `device`."""
    lengths = torch.tensor([len(e.ids) for e in examples])
    width = int(lengths.max())
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    states = None
    if hidden:
        states = torch.zeros(len(examples), width, examples[0].hidden.shape[-1])
    for row, e in enumerate(examples):
        ids[row, :len(e.ids)] = e.ids
        if hidden:
            states[row, :len(e.ids)] = e.hidden.float()
    starts = torch.tensor([e.answer_start for e in examples])
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(ids), move(lengths), move(starts), move(states)


def offset_mask(lengths: torch.Tensor, starts: torch.Tensor, width: int, offset: int) -> torch.Tensor:
    """[B, width - offset] bool: in example b, position t predicts token t + offset, which exists and
    belongs to the answer (`answer_mask` of each example, padded with False)."""
    t = torch.arange(width - offset, device=lengths.device)[None]
    return (t + offset >= starts[:, None]) & (t + offset < lengths[:, None])


def choose_mask_token(tokenizer, examples: list[Example], rows: int) -> int:
    """A draft's mask id when none is given (DFlash's, PARD's: upstream's are reserved tokens): the highest-id
    added token of the tokenizer that no example holds and that is not its bos, eos, pad or unk; else the
    highest id below `rows` that no example holds."""
    used = set()
    for example in examples:
        used.update(example.ids.tolist())
    special = set(getattr(tokenizer, "all_special_ids", None) or ()) | {
        getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    added = sorted(i for i in (getattr(tokenizer, "added_tokens_decoder", None) or {})
                   if i < rows and i not in used and i not in special)
    if added:
        return added[-1]
    unused = next((i for i in range(rows - 1, -1, -1) if i not in used and i not in special), None)
    if unused is None:
        raise ValueError("every vocabulary row occurs in the training data: give the mask id as --mask-token")
    return unused


def draft_labels(labels: torch.Tensor, ids: torch.Tensor | None, full_size: int) -> torch.Tensor:
    """Target-vocabulary `labels` as rows of the draft vocabulary `ids` (its target ids, in order; None: the
    full vocabulary, the labels unchanged); -1 where a label is outside the draft vocabulary."""
    if ids is None:
        return labels
    to_draft = torch.full((full_size,), -1, dtype=torch.long, device=labels.device)
    to_draft[ids.to(labels.device)] = torch.arange(len(ids), device=labels.device)
    return to_draft[labels]


def mean_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, owner: torch.Tensor, examples: int) -> torch.Tensor:
    """[examples] each example's mean cross-entropy over its rows of `logits` (`owner[r]`: row r's example)
    against `labels` (`draft_labels`: a row labelled -1 counts 0)."""
    ce = F.cross_entropy(logits, labels.clamp_min(0), reduction="none") * (labels >= 0)
    per_example = ce.new_zeros(examples).index_add(0, owner, ce)
    counts = ce.new_zeros(examples).index_add(0, owner, torch.ones_like(ce))
    return per_example / counts.clamp_min(1)
