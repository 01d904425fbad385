"""The stages of a training run, as plain functions: the Prefect flows and the CLI call these.

    warm_start      SFT on math_tool demonstrations -> the run's version-0 policy (skipped if present)
    pretrain_value  version-0 rollouts into the lake, then the version-0 critic fitted on them
    train_async     the asynchronous pipeline (:func:`sao.pipeline.run_pipeline`) for the run's steps
    evaluate        sampled accuracy (temperature 1; an agent's: as its rollouts sample) of a version on held-out tasks
    summarize       plots from the lake and a short text summary

Every stage is idempotent for a run id: re-running a run resumes it, from wherever it stopped (a
Ctrl-C, a crash, a kill). The warm start and each evaluation write their result atomically (a stage
stopped half-way leaves nothing that a resume would mistake for its result); value pretraining and
training resume from what the lake and the checkpoints hold. A run that reached its steps records its
result (:func:`record_finished`); running it again with no more steps prints that result
(:func:`finished`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from sao import interrupt
from sao.config import (
    RESUME_SAFE,
    ConfigError,
    RunConfig,
    changed_keys,
    leaves,
    setting_keys,
    under_free_mapping,
    without_unread,
)
from sao.envs.base import Split, Task
from sao.envs.math_tool import MathToolConfig, ensure_dataset, generate_tasks
from sao.lake.config import LakeConfig
from sao.lake.ledger import newest_policy_version, registered_checkpoint
from sao.lake.store import Lake, LakeNotFoundError, is_valid_run_id
from sao.pipeline import PipelineConfig, PipelineResult, run_pipeline
from sao.runtime import init_ray
from sao.train import checkpoint as checkpoints
from sao.train.config import TrainConfig
from sao.train.loop import StepReport, prepare_run
from sao.train.pretrain import PretrainReport
from sao.train.run_config import ReplayContext, read_run_config, run_config_path

__all__ = ["Evaluation", "check_resume", "env_options", "evaluate", "failure_counts", "finished", "math_tasks", "own_format_tools", "pipeline_config", "played_by_agent",
           "import_paths", "model_notes", "policy_dir", "prepare_inputs", "record_what_if", "what_if", "pretrain_value", "record_start", "run_tasks", "user_tasks",
           "record_finished", "recorded_settings", "summarize", "train_async", "value_data_run", "warm_start"]

RESULT_FILE = "result.json"
"""Under the run's folder: the result of a run that reached its steps (:func:`record_finished`)."""

log = logging.getLogger(__name__)


def math_tasks(split: Split | str, path: str | Path | None = None) -> list[Task]:
    """The math_tool tasks of one split (default config, the one the SFT warm start used); with
    ``path``, from that task file, which is written first if missing (and checked if present)."""
    tasks = generate_tasks(MathToolConfig()) if path is None else ensure_dataset(MathToolConfig(), path)
    return [t for t in tasks if t.split is Split(split)]


def tasks_path(config: RunConfig) -> Path:
    """The run's task file (JSON Lines of :class:`~sao.envs.base.Task`, both splits): what the rollouts
    draw from and trajectory replay re-scores. The user's tasks (``data.train``) are copied there when
    the run starts, so a changed source file cannot change a run under way."""
    return config.run_dir / ("tasks.jsonl" if config.own_tasks else "math_tool.jsonl")


def user_tasks(config: RunConfig) -> list[Task]:
    """The tasks of ``data.train`` (train split) and ``data.eval`` or a seeded held-out fraction of
    ``data.train`` (held-out split), every row checked (:mod:`sao.data`)."""
    from sao.data import load_tasks, split_heldout

    if config.env.verifiers is not None:
        from sao.envs import verifiers_env

        return verifiers_env.tasks(_verifiers_spec(config), eval_fraction=config.data.eval_fraction, seed=config.seed)
    train = load_tasks(config.data.train, Split.TRAIN)
    if config.data.eval is None:
        return split_heldout(train, config.data.eval_fraction, config.seed)
    heldout = load_tasks(config.data.eval, Split.HELDOUT)
    clash = {t.task_id for t in train} & {t.task_id for t in heldout}
    if clash:
        from sao.data import DataError

        raise DataError(f"{len(clash)} task id(s) are in both data.train and data.eval, e.g. {sorted(clash)[:3]}")
    return train + heldout


def env_options(config: RunConfig, reward_paths: tuple[str, ...] = ()) -> dict[str, dict]:
    """Options of the run's environment (``make_env(name, **options)``); {} for math_tool."""
    if not config.own_tasks:
        return {}
    agent = config.env.agent
    if config.env.verifiers is not None:
        from sao.envs.verifiers_env import AGENT as agent
    return {"dataset": {"rewards": list(config.reward.functions), "weights": config.reward.weights,
                        "paths": list(reward_paths), "max_tool_calls": config.env.max_tool_calls,
                        "tools": list(config.env.tools),
                        "system_prompt": config.env.system_prompt, "agent": agent}}


