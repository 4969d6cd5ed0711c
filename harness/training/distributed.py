"""The draft recipes' distributed plumbing, in one place (`loop.py` and `examples.py` use it).

    torchrun --nproc_per_node=8 -m harness.training eagle --model vicuna-7b --batch 64

Under `torchrun` (it sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR) the first call of `context()`
joins the process group: gloo when the recipe's parameters live on the CPU, nccl when they live on a
GPU. Without torchrun everything here is the one-process identity, so the recipes run unchanged.

- **Data**: rank r owns the training examples i with i % world == r (`LaneSampler`): it reads only
  those conversations and their cached hidden states (`examples.attach_hidden` maps the cache file;
  a rank touches only its rows). The order of examples in each global batch does not depend on the
  number of processes, so 1 process and N processes at the same `--batch` and seed train on the same
  global batches, and their loss curves agree up to floating-point summation order
  (`tests/test_distributed_training.py`).
- **Gradients**: the recipe's trainable parameters are wrapped in `DistributedDataParallel`
  (`RecipeModule`), which all-reduces (averages) them in the backward of each step's last micro-batch.
- **Checkpoints / logs**: written by rank 0 only (`is_main()`); every rank reads the checkpoint on `--resume`.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class Context:
    rank: int = 0
    world: int = 1
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def launched() -> bool:
    """True inside `torchrun` (or any launcher that sets WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def context(device: torch.device | str | None = None) -> Context:
    """This process's rank and the world size; joins the process group on the first call under torchrun."""
    if dist.is_available() and dist.is_initialized():
        return Context(dist.get_rank(), dist.get_world_size(), dist.get_backend())
    if not launched():
        return Context()
    device = torch.device(device or "cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    return Context(dist.get_rank(), dist.get_world_size(), backend)


def default_device(recipe) -> torch.device:
    """Under torchrun with CUDA, for a recipe that can train there (`on_gpu`: draft LM, EAGLE, Medusa):
    this rank's GPU (LOCAL_RANK); otherwise where its parameters are (the others train on the CPU, gloo)."""
    params = recipe.parameters()
    if launched() and torch.cuda.is_available() and getattr(recipe, "on_gpu", False):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return params[0].device


def place(recipe, device: torch.device) -> None:
    """Move a recipe's modules and tensors (its attributes) to `device`; examples stay on the CPU and
    each batch is moved by the recipe's `batch_loss`."""
    for name, value in list(vars(recipe).items()):
        if isinstance(value, torch.nn.Module):
            value.to(device)
        elif isinstance(value, torch.Tensor) and value.device != device:
            setattr(recipe, name, value.to(device))


def is_main() -> bool:
    """Rank 0 (or the only process): the one that writes checkpoints, logs, weights and model cards."""
    return context().is_main


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: list[float]) -> list[float]:
    """The sum over ranks of each value (float64); the values themselves in one process."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.cpu().tolist()


def gather_objects(obj):
    """[obj of rank 0, obj of rank 1, ...] on every rank ([obj] in one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class RecipeModule(torch.nn.Module):
    """A recipe as an nn.Module for DistributedDataParallel: its trainable parameters registered (and
    nothing else: frozen tensors shared with the target are neither broadcast nor reduced), forward =
    the summed loss of a micro-batch of examples. Every parameter takes part in every backward (a
    zero-weighted sum of all of them is added), so DDP needs no unused-parameter search and a rank
    whose micro-batch is empty still joins the all-reduce."""

    def __init__(self, recipe, params: list[torch.nn.Parameter]):
        super().__init__()
        self.recipe = [recipe]  # a list: not a submodule
        self.params = torch.nn.ParameterList(params)

    def forward(self, examples, noise: float, generators) -> torch.Tensor:
        recipe = self.recipe[0]
        anchor = sum(p.sum() for p in self.params) * 0.0
        if not examples:
            return anchor
        if hasattr(recipe, "batch_loss"):
            total, _ = recipe.batch_loss(examples, noise, generators)
        else:  # a recipe with a per-example loss only (its mean over the example's tokens)
            total = anchor.new_zeros(())
            for example, generator in zip(examples, generators):
                loss, _ = recipe.loss(example, noise, generator)
                total = total + loss
        return total + anchor


def wrap(module: RecipeModule, ctx: Context) -> torch.nn.Module:
    if not ctx.distributed:
        return module

    device = next(iter(module.parameters())).device
    return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None,
                                   find_unused_parameters=False)  # RecipeModule holds no buffers


class LaneSampler:
    """Global batches that do not depend on the number of processes, each rank holding a fixed shard.

    Example i belongs to lane i % batch; each lane walks its members in a fresh seeded order per pass;
    global batch k takes the k-th next member of every lane. Rank r processes lanes l with
    l % world == r, i.e. (world dividing batch) exactly the examples i with i % world == r, at every step."""

    def __init__(self, n: int, batch: int, seed: int):
        self.n, self.batch, self.seed = n, batch, seed
        self.lanes = [list(range(lane, n, batch)) for lane in range(batch)]

    def _member(self, lane: int, step: int) -> int | None:
        members = self.lanes[lane]
        if not members:
            return None
        passes, position = divmod(step, len(members))
        order = list(members)
        random.Random(f"{self.seed}:{lane}:{passes}").shuffle(order)
        return order[position]

    def local_batch(self, step: int, rank: int, world: int) -> list[int]:
        return [i for lane in range(rank, self.batch, world) if (i := self._member(lane, step)) is not None]

    def shard(self, rank: int, world: int) -> list[int]:
        """The examples rank r ever reads."""
        return [i for lane in range(rank, self.batch, world) for i in self.lanes[lane]]


def example_generator(seed: int, step: int, index: int) -> torch.Generator:
    """The noise generator of one example at one step: the same on whichever rank processes it."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_000_033 + index)
