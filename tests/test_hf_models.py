"""Hugging Face model families (conf/model/hf_*.yaml), built from configs with nothing downloaded,
each trained for one tiny trial on CPU with its HF-format synthetic batches; and without the
`[hf]` extra, the one-line message."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from gpuopt.core.errors import ConfigError
from gpuopt.core.result import Status
from gpuopt.engines.registry import run_trial
from gpuopt.trial.prepare import load_spec
from gpuopt.workload.data import SyntheticDataset
from tests.conftest import TINY_TRIAL

pytest.importorskip("transformers")

# Each family at test size: the shipped config with its dimensions shrunk by overrides.
TINY_HF = {
    "hf_gpt2_tiny": [],
    "hf_llama": ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1",
                 "model.num_attention_heads=4", "model.num_key_value_heads=2",
                 "model.num_classes=128", "model.input_shape=[16]"],
    "hf_bert": ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1",
                "model.num_attention_heads=2", "model.num_classes=128", "model.input_shape=[16]"],
    "hf_vit": ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1",
               "model.num_attention_heads=2", "model.input_shape=[3,16,16]", "model.patch_size=8",
               "model.num_classes=10"],
    "hf_resnet": ["model.embedding_size=8", "model.hidden_sizes=[8,16]", "model.depths=[1,1]",
                  "model.layer_type=basic", "model.input_shape=[3,32,32]", "model.num_classes=10"],
}  # fmt: skip
FAST = ["measure.ceiling_steps=1", "loader.batch_size=4", "data.size=16", "data.sample_cost=0"]


@pytest.mark.parametrize("family", sorted(TINY_HF))
def test_each_hf_family_runs_one_trial(compose_cfg, family):
    built = {}
    cfg = compose_cfg(*TINY_TRIAL, *FAST, f"model={family}", *TINY_HF[family])
    result = run_trial(load_spec(cfg), device=torch.device("cpu"), inspect=built.__setitem__)
    m = result.metrics
    assert result.status is Status.OK, result.reason
    assert type(built["model"]).__module__.startswith("transformers.models.")
    assert m.throughput == pytest.approx(m.timed_steps * 4 / m.timed_seconds)
    assert m.flops_per_sample > 0 and m.ceiling_throughput > 0


def test_hf_batches_follow_the_hugging_face_format():
    lm = SyntheticDataset("hf_masked_lm", [64], num_classes=50, sample_cost=0)[3]
    assert set(lm) == {"input_ids", "attention_mask", "labels"}
    masked = lm["labels"] != -100
    assert masked.any() and (lm["input_ids"][masked] == 49).all()  # the [MASK] id: the last
    causal = SyntheticDataset("hf_causal_lm", [16], num_classes=50, sample_cost=0)[0]
    steps = (causal["input_ids"][1:] - causal["input_ids"][:-1]) % 50
    assert torch.equal(causal["labels"], causal["input_ids"]) and len(set(steps.tolist())) == 1
    image = SyntheticDataset("hf_images", [3, 8, 8], num_classes=5, sample_cost=0)[1]
    assert image["pixel_values"].shape == (3, 8, 8) and image["labels"].dtype == torch.int64


def test_the_124m_gpt2_config_is_the_real_size(compose_cfg):
    cfg = compose_cfg("model=hf_gpt2")
    spec = load_spec(cfg)
    assert spec.model["n_layer"] == 12 and spec.model["n_embd"] == 768
    assert spec.model["vocab_size"] == 50257 and spec.model["n_positions"] == 1024


def test_without_the_extra_validation_says_how_to_install_it(compose_cfg, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # find_spec -> None: "not installed"
    with pytest.raises(ConfigError, match=r'pip install "gpuopt\[hf\]"'):
        load_spec(compose_cfg("model=hf_gpt2_tiny"))


def test_without_the_extra_gpuopt_run_exits_2_with_one_line(tmp_path):
    code = (
        "import sys; sys.modules['transformers'] = None; from gpuopt.run import main; "
        "sys.argv = ['gpuopt.run', 'model=hf_gpt2_tiny']; main()"
    )
    env = {"GPUOPT_OUTPUT_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and 'pip install "gpuopt[hf]"' in lines[0]
    assert not any(tmp_path.iterdir())  # nothing created
