"""FSDP2 under a policy: one ``fully_shard`` unit per block, each unit's
``MixedPrecisionPolicy`` taken from the policy's dtypes.

- **Units follow blocks**, as the automatic groups do (`autoprec.profile.autogroups`): each
  repeated block is a unit, the rest of the model is the root unit. A unit's
  ``param_dtype`` is the dtype that most of its parameters run in under the policy, so
  that its all-gather moves that dtype.
- **A layer of another dtype inside a unit** (an fp32 layer kept inside a bf16 block) is
  a unit of its own with its own ``param_dtype``: it still runs in its dtype, where one
  unit-wide cast would have handed it bf16 weights.
- **Dtype boundaries**: a unit inside surroundings of another dtype hands its outputs on
  in the surroundings' dtype (``output_dtype``: a bf16 block in an fp32 model outputs
  fp32, an fp32 block in a bf16 model bf16, which its next layer takes); a low-precision
  block followed by a block of another dtype outputs fp32; every unit casts its inputs
  to its own ``param_dtype`` (``cast_forward_inputs``). So FSDP2's casts alone carry a
  mixed model across its boundaries; without them a bf16 block before an fp32 one fails
  with ``mat1 and mat2 must have the same dtype``.
- **Gradients are reduced in fp32** by default (``reduce_dtype``); bf16 (or fp16) halves
  their traffic at some accuracy risk, which is the trial's to measure.
- **Optimizer states** (the policy's ``optimizer`` section) shard with the parameters:
  torchao's optimizers keep each state as a DTensor over this rank's shard, quantised per
  shard. On the CPU (gloo, 2 ranks) 8-bit, fp8, bf16 and fp8-bf16 states stepped the
  same weights under FSDP2 as under DDP, bit for bit, where no state collapsed; torchao's
  4-bit state fails in its step there (``AssertionError: wrong number of dimensions1 for
  op: input``), so it is refused on the CPU (`fsdp2_state_refusal`). bf16 masters are cast
  after sharding and before the first forward, which FSDP2 takes up at its lazy init.

The policy's own regions (`autoprec.precision.hooks`) are installed first and stay: autocast
still decides what each op computes in, the units decide what the weights are gathered
and reduced in.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoprec.dtypes import TORCH_DTYPES, below_fp32
from autoprec.errors import PolicyError
from autoprec.formats import get
from autoprec.policy import REDUCE_DTYPES
from autoprec.precision.plan import own_parameters
from autoprec.profile.autogroups import repeated_blocks

if TYPE_CHECKING:
    from autoprec.devices import Backend
    from autoprec.guard.settings import Guard
    from autoprec.policy import Policy
    from autoprec.precision.hooks import Precision


@dataclass(frozen=True)
class ShardUnit:
    """One ``fully_shard`` unit: the module (``""``: the root), the dtype its parameters
    are gathered in, and the dtype its outputs are handed on in (None: as computed)."""

    name: str
    param_dtype: str
    output_dtype: str | None = None


def shard_units(model: nn.Module, leaf_dtypes: dict[str, str]) -> list[ShardUnit]:
    """The units for a model whose parameterised leaves run in ``leaf_dtypes`` (a plan's),
    innermost first, as ``fully_shard`` must be applied."""
    converted = sorted(d for d in set(leaf_dtypes.values()) if get(d).records_conversion)
    if converted:
        raise PolicyError(f"{converted[0]} layers under FSDP2 are not supported yet (use DDP)")
    modules = dict(model.named_modules())
    blocks = list(repeated_blocks(model))

    def owner(leaf: str) -> str:
        return next((b for b in blocks if leaf == b or leaf.startswith(f"{b}.")), "")

    owned: dict[str, list[str]] = {name: [] for name in ["", *blocks]}
    for leaf in leaf_dtypes:
        owned[owner(leaf)].append(leaf)

    def main_dtype(leaves: list[str]) -> str | None:
        weights: Counter[str] = Counter()
        for leaf in leaves:
            weights[leaf_dtypes[leaf]] += own_parameters(modules[leaf])
        return max(weights, key=lambda d: weights[d]) if weights else None

    root = main_dtype(owned[""]) or main_dtype(list(leaf_dtypes)) or "fp32"
    dtypes = {name: main_dtype(leaves) for name, leaves in owned.items()}
    units: list[ShardUnit] = []
    ordered = [b for b in blocks if dtypes[b] is not None]
    for index, block in enumerate(ordered):
        dtype = dtypes[block]
        assert dtype is not None
        units += _odd_leaves(owned[block], leaf_dtypes, dtype)
        following = dtypes[ordered[index + 1]] if index + 1 < len(ordered) else root
        if dtype != root:
            output: str | None = root
        else:
            output = "fp32" if below_fp32(dtype) and following != dtype else None
        units.append(ShardUnit(block, dtype, output))
    units += _odd_leaves(owned[""], leaf_dtypes, root)
    units.append(ShardUnit("", root, "fp32" if below_fp32(root) else None))
    return units


def _odd_leaves(leaves: list[str], leaf_dtypes: dict[str, str], around: str) -> list[ShardUnit]:
    """Leaves of another dtype than their unit's, each a unit of its own that hands its
    outputs on in the unit's dtype."""
    return [
        ShardUnit(leaf, leaf_dtypes[leaf], around) for leaf in leaves if leaf_dtypes[leaf] != around
    ]


def fsdp2_state_refusal(kinds: set[str] | tuple[str, ...], device_type: str) -> str | None:
    """Why FSDP2 on ``device_type`` cannot train optimizer states of ``kinds`` (None: it
    can): torchao's 4-bit state fails in its step on sharded parameters on the CPU."""
    if "4bit" in kinds and device_type == "cpu":
        return (
            "optimizer state 4bit under --parallel fsdp2: torchao's AdamW4bit fails on "
            "sharded parameters on the CPU; drop 4bit or use --parallel ddp"
        )
    return None


def shard_model(
    model: nn.Module,
    leaf_dtypes: dict[str, str],
    mesh: Any = None,
    reduce_dtype: str = "fp32",
) -> list[ShardUnit]:
    """``fully_shard`` each unit of `shard_units` in place, with its mixed precision;
    returns the units. ``mesh``: a 1-D DeviceMesh (default: all ranks, on the model's
    device kind)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if reduce_dtype not in REDUCE_DTYPES:
        raise PolicyError(
            f"reduce_dtype: expected one of {', '.join(REDUCE_DTYPES)}, got {reduce_dtype!r}"
        )
    if mesh is None:
        mesh = default_mesh(model)
    modules = dict(model.named_modules())
    units = shard_units(model, leaf_dtypes)
    for unit in units:
        policy = MixedPrecisionPolicy(
            param_dtype=TORCH_DTYPES[unit.param_dtype],
            reduce_dtype=TORCH_DTYPES[reduce_dtype],
            output_dtype=None if unit.output_dtype is None else TORCH_DTYPES[unit.output_dtype],
        )
        fully_shard(modules[unit.name], mesh=mesh, mp_policy=policy)
    return units


def default_mesh(model: nn.Module) -> Any:
    """All ranks of the default process group, on the device kind of the model."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    first = next(model.parameters(), None)
    kind = "cpu" if first is None else first.device.type
    return init_device_mesh(kind, (dist.get_world_size(),))


def apply_fsdp2(
    model: nn.Module,
    policy: Policy,
    mesh: Any = None,
    reduce_dtype: str | None = None,
    device: str | torch.device | Backend | None = None,
    guard: Guard | bool | None = None,
) -> Precision:
    """Apply ``policy`` to ``model`` and shard it with FSDP2 as a trial did: the policy's
    regions installed (`Policy.apply`), then one ``fully_shard`` unit per block with its
    dtypes (see the module's docstring), and the loss scaler's overflow decision made
    across the ranks. Call it on every rank, with the model on the rank's device and the
    process group initialised; create the optimizer afterwards, from
    ``model.parameters()`` (the sharded ones). ``reduce_dtype``: the gradients' reduction
    dtype, default the policy's (``reduce_dtype``), else fp32. Returns the Precision the loop calls
    (``prec.autocast()``, ``prec.backward(loss)``, ``prec.step(optimizer)``); ``guard``:
    as `Policy.apply`'s (a unit's all-gather keeps the dtype it was sharded with, so a
    promotion widens the computation of its region, not the weights it gathers)."""
    from autoprec.distributed.collectives import max_over_ranks

    prec = policy.apply(model, device, guard=guard)
    reduce = reduce_dtype or policy.reduce_dtype or "fp32"
    shard_model(model, prec.plan.leaf_dtypes, mesh, reduce)
    group = None if mesh is None else mesh.get_group()
    prec.scaler.reduce_found_inf = max_over_ranks(prec.backend.device, group)
    return prec