def _verifiers_spec(config: RunConfig) -> dict:
    """``env.verifiers`` with the folder its module is imported from (replicas import the same file)."""
    from sao.envs.verifiers_env import module_folder

    spec = config.env.verifiers.model_dump(mode="json")
    folder = module_folder(spec["id"])
    spec["paths"] = [] if folder is None else [folder]
    return spec


def prepare_inputs(config: RunConfig) -> tuple[str, ...]:
    """Check the run's inputs before anything starts and write its task file: the user's model, tasks
    (every row), reward and tool functions (imported). Returns the folders the reward and tool modules
    came from (what the rollout replicas add to their import path). Nothing to do for the built-in math_tool task.

    Raises:
        sao.data.DataError: a bad row (file, row, field), a missing file, or the task file of a resumed
            run holding other tasks than the data now gives.
        sao.rewards.RewardImportError: a reward function that cannot be imported (the paths tried).
        sao.models.policy.ModelDirectoryError: a ``model.path`` that is not a usable model directory.
        sao.rollout.vllm_engine.VLLMEnvironmentError: ``rollout.engine: vllm`` with no usable vLLM environment.
    """
    from sao.data import DataError
    from sao.envs.base import ensure_tasks

    replica_python(config)  # rollout.engine vllm: the environment exists and matches, or refused now
    if config.model.path is not None:
        from sao.models.policy import check_model_directory

        check_model_directory(config.model.path, need_tools=runs_tool_loop(config), own_format=config.own_tasks,
                              template_variables=config.model.chat_template_kwargs)
    if config.sft.data is not None:
        from sao.data import load_demonstrations

        load_demonstrations(config.sft.data)  # every row checked now, not after the model is loaded
    if not config.own_tasks:
        return ()
    paths = import_paths(config)
    tasks = user_tasks(config)
    _check_answers(config, tasks)
    try:
        ensure_tasks(tasks_path(config), tasks)
    except ValueError:
        source = "env.verifiers" if config.env.verifiers is not None else "data.train and data.eval"
        raise DataError(f"{tasks_path(config)} holds the tasks run {config.run_id!r} started with, and {source} now "
                        "give other tasks: a run trains on, and its trajectories are replayed against, the tasks it "
                        "started with. Resume with the data it started with, or start a new run id") from None
    return paths


def _check_answers(config: RunConfig, tasks: list[Task]) -> None:
    """A built-in reward that compares with the task's answer needs every task to have one: a task file
    whose answers sit under another column name would otherwise score every reply the same."""
    from sao.data import DataError
    from sao.rewards import ANSWER_REWARDS

    comparing = sorted(set(config.reward.functions) & ANSWER_REWARDS)
    missing = [task.task_id for task in tasks if not task.answer.strip()]
    if comparing and missing and config.env.verifiers is None and not config.env.agent:  # an agent may score
        raise DataError(f"{len(missing)} of {len(tasks)} tasks have no reference answer (e.g. task "
                        f"{missing[0]!r}), which reward.functions {comparing} compare with: give each row an "
                        "'answer' (the column is named 'answer'; other columns are not read), or score with a "
                        "reward function of your own")


def runs_tool_loop(config: RunConfig) -> bool:
    """Whether the policy must call the built-in loop's Python tool: the built-in math_tool task (with
    this project's tool-call tokens), or tasks of one's own with ``env.max_tool_calls`` > 0 (with those
    tokens, or in the model's own format when its chat template renders calls in a layout the loop reads:
    :func:`sao.models.policy.check_model_directory`). An agent of one's own or a verifiers environment
    calls tools through the chat endpoint and the model's own chat template instead."""
    if played_by_agent(config):
        return False
    return config.data.train is None or config.env.max_tool_calls > 0


def replica_python(config: RunConfig) -> str | None:
    """The Python the rollout replicas run in: None (this one) for the torch engine; for vLLM, the checked
    environment of ``rollout.python`` or the checkout's (:func:`sao.rollout.vllm_engine.vllm_python`, which
    raises ``VLLMEnvironmentError`` naming the command that creates one)."""
    if config.rollout.engine != "vllm":
        return None
    from sao.rollout.vllm_engine import vllm_python

    return vllm_python(config.rollout.python)


