"""The search space found for you (gpuopt.core.search_space): what the job's training ran with,
traced back to the config keys it came from, and the sweep proposed over them."""

from __future__ import annotations

import pytest
import yaml

from gpuopt.core.search_space import (
    SEARCH_SPACE_FILE,
    batch_keys_among,
    propose,
    trace,
    write_proposal,
)

# lightning-hydra-template's composed config, in part (its data and trainer groups).
TEMPLATE = {
    "data": {"batch_size": 128, "num_workers": 0, "pin_memory": False, "data_dir": "data/"},
    "model": {"net": {"lin1_size": 64, "output_size": 10}, "compile": False},
    "trainer": {"max_epochs": 10, "precision": 32, "accumulate_grad_batches": 1},
    "hydra": {"job": {"num": 0}},
    "seed": 128,  # the batch size's value under another name: never traced
}
OBSERVED = {"batch_size": 128, "num_workers": 0, "pin_memory": False, "persistent_workers": False,
            "prefetch_factor": None, "precision": "32-true", "accumulate_grad_batches": 1}  # fmt: skip


def test_each_setting_is_traced_to_the_key_named_for_it_with_its_value():
    assert trace(TEMPLATE, OBSERVED) == {
        "batch_size": "data.batch_size",
        "num_workers": "data.num_workers",
        "pin_memory": "data.pin_memory",
        "precision": "trainer.precision",  # 32 in the config is Lightning's "32-true"
        "accumulate_grad_batches": "trainer.accumulate_grad_batches",
    }
    # A value the run did not use is not traced to the key that holds another one.
    assert "batch_size" not in trace(TEMPLATE, {**OBSERVED, "batch_size": 64})


def test_the_proposal_searches_the_traced_keys_and_names_the_batch_keys():
    params, batch_keys = propose(trace(TEMPLATE, OBSERVED), OBSERVED, device="cpu", cpus=2)
    assert params == {
        "data.batch_size": "choice(64, 128, 256, 512)",
        "data.num_workers": "choice(0, 1, 2)",
        "trainer.precision": "choice(32-true, bf16-mixed)",
        "trainer.accumulate_grad_batches": "choice(1, 2, 4)",
    }  # pin_memory only where there is a device to pin for
    assert batch_keys == ["data.batch_size", "trainer.accumulate_grad_batches"]
    on_gpu, _ = propose(trace(TEMPLATE, OBSERVED), OBSERVED, device="cuda", cpus=8)
    assert on_gpu["data.pin_memory"] == "choice(true, false)"
    assert on_gpu["trainer.precision"] == "choice(32-true, bf16-mixed, 16-mixed)"


def test_the_proposal_is_written_beside_the_result_from_the_run_dirs_config(tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(TEMPLATE))
    text = write_proposal(tmp_path, OBSERVED, "cpu")
    assert text == (tmp_path / SEARCH_SPACE_FILE).read_text()
    sweeper = yaml.safe_load(text)["hydra"]["sweeper"]
    assert sweeper["batch_keys"] == ["data.batch_size", "trainer.accumulate_grad_batches"]
    assert sweeper["params"]["data.num_workers"].startswith("choice(0, 1")
    assert write_proposal(tmp_path / "elsewhere", OBSERVED, "cpu") is None  # no composed config


@pytest.mark.parametrize(
    ("searched", "found"),
    [
        (["data.batch_size", "data.num_workers"], ["data.batch_size"]),
        (["batch_size", "trainer.accumulate_grad_batches"],
         ["batch_size", "trainer.accumulate_grad_batches"]),
        (["args.per_device_train_batch_size", "args.gradient_accumulation_steps"],
         ["args.per_device_train_batch_size", "args.gradient_accumulation_steps"]),
        (["data.num_workers"], []),
        (["train.batch_size", "eval.batch_size"], []),  # two: which is the training's is unknown
    ],
)  # fmt: skip
def test_a_sweep_without_batch_keys_takes_the_searched_ones_named_so(searched, found):
    assert batch_keys_among(searched) == found
