"""The code of one's own a run imports, recorded with each start in the ``runs`` table (sao/user_code.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys

import pyarrow as pa
import pytest

from sao import runs, user_code
from sao.config import RunConfig
from sao.lake.store import TABLES, Lake
from schemas import runs as runs_table

REWARD = "import helper_scores\n\ndef correct(completion, answer, **kwargs):\n    return helper_scores.same(completion, answer)\n"
HELPER = "def same(a, b):\n    return float(a.strip() == b.strip())\n"


@pytest.fixture
def own_code(tmp_path):
    """A reward module of one's own in its folder, importing a helper beside it; unloaded afterwards."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "my_scores.py").write_text(REWARD)
    (folder / "helper_scores.py").write_text(HELPER)
    (folder / "unused.py").write_text("X = 1\n")  # beside them, never imported: not the run's code
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    for name in ("my_scores", "helper_scores", "unused"):
        sys.modules.pop(name, None)


def _config(tmp_path, **values) -> RunConfig:
    return RunConfig(run_id="own", workdir=str(tmp_path / "runs"), lake={"root": str(tmp_path / "lake")},
                     data={"train": str(tmp_path / "tasks.jsonl")},
                     reward={"functions": ["sao.rewards:exact_match", "my_scores:correct"]}).with_values(values)


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_named_modules_and_the_helpers_they_import_are_fingerprinted(tmp_path, own_code):
    import my_scores  # noqa: F401 - as the run's start imports it (sao.runs.prepare_inputs)

    record = user_code.fingerprint(_config(tmp_path, **{"env.tools": ["my_scores:correct"]}))
    reward, helper = own_code / "my_scores.py", own_code / "helper_scores.py"
    assert record == {  # the project's own sao.rewards is versioned by sao_version instead
        "helper_scores": {"file": str(helper.resolve()), "sha256": _sha(helper), "key": "imported"},
        "my_scores": {"file": str(reward.resolve()), "sha256": _sha(reward), "key": "reward.functions"},
    }
    assert _sha(reward) == hashlib.sha256(REWARD.encode()).hexdigest()


def test_a_module_not_imported_yet_is_found_not_imported(tmp_path, own_code):
    record = user_code.fingerprint(_config(tmp_path))
    assert set(record) == {"my_scores"} and "my_scores" not in sys.modules


def test_the_built_in_task_and_built_in_rewards_record_no_code(tmp_path):
    assert user_code.fingerprint(RunConfig(run_id="b", workdir=str(tmp_path))) is None
    built_in = RunConfig(run_id="b", workdir=str(tmp_path), data={"train": "tasks.jsonl"})
    assert user_code.named_modules(built_in) == {} and user_code.fingerprint(built_in) is None
    verifiers = RunConfig(run_id="v", workdir=str(tmp_path), env={"verifiers": {"id": "my-env"}})
    assert user_code.named_modules(verifiers) == {"my_env": "env.verifiers"}


def test_changes_name_each_module_changed_new_or_gone():
    before = {"a": {"file": "/x/a.py", "sha256": "1" * 64, "key": "reward.functions"},
              "b": {"file": "/x/b.py", "sha256": "2" * 64, "key": "imported"}}
    after = {"a": {"file": "/x/a.py", "sha256": "3" * 64, "key": "reward.functions"},
             "c": {"file": "/x/c.py", "sha256": "4" * 64, "key": "imported"}}
    assert user_code.changes(json.dumps(before), after) == [
        "a (/x/a.py): changed, sha256 111111111111 -> 333333333333",
        "b (/x/b.py): no longer imported",
        "c (/x/c.py): new",
    ]
    assert user_code.changes(json.dumps(before), before) == []
    assert user_code.changes(None, after) == []  # a row from before the code column: nothing to compare


