"""A data set prepared before the `sft_runtime` namespace is refused naming the file."""

from __future__ import annotations

import pytest

from sft_runtime.runtime.data.integrity import DataSetError, check_sample_type
from sft_runtime.runtime.data.prepare import DATASET_YAML


def _data_set(root, text: str):
    (root / ".nv-meta").mkdir()
    (root / ".nv-meta" / "dataset.yaml").write_text(text)
    return root


def test_the_sample_type_written_today_is_accepted_and_importable(tmp_path):
    import importlib

    import yaml

    check_sample_type(_data_set(tmp_path, DATASET_YAML))
    spec = yaml.safe_load(DATASET_YAML)["sample_type"]
    module = importlib.import_module(spec["__module__"])
    assert hasattr(module, spec["__class__"])


def test_the_pre_namespace_module_is_refused_naming_file_and_fix(tmp_path):
    old = DATASET_YAML.replace("sft_runtime.runtime.data.sample", "runtime.data.sample")
    with pytest.raises(DataSetError, match=r"dataset.yaml: sample_type.__module__ is") as err:
        check_sample_type(_data_set(tmp_path, old))
    assert "'sft_runtime.runtime.data.sample'" in str(err.value)
