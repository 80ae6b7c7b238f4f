"""Exports: a found policy in the formats other tools read (autoprec.exports).

torch_npu and ATC are not installed here (no Ascend chip): the torch-npu and cann outputs are
checked against the documented formats (shared/NPU.md).
"""

from __future__ import annotations

import re
import warnings

import autoprec
from autoprec import LossScale, Policy, Rule, load_policy
from autoprec.exports import ExportWarning, export_policy


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
    model = autoprec.load_task("digits-mlp").model()  # its LayerNorms run in fp32 on the NPU
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
    model = autoprec.load_task("digits-mlp").model()
    _, mode = settings(export_policy(policy, "torch-npu", tmp_path / "model", model))
    assert mode == "allow_fp32_to_fp16"
    _, mode = settings(export_policy(policy, "torch-npu", tmp_path / "rules"))
    assert mode == "must_keep_origin_dtype"


def test_torch_npu_mixed_keeps_origin_dtype(tmp_path):
    policy = Policy(rules=(Rule("fp32", patterns=("head",)),), default="fp16", hf32=True)
    model = autoprec.load_task("digits-mlp").model()
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
    model = autoprec.load_task("digits-cnn").model()
    paths, notes = export_quietly(Policy.uniform("bf16"), "torch-npu", tmp_path, model=model)
    text, mode = settings(paths)
    assert mode == "must_keep_origin_dtype"
    (note,) = notes
    assert "no bf16 mode" in note
    assert note in header_text(text)