def import_paths(config: RunConfig) -> tuple[str, ...]:
    """The folders the run's reward, tool and agent modules are imported from (the rollout replicas add them
    to their import path), each function found and checked; () for the built-in math_tool task. Reads
    no task data (:func:`prepare_inputs` checks that once, at start)."""
    from sao.envs.dataset import tool_prelude
    from sao.rewards import RewardSet, resolve_function

    if not config.own_tasks:
        return ()
    rewards = RewardSet(config.reward.functions, config.reward.weights)
    tool_paths = tuple(folder for _, folder in (resolve_function(spec, what="tool function")
                                                for spec in config.env.tools) if folder is not None)
    tool_prelude(tuple(config.env.tools), tool_paths)  # found, top-level, with source: or refused now
    agent_paths: tuple[str, ...] = ()
    if config.env.agent:
        from sao.rollout.user_agent import resolve_agent

        folder = resolve_agent(config.env.agent)[1]  # importable and async: or refused now
        agent_paths = () if folder is None else (folder,)
    return tuple(dict.fromkeys(rewards.paths + tool_paths + agent_paths))


def run_tasks(config: RunConfig, split: Split | str) -> list[Task]:
    """The tasks of one split of the run: the user's (:func:`prepare_inputs` wrote them) or math_tool's."""
    from sao.envs.base import read_tasks

    if not config.own_tasks:
        return math_tasks(split, tasks_path(config))
    return read_tasks(tasks_path(config), split=split)


def latest_config(lake: Lake, run_id: str) -> dict | None:
    """The config of run ``run_id``'s latest row in ``runs`` (None: the run has none)."""
    rows = lake.read_run("runs", run_id, ["started_at", "config"]).to_pylist()
    if not rows:
        return None
    return json.loads(max(rows, key=lambda row: row["started_at"])["config"])


def recorded_settings(run_id: str, lake_root: str, **values: object) -> RunConfig | None:
    """Run ``run_id``'s latest recorded config in the lake at ``lake_root``, with ``values`` (dotted keys)
    applied: what a later stage of the run (an evaluation from the UI) must use to run on the run's own
    tasks, model and budgets. None when there is no lake there or it holds no config of the run."""
    try:
        lake = Lake.open(lake_root, create=False)
    except LakeNotFoundError:
        return None
    stored = latest_config(lake, run_id)
    if not stored:  # none, or a row written without one (a what-if of a run that had none)
        return None
    try:
        return RunConfig.model_validate(without_unread(stored)).with_values({"run_id": run_id, **values})
    except ValueError as error:  # pydantic's ValidationError and the config's own checks
        raise ConfigError(f"run {run_id!r}: the config the lake at {lake_root} recorded does not load: {error}") from None


def check_resume(config: RunConfig, lake: Lake | None = None) -> dict[str, tuple] | None:
    """What a start of ``config`` changes from the run's latest recorded config (None: the run has no
    recorded config, this is its start).

    Raises:
        ConfigError: a changed key is not among :data:`sao.config.RESUME_SAFE`; the message names
            each with its recorded and its new value. Or the run's checkpoints are registered outside
            its checkpoint root (a moved run folder: :func:`~sao.train.checkpoint.registered_location`).
    """
    if lake is None:
        try:
            lake = Lake.open(config.lake_config(), create=False)  # a check writes nothing, not even a new lake
        except LakeNotFoundError:
            return None  # no lake yet: nothing recorded, this is the run's start
    _check_checkpoint_location(config, lake)
    stored = latest_config(lake, config.run_id)
    if stored is None:
        return None
    defaults = leaves(RunConfig(), json_values=True)
    # A key the recorded config lacks (added by a later version of sao) at its default is no change (a
    # field of an optional section has none in the defaults: null); a setting recorded where nothing read
    # it (before such settings were refused) is compared as it ran, at its default. An argument of a
    # setting that is a free mapping (rollout.vllm.engine_args) has no default: added, even as null, it
    # is a change.
    changed = {key: (before, after) for key, (before, after) in changed_keys(without_unread(stored),
                                                                           config.public()).items()
               if not (before is None and key not in setting_keys(stored) and not under_free_mapping(key)
                       and after == defaults.get(key))}
    refused = {key: values for key, values in changed.items() if key not in RESUME_SAFE}
    if refused:
        recorded, now = setting_keys(stored), setting_keys(config.public())
        lines = "\n".join(f"  {key}: recorded {repr(before) if key in recorded else 'nothing'}, "
                          f"now {repr(after) if key in now else 'nothing'}" for key, (before, after) in refused.items())
        raise ConfigError(
            f"run {config.run_id!r} exists with other settings; a resumed run may change only "
            f"{', '.join(RESUME_SAFE)}. Changed:\n{lines}\nResume with the recorded settings "
            f"(sao sql \"SELECT config FROM runs WHERE run_id = '{config.run_id}'\"), or start a new run id.")
    return changed


