"""One rank's side of a trial across several devices: the model wrapped for the parallel
mode (DDP or FSDP2), the loss made the mean over the ranks, the loss scaler's overflow
decision made across them, the rank's slice of the data, and the dtypes its layers
really ran in (forward hooks on the first training forward).

It is the `autoprec.trials.training.Ranks` the training loop takes, so that a rank runs
the very loop a single-device trial runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from autoprec.distributed.collectives import max_over_ranks, mean_over_ranks
from autoprec.distributed.data import rank_train_data
from autoprec.distributed.ddp import compress_gradients
from autoprec.distributed.fsdp import ShardUnit, shard_model
from autoprec.errors import AutoprecError
from autoprec.formats import get, known
from autoprec.numerics.observe import first_floating_dtype
from autoprec.precision.plan import parameterised_leaves

if TYPE_CHECKING:
    from autoprec.precision.hooks import Precision
    from autoprec.tasks import Task

PARALLEL_MODES = ("ddp", "fsdp2")


class RankTraining:
    """How this rank trains under ``parallel`` (``ddp`` or ``fsdp2``) on ``device``."""

    def __init__(self, parallel: str, device: torch.device, reduce_dtype: str = "fp32") -> None:
        if parallel not in PARALLEL_MODES:
            raise AutoprecError(
                f"parallel: expected one of {', '.join(PARALLEL_MODES)}, got {parallel!r}"
            )
        self.parallel, self.device, self.reduce_dtype = parallel, device, reduce_dtype
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mean = mean_over_ranks(device)
        self.expected_dtypes: dict[str, str] = {}
        self.observed_dtypes: dict[str, str] = {}
        self.units: list[ShardUnit] = []
        self.comm_hook: str | None = None  # DDP's compression hook, where one is registered
        self._hooks: list[Any] = []

    def wrap(self, model: nn.Module, prec: Precision) -> nn.Module:
        """``model`` (the policy applied) made this rank's part of the parallel model."""
        self.expected_dtypes = dict(prec.plan.leaf_dtypes)
        self._watch(model)  # before FSDP2's hooks, so these see what each leaf computed
        prec.scaler.reduce_found_inf = max_over_ranks(self.device)
        if self.parallel == "fsdp2":
            self.units = shard_model(model, prec.plan.leaf_dtypes, reduce_dtype=self.reduce_dtype)
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = None if self.device.type == "cpu" else [self.device]
        ddp = DistributedDataParallel(model, device_ids=ids)
        self.comm_hook = compress_gradients(ddp, self.reduce_dtype)
        return ddp

    def train_data(self, task: Task, seed: int) -> Iterable[Any]:
        return rank_train_data(task.train_data, seed, self.rank, self.world)

    def _watch(self, model: nn.Module) -> None:
        """Record each leaf's output dtype on the first forward that calls it."""
        for name, leaf in parameterised_leaves(model):

            def hook(module: nn.Module, args: Any, output: Any, name: str = name) -> None:
                dtype = first_floating_dtype(output)
                if dtype is not None and name not in self.observed_dtypes:
                    self.observed_dtypes[name] = dtype

            self._hooks.append(leaf.register_forward_hook(hook))

    def stop_watching(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def dtype_mismatches(self) -> list[str]:
        """Leaves that ran in another dtype than the policy resolves for them."""
        found = []
        for name, seen in self.observed_dtypes.items():
            expected = self.expected_dtypes.get(name)
            # a converted layer (fp8) runs in the region around it
            if expected != seen and not (known(expected) and get(str(expected)).converts):
                found.append(f"{name}: ran {seen}, resolved {expected}")
        return found
