"""The task zoo: healthy, fragile-late and mixed-boundary tasks with measured ground truth.

Every automatic judgement (the range forecast, the casts, the choice) is measured on it.
Each entry names its kind, its mechanism and the module groups expected to fail; its
factory builds the `autoprec.Task`, which the command line takes by the entry's name
(``autoprec search --task zoo-lstm``). The ground truth, from long real runs, is in
``benchmarks/zoo_truth.json`` (``python benchmarks/bench_zoo.py --ground-truth``
regenerates it; `autoprec.tasks.zoo.truth`).
"""

from __future__ import annotations

from collections.abc import Callable

from autoprec.tasks.base import Task
from autoprec.tasks.zoo import boundary, fragile, healthy
from autoprec.tasks.zoo._entry import Kind, ZooEntry


def _builtin(name: str, measured: str) -> Callable[[], Task]:
    def factory() -> Task:
        from autoprec.tasks.builtin import BUILTIN_TASKS

        return BUILTIN_TASKS[name]()

    factory.__doc__ = (
        f"The built-in task {name!r} (autoprec.tasks.hf), as it ships. Measured (2000 "
        f"steps, seed 0, CPU, torch 2.13; benchmarks/zoo_truth.json): {measured}"
    )
    return factory


H, F, B = Kind.HEALTHY, Kind.FRAGILE, Kind.BOUNDARY
_ENTRIES = (
    ZooEntry("zoo-sgd-mlp", H, "saturating logits, SGD with momentum", healthy.sgd_mlp),
    ZooEntry("zoo-adam-mlp", H, "saturating logits, Adam", healthy.adam_mlp),
    ZooEntry(
        "zoo-adamw-cosine", H, "saturating logits, AdamW, warm-up + cosine", healthy.adamw_cosine
    ),
    ZooEntry("zoo-wide-mlp", H, "a wide MLP's large early head output", healthy.wide_mlp),
    ZooEntry("zoo-tanh-regression", H, "tanh MLP regression (R^2)", healthy.tanh_regression),
    ZooEntry("zoo-bn-cnn", H, "CNN with BatchNorm", healthy.bn_cnn),
    ZooEntry("zoo-prenorm-transformer", H, "pre-norm transformer", healthy.prenorm_transformer),
    ZooEntry("zoo-lstm", H, "LSTM", healthy.lstm),
    ZooEntry("zoo-gru", H, "GRU", healthy.gru),
    ZooEntry("zoo-embedding-bag", H, "embeddings (EmbeddingBag, mean)", healthy.embedding_bag),
    ZooEntry("zoo-my-task", H, "the README's my_task.py", healthy.my_task),
    ZooEntry(
        "tiny-gpt2",
        H,
        "built-in GPT-2 (transformers)",
        _builtin(
            "tiny-gpt2", "no failure; next-token accuracy fp32 0.462, fp16 0.463, bf16 0.465."
        ),
    ),
    ZooEntry(
        "tiny-bert",
        H,
        "built-in BERT (transformers)",
        _builtin("tiny-bert", "no failure; accuracy 1.000 in fp32, fp16 and bf16."),
    ),
    ZooEntry(
        "tiny-llama",
        H,
        "built-in Llama (transformers)",
        _builtin(
            "tiny-llama", "no failure; next-token accuracy fp32 0.464, fp16 0.462, bf16 0.457."
        ),
    ),
    ZooEntry(
        "tiny-t5",
        H,
        "built-in T5 (transformers)",
        _builtin("tiny-t5", "no failure; accuracy 1.000 in fp32, fp16 and bf16."),
    ),
    *fragile.HOLDING,
    *fragile.ENTRIES,
    *boundary.ENTRIES,
)
ZOO: dict[str, ZooEntry] = {entry.name: entry for entry in _ENTRIES}
HF_TASKS = ("tiny-gpt2", "tiny-bert", "tiny-llama", "tiny-t5")


def zoo_task(name: str) -> Task:
    """The zoo task of that name (a `KeyError` names the zoo's tasks otherwise)."""
    return ZOO[name].task()


def entries(kind: Kind | None = None) -> list[ZooEntry]:
    """The zoo's entries, of one kind or all, in the registry's order."""
    return [e for e in ZOO.values() if kind is None or e.kind == kind]


__all__ = ["HF_TASKS", "ZOO", "Kind", "ZooEntry", "entries", "zoo_task"]