def _check_checkpoint_location(config: RunConfig, lake: Lake) -> None:
    """Refuse a start of a run whose newest registered version is not under its checkpoint root."""
    newest = newest_policy_version(lake, config.run_id)
    if newest is None:
        return
    try:
        checkpoints.registered_location(registered_checkpoint(lake, config.run_id, newest), config.checkpoint_root,
                                        newest)
    except checkpoints.CheckpointMovedError as error:
        raise ConfigError(f"workdir: {error}") from None


def _append_runs_row(lake: Lake, config: RunConfig | None, **fields: object) -> None:
    """Append one row to ``runs``: ``fields`` (run_id, event, sources, changed, notes, parent), the
    config (JSON and by dotted key; empty when unknown) and the row's time and versions."""
    import pyarrow as pa

    from sao import __version__
    from sao.lake.commit import append_blind
    from sao.lake.records import utc_now
    from schemas import runs as runs_table

    row = {"started_at": utc_now(), "sao_version": __version__, "schema_version": runs_table.SCHEMA_VERSION,
           "config": json.dumps({} if config is None else config.public(), sort_keys=True),
           "settings": [] if config is None else [(key, json.dumps(value))
                                                  for key, value in leaves(config, json_values=True).items()],
           "parent_run_id": None, "parent_steps": None, "changed": None, "notes": None, "code": None} | fields
    append_blind(lake, "runs", pa.Table.from_pylist([row], schema=runs_table.SCHEMA))


def record_start(config: RunConfig, sources: dict[str, str] | None = None, notes: str | None = None,
                 lake: Lake | None = None, warn: Callable[[str], object] | None = None) -> str:
    """Check a start of ``config`` (:func:`check_resume`) and append its row to ``runs``, with the
    code of one's own it imports (:func:`sao.user_code.fingerprint`); returns the event (``start`` or
    ``resume``). A resume whose code differs from the run's previous start is said through ``warn``
    (default: this module's logger), naming each module. ``lake``: the run's lake opened already (default:
    opened from ``config.lake``, with object-store options from the environment)."""
    from sao import user_code
    from schemas import runs as runs_table

    lake = lake or Lake.open(config.lake_config())
    changed = check_resume(config, lake)
    resumed = changed is not None or config.checkpoint_root.exists()
    event = runs_table.RESUME if resumed else runs_table.START
    code = user_code.fingerprint(config)
    differs = user_code.changes(user_code.recorded_code(lake, config.run_id), code) if resumed else []
    if differs:
        (warn or log.warning)(f"run {config.run_id}: code of one's own changed since the run's previous start "
                              "(the steps from here run with it; the runs table keeps each start's code, column "
                              "code):\n  " + "\n  ".join(differs))
    _append_runs_row(lake, config, run_id=config.run_id, event=event, sources=json.dumps(sources or {}, sort_keys=True),
                     changed=None if changed is None else json.dumps(changed, sort_keys=True), notes=notes,
                     code=None if code is None else json.dumps(code, sort_keys=True))
    log.info("run %s: %s recorded in the lake's runs table", config.run_id, event)
    return event


def record_what_if(lake: Lake, run_id: str, parent_run_id: str, first: int, last: int,
                   overrides: dict[str, object], sources: dict[str, str]) -> None:
    """Record a what-if replay of ``parent_run_id``'s steps ``first``..``last`` as run ``run_id`` in
    ``runs``: the parent's latest config with ``overrides`` (dotted keys) applied, the parent, the steps
    and the overrides (``changed``: key -> [parent's value, new value])."""
    from schemas import runs as runs_table

    stored = latest_config(lake, parent_run_id)
    config, notes = None, None
    if stored is None:
        notes = f"run {parent_run_id!r} has no recorded config (it started before the runs table): only the overrides are known"
        changed = {key: [None, value] for key, value in overrides.items()}
    else:
        parent = RunConfig.model_validate(without_unread(stored))
        config = parent.with_values({"run_id": run_id, **overrides})
        changed = {key: list(values) for key, values in changed_keys(parent.public(), config.public()).items()
                   if key != "run_id"}
    _append_runs_row(lake, config, run_id=run_id, event=runs_table.WHAT_IF, sources=json.dumps(sources, sort_keys=True),
                     changed=json.dumps(changed, sort_keys=True), notes=notes, parent_run_id=parent_run_id,
                     parent_steps=f"{first}:{last}")


