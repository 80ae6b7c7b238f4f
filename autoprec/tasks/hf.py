"""Built-in transformers tasks: tiny, randomly initialised models built from configs (no
downloads), fed as transformers' Trainer feeds a model, with data generated from seeds.

- ``tiny-gpt2``: a 4-layer GPT-2 learning a synthetic language (each token has a few
  likely successors), fed dict batches ``{input_ids, attention_mask, labels}``; the model
  computes its own loss (``loss=None``), scored by next-token accuracy.
- ``tiny-bert``: a 2-layer BERT classifying variable-length, padded sequences (does the
  sequence hold the marker token?), fed dict batches with an attention mask and labels.
- ``tiny-llama``: a 2-layer Llama (RMSNorm, rotary embeddings, SwiGLU, grouped-query
  attention, the head tied to the embedding) learning the same synthetic language.
- ``tiny-t5``: a T5 encoder-decoder (T5LayerNorm, relative position buckets, the head
  tied to the shared embedding) answering tiny-bert's question in a word: the padded
  sequence and its mask go to the encoder, the one-token answer is the label (the model
  shifts the labels right for its decoder).

They need the optional extra: ``pip install -e '.[hf]'``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from autoprec.errors import TaskError
from autoprec.tasks.base import Task

VOCAB = 64
GPT2_LENGTH = 32
GPT2_BATCH = 16
SUCCESSORS = 2  # likely next tokens per token in the synthetic language
BERT_BATCH = 32
BERT_LENGTHS = (8, 24)  # shortest and longest sequence, [CLS] included
PAD, CLS, MARKER = 0, 1, 2  # token ids of tiny-bert's special tokens
VAL_BATCHES = 4
YES, NO = 3, 4  # tiny-t5's answer tokens


def _transformers() -> Any:
    # transformers imports torchao where it is installed, whose optional CUDA kernels and
    # torch's pytree log warnings at import on a CPU-only machine: not ours to show.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import transformers
    except ImportError:
        raise TaskError(
            "the transformers tasks need the transformers package: pip install -e '.[hf]'"
        ) from None
    transformers.logging.set_verbosity_error()
    return transformers


def _forever(make: Callable[[torch.Generator], dict[str, torch.Tensor]], seed: int) -> Iterator:
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield make(generator)


# -- tiny-gpt2 ---------------------------------------------------------------------------


def _language() -> torch.Tensor:
    """Each token's likely successors (fixed: the language is the same for every seed)."""
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(3, VOCAB, (VOCAB, SUCCESSORS), generator=generator)


