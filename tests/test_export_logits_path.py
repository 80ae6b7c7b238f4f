"""The ``model`` export's program is the logits path the MLflow model serves: a decoder-only
LM whose ``use_cache`` defaults to True (its outputs then carry a DynamicCache, which
torch.export cannot return) gets a program, an encoder-decoder gets one that starts its
decoder, and what the export says when it cannot is never cut inside a URL."""

from __future__ import annotations

import warnings

import pytest
import torch

from autoprec import Policy, Rule, load_served_model
from autoprec.errors import first_line
from autoprec.exports import ExportWarning, export_policy
from autoprec.serving.logits_path import LogitsPath, served_logits
from autoprec.serving.mlflow_model import ServedModel
from autoprec.tasks import load_task


@pytest.fixture(autouse=True)
def _needs_transformers():
    pytest.importorskip("transformers")


def cached_llama():
    """tiny-llama as transformers builds a Llama by default: with its cache on."""
    task = load_task("tiny-llama")
    model = task.model().eval()
    model.config.use_cache = True
    return task, model


def export(policy, model, example, folder):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = export_policy(policy, "model", folder, model=model, example=example)
    notes = [str(w.message) for w in caught if issubclass(w.category, ExportWarning)]
    return {p.name: p for p in paths}, notes


def test_a_llama_with_its_cache_on_gets_a_program_of_its_logits(tmp_path):
    task, model = cached_llama()
    batch = task.first_val_batch()
    inputs = {k: v for k, v in batch.kwargs.items() if k != "labels"}
    with torch.no_grad():
        assert type(model(**inputs).past_key_values).__name__ == "DynamicCache"
    policy = Policy(rules=(Rule("fp32", patterns=("model.layers.0.self_attn",)),), default="bf16")
    files, notes = export(policy, model, batch, tmp_path)
    assert "program.pt2" in files and notes == []
    program = torch.export.load(files["program.pt2"]).module()
    converted = load_served_model(model, policy)
    with torch.no_grad():
        logits = converted(**inputs).logits
        assert torch.equal(program(**inputs), logits)
        # The batch size is free, as for every program the export writes.
        three = {k: v[:3] for k, v in inputs.items()}
        assert torch.equal(program(**three), converted(**three).logits)


def test_the_mlflow_model_and_the_program_compute_one_logits_path():
    task, model = cached_llama()
    inputs = {k: v for k, v in task.first_val_batch().kwargs.items() if k != "labels"}
    names = list(inputs)
    stacked = torch.stack([inputs[n] for n in names], 1)
    with torch.no_grad():
        mlflow_logits = ServedModel(model, names, stacked=True)(stacked)
        assert torch.equal(LogitsPath(model)(**inputs), mlflow_logits)
        assert torch.equal(served_logits(model, (), inputs), model(**inputs).logits)


def test_an_encoder_decoder_program_starts_its_decoder(tmp_path):
    task = load_task("tiny-t5")
    model = task.model().eval()
    batch = task.first_val_batch()
    files, notes = export(Policy.uniform("bf16"), model, batch, tmp_path)
    assert "program.pt2" in files and notes == []
    inputs = {k: v for k, v in batch.kwargs.items() if k != "labels"}
    program = torch.export.load(files["program.pt2"]).module()
    start = torch.full((len(inputs["input_ids"]), 1), model.config.decoder_start_token_id)
    converted = load_served_model(model, Policy.uniform("bf16"))
    with torch.no_grad():
        expected = converted(**inputs, decoder_input_ids=start).logits
        assert torch.equal(program(**inputs), expected)


def test_a_long_message_is_cut_between_words_never_inside_a_url():
    url = "https://github.com/pytorch/functorch/issues/" + "1" * 40
    error = RuntimeError(f"Found a type that is not known. If it holds tensors, see {url} now")
    for limit in range(20, len(str(error)) + 5):
        line = first_line(error, limit)
        assert len(line) <= limit
        assert url in line or "https" not in line, (limit, line)
        if len(str(error)) > limit:
            assert line.endswith(" ...")
    assert first_line(error, 1000) == str(error)