def warm_start(config: RunConfig, on_log: Callable | None = None) -> Path:
    """The run's version-0 policy directory, made unless it exists: the model of ``model.path``
    copied as a policy directory (after SFT on ``sft.data`` when given), or the built-in policy's SFT
    warm start."""
    from sao.data import load_demonstrations
    from sao.models.policy import import_policy, read_policy_metadata
    from sao.models.tokenizer import load_tokenizer
    from sao.train.sft import SFTConfig, sft_own_model, sft_warm_start

    path = config.initial_policy_dir
    metadata = read_policy_metadata(path) if (path / "config.json").exists() else None
    if metadata is not None:
        made_with = metadata.extra.get("chat_template_kwargs", {}) if config.model.path is not None else {}
        if made_with != config.model.chat_template_kwargs:
            raise ConfigError(f"version 0 at {path} was made with model.chat_template_kwargs {made_with}, and the "
                              f"config gives {config.model.chat_template_kwargs}: its chat template has the variables "
                              "it was made with. Start a new run id, or remove that folder to make version 0 again")
        log.info("warm start: reusing %s", path)
        return path
    # Written beside, then renamed: a warm start stopped half-way leaves no directory that looks done.
    partial = path.with_name(path.name + ".partial")
    for leftover in (partial, path):
        if leftover.exists():
            shutil.rmtree(leftover)
    sft = SFTConfig(seed=config.sft.seed, max_steps=config.sft.max_steps, learning_rate=config.sft.learning_rate,
                    batch_size=config.sft.batch_size)
    if config.model.path is None:
        sft_warm_start(sft, partial, on_log=on_log)
    elif config.sft.data is None:
        log.info("version 0: the model of %s (no SFT: no sft.data)", config.model.path)
        import_policy(config.model.path, partial, config.model.chat_template_kwargs)
    else:
        demonstrations = load_demonstrations(config.sft.data)
        log.info("version 0: the model of %s after SFT on %d demonstrations of %s", config.model.path,
                 len(demonstrations), config.sft.data)
        sft_own_model(config.model.path, demonstrations, partial, sft, system_prompt=config.env.system_prompt,
                      tools=own_format_tools(config, load_tokenizer(config.model.path)),
                      template_variables=config.model.chat_template_kwargs, on_log=on_log)
    partial.rename(path)
    return path


def model_notes(config: RunConfig) -> str | None:
    """What the run says once about its model (in the log and its ``runs`` row): that routing is
    not recorded for a mixture-of-experts model whose routers are not recognised."""
    from sao.models.policy import routing_note

    if config.model.path is None:
        return None
    note = routing_note(config.model.path)
    if note is not None:
        log.warning("run %s: %s", config.run_id, note)
    return note