def test_a_resume_with_edited_code_says_so_and_each_row_keeps_its_code(tmp_path, own_code):
    import my_scores  # noqa: F401

    config = _config(tmp_path)
    said = []
    assert runs.record_start(config, warn=said.append) == "start"
    (own_code / "helper_scores.py").write_text(HELPER.replace("strip()", "strip().lower()"))
    config.checkpoint_root.mkdir(parents=True)  # the run has begun
    assert runs.record_start(config, warn=said.append) == "resume"
    assert len(said) == 1
    assert "run own: code of one's own changed since the run's previous start" in said[0]
    assert f"helper_scores ({(own_code / 'helper_scores.py').resolve()}): changed, sha256" in said[0]
    assert "my_scores" not in said[0]
    rows = sorted(Lake.open(config.lake_config()).read("runs").to_pylist(), key=lambda row: row["started_at"])
    first, second = (json.loads(row["code"]) for row in rows)
    assert first["my_scores"] == second["my_scores"]
    assert first["helper_scores"]["sha256"] != second["helper_scores"]["sha256"]
    assert runs.record_start(config, warn=said.append) == "resume" and len(said) == 1  # unchanged: silent


def test_a_run_recorded_before_the_code_column_resumes_and_is_migrated(tmp_path, own_code, monkeypatch):
    import my_scores  # noqa: F401

    config = _config(tmp_path)
    old_schema = pa.schema(list(runs_table.SCHEMA)[:-1])
    monkeypatch.setitem(TABLES, "runs", dataclasses.replace(runs_table.SPEC, schema=old_schema, schema_version=1))
    old = Lake.open(config.lake_config())
    from sao.lake.commit import append_blind
    from sao.lake.records import utc_now

    append_blind(old, "runs", pa.Table.from_pylist([{
        "run_id": "own", "event": "start", "started_at": utc_now(), "config": json.dumps(config.public()),
        "settings": [], "sources": "{}", "changed": None, "notes": None, "parent_run_id": None,
        "parent_steps": None, "sao_version": "0", "schema_version": 1}], schema=old_schema))
    monkeypatch.undo()
    said = []
    config.checkpoint_root.mkdir(parents=True)
    assert runs.record_start(config, warn=said.append) == "resume" and said == []
    rows = Lake.open(config.lake_config()).read("runs", columns=["schema_version", "code"]).to_pylist()
    assert sorted(rows, key=lambda row: row["schema_version"])[0] == {"schema_version": 1, "code": None}
    assert "my_scores" in json.loads(max(rows, key=lambda row: row["schema_version"])["code"])


def test_changed_since_rehashes_the_recorded_files(tmp_path):
    kept, gone = tmp_path / "kept.py", tmp_path / "gone.py"
    kept.write_text("A = 1\n")
    record = {"kept": {"file": str(kept), "sha256": _sha(kept), "key": "reward.functions"},
              "gone": {"file": str(gone), "sha256": "0" * 64, "key": "imported"}}
    assert user_code.changed_since(json.dumps(record)) == [f"gone ({gone}): no longer found"]
    kept.write_text("A = 2\n")
    assert user_code.changed_since(record)[1].startswith(f"kept ({kept}): changed, sha256 {record['kept']['sha256'][:12]}")
    assert user_code.changed_since(None) == []


def test_a_module_in_a_package_is_found_without_importing_the_package(tmp_path, monkeypatch):
    package = tmp_path / "own_graders"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")  # must not run
    (package / "scores.py").write_text("def f(**kwargs):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    config = _config(tmp_path, **{"reward.functions": ["own_graders.scores:f", "missing_graders:f"]})
    record = user_code.fingerprint(config)
    assert record == {"own_graders.scores": {"file": str((package / "scores.py").resolve()),
                                             "sha256": _sha(package / "scores.py"), "key": "reward.functions"}}
    assert "own_graders" not in sys.modules
    assert user_code.fingerprint(_config(tmp_path, **{"reward.functions": ["missing_graders:f"]})) is None
