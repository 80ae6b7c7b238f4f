"""Serving exports: the model a serving search chose, as a deployment loads it.

The ``model`` format writes a torch.export program of the converted model (checked against
it at export time), the fp32 weights, the policy and ``load_model.py``; the ``torchao`` format
writes the int8 layers as a torchao ``FqnToConfig``. Each is loaded back here with the
library itself (torch.export.load, torchao's quantize_) and compared with what
``autoprec.load_served_model`` serves, which is what the search's trial measured.
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from autoprec import Policy, Rule, load_policy, load_served_model
from autoprec._util.structures import tensors
from autoprec.exports import ExportError, ExportWarning, export_policy
from autoprec.policy import Quantization
from autoprec.tasks import load_task

pytest.importorskip("torchao", reason="the torchao tests need torchao (pip install torchao)")


def export_quietly(*args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = export_policy(*args, **kwargs)
    return {p.name: p for p in paths}, [
        str(w.message) for w in caught if issubclass(w.category, ExportWarning)
    ]


def module_from(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def outputs(model, batch, drop_labels=False):
    kwargs = {k: v for k, v in batch.kwargs.items() if not (drop_labels and k == "labels")}
    with torch.no_grad():
        found = model(*batch.args, **kwargs)
    logits = getattr(found, "logits", found)
    return logits if isinstance(logits, torch.Tensor) else next(iter(tensors(found)))


def task_and_batch(name):
    task = load_task(name)
    batch = task.batch(next(iter(task.val_data())))
    return task, task.model().eval(), batch


MIXED = Policy(rules=(Rule("fp32", patterns=("head",)),), default="fp16", name="fp16-body")


def test_model_format_program_and_rebuilt_serve_what_the_trial_served(tmp_path):
    task, model, batch = task_and_batch("digits-mlp")
    files, notes = export_quietly(
        MIXED, "model", tmp_path, model=model, example=batch, task="digits-mlp"
    )
    assert sorted(files) == [
        "fp32.pt",
        "load_model.py",
        "policy.yaml",
        "program.pt2",
        "served.pt",
    ]
    assert notes == []
    assert load_policy(files["policy.yaml"]) == MIXED
    saved = torch.load(files["fp32.pt"])
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())

    served = outputs(load_served_model(model, MIXED), batch)
    loader = module_from(files["load_model.py"])
    assert torch.equal(outputs(loader.exported(), batch), served)
    assert torch.equal(outputs(loader.rebuilt(), batch), served)  # the task built by name
    # The program's batch size is free: three samples go through it as through the model.
    three = task.batch((batch.args[0][:3], batch.targets[:3]))
    assert torch.equal(
        outputs(loader.exported(), three), outputs(load_served_model(model, MIXED), three)
    )
    text = files["load_model.py"].read_text()
    assert "Inputs: positional float32 [batch, 64]." in text
    # served.pt: the converted weights, each in its dtype, loading into a converted model.
    state = torch.load(files["served.pt"])
    assert state["fc1.weight"].dtype == torch.float16 and state["head.weight"].dtype == (
        torch.float32
    )
    other = load_served_model(load_task("digits-mlp").model(), MIXED)
    other.load_state_dict(state, assign=True)
    assert torch.equal(outputs(other, batch), served)


def test_model_format_takes_a_transformers_model_by_keyword(tmp_path):
    pytest.importorskip("transformers")
    task, model, batch = task_and_batch("tiny-gpt2")
    policy = Policy(rules=(Rule("fp32", patterns=("lm_head", "transformer.wte")),), default="bf16")
    files, notes = export_quietly(policy, "model", tmp_path, model=model, example=batch)
    assert "program.pt2" in files and notes == []
    served = outputs(load_served_model(model, policy), batch)
    loader = module_from(files["load_model.py"])
    # The program takes the model's inputs without labels: serving computes no loss.
    assert torch.equal(outputs(loader.exported(), batch, drop_labels=True), served)
    assert torch.equal(outputs(loader.rebuilt(task.model()), batch), served)
    with pytest.raises(ValueError, match="pass an instance of your fp32 model"):
        loader.rebuilt()  # no task named at export: the caller brings the model


def test_torch_dynamic_int8_gets_no_program_and_says_how_to(tmp_path):
    _, model, batch = task_and_batch("digits-mlp")
    policy = Policy.uniform("int8")
    files, notes = export_quietly(policy, "model", tmp_path, model=model, example=batch)
    assert "program.pt2" not in files
    assert len(notes) == 1 and "torchao" in notes[0] and "rebuilt()" in notes[0]
    assert "# NOTE: no program.pt2: torch's dynamic int8" in files["load_model.py"].read_text()
    loader = module_from(files["load_model.py"])
    assert not hasattr(loader, "exported")  # only what the export wrote
    served = outputs(load_served_model(model, policy, int8="dynamic"), batch)
    assert torch.equal(outputs(loader.rebuilt(load_task("digits-mlp").model()), batch), served)
    other = load_served_model(load_task("digits-mlp").model(), policy, int8="dynamic")
    other.load_state_dict(torch.load(files["served.pt"]), assign=True)
    assert torch.equal(outputs(other, batch), served)


def test_torchao_int8_exports_as_a_program(tmp_path):
    _, model, batch = task_and_batch("digits-mlp")
    policy = Policy.uniform("int8")
    files, notes = export_quietly(
        policy, "model", tmp_path, model=model, example=batch, int8="torchao-dynamic"
    )
    assert "program.pt2" in files and notes == []
    served = outputs(load_served_model(model, policy, int8="torchao-dynamic"), batch)
    assert torch.equal(outputs(module_from(files["load_model.py"]).exported(), batch), served)


def test_model_format_without_an_example_writes_no_program(tmp_path):
    model = load_task("digits-mlp").model()
    files, notes = export_quietly(MIXED, "model", tmp_path, model=model)
    assert "program.pt2" not in files
    assert notes == ["no example input: no program.pt2 (rebuilt() converts the weights)"]


class Branching(torch.nn.Module):
    """A model whose output decides its path: torch.export cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y if y.sum() > 0 else -y


