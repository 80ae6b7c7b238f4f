"""The logits path: what a served model computes for a request, the one way both served
forms call the converted model (the MLflow model's `ServedModel` and the ``model`` export's
``program.pt2``, through `LogitsPath`).

A request carries the model's inputs and nothing else: no labels (serving computes no
loss), no decoder inputs, no use for a key/value cache. So the converted model is called

- without its cache (``use_cache=False``, where its forward takes it and the caller did not
  say): transformers' decoder-only LMs (Llama, Qwen2, GPT-NeoX) default to returning a
  ``DynamicCache``, which ``torch.export`` cannot put among a program's outputs, and one
  forward of a whole sequence has no use for it;
- with an encoder-decoder's (T5, BART) decoder started from its start token where the
  request carries no decoder inputs (training fed them from the labels), so the logits
  are those of the first output token;

and it returns the logits (the output itself, its ``logits`` field, else its first
floating tensor).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from autoprec._util.structures import tensors
from autoprec.tasks.base import logits_of

DECODER_INPUTS = ("decoder_input_ids", "decoder_inputs_embeds")


def served_logits(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """``model(*args, **kwargs)`` on the logits path (module docstring): without its cache,
    an encoder-decoder's decoder started where no decoder inputs are given; its logits."""
    outputs = model(*args, **kwargs, **serving_defaults(model, args, kwargs))
    logits = logits_of(outputs)
    if logits is not None:
        return logits
    return next(t for t in tensors(outputs) if t.is_floating_point())


def serving_defaults(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The keyword inputs a request leaves out that the logits path sets (also what an
    exporter that traces the model itself, such as ONNX's, passes it)."""
    defaults: dict[str, Any] = {}
    if "use_cache" in inspect.signature(model.forward).parameters and "use_cache" not in kwargs:
        defaults["use_cache"] = False
    config = getattr(model, "config", None)
    decoder_given = any(k in kwargs for k in DECODER_INPUTS)
    if getattr(config, "is_encoder_decoder", False) and not decoder_given:
        first = next(iter(tensors((args, kwargs))))
        start = getattr(config, "decoder_start_token_id", None)
        start = 0 if start is None else int(start)
        defaults["decoder_input_ids"] = torch.full(
            (first.shape[0], 1), start, dtype=torch.long, device=first.device
        )
    return defaults


class LogitsPath(nn.Module):
    """A converted model as the ``model`` export traces it: called as the model is (its
    forward's own signature, so that the program takes the same inputs by the same names),
    on the logits path (module docstring), returning the logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

        def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
            return served_logits(self.model, args, kwargs)

        # torch.export binds the example inputs to the forward's signature by name.
        forward.__signature__ = inspect.signature(model.forward)  # type: ignore[attr-defined]
        self.forward = forward


class ServedModel(nn.Module):
    """A converted model as MLflow's PyTorch flavour calls it: one tensor in (several
    inputs stacked along dimension 1, passed by ``keywords`` where the model takes them by
    name), one tensor out: the logits path (`autoprec.serving.logits_path`), as the
    ``model`` export's program computes it."""

    def __init__(
        self, model: nn.Module, keywords: list[str] | None = None, stacked: bool = False
    ) -> None:
        super().__init__()
        self.model = model
        self.keywords = keywords or []
        self.stacked = stacked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs = x.unbind(1) if self.stacked else (x,)
        if self.keywords:
            return served_logits(self.model, (), dict(zip(self.keywords, inputs, strict=True)))
        return served_logits(self.model, inputs, {})
