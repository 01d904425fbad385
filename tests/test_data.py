"""sao.data: the user's task files in every format, checked in full before anything starts."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sao.data import DataError, load_demonstrations, load_tasks, split_heldout
from sao.envs.base import Split, Task

ROWS = [
    {"prompt": "What is 2 + 2?", "answer": 4, "info": {"level": 1}},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3 * 3?"}],
     "answer": "9", "task_id": "nine"},
    {"prompt": "Name a colour.", "extra": "ignored"},
]


def write_jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def check(tasks):
    first, second, third = tasks
    assert first == Task(first.task_id, "dataset", "What is 2 + 2?", "4", "train", info='{"level": 1}')
    assert first.task_id.startswith("t") and len(first.task_id) == 17
    assert second.task_id == "nine" and second.prompt == "3 * 3?" and json.loads(second.messages)[0]["role"] == "system"
    assert third.answer == "" and third.info == "" and third.messages == ""


def test_jsonl(tmp_path):
    check(load_tasks(write_jsonl(tmp_path / "t.jsonl", ROWS)))


def test_the_task_id_of_a_row_is_a_stable_hash(tmp_path):
    one = load_tasks(write_jsonl(tmp_path / "a.jsonl", ROWS))[0].task_id
    two = load_tasks(write_jsonl(tmp_path / "b.jsonl", [ROWS[0]]))[0].task_id
    assert one == two


def test_parquet(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "What is 2 + 2?", "answer": "4", "task_id": "four"},
                                         {"prompt": "Name a colour.", "answer": None, "task_id": "colour"}]), path)
    tasks = load_tasks(path)
    assert [(t.task_id, t.prompt, t.answer) for t in tasks] == [("four", "What is 2 + 2?", "4"),
                                                                ("colour", "Name a colour.", "")]


def test_a_saved_datasets_directory(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"prompt": "What is 2 + 2?", "answer": "4"},
                                {"prompt": "Name a colour.", "answer": ""}]).save_to_disk(str(tmp_path / "ds"))
    assert [t.answer for t in load_tasks(tmp_path / "ds")] == ["4", ""]


def test_a_delta_table(tmp_path):
    from deltalake import write_deltalake

    write_deltalake(str(tmp_path / "delta"), pa.Table.from_pylist([{"prompt": "What is 2 + 2?", "answer": "4"}]))
    assert load_tasks(tmp_path / "delta")[0].prompt == "What is 2 + 2?"


def test_every_bad_row_is_reported_with_file_row_and_field(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        ROWS[0],
        {"answer": "1"},                                               # 2: no prompt
        "{not json",                                                   # 3
        {"prompt": "ok", "info": [1, 2]},                              # 4: info not an object
        {"prompt": [{"role": "robot", "content": "hi"}]},              # 5: unknown role
        {"prompt": "ok", "answer": {"a": 1}},                          # 6: answer not text
        ROWS[0],                                                       # 7: same row again: same hashed id
        {"prompt": "", "task_id": 3},                                  # 8: two problems
        '{"prompt": "ok", "answer": NaN}',                             # 9: Python's json reads NaN
    ])
    with pytest.raises(DataError) as error:
        load_tasks(path)
    text = str(error.value)
    assert text.startswith("9 problem(s) in the task data:")
    for expected in (f"{path}: row 2: field 'prompt': missing", f"{path}: row 3: not JSON",
                     f"{path}: row 4: field 'info': must be an object, got list",
                     f"{path}: row 5: field 'prompt[0].role': must be one of",
                     f"{path}: row 6: field 'answer': must be a string or a number, got dict",
                     f"{path}: row 7: field 'task_id':", "repeats row 1",
                     f"{path}: row 8: field 'prompt': must be a non-empty string",
                     f"{path}: row 8: field 'task_id': must be a non-empty string, got 3",
                     f"{path}: row 9: field 'answer': must be a finite number, got nan"):
        assert expected in text, expected


@pytest.mark.parametrize(("name", "message"), [
    ("missing.jsonl", "no such task file"), ("t.csv", "unknown task file type '.csv'"),
])
def test_unusable_paths_are_refused(tmp_path, name, message):
    if name.endswith(".csv"):
        (tmp_path / name).write_text("prompt\nx\n")
    with pytest.raises(DataError, match=message):
        load_tasks(tmp_path / name)


def test_an_empty_file_is_refused(tmp_path):
    with pytest.raises(DataError, match="no tasks"):
        load_tasks(write_jsonl(tmp_path / "e.jsonl", []))


def test_the_held_out_fraction_is_seeded_and_never_everything(tmp_path):
    tasks = load_tasks(write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"q{i}"} for i in range(20)]))
    split = split_heldout(tasks, 0.1, seed=3)
    held = [t.task_id for t in split if t.split is Split.HELDOUT]
    assert len(held) == 2 and held == [t.task_id for t in split_heldout(tasks, 0.1, seed=3) if t.split is Split.HELDOUT]
    assert held != [t.task_id for t in split_heldout(tasks, 0.1, seed=4) if t.split is Split.HELDOUT]
    assert sum(t.split is Split.HELDOUT for t in split_heldout(tasks[:2], 0.9, seed=0)) == 1
    with pytest.raises(DataError, match="too few"):
        split_heldout(tasks[:1], 0.5, seed=0)


def test_demonstrations_pair_a_task_with_its_completion_and_every_bad_row_is_named(tmp_path):
    good = write_jsonl(tmp_path / "demos.jsonl", [{"prompt": "2 + 2?", "completion": "4"},
                                                  {"prompt": "2 + 2?", "completion": "four"}])  # a prompt may repeat
    (first, four), (second, word) = load_demonstrations(good)
    assert first.task_id == second.task_id and first.prompt == "2 + 2?" and (four, word) == ("4", "four")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1?", "completion": "1"}, {"prompt": "2?"},
                                               {"prompt": "", "completion": 3}, "not json"])
    with pytest.raises(DataError) as error:
        load_demonstrations(bad)
    message = str(error.value)
    assert message.startswith("4 problem(s) in the demonstrations")
    assert f"{bad}: row 2: field 'completion': must be a non-empty string (the assistant's reply), got None" in message
    assert f"{bad}: row 3: field 'prompt'" in message and f"{bad}: row 3: field 'completion'" in message
    assert f"{bad}: row 4: not JSON" in message