def test_a_model_without_a_program_gets_no_exported(tmp_path):
    model = Branching().eval()
    policy = Policy.uniform("bf16")
    files, notes = export_quietly(policy, "model", tmp_path, model=model, example=torch.ones(2, 4))
    assert "program.pt2" not in files
    assert len(notes) == 1 and notes[0].startswith("no program.pt2: torch.export failed")
    loader = module_from(files["load_model.py"])
    assert (
        not hasattr(loader, "exported") and "exported()" not in files["load_model.py"].read_text()
    )
    other = Branching()
    served = loader.rebuilt(other)
    x = torch.randn(5, 4)
    assert torch.equal(served(x), load_served_model(model, policy)(x))


def test_model_format_needs_a_model(tmp_path):
    with pytest.raises(ExportError, match="format 'model': needs a model"):
        export_policy(MIXED, "model", tmp_path)


def test_torchao_config_quantizes_the_int8_layers_as_the_trial_did(tmp_path):
    _, model, batch = task_and_batch("digits-mlp")
    policy = Policy(rules=(Rule("fp32", patterns=("head",)),), default="int8")
    files, notes = export_quietly(
        policy, "torchao", tmp_path, model=model, int8="torchao-weight-only"
    )
    assert sorted(files) == ["policy.yaml", "torchao_config.py"] and notes == []
    config = module_from(files["torchao_config.py"])
    assert config.LAYERS == ["fc1", "fc2"]
    fresh = load_task("digits-mlp").model().eval()
    fresh.load_state_dict(model.state_dict())
    quantized = config.quantize(fresh)
    assert type(quantized.fc1.weight) is not torch.nn.Parameter  # torchao's int8 tensor
    assert type(quantized.head.weight) is torch.nn.Parameter  # kept fp32 by the rule
    served = outputs(load_served_model(model, policy, int8="torchao-weight-only"), batch)
    assert torch.equal(outputs(quantized, batch), served)


@pytest.mark.parametrize("method", ["torchao-weight-only", "torchao-dynamic"])
def test_the_policy_s_own_method_is_what_every_format_serves(tmp_path, method):
    """The method a serving policy records, without an ``int8`` argument anywhere: the
    torchao config, the model export and load_served_model all take it."""
    _, model, batch = task_and_batch("digits-mlp")
    policy = Policy(
        rules=(Rule("fp32", patterns=("head",)),),
        default="int8",
        writes_loss_scale=False,
        quantization=Quantization(int8=method),
    )
    files, notes = export_quietly(policy, "torchao", tmp_path / "torchao", model=model)
    assert notes == []
    config = module_from(files["torchao_config.py"])
    fresh = load_task("digits-mlp").model().eval()
    fresh.load_state_dict(model.state_dict())
    served = outputs(load_served_model(model, policy), batch)
    assert torch.equal(outputs(config.quantize(fresh), batch), served)
    assert torch.equal(served, outputs(load_served_model(model, policy, int8=method), batch))
    files, _ = export_quietly(policy, "model", tmp_path / "model", model=model, example=batch)
    assert f"int8={method!r}" in files["load_model.py"].read_text()
    assert load_policy(files["policy.yaml"]).int8_method == method


def test_torchao_format_says_what_it_cannot_hold(tmp_path):
    pytest.importorskip("transformers")
    _, model, _ = task_and_batch("tiny-gpt2")
    policy = Policy(rules=(Rule("fp16", types=("LayerNorm",)),), default="int8")
    files, notes = export_quietly(policy, "torchao", tmp_path, model=model, int8="dynamic")
    config = module_from(files["torchao_config.py"])
    assert config.LAYERS == ["lm_head"]  # GPT-2's other Linears are transformers' Conv1D
    assert any("fp16/bf16 layer(s)" in n and "stay fp32" in n for n in notes)
    assert any("Conv1D" in n for n in notes)
    assert any("no torchao twin" in n for n in notes)
    assert "Int8DynamicActivationInt8WeightConfig" in files["torchao_config.py"].read_text()


def test_torchao_format_refuses_a_policy_without_int8(tmp_path):
    _, model, _ = task_and_batch("digits-mlp")
    with pytest.raises(ExportError, match="serves no Linear layer in int8"):
        export_policy(MIXED, "torchao", tmp_path, model=model)
    assert not (tmp_path / "torchao_config.py").exists()


@pytest.mark.parametrize("fmt", ["torch-npu", "cann", "transformers"])
def test_training_formats_refuse_int8(tmp_path, fmt):
    _, model, batch = task_and_batch("digits-mlp")
    with pytest.raises(ExportError, match=f"format '{fmt}': the policy serves layers in int8"):
        export_policy(Policy.uniform("int8"), fmt, tmp_path / "out", model=model, example=batch)
    assert not (tmp_path / "out").exists()