def _write_json(path: Path, data: object) -> None:
    """Write ``data`` as JSON atomically (a temporary file renamed over ``path``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def _absolute_lake(lake: LakeConfig) -> LakeConfig:
    return lake if "://" in lake.root else dataclasses.replace(lake, root=str(Path(lake.root).resolve()))


def trainer_threads(config: RunConfig) -> int:
    """``train.threads``, or its default: 1 for an asynchronous run, whose replicas generate while it
    updates; for a synchronous run, where nothing generates during an update, the CPUs this process may
    run on shared among the trainer's workers, counted when the run started: a resumed run keeps the
    count its steps ran with (it is replay-relevant, :data:`sao.train.run_config.REPLAY_FIELDS`), on
    another machine or with other ``train.workers`` too."""
    if config.train.threads is not None:
        return config.train.threads
    if not config.train.synchronous:
        return 1
    if run_config_path(config.checkpoint_root).is_file():
        return read_run_config(config.checkpoint_root).torch_threads
    return max(1, len(os.sched_getaffinity(0)) // config.train.workers)


def pipeline_config(config: RunConfig, policy_path: str | Path, reward_paths: tuple[str, ...] | None = None
                    ) -> PipelineConfig:
    """The pipeline of ``config``. Local paths are made absolute here: Ray Train workers run in
    their own working directory, where ``runs/...`` or ``lake`` would name nothing.

    Checkpoints are pruned as the run goes (the ``retention`` section; by default:
    every version keeps its policy weights (trajectory replay, evaluation), and the full state
    (critic, optimisers) stays for version 0, the newest versions and every ``keep_every``-th, which
    is what step replay and resume start from). Kept whole, a 150-step demo's checkpoints took about
    2 GB.

    ``reward_paths``: where the reward modules were imported from (None: :func:`import_paths`
    finds them again)."""
    if reward_paths is None:
        reward_paths = import_paths(config)
    options = env_options(config, reward_paths)
    train = TrainConfig(
        run_id=config.run_id, lake=_absolute_lake(config.lake_config()),
        checkpoint_root=str(config.checkpoint_root.resolve()),
        policy_path=str(Path(policy_path).resolve()), update=config.update(), batch_size=config.train.batch_size,
        max_staleness=config.train.max_staleness, total_steps=config.train.steps, seed=config.seed,
        num_workers=config.train.workers, torch_threads=trainer_threads(config),
        resources_per_worker=dict(config.train.resources),
        device=config.train.device, gpus_per_worker=config.train.gpus_per_worker,
        rollout_gpus=config.rollout.num_replicas * config.rollout.gpus,
        bf16=config.train.bf16,
        rollout=ReplayContext(tasks_path=str(tasks_path(config).resolve()), env_options=options,
                              max_turns=config.agent().max_turns),
        retention=config.retention_config(),
        critic=config.critic_config(),
    )
    return PipelineConfig(train=train, ray=config.ray_config(), num_replicas=config.rollout.num_replicas,
                          resources_per_replica=dict(config.rollout.resources), gpus_per_replica=config.rollout.gpus,
                          engine=config.engine(),
                          rollout_python=replica_python(config),
                          agent=config.agent(), max_in_flight=config.rollout.max_in_flight, seed=config.seed,
                          group_size=config.rollout.group_size, cancel_stale=config.rollout.cancel_stale,
                          synchronous=config.train.synchronous,
                          env_options=options)


def value_data_run(config: RunConfig) -> str:
    """The run that holds the version-0 rollouts value pretraining fits the critic on."""
    return f"{config.run_id}-v0"


def pretrain_value(config: RunConfig, policy_path: str | Path,
                   on_record: Callable[[object], None] | None = None,
                   on_progress: Callable[[str], None] | None = None,
                   env_options: dict | None = None) -> PretrainReport | None:
    """Value pretraining before the first step (SAO.md section 3), when ``value_pretraining.samples`` > 0:
    roll out that many tasks with the version-0 policy into the lake as run
    :func:`value_data_run` (its own run: auditable, never trained on), then fit the run's version-0
    critic on them (:func:`sao.train.pretrain.pretrain_value`). Skipped (None) when the run has
    pretrained or trained already, so a resumed run does not redo it. ``env_options``, when given,
    replace the rollouts' environment options (:attr:`sao.pipeline.PipelineConfig.env_options`: a
    benchmark's tool latency)."""
    from sao.pipeline import collect_rollouts
    from sao.train.pretrain import REPORT_FILE, PretrainConfig
    from sao.train.pretrain import pretrain_value as fit_critic

    pipeline = pipeline_config(config, policy_path)
    if env_options is not None:
        pipeline = dataclasses.replace(pipeline, env_options=env_options)
    train = pipeline.train
    if config.value_pretraining.samples == 0 or not train.update.uses_critic:
        return None
    if (checkpoints.critic_dir(train.checkpoint_root, 0) / REPORT_FILE).exists():
        log.info("value pretraining: done already for run %s", config.run_id)
        return None
    init_ray(pipeline.ray)
    if prepare_run(train) != 0:
        log.info("value pretraining: run %s has trained already", config.run_id)
        return None
    data = dataclasses.replace(train, run_id=value_data_run(config),
                               checkpoint_root=str(Path(train.checkpoint_root).parent / "v0-data-checkpoints"))
    prepare_run(data)  # the data run's version 0: the same weights, registered under its own id
    collect_rollouts(dataclasses.replace(pipeline, train=data), run_tasks(config, Split.TRAIN),
                     data.run_id, config.value_pretraining.samples, on_record=on_record, on_progress=on_progress)
    return fit_critic(train, PretrainConfig(num_samples=config.value_pretraining.samples, data_run_id=data.run_id))


def train_async(config: RunConfig, policy_path: str | Path,
                on_step: Callable[[StepReport], None] | None = None) -> PipelineResult:
    """Run (or resume) the asynchronous training of ``config`` from ``policy_path`` (version 0)."""
    pipeline = pipeline_config(config, policy_path)
    result = run_pipeline(pipeline, run_tasks(config, Split.TRAIN), on_step=on_step)
    if result.interrupted:
        raise interrupt.RunInterrupted(f"run {config.run_id}: stopped after {result.steps} of {config.train.steps} "
                                       f"steps (policy version {result.version})")
    return result


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """A version's sampled accuracy on held-out tasks; ``failures``: the failed math_tool episodes by
    :func:`sao.envs.math_tool.failure_class` (empty for other environments, and for an evaluation
    kept by a version of this code that did not count them); ``rewards``: each task's reward, in the
    order of the held-out tasks evaluated (empty for an evaluation kept before they were);
    ``terminations``: how many episodes ended each way (``stop``, ``length``, ``error``, ...; empty for an
    evaluation kept before they were counted)."""

    version: int
    accuracy: float
    stderr: float
    num_tasks: int
    failures: dict[str, int] = dataclasses.field(default_factory=dict)
    rewards: tuple[float, ...] = ()
    terminations: dict[str, int] = dataclasses.field(default_factory=dict)


