"""agent.dataset: local jsonl and parquet through the datasets library, the train/eval split, the
prompt template, and one clear error naming the field for a bad path, template or answer field."""

from __future__ import annotations

import json

import pytest

from areal_bus.tasks.dataset import DatasetError, DatasetSplits, template_fields
from areal_bus.tasks.driver import EVAL_SEED_BASE
from areal_bus.config.topology import DatasetConfig, TopologyError, parse_topology


def _jsonl(path, n, start=0):
    path.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": i + 1}) + "\n"
                            for i in range(start, start + n)))
    return path


def test_jsonl_with_an_eval_fraction_splits_disjointly_and_the_seed_fixes_the_split(tmp_path):
    _jsonl(tmp_path / "p.jsonl", 50)
    cfg = DatasetConfig(path="p.jsonl", eval_fraction=0.2, shuffle_seed=7)
    a, b = DatasetSplits(cfg, tmp_path), DatasetSplits(cfg, tmp_path)
    assert (a.train_size, a.eval_size) == (40, 10)
    train_q = {a.row(i)["question"] for i in range(a.train_size)}
    eval_q = {a.row(EVAL_SEED_BASE + i)["question"] for i in range(a.eval_size)}
    assert not train_q & eval_q and len(train_q | eval_q) == 50
    assert [a.row(i) for i in range(40)] == [b.row(i) for i in range(40)]  # same seed, same order
    other = DatasetSplits(DatasetConfig(path="p.jsonl", eval_fraction=0.2, shuffle_seed=8), tmp_path)
    assert [other.row(i) for i in range(40)] != [a.row(i) for i in range(40)]


def test_parquet_and_a_second_eval_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"problem": ["2+2", "3+3", "4+4"], "solution": [4, 6, 8]}), tmp_path / "t.parquet")
    _jsonl(tmp_path / "e.jsonl", 2)
    with pytest.raises(DatasetError, match="agent.dataset.prompt_template: field 'problem' is not a column of .*e.jsonl"):
        DatasetSplits(DatasetConfig(path="t.parquet", eval_path="e.jsonl", prompt_template="Solve {problem}",
                                    answer_field="solution"), tmp_path)
    pq.write_table(pa.table({"problem": ["9+9"], "solution": [18]}), tmp_path / "e.parquet")
    d = DatasetSplits(DatasetConfig(path="t.parquet", eval_path="e.parquet", prompt_template="Solve {problem}",
                                    answer_field="solution"), tmp_path)
    assert (d.train_size, d.eval_size) == (3, 1)
    row = d.row(EVAL_SEED_BASE)
    assert d.prompt(row) == "Solve 9+9" and d.answer(row) == 18


def test_a_missing_file_names_the_field_and_the_path(tmp_path):
    with pytest.raises(DatasetError, match=r"agent.dataset.path: no such file .*nope.jsonl"):
        DatasetSplits(DatasetConfig(path="nope.jsonl"), tmp_path)
    _jsonl(tmp_path / "p.jsonl", 4)
    with pytest.raises(DatasetError, match=r"agent.dataset.eval_path: no such file"):
        DatasetSplits(DatasetConfig(path="p.jsonl", eval_path="gone.jsonl"), tmp_path)
    (tmp_path / "p.csv").write_text("question,answer\n")
    with pytest.raises(DatasetError, match="agent.dataset.path: .*neither jsonl nor parquet"):
        DatasetSplits(DatasetConfig(path="p.csv"), tmp_path)


def test_a_malformed_file_names_the_field(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"question": "a", "answer": 1}\n{not json\n')
    with pytest.raises(DatasetError, match="agent.dataset.path: cannot read .*bad.jsonl as json"):
        DatasetSplits(DatasetConfig(path="bad.jsonl"), tmp_path)


def test_a_missing_answer_field_names_the_field_and_the_columns(tmp_path):
    _jsonl(tmp_path / "p.jsonl", 10)
    with pytest.raises(DatasetError, match=r"agent.dataset.answer_field: 'label' is not a column .*\(columns: answer, question\)"):
        DatasetSplits(DatasetConfig(path="p.jsonl", answer_field="label"), tmp_path)
    # a task plug-in that reads no answer may leave it out
    assert DatasetSplits(DatasetConfig(path="p.jsonl", answer_field="label"), tmp_path, answer_required=False)


def test_template_fields_and_bad_templates():
    assert template_fields("{question} in {unit}, {{literal}}") == ["question", "unit"]
    for bad in ("{question", "{}", "{0}"):
        with pytest.raises(DatasetError, match="agent.dataset.prompt_template"):
            template_fields(bad)


def test_math_without_a_dataset_is_a_validation_error_naming_the_field():
    with pytest.raises(TopologyError, match="agent.dataset"):
        parse_topology({"agent": {"framework": "math"}, "rollout_engine": {"kind": "torch"},
                        "trainer_engine": {"kind": "torch"}})
    with pytest.raises(TopologyError, match=r"agent.dataset.eval_fraction"):
        parse_topology({"agent": {"framework": "math", "dataset": {"path": "p.jsonl", "eval_fraction": 1.5}},
                        "rollout_engine": {"kind": "torch"}, "trainer_engine": {"kind": "torch"}})