def _gpt2_batch(successors: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Sequences that follow a likely successor 90% of the time, a random token else."""
    tokens = torch.empty(GPT2_BATCH, GPT2_LENGTH, dtype=torch.long)
    tokens[:, 0] = torch.randint(3, VOCAB, (GPT2_BATCH,), generator=generator)
    for position in range(1, GPT2_LENGTH):
        choice = torch.randint(0, SUCCESSORS, (GPT2_BATCH,), generator=generator)
        likely = successors[tokens[:, position - 1], choice]
        noise = torch.randint(3, VOCAB, (GPT2_BATCH,), generator=generator)
        keep = torch.rand(GPT2_BATCH, generator=generator) < 0.9
        tokens[:, position] = torch.where(keep, likely, noise)
    return {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": tokens}


def tiny_gpt2_model() -> nn.Module:
    transformers = _transformers()
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=GPT2_LENGTH,
        n_embd=64,
        n_layer=4,
        n_head=4,
        use_cache=False,
        bos_token_id=CLS,
        eos_token_id=CLS,
        pad_token_id=PAD,
    )
    return transformers.GPT2LMHeadModel(config)


def tiny_gpt2() -> Task:
    """A 4-layer GPT-2 (64 wide) learning a synthetic language, transformers style."""
    return _language_task("tiny-gpt2", tiny_gpt2_model)


def _language_task(name: str, model: Callable[[], nn.Module]) -> Task:
    """A causal language model learning the synthetic language, transformers style."""
    _transformers()
    successors = _language()

    def make(generator: torch.Generator) -> dict[str, torch.Tensor]:
        return _gpt2_batch(successors, generator)

    return Task(
        name,
        model,
        lambda seed: _forever(make, seed),
        lambda: _held_out(make),
        loss=None,
        metric="next_token_accuracy",
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
    )


# -- tiny-bert ---------------------------------------------------------------------------


def _bert_batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Padded sequences of random lengths; label 1 when the marker token occurs."""
    low, high = BERT_LENGTHS
    lengths = torch.randint(low, high + 1, (BERT_BATCH,), generator=generator)
    tokens = torch.randint(3, VOCAB, (BERT_BATCH, high), generator=generator)
    positions = torch.arange(high).expand(BERT_BATCH, high)
    real = positions < lengths[:, None]
    labels = torch.randint(0, 2, (BERT_BATCH,), generator=generator)
    # The marker goes at a random real position after [CLS] in the positive sequences.
    where = (torch.rand(BERT_BATCH, generator=generator) * (lengths - 1)).long() + 1
    marked = positions == where[:, None]
    tokens = torch.where(marked & (labels[:, None] == 1), MARKER, tokens)
    tokens[:, 0] = CLS
    tokens = torch.where(real, tokens, PAD)
    return {"input_ids": tokens, "attention_mask": real.long(), "labels": labels}


def tiny_bert_model() -> nn.Module:
    transformers = _transformers()
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=BERT_LENGTHS[1],
        num_labels=2,
        pad_token_id=PAD,
    )
    return transformers.BertForSequenceClassification(config)


def tiny_bert() -> Task:
    """A 2-layer BERT (64 wide) classifying padded sequences with an attention mask."""
    _transformers()
    return Task(
        "tiny-bert",
        tiny_bert_model,
        lambda seed: _forever(_bert_batch, seed),
        lambda: _held_out(_bert_batch),
        loss=None,
        metric="accuracy",
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
    )


# -- tiny-llama --------------------------------------------------------------------------


def tiny_llama_model() -> nn.Module:
    transformers = _transformers()
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=GPT2_LENGTH,
        tie_word_embeddings=True,
        use_cache=False,
        bos_token_id=CLS,
        eos_token_id=CLS,
        pad_token_id=PAD,
    )
    return transformers.LlamaForCausalLM(config)


def tiny_llama() -> Task:
    """A 2-layer Llama (64 wide, RMSNorm, rotary, SwiGLU, tied head) learning the synthetic
    language of tiny-gpt2."""
    return _language_task("tiny-llama", tiny_llama_model)


# -- tiny-t5 -----------------------------------------------------------------------------


def _t5_batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """tiny-bert's padded sequences, answered in words: the one-token target says whether
    the marker occurs (cross-attention must find it wherever it is)."""
    batch = _bert_batch(generator)
    answer = torch.where(batch["labels"] == 1, YES, NO)
    return {**batch, "labels": answer[:, None]}


def tiny_t5_model() -> nn.Module:
    transformers = _transformers()
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        use_cache=False,
        pad_token_id=PAD,
        eos_token_id=CLS,
        decoder_start_token_id=PAD,
    )
    return transformers.T5ForConditionalGeneration(config)


def tiny_t5() -> Task:
    """A T5 encoder-decoder (2 + 2 layers, 64 wide) saying whether a marker occurs."""
    _transformers()
    return Task(
        "tiny-t5",
        tiny_t5_model,
        lambda seed: _forever(_t5_batch, seed),
        lambda: _held_out(_t5_batch),
        loss=None,
        metric="accuracy",
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
    )


def _held_out(
    make: Callable[[torch.Generator], dict[str, torch.Tensor]],
) -> list[dict[str, torch.Tensor]]:
    """Validation batches from a seed no training run uses."""
    generator = torch.Generator().manual_seed(2**31 - 1)
    return [make(generator) for _ in range(VAL_BATCHES)]