def policy_dir(config: RunConfig, version: int) -> Path:
    """Where version ``version`` of the run's policy lives (version 0: the warm start, until the
    run's first checkpoint exists)."""
    path = checkpoints.policy_dir(config.checkpoint_root, version)
    if version == 0 and not path.exists():
        return config.initial_policy_dir
    return path


def evaluate(config: RunConfig, version: int) -> Evaluation:
    """Sampled accuracy (temperature 1, the policy's own distribution; an agent run's: see below) of
    ``version`` on held-out tasks,
    each episode within the budgets a rollout of the run has (``rollout.max_tokens`` over its whole
    completion, ``rollout.max_turns`` action segments). Kept under the run's folder, so a resumed run
    does not evaluate a version again (the evaluation is seeded: the same version, tasks and seed give
    the same figure; the budgets cannot change on a resume). A run with an agent of one's own
    (``env.agent``) or a verifiers environment is evaluated on that agent's episodes, played against the
    chat endpoint as in a rollout, sampling as the rollouts do (:func:`sao.train.evaluate.evaluate_agent`),
    and so is a run whose model calls the built-in loop's tool in its own format
    (:mod:`sao.rollout.env_agent`); other runs on the built-in loop (:func:`sao.train.evaluate.evaluate_math`)."""
    from sao.models.policy import load_policy
    from sao.models.tokenizer import load_tokenizer
    from sao.train.evaluate import EvalConfig, evaluate_agent, evaluate_math

    # Named by what decides the figure: an evaluation kept with other budgets (or by an evaluation that
    # gave a reply 48 tokens, before it had a rollout's budgets) is not reused.
    # An agent run's evaluation is named apart: one kept before it ran the agent played the built-in loop.
    played = "-agent" if played_by_agent(config) else ""
    kept = config.run_dir / "evaluations" / (f"v{version:06d}-tasks{config.eval.tasks}-seed{config.eval_seed}"
                                             f"-tokens{config.rollout.max_tokens}-turns{config.rollout.max_turns}"
                                             f"{played}.json")
    if kept.exists():
        fields = json.loads(kept.read_text())
        return Evaluation(**fields | {"rewards": tuple(fields.get("rewards", ()))})
    path = policy_dir(config, version)
    options = env_options(config, import_paths(config))

    def environment(task: Task):
        from sao.envs import make_env

        return make_env(task.env, **options.get(task.env, {}))

    tokenizer = load_tokenizer(path)
    tasks = run_tasks(config, Split.HELDOUT)
    settings = EvalConfig(num_tasks=config.eval.tasks, seed=config.eval_seed, max_tokens=config.rollout.max_tokens,
                          max_turns=config.rollout.max_turns)
    agent = options.get("dataset", {}).get("agent")
    # An agent of one's own, a verifiers environment, or the built-in tool loop in the model's own tool-call
    # format: its episodes as a rollout runs them, on the chat endpoint.
    if agent or own_format_tools(config, tokenizer) is not None:
        result = evaluate_agent(load_policy(path), tokenizer, tasks, settings, environment, agent or None,
                                config.agent())
    else:
        result = evaluate_math(load_policy(path), tokenizer, tasks, settings, env_factory=environment)
    reward_of = {episode.task_id: episode.reward for episode in result.episodes}
    evaluation = Evaluation(version, result.accuracy, result.stderr, result.num_tasks,
                            failure_counts(result.episodes, {t.task_id: t for t in tasks}, tokenizer),
                            tuple(reward_of[task.task_id] for task in tasks[: result.num_tasks]),
                            dict(sorted(result.terminations.items())))
    _write_json(kept, dataclasses.asdict(evaluation))
    return evaluation


def own_format_tools(config: RunConfig, tokenizer) -> list | None:
    """The tools every prompt of the run offers when a model of one's own runs the built-in tool loop in
    its own tool-call format (:func:`sao.rollout.env_agent.tool_schema`: tasks of one's own that allow
    tool calls, a tokenizer without this project's tool-call tokens); None otherwise. ``tokenizer``:
    the policy's."""
    if config.model.path is None or not runs_tool_loop(config) or not config.own_tasks:
        return None
    from sao.envs import make_env
    from sao.models.chat import ChatTokens
    from sao.rollout.env_agent import tool_schema

    environment = make_env("dataset", **env_options(config, import_paths(config))["dataset"])
    return tool_schema(environment, ChatTokens.from_tokenizer(tokenizer))


