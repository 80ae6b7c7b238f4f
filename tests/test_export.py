"""Exports: a found policy in the formats other tools read (autoprec.exports).

torch_npu and ATC are not installed here (no Ascend chip): the torch-npu and cann outputs are
checked against the documented formats (shared/NPU.md), the transformers one by loading a
real model with from_pretrained.
"""

from __future__ import annotations

import json
import re
import subprocess
import warnings

import pytest
import torch

import autoprec
from autoprec import LossScale, Policy, Rule, load_policy
from autoprec.exports import ExportError, ExportWarning, export_policy
from autoprec.exports.hf import keep_entries, selected
from autoprec.tasks import load_task


def first_batch(task: autoprec.Task):
    return task.batch(next(iter(task.train_data(0))))


def header_text(text: str) -> str:
    """The comment lines of a generated file as one line of prose (wrapping undone)."""
    lines = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    return " ".join(line.removeprefix("NOTE:").strip() for line in lines)


def export_quietly(*args, **kwargs):
    """export_policy, returning the paths and the ExportWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = export_policy(*args, **kwargs)
    return paths, [str(w.message) for w in caught if issubclass(w.category, ExportWarning)]


# -- yaml ----------------------------------------------------------------------------------


def test_yaml_round_trip(tmp_path):
    policy = Policy(
        rules=(
            Rule("fp32", types=("LayerNorm",), name="norms"),
            Rule("bf16", patterns=("fc2",), name="middle"),
        ),
        default="fp16",
        loss_scale=LossScale("dynamic", init_scale=1024.0, growth_interval=50),
        hf32=False,
        name="found",
    )
    (path,) = export_policy(policy, "yaml", tmp_path / "out")
    assert path.name == "policy.yaml"
    assert load_policy(path) == policy


# -- torch-npu -----------------------------------------------------------------------------


def settings(paths):
    path = next(p for p in paths if p.name == "npu_settings.py")
    text = path.read_text()
    compile(text, str(path), "exec")  # a script can paste it
    mode = re.search(r'"ACL_PRECISION_MODE": "(\w+)"', text).group(1)
    return text, mode


def test_torch_npu_all_fp16_allows_fp32_to_fp16(tmp_path):
    model = load_task("digits-mlp").model()  # its LayerNorms run in fp32 on the NPU
    paths, notes = export_quietly(Policy.uniform("fp16"), "torch-npu", tmp_path, model=model)
    text, mode = settings(paths)
    assert mode == "allow_fp32_to_fp16" and notes == []
    assert "leaves the device's defaults" in text and "allow_hf32 =" not in text
    assert 'policy = autoprec.load_policy("policy.yaml")' in text
    assert 'prec = policy.apply(model, device="npu")' in text
    assert "import torch_npu" in text
    assert load_policy(tmp_path / "policy.yaml") == Policy.uniform("fp16")
    _, mode = settings(export_policy(Policy.uniform("fp16"), "torch-npu", tmp_path / "rules"))
    assert mode == "allow_fp32_to_fp16"


def test_torch_npu_norms_in_fp32_need_a_model_to_tell(tmp_path):
    # LayerNorm runs in fp32 on the NPU whatever the policy says: with the model, keeping it
    # in fp32 keeps nothing else; from the rules alone, an fp32 rule must be honoured.
    policy = Policy(rules=(Rule("fp32", types=("LayerNorm",)),), default="fp16")
    model = load_task("digits-mlp").model()
    _, mode = settings(export_policy(policy, "torch-npu", tmp_path / "model", model))
    assert mode == "allow_fp32_to_fp16"
    _, mode = settings(export_policy(policy, "torch-npu", tmp_path / "rules"))
    assert mode == "must_keep_origin_dtype"


def test_torch_npu_mixed_keeps_origin_dtype(tmp_path):
    policy = Policy(rules=(Rule("fp32", patterns=("head",)),), default="fp16", hf32=True)
    model = load_task("digits-mlp").model()
    for given in (model, None):  # the policy's rules decide without a model
        text, mode = settings(
            export_policy(
                policy, "torch-npu", tmp_path / ("rules" if given is None else "model"), given
            )
        )
        assert mode == "must_keep_origin_dtype"
        assert "torch.npu.matmul.allow_hf32 = True" in text
        assert "torch.npu.conv.allow_hf32 = True" in text
        assert ("1 layer(s) in fp32 (head)" in header_text(text)) == (given is not None)


def test_torch_npu_bf16_says_what_it_approximates(tmp_path):
    model = load_task("digits-cnn").model()
    paths, notes = export_quietly(Policy.uniform("bf16"), "torch-npu", tmp_path, model=model)
    text, mode = settings(paths)
    assert mode == "must_keep_origin_dtype"
    (note,) = notes
    assert "no bf16 mode" in note
    assert note in header_text(text)


# -- cann ----------------------------------------------------------------------------------


def unqualified(name: str) -> str:
    """The scope name torch's TorchScript exporter gives a module (last non-numeric part on)."""
    parts = name.split(".")
    starts = [i for i, part in enumerate(parts) if not part.isnumeric()]
    return ".".join(parts[starts[-1] :]) if starts else name


