"""Tasks whose modules meet other dtypes at their borders in every way real code does:
custom modules that ``torch.cat``, ``stack``, ``einsum`` or ``matmul`` their inputs with
other tensors, residual adds across dtypes, several inputs (positional, keyword, tuples,
dicts) and nested outputs; beside them an LSTM, a GRU, a CNN with BatchNorm and tiny
transformers. Written only against the Task contract, imported by the boundary and dtype
truth tests."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import autoprec
from autoprec import Policy, Rule
from autoprec.precision.plan import parameterised_leaves

WIDTH = 16


class CatMix(nn.Module):
    """Joins its input with its own projection (``torch.cat``), as rotary embeddings and
    DenseNet blocks do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([x, self.proj(x)], dim=-1))


class StackMix(nn.Module):
    """Stacks its input with two projections and averages them (``torch.stack``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([x, self.a(x), self.b(x)]).mean(dim=0)


class EinsumAttention(nn.Module):
    """Attention over its input written with ``einsum`` and ``matmul``: the values are
    the input itself, beside the projections' queries and keys."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(WIDTH, WIDTH)
        self.k = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("bsd,btd->bst", self.q(x), self.k(x)) / WIDTH**0.5
        return torch.matmul(scores.softmax(dim=-1), x)


class Residual(nn.Module):
    """``x + f(x)``: the add meets the input's dtype and the branch's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Gated(nn.Module):
    """A leaf with parameters of its own and no autocast op: ``x * sigmoid(gate)`` plus a
    bias, concatenated with its input and folded back."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(WIDTH))
        self.bias = nn.Parameter(torch.zeros(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both = torch.cat([x, x * torch.sigmoid(self.gate) + self.bias], dim=-1)
        return both[..., :WIDTH] + both[..., WIDTH:]


class TwoInputs(nn.Module):
    """Several inputs: a positional pair (a tuple), a keyword tensor and a dict; returns
    a dict and a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.mix = nn.Linear(2 * WIDTH, WIDTH)

    def forward(
        self, pair: tuple[torch.Tensor, torch.Tensor], *, context: torch.Tensor, extra: dict
    ) -> dict[str, Any]:
        left, right = pair
        joined = torch.cat([left, right + context, extra["bias"].expand_as(left)], dim=-1)
        mixed = self.mix(joined[..., : 2 * WIDTH]) + self.fc(left)
        return {"hidden": mixed, "parts": (left, torch.stack([right, context]).sum(0))}


class BoundaryNet(nn.Module):
    """Every kind of border above in one model, each custom module between layers that a
    random policy may put in the other low dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.cat = CatMix()
        self.stack = StackMix()
        self.attn = EinsumAttention()
        self.res = Residual()
        self.gated = Gated()
        self.side = nn.Linear(WIDTH, WIDTH)
        self.two = TwoInputs()
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.attn(self.stack(self.cat(h)))
        h = self.gated(self.res(h))
        side = self.side(h)
        out = self.two((h, side), context=h * 0.5, extra={"bias": side.mean(dim=1, keepdim=True)})
        h = out["hidden"] + out["parts"][1]
        return self.head(self.norm(h).mean(dim=1))


def _sequence_task(name: str, model: Callable[[], nn.Module], vocab: int = 0) -> autoprec.Task:
    generator = torch.Generator().manual_seed(3)
    if vocab:
        inputs: torch.Tensor = torch.randint(0, vocab, (256, 10), generator=generator)
        labels = (inputs[:, 0] % 3).long()
    else:
        inputs = torch.randn(256, 10, 8, generator=generator)
        labels = (inputs[:, 0, 0] > 0).long() + (inputs[:, 1, 1] > 0).long()

    def train_data(seed: int):
        g = torch.Generator().manual_seed(seed)
        while True:
            order = torch.randperm(192, generator=g)
            for i in range(0, 192, 32):
                yield inputs[order[i : i + 32]], labels[order[i : i + 32]]

    return autoprec.Task(
        name, model, train_data, lambda: [(inputs[192:], labels[192:])], F.cross_entropy
    )


def boundary_task() -> autoprec.Task:
    return _sequence_task("boundaries", BoundaryNet)


class RecurrentNet(nn.Module):
    """Embedding, LSTM, GRU, head: oneDNN's recurrent kernels on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, WIDTH)
        self.lstm = nn.LSTM(WIDTH, WIDTH, batch_first=True)
        self.gru = nn.GRU(WIDTH, WIDTH, batch_first=True)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(tokens))
        h, _ = self.gru(h)
        return self.head(h[:, -1])


def recurrent_task() -> autoprec.Task:
    return _sequence_task("recurrent", RecurrentNet, vocab=32)


class ConvNet(nn.Module):
    """Convolutions with BatchNorm and a skip connection."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(10, WIDTH, 3, padding=1)
        self.bn1 = nn.BatchNorm1d(WIDTH)
        self.conv2 = nn.Conv1d(WIDTH, WIDTH, 3, padding=1)
        self.bn2 = nn.BatchNorm1d(WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = h + F.relu(self.bn2(self.conv2(h)))
        return self.head(h.mean(dim=-1))


def conv_task() -> autoprec.Task:
    return _sequence_task("conv-bn", ConvNet)


def random_mixed_policies(model: nn.Module, count: int, seed: int) -> list[Policy]:
    """``count`` policies that put each leaf with parameters in fp16 or bf16 at random
    (now and then fp32), under a random default, so that fp16 and bf16 layers meet."""
    leaves = [name for name, _ in parameterised_leaves(model)]
    rng = random.Random(seed)
    policies = []
    for index in range(count):
        rules = []
        for dtype in ("fp16", "bf16", "fp32"):
            weight = 0.15 if dtype == "fp32" else 0.45
            chosen = tuple(name for name in leaves if rng.random() < weight)
            if chosen:
                rules.append(Rule(dtype, patterns=chosen))
        default = rng.choice(("fp16", "bf16"))
        policies.append(Policy(rules=tuple(rules), default=default, name=f"random-{index}"))
    return policies


def held_out_transformers() -> dict[str, Callable[[], nn.Module]]:
    """Tiny transformers of families no built-in task uses (and two that one does), built
    offline from a config with random weights: each one's name -> a model factory."""
    import transformers as hf

    common = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
    }
    return {
        "llama": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(num_key_value_heads=2, **common)),
        "qwen2": lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(num_key_value_heads=2, **common)),
        "gemma": lambda: hf.GemmaForCausalLM(
            hf.GemmaConfig(num_key_value_heads=2, head_dim=8, **common)
        ),
        "mistral": lambda: hf.MistralForCausalLM(hf.MistralConfig(num_key_value_heads=2, **common)),
        "phi": lambda: hf.PhiForCausalLM(hf.PhiConfig(**common)),
        "t5": lambda: hf.T5ForConditionalGeneration(
            hf.T5Config(
                vocab_size=64,
                d_model=32,
                d_ff=64,
                d_kv=8,
                num_layers=2,
                num_heads=4,
                decoder_start_token_id=0,
                pad_token_id=0,
            )
        ),
        "bert": lambda: hf.BertForMaskedLM(hf.BertConfig(**common)),
        "gpt2": lambda: hf.GPT2LMHeadModel(
            hf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)
        ),
        "falcon": lambda: hf.FalconForCausalLM(
            hf.FalconConfig(
                vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4
            )
        ),
        "opt": lambda: hf.OPTForCausalLM(
            hf.OPTConfig(
                vocab_size=64,
                hidden_size=32,
                ffn_dim=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                word_embed_proj_dim=32,
                max_position_embeddings=64,
            )
        ),
    }