def played_by_agent(config: RunConfig) -> bool:
    """Whether the run's episodes (and its evaluation's) are played by an agent of one's own or a
    verifiers environment's rollout loop, not the built-in loop."""
    return bool(config.env.agent) or config.env.verifiers is not None


def failure_counts(episodes, tasks: dict[str, Task], tokenizer) -> dict[str, int]:
    """The failed math_tool ``episodes`` (:class:`sao.train.evaluate.Episode`) counted by
    :func:`sao.envs.math_tool.failure_class`, every class present (zeros included) when any episode is
    a math_tool one."""
    from sao.envs.math_tool import ENV_NAME, FAILURE_CLASSES, failure_class
    from sao.train.evaluate import action_segments

    counts: dict[str, int] = {}
    for episode in episodes:
        task = tasks[episode.task_id]
        if task.env != ENV_NAME:
            continue
        counts = counts or dict.fromkeys(FAILURE_CLASSES, 0)
        kind = failure_class(task, action_segments(episode, tokenizer))
        if kind is not None:
            counts[kind] += 1
    return counts


def finished(config: RunConfig) -> dict | None:
    """The recorded result of run ``config.run_id`` if it has reached ``config.train.steps`` steps
    (None: it has not, or never ran)."""
    path = config.run_dir / RESULT_FILE
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    return result if result.get("steps", -1) >= config.train.steps else None


def record_finished(config: RunConfig, result: dict) -> None:
    """Record the result of a run that reached its steps (what :func:`finished` returns)."""
    _write_json(config.run_dir / RESULT_FILE, result)


def summarize(config: RunConfig, evaluations: list[Evaluation]) -> tuple[list[Path], str]:
    """Plots of the run (from the lake) and a markdown summary."""
    from sao.report import plot_run

    lake = Lake.open(config.lake_config())
    plots = plot_run(lake, config.run_id, config.plots_dir, [(e.version, e.accuracy) for e in evaluations])
    counts = lake.read_run("trajectories", config.run_id, ["termination_reason"]).column(0).to_pylist()
    lines = [f"# Run `{config.run_id}` ({config.algorithm.name.value})", "",
             f"| policy version | held-out accuracy ({'as the rollouts sample' if played_by_agent(config) else 'T=1'}) |",
             "|---:|---:|"]
    lines += [f"| {e.version} | {e.accuracy:.3f} ± {e.stderr:.3f} ({e.num_tasks} tasks) |" for e in evaluations]
    lines += ["", f"Trajectories stored: {len(counts)} "
              + "(" + ", ".join(f"{r}: {counts.count(r)}" for r in sorted(set(counts))) + ")",
              f"Lake: `{config.lake.root}`; plots: `{config.plots_dir}`."]
    return plots, "\n".join(lines)


def what_if(lake: Lake, run_id: str, first: int, last: int, overrides: dict[str, object],
            as_run: str | None = None, checkpoint_root: str | None = None) -> tuple[object, str]:
    """A what-if replay (:func:`sao.train.replay.what_if_steps`) of ``run_id``'s steps ``first``..``last``
    with ``overrides`` (dotted ``algorithm.*`` keys of the run config), recorded as run ``as_run``
    (default ``<run_id>-whatif-<hash of the request>``): its steps, versions and checkpoints, and its
    ``runs`` row naming the parent. Returns (report, its run id).

    Raises:
        ConfigError: a key outside ``algorithm.*`` or an invalid run id.
        sao.train.replay.ReplayError: as what_if_steps.
    """
    import hashlib

    from sao.config import AlgorithmSection
    from sao.train.replay import what_if_steps

    outside = sorted(key for key in overrides if not key.startswith("algorithm."))
    if outside:
        raise ConfigError(f"{outside}: a what-if replay changes update settings only (algorithm.*), the data and "
                          "the rollouts being the recorded ones")
    digest = hashlib.sha256(json.dumps([run_id, first, last, overrides], sort_keys=True, default=str).encode())
    new_run = as_run or f"{run_id}-whatif-{digest.hexdigest()[:8]}"
    if not is_valid_run_id(new_run):
        raise ConfigError(f"{new_run!r} is not a valid run id")
    fields = {AlgorithmSection.renamed.get(key.removeprefix("algorithm."), key.removeprefix("algorithm.")): value
              for key, value in overrides.items()}
    report = what_if_steps(lake, run_id, first, last, fields, checkpoint_root=checkpoint_root, record_as=new_run)
    record_what_if(lake, new_run, run_id, first, last, dict(overrides), dict.fromkeys(overrides, "--set"))
    return report, new_run