def scopes_by_running(model, batch) -> dict[str, str]:
    """Scope path -> module name, from the module calls of one real forward pass (the chain of
    modules each call sits in), not from the names: a ModuleList, never called, has no scope."""
    names = {module: name for name, module in model.named_modules()}
    stack: list[str] = []
    scopes: dict[str, str] = {}

    def enter(module, args, kwargs=None):
        stack.append(unqualified(names[module]))
        scopes.setdefault("/".join(stack), names[module])

    def leave(module, args, output):
        stack.pop()

    handles = [m.register_forward_pre_hook(enter) for m in model.modules() if m is not model]
    handles += [m.register_forward_hook(leave) for m in model.modules() if m is not model]
    was_training = model.training
    try:
        with torch.no_grad():
            model.eval()(*batch.args, **{k: v for k, v in batch.kwargs.items() if k != "labels"})
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return scopes


def module_of(node_name: str, scopes: dict[str, str]) -> str:
    parts = node_name.split("/")[1:-1]
    while parts:
        for key in ("/".join(parts), "/".join(re.sub(r"_\d+$", "", p) for p in parts)):
            if key in scopes:
                return scopes[key]
        parts = parts[:-1]
    return ""


def expected_fp32(module: str, dtypes: dict[str, str]) -> bool:
    """A node runs in fp32 when the module it sits in (or the nearest one above it with
    layers) has only fp32 layers."""
    while True:
        below = [
            d for layer, d in dtypes.items() if module == "" or f"{layer}.".startswith(module + ".")
        ]
        if below or module == "":
            return bool(below) and set(below) == {"fp32"}
        module = module.rpartition(".")[0]


def onnx_nodes(path):
    onnx = pytest.importorskip("onnx")
    return [node for node in onnx.load(str(path)).graph.node if node.op_type != "Constant"]


def check_cann(tmp_path, task_name, policy, mode, device="npu", widened=()):
    task = load_task(task_name)
    model = task.model()
    batch = first_batch(task)
    paths, notes = export_quietly(
        policy, "cann", tmp_path, model=model, example=batch, device=device
    )
    assert [p.name for p in paths] == ["model.onnx", "keep_dtype.cfg", "atc_command.sh"]
    assert model.training  # the export put the model in eval mode and back

    listed = paths[1].read_text().splitlines()
    scopes = scopes_by_running(model, batch)
    dtypes = {**policy.resolve(model, device), **dict.fromkeys(widened, "fp32")}
    nodes = onnx_nodes(paths[0])
    kept = [n.name for n in nodes if expected_fp32(module_of(n.name, scopes), dtypes)]
    assert listed == kept
    # every fp32 layer that the graph has a node for is listed
    node_layers = {module_of(n.name, scopes) for n in nodes}
    for layer, dtype in dtypes.items():
        if dtype == "fp32" and layer in node_layers:
            assert any(module_of(name, scopes) == layer for name in listed), layer

    command = paths[2].read_text()
    subprocess.run(["bash", "-n", str(paths[2])], check=True)
    assert "atc --model=model.onnx" in command and "--framework=5" in command
    assert "--output=model" in command and '--soc_version="$SOC_VERSION"' in command
    assert f"--precision_mode_v2={mode}" in command
    assert ("--keep_dtype=keep_dtype.cfg" in command) == (mode != "origin" and bool(listed))
    for note in notes:
        assert note in header_text(command)
    return listed, notes, command


def test_cann_mlp_fp16(tmp_path):
    policy = Policy(rules=(Rule("fp32", patterns=("fc2",)),), default="fp16")
    listed, notes, _ = check_cann(tmp_path, "digits-mlp", policy, "mixed_float16")
    # fc2 by the policy, the LayerNorms because autocast runs them in fp32 on the NPU
    assert listed == [
        "/norm1/LayerNormalization",
        "/fc2/Gemm",
        "/norm2/LayerNormalization",
    ]
    assert notes == []