def token_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """A transformers-style batch for the models above: ids that are their own labels."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def low_policies(model: nn.Module, seed: int) -> list[Policy]:
    """Uniform bf16, uniform fp16, and two random mixes of the two (one of them with fp32
    layers beside), for the dtype truth tests."""
    leaves = [name for name, _ in parameterised_leaves(model)]
    rng = random.Random(seed)
    half = tuple(name for name in leaves if rng.random() < 0.5)
    mixed = Policy(rules=(Rule("bf16", patterns=half),) if half else (), default="fp16")
    return [
        Policy.uniform("bf16"),
        Policy.uniform("fp16"),
        mixed,
        *random_mixed_policies(model, 1, seed),
    ]


class TrainingKernelLinear(nn.Linear):
    """A layer with the shape of oneDNN's LSTM on a CPU with avx512_fp16: under fp16 or
    bf16 autocast it runs an fp32 input for inference only, while a training step (train
    mode, gradients on) needs its input already in the low dtype. The same on every CPU,
    so that the probe's verdict on such kernels is tested whatever the instruction set."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = torch.is_autocast_enabled("cpu") and x.dtype == torch.float32
        if low and self.training and torch.is_grad_enabled():
            raise RuntimeError(
                "could not create a primitive descriptor for the training forward propagation"
            )
        return super().forward(x)


class NoFp16TrainingLinear(nn.Linear):
    """A layer whose fp16 kernel has no backward (cast or not): fp16 cannot train it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if out.dtype == torch.float16 and out.requires_grad:
            out.register_hook(_no_fp16_backward)
        return out


def _no_fp16_backward(grad: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("no fp16 backward kernel for this layer")


class KernelNet(nn.Module):
    def __init__(self, layer: type[nn.Linear]) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.kernel = layer(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.kernel(torch.relu(self.inp(x))).mean(dim=1))


def _kernel_task(name: str, layer: type[nn.Linear]) -> autoprec.Task:
    return _sequence_task(name, lambda: KernelNet(layer))


def training_kernel_task() -> autoprec.Task:
    return _kernel_task("training-kernel", TrainingKernelLinear)


def no_fp16_training_task() -> autoprec.Task:
    return _kernel_task("no-fp16-training", NoFp16TrainingLinear)
