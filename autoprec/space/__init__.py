"""Search spaces: which dtypes each group of layers may take, and the loss-scale ranges.

A space is read from YAML (see ``search_spaces/*.yaml``)::

    name: digits-mlp
    accuracy_tolerance: 0.01     # feasible when accuracy drops at most this much from fp32
    dtypes: [fp32, fp16, bf16]   # choices of a group that lists none
    groups:                      # first match wins, as in a policy
      - {name: fc1, patterns: [fc1]}
      - {name: norms, types: [LayerNorm], dtypes: [fp32, bf16]}
    loss_scale:
      modes: [none, static, dynamic]
      static_scale_log2: [0, 24]   # static scale 2**k, k in this range
      init_scale_log2: [8, 24]     # dynamic: initial scale 2**k
      growth_interval: [10, 2000]  # dynamic: sampled on a log scale
      hysteresis: [1, 1]           # dynamic: a fixed value when both ends agree

Each Optuna parameter is named after what it sets: ``dtype.<group>``,
``loss_scale.mode``, ``loss_scale.init_scale_log2`` and so on. Loss scaling is only
searched when some group is fp16: bf16 has fp32's exponent range and needs none.
Layers with parameters that no group takes stay in fp32 (add a catch-all group such as
``{name: rest, patterns: ["*"], optional: true}`` to search them too).

``groups: auto`` (with ``auto_groups: {max_groups: 12, own_groups: 3}``, the defaults)
builds the groups when the space is fitted to a model: following its structure
(``h.0-1.attn``, ``h.2-3.mlp``, ``norms.ln_f``, ``head``), with the riskiest modules of a
sensitivity profile first as groups of their own (``risk.features``); see
`autoprec.profile.autogroups`. The fitted space holds the concrete groups, and its fingerprint
says so.

A space is fitted for a mode of search; what differs between modes (which layers are
searched, int8 and fp8 where weights are converted, loss scaling and optimizer states
where the model trains, the anchors) is the mode's `SpaceRules`, found through the mode
object (``Mode.space_rules``).

The package, by concept: ``fields`` (what a space holds, plain data), ``base``
(`SearchSpace`: the fields with their methods, and its fingerprint), ``groups`` (`Group`,
`AutoGroups`, the rules a group's dtype gives), ``loss_scale`` (the ``loss_scale`` section
and its parameters), ``reading`` (the YAML), ``shipped`` (the shipped spaces,
`load_space`), ``rules`` (`SpaceRules`), ``fitting`` (to a model, a device and a mode),
``policies`` (from parameters to a policy, and to the records).
"""

from __future__ import annotations

from autoprec.space.base import SearchSpace
from autoprec.space.fields import DDP_REDUCE_PARAM, FSDP_REDUCE_PARAM
from autoprec.space.groups import AutoGroups, Group, dtype_beside
from autoprec.space.loss_scale import LossScaleSpace, Suggester
from autoprec.space.policies import policy_label
from autoprec.space.rules import SpaceRules, searched_leaves, space_rules
from autoprec.space.shipped import DEFAULT_SPACE, builtin_spaces, load_space

__all__ = [
    "DDP_REDUCE_PARAM",
    "DEFAULT_SPACE",
    "FSDP_REDUCE_PARAM",
    "AutoGroups",
    "Group",
    "LossScaleSpace",
    "SearchSpace",
    "SpaceRules",
    "Suggester",
    "builtin_spaces",
    "dtype_beside",
    "load_space",
    "policy_label",
    "searched_leaves",
    "space_rules",
]