def test_cann_mlp_on_cpu_follows_the_policy_for_norms(tmp_path):
    policy = Policy(rules=(Rule("fp32", patterns=("fc2",)),), default="fp16")
    listed, _, _ = check_cann(tmp_path, "digits-mlp", policy, "mixed_float16", device="cpu")
    assert listed == ["/fc2/Gemm"]


def test_cann_cnn_bf16_keeps_batchnorm_as_a_node(tmp_path):
    policy = Policy(rules=(Rule("fp32", patterns=("bn1", "head")),), default="bf16")
    listed, notes, _ = check_cann(tmp_path, "digits-cnn", policy, "mixed_bfloat16")
    assert listed == ["/bn1/BatchNormalization", "/head/Gemm"]
    (note,) = notes  # ATC could fold the kept BatchNorm into the bf16 Conv before it
    assert "/bn1/BatchNormalization after /conv1/Conv" in note


def test_cann_resnet_nested_blocks(tmp_path):
    policy = Policy(rules=(Rule("fp32", patterns=("layer2", "fc")),), default="fp16")
    listed, notes, _ = check_cann(tmp_path, "digits-resnet", policy, "mixed_float16")
    assert "/layer2/layer2.0/downsample/downsample.0/Conv" in listed
    assert "/layer2/layer2.3/relu_2/Relu" in listed  # the block's own ops, all fp32 inside
    assert "/layer2/layer2.0/Add" in listed and "/fc/Gemm" in listed
    assert not any(name.startswith(("/layer1/", "/layer3/")) for name in listed)
    assert notes == []


def test_cann_tiny_bert(tmp_path):
    pytest.importorskip("transformers")
    policy = Policy(
        rules=(Rule("fp32", patterns=("bert.encoder.layer.1.attention", "classifier")),),
        default="fp16",
    )
    listed, _, command = check_cann(tmp_path, "tiny-bert", policy, "mixed_float16")
    attention = "/bert/encoder/layer.1/attention/"
    assert attention + "self/query/MatMul" in listed
    assert attention + "self/Softmax" in listed  # inside a module whose layers are all fp32
    assert "/bert/encoder/layer.0/attention/self/query/MatMul" not in listed
    assert "/classifier/Gemm" in listed
    assert "attention_mask" in command  # the inputs and their shapes are in the header


def test_cann_all_fp32_is_origin(tmp_path):
    _, _, command = check_cann(tmp_path, "digits-mlp", Policy.uniform("fp32"), "origin")
    assert "--keep_dtype" not in command


def test_cann_mixed_low_dtypes_widens_the_smaller_one(tmp_path):
    policy = Policy(rules=(Rule("bf16", patterns=("head",)),), default="fp16", hf32=True)
    listed, notes, _ = check_cann(tmp_path, "digits-mlp", policy, "mixed_float16", widened=["head"])
    assert "/head/Gemm" in listed
    assert any("mixes fp16 and bf16" in note and "(head)" in note for note in notes)
    assert any("hf32" in note for note in notes)


def test_cann_soc_version_default(tmp_path):
    task = load_task("digits-mlp")
    from autoprec.exports import export_cann

    paths = export_cann(
        Policy.uniform("fp16"), tmp_path, task.model(), first_batch(task), soc_version="Ascend910B3"
    )
    assert 'SOC_VERSION="${SOC_VERSION:-Ascend910B3}"' in paths[2].read_text()


@pytest.mark.parametrize(
    ("fmt", "with_model", "needs"),
    [
        ("cann", False, "needs a model"),
        ("cann", True, "needs an example input"),
        ("transformers", False, "needs a model"),
    ],
)
def test_missing_inputs_are_one_line_errors(tmp_path, fmt, with_model, needs):
    model = load_task("digits-mlp").model() if with_model else None
    with pytest.raises(autoprec.AutoprecError, match=needs) as error:
        export_policy(Policy.uniform("fp16"), fmt, tmp_path, model=model)
    assert isinstance(error.value, ExportError) and "\n" not in str(error.value)


def test_unknown_format_and_non_transformers_model(tmp_path):
    with pytest.raises(ExportError, match="unknown"):
        export_policy(Policy.uniform("fp16"), "tflite", tmp_path)
    model = load_task("digits-mlp").model()
    with pytest.raises(ExportError, match="not a transformers PreTrainedModel"):
        export_policy(Policy.uniform("fp16"), "transformers", tmp_path, model=model)


# -- transformers --------------------------------------------------------------------------


