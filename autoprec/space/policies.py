"""From a fitted space's Optuna parameters to a policy, and back to what the records
say of one: each parameter is named after what it sets (``dtype.<group>``,
``loss_scale.mode``, ``fp8.recipe``...)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import autoprec.formats as formats
from autoprec.optim.state import OptimizerStates
from autoprec.policy import Policy, Quantization, Rule
from autoprec.space.groups import formats_among, group_rules
from autoprec.space.loss_scale import loss_scale_of, suggest_loss_scale, torch_default_params
from autoprec.space.rules import space_rules

if TYPE_CHECKING:
    from autoprec.space.fields import SpaceFields
    from autoprec.space.loss_scale import Suggester


def suggest_policy(space: SpaceFields, trial: Suggester) -> Policy:
    """`SearchSpace.suggest`: ask the trial for every parameter of the space."""
    rules = space_rules(space.mode)
    params: dict[str, Any] = {}
    for group in space.groups:
        name = f"dtype.{group.name}"
        params[name] = trial.suggest_categorical(name, list(group.dtypes))
    if space.switch is not None:
        name = f"switch.{space.switch}"
        params[name] = trial.suggest_categorical(name, [False, True])
    if len(space.reduce_dtypes) > 1:
        params[space.reduce_param] = trial.suggest_categorical(
            space.reduce_param, list(space.reduce_dtypes)
        )
    states = rules.searched_states(space)
    if states is not None:
        params.update(states.suggest(trial))
    # the layers' dtypes (not an fp16 gradient communication, nor an fp8 state kind)
    layers = {value for key, value in params.items() if key.startswith("dtype.")}
    if any(f.records_conversion for f in formats_among(layers)) and len(space.fp8_recipes) > 1:
        params["fp8.recipe"] = trial.suggest_categorical("fp8.recipe", list(space.fp8_recipes))
    if any(f.scales_loss for f in formats_among(layers)) and rules.scales_loss:
        params.update(suggest_loss_scale(space.loss_scale, trial))
    return policy_of(space, params)


def policy_of(space: SpaceFields, params: Mapping[str, Any]) -> Policy:
    """`SearchSpace.policy`: the policy for a set of parameter values."""
    rules = space_rules(space.mode)
    tied = tuple(
        Rule(params[f"dtype.{group}"], patterns=(leaf,), name=f"tied.{group}")
        for leaf, group in space.ties
    )
    layer_rules = tied + tuple(rule for g in space.groups for rule in group_rules(g, params))
    made = formats_among({r.dtype for r in layer_rules})
    fp8 = any(f.records_conversion for f in made)
    states = rules.searched_states(space)
    return Policy(
        rules=layer_rules,
        default="fp32",
        loss_scale=loss_scale_of(space.loss_scale, params, any(f.scales_loss for f in made)),
        tf32=params.get("switch.tf32"),
        hf32=params.get("switch.hf32"),
        writes_loss_scale=rules.scales_loss,
        quantization=Quantization(
            int8=space.int8_method if any(f.records_quantization for f in made) else None,
            fp8=rules.fp8_made_with(space, params) if fp8 else None,
        ),
        reduce_dtype=params.get(
            space.reduce_param, space.reduce_dtypes[0] if space.reduce_dtypes else None
        ),
        optimizer_states=OptimizerStates() if states is None else states.states(params),
    )


def uniform_params(space: SpaceFields, dtype: str) -> dict[str, Any]:
    """`SearchSpace.uniform_params`: parameters that put every group in ``dtype``."""
    rules = space_rules(space.mode)
    params: dict[str, Any] = {f"dtype.{g.name}": dtype for g in space.groups}
    made = formats.get(dtype)
    if made.records_quantization:  # int8, as dynamic quantization: the rest fp32
        fp32 = formats.reference().name
        params = {f"dtype.{g.name}": dtype if dtype in g.dtypes else fp32 for g in space.groups}
    if made.records_conversion:
        params = rules.uniform_fp8(space, dtype)
    if any(f.scales_loss for f in formats_among(params.values())) and rules.scales_loss:
        params.update(torch_default_params(space.loss_scale))
    states = rules.searched_states(space)
    if states is not None:  # every state as the task's optimizer keeps it (fp32 where offered)
        params.update(states.flat_params(states.states({})))
    return params


def flat_params(space: SpaceFields, policy: Policy) -> dict[str, str]:
    """`SearchSpace.flat_params`: the same keys for every policy of the space."""
    flat = {f"dtype.{g.name}": r.dtype for g, r in zip(space.groups, policy.rules, strict=False)}
    return flat | space_rules(space.mode).recorded(space, policy, flat)


def policy_label(params: dict[str, str]) -> str:
    """A short label of a policy, e.g. ``fc1=fp16 fc2=bf16 head=fp32 scale=dynamic`` or, for
    serving on CUDA with TF32 on, ``fc1=fp32 fc2=fp16 head=fp32 tf32``."""
    parts = [f"{k.removeprefix('dtype.')}={v}" for k, v in params.items() if k.startswith("dtype.")]
    # A serving switch (TF32 on CUDA, HF32 on Ascend) for the fp32 layers, where it is on.
    parts += [
        k.removeprefix("switch.")
        for k, v in params.items()
        if k.startswith("switch.") and v == "True"
    ]
    states = {k: v for k, v in params.items() if k.startswith(("state.", "master."))}
    parts += [
        f"{k}={v}" for k, v in states.items() if not any(f.reference for f in formats_among([v]))
    ]
    if params.get("fp8.recipe", "-") != "-":
        parts.append(f"fp8={params['fp8.recipe']}")
    mode = params.get("loss_scale.mode", "none")
    if mode != "none":
        parts.append(f"scale={mode}:{params.get('loss_scale.init_scale', '-')}")
    elif "loss_scale.mode" in params and any(f.scales_loss for f in formats_among(params.values())):
        parts.append("scale=none")  # training, unscaled
    return " ".join(parts)
