"""The model families people train, searched as a user runs them, through the command line:
tiny-llama (RMSNorm, rotary, SwiGLU, a tied head) and tiny-t5 (an encoder-decoder) train
and serve without a trial that crashes, T5's serving search writes its summary and int8
reaches Llama's block layers; then ``autoprec export`` of every format that applies to the
study, each file written loaded back (the policy, the program, the ONNX graph, the loading
snippets) and, where it computes, compared with the converted model."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import warnings
from pathlib import Path

import pytest
import torch

import autoprec
from autoprec import load_policy, load_served_model
from autoprec.cli import main
from autoprec.exports.hf import ATTRIBUTE
from autoprec.serving.logits_path import served_logits
from autoprec.tasks import load_task
from autoprec.trials.serving import FP32_CHECKPOINT

pytestmark = [pytest.mark.slow]
FAMILIES = ["tiny-llama", "tiny-t5"]


@pytest.fixture(scope="module", autouse=True)
def _needs_transformers():
    pytest.importorskip("transformers")


def _module_from(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _export(study: str, fmt: str, capsys, *extra: str) -> dict[str, Path]:
    """``autoprec export`` of one format; the files it printed, by name (each exists)."""
    capsys.readouterr()
    assert main(["export", "--study", study, "--format", fmt, *extra]) == 0
    written = [Path(line) for line in capsys.readouterr().out.split()]
    assert written and all(path.is_file() for path in written), written
    return {path.name: path for path in written}


def _search(*args: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the libraries' own, not the search's outcome
        assert main(["search", *args, "--device", "cpu", "--no-progress"]) == 0


def _trials(study: str) -> list[dict]:
    return json.loads(Path(f"runs/{study}/summary.json").read_text())["trials"]


def _crashed(study: str) -> list[str]:
    """Reasons of trials that failed (an exception), not for a numeric reason."""
    return [t["reason"] for t in _trials(study) if t["state"] == "failed"]


@pytest.mark.parametrize("task", FAMILIES)
def test_a_training_search_and_its_exports(task, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    study = f"{task}-train"
    _search("--task", task, "--trials", "6", "--steps", "12", "--study", study)
    assert len(_trials(study)) >= 6
    assert not _crashed(study)
    best = load_policy(f"runs/{study}/best_policy.yaml")
    model = load_task(task).model()
    torch.save(model.state_dict(), "weights.pt")  # cann exports a model: any fp32 weights

    files = _export(study, "yaml", capsys)
    assert load_policy(files["policy.yaml"]) == best
    files = _export(study, "torch-npu", capsys)
    assert load_policy(files["policy.yaml"]) == best
    ast.parse(files["npu_settings.py"].read_text())  # torch_npu itself is not here
    files = _export(study, "cann", capsys, "--checkpoint", "weights.pt")
    onnx = pytest.importorskip("onnx")
    onnx.checker.check_model(onnx.load(files["model.onnx"]))
    assert "keep_dtype.cfg" in files["atc_command.sh"].read_text()

    files = _export(study, "transformers", capsys)
    keep = json.loads(files["keep_in_fp32_modules.json"].read_text())[ATTRIBUTE]
    # The snippet loads a checkpoint as from_pretrained does: give it one.
    model.save_pretrained(tmp_path / "checkpoint")
    snippet = files["load_transformers.py"].read_text()
    assert "'path/to/checkpoint'" in snippet
    code = snippet.replace("'path/to/checkpoint'", repr(str(tmp_path / "checkpoint")))
    cls = type(model)
    before = cls.__dict__.get(ATTRIBUTE)
    scope: dict = {}
    try:
        exec(compile(code, "load_transformers.py", "exec"), scope)  # our own file
    finally:  # the snippet sets the list on the class: put it back for other tests
        setattr(cls, ATTRIBUTE, before)
    dtypes = {
        name: parameter.dtype
        for name, parameter in scope["model"].named_parameters()
        if any(re.search(rf"(^|\.){entry}($|\.)", name) for entry in keep)
    }
    assert set(dtypes.values()) <= {torch.float32}, dtypes


@pytest.mark.parametrize("task", FAMILIES)
def test_a_serving_search_and_its_exports(task, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    study = f"{task}-serve"
    _search(
        "--task", task, "--mode", "serving", "--scenario", "edge", "--int8",
        "torchao-weight-only", "--trials", "5", "--steps", "20", "--study", study,
    )  # fmt: skip
    assert not _crashed(study)
    if task == "tiny-llama":  # int8 reaches the Linear layers inside the blocks
        model = load_task(task).model()
        served = [
            autoprec.Policy.from_dict(t["policy"]).resolve_served(model) for t in _trials(study)
        ]
        assert any(
            dtype == "int8" and ".layers." in layer
            for dtypes in served
            for layer, dtype in dtypes.items()
        ), "no trial served a block layer in int8"
    folder = Path("runs") / study
    best = load_policy(folder / "best_policy.yaml")
    summary = json.loads((folder / "summary.json").read_text())
    int8 = summary["serving"]["int8"]
    fp32 = load_task(task).model().eval()
    fp32.load_state_dict(torch.load(folder / FP32_CHECKPOINT))
    converted = load_served_model(fp32, best, int8=int8)
    batch = load_task(task).first_val_batch()
    inputs = {k: v for k, v in batch.kwargs.items() if k != "labels"}
    with torch.no_grad():
        expected = served_logits(converted, (), inputs)

    files = _export(study, "model", capsys)
    assert {"program.pt2", "served.pt", "fp32.pt", "policy.yaml", "load_model.py"} <= set(files)
    assert load_policy(files["policy.yaml"]) == best
    program = torch.export.load(files["program.pt2"]).module()
    with torch.no_grad():
        assert torch.equal(program(**inputs), expected)  # the logits, no cache
        loader = _module_from(files["load_model.py"])
        assert torch.equal(served_logits(loader.rebuilt(), (), inputs), expected)

    resolved = best.resolve_served(fp32)
    if any(dtype == "int8" for dtype in resolved.values()):
        files = _export(study, "torchao", capsys)
        config = _module_from(files["torchao_config.py"])
        assert config.LAYERS and all(resolved[layer] == "int8" for layer in config.LAYERS)
        fresh = load_task(task).model().eval()
        fresh.load_state_dict(fp32.state_dict())
        quantized = config.quantize(fresh)
        for layer in config.LAYERS:  # torchao's int8 tensors, where the policy said int8
            assert type(quantized.get_submodule(layer).weight) is not torch.nn.Parameter
        if set(resolved.values()) <= {"int8", "fp32"}:  # the format holds only int8
            with torch.no_grad():
                assert torch.equal(served_logits(quantized, (), inputs), expected)
    else:  # nothing in int8: the format does not apply, and says so in one line
        assert main(["export", "--study", study, "--format", "torchao"]) == 2
        assert "serves no Linear layer in int8" in capsys.readouterr().err
    assert autoprec.load_policy(_export(study, "yaml", capsys)["policy.yaml"]) == best