def test_keep_entries_select_exactly():
    keys = [
        f"encoder.layer.{i}.{part}.{p}"
        for i in range(12)
        for part in ("attn", "mlp")
        for p in ("weight", "bias")
    ] + ["head.weight"]
    fp32 = ["encoder.layer.1.attn", "encoder.layer.1.mlp", "encoder.layer.3.mlp", "head"]
    wanted = {k for k in keys if k.rpartition(".")[0] in fp32}
    plain = keep_entries(keys, fp32)
    # "layer.1" would select layer.10 and layer.11 too (a regex search): its parts instead
    assert plain == ["layer.1.attn", "layer.1.mlp", "layer.3.mlp", "head"]
    assert selected(keys, plain) == wanted

    # names that contain a kept name: whole components only
    keys += ["encoder.layer.1x.attn.weight", "head_extra.weight", "lm_head.weight"]
    entries = keep_entries(keys, fp32)
    assert entries == ["layer.1.attn", "layer.1.mlp", "layer.3.mlp", r"(?<![^.])head(?=\.)"]
    assert selected(keys, entries) == wanted
    # as transformers 4.54+ (whole components) and 5.x (the installed loader's regex) read them
    anchored = re.compile("|".join(rf"((^|\.){e}($|\.))" for e in entries))
    assert {k for k in keys if anchored.search(k)} == wanted
    loading = pytest.importorskip("transformers.core_model_loading")
    alternation, _, _ = loading.build_glob_alternation(entries)
    assert {k for k in keys if alternation.search(k)} == wanted


@pytest.fixture
def restore_bert_class():
    """The snippet sets a class attribute; put it back after the test."""
    transformers = pytest.importorskip("transformers")
    cls = transformers.BertForSequenceClassification
    attribute = "_keep_in_fp32_modules_strict"
    had_own = attribute in cls.__dict__
    saved = cls.__dict__.get(attribute)
    yield
    if had_own:
        setattr(cls, attribute, saved)
    elif attribute in cls.__dict__:
        delattr(cls, attribute)


@pytest.mark.parametrize(
    ("low", "torch_dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)]
)
@pytest.mark.parametrize("device", ["npu", "cpu"])
def test_transformers_loads_the_policy_dtypes(
    tmp_path, restore_bert_class, low, torch_dtype, device
):
    task = load_task("tiny-bert")
    model = task.model()
    model.save_pretrained(tmp_path / "checkpoint")
    policy = Policy(
        rules=(Rule("fp32", patterns=("bert.encoder.layer.1.attention", "classifier")),),
        default=low,
    )
    paths, notes = export_quietly(
        policy, "transformers", tmp_path / "out", model=model, device=device
    )
    assert notes == []
    snippet = paths[1].read_text().replace("path/to/checkpoint", str(tmp_path / "checkpoint"))
    namespace: dict = {}
    exec(compile(snippet, str(paths[1]), "exec"), namespace)  # as the snippet says
    loaded = namespace["model"]

    dtypes = policy.resolve(model, device)
    for name, parameter in loaded.named_parameters():
        layer = name.rpartition(".")[0]
        expected = torch.float32 if dtypes[layer] == "fp32" else torch_dtype
        assert parameter.dtype == expected, name
    # LayerNorm runs in fp32 under autocast on the NPU, in the policy's dtype on the CPU
    norm = loaded.bert.encoder.layer[0].output.LayerNorm.weight
    assert norm.dtype == (torch.float32 if device == "npu" else torch_dtype)
    assert loaded.bert.encoder.layer[0].attention.self.query.weight.dtype == torch_dtype
    assert loaded.bert.encoder.layer[1].attention.self.query.weight.dtype == torch.float32

    prec = policy.apply(loaded, device="cpu")  # the loaded model runs under the policy
    batch = first_batch(task)
    with torch.no_grad(), prec.autocast():
        assert torch.isfinite(loaded(**batch.kwargs).loss)


def test_transformers_mixed_low_dtypes_says_so(tmp_path):
    pytest.importorskip("transformers")
    model = load_task("tiny-bert").model()
    policy = Policy(rules=(Rule("bf16", patterns=("bert.pooler",)),), default="fp16")
    paths, notes = export_quietly(policy, "transformers", tmp_path, model=model)
    (note,) = notes
    assert "mixes fp16 and bf16" in note and "bert.pooler.dense" in note
    assert note in header_text(paths[1].read_text())
    assert "pooler" in json.loads(paths[0].read_text())["_keep_in_fp32_modules_strict"]
