"""sao.config: the run config: one default per setting, clear refusals, layering, resume rules."""

import dataclasses
import json

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from sao import runs
from sao.cli import app
from sao.config import (
    BUILDS,
    DEMO_CONFIG,
    RESUME_SAFE,
    RUN_OWN,
    ConfigError,
    RunConfig,
    changed_keys,
    default_of,
    demo_config,
    leaves,
    resolve,
    show,
)
from sao.lake.store import Lake
from sao.train.config import UpdateConfig
from sao.train.retention import RetentionConfig


def test_every_setting_builds_component_fields_and_takes_their_default():
    config = RunConfig()
    settings = leaves(config)
    assert set(settings) == set(BUILDS) | set(RUN_OWN)
    for key, targets in BUILDS.items():
        for component, name in targets:
            default = default_of(component, name)
            value = settings[key]
            sequences = isinstance(value, list | tuple) and isinstance(default, list | tuple)
            assert value == default or (sequences and list(value) == list(default)), (
                f"{key} defaults to {value!r} but {component.__name__}.{name} to {default!r}")


def test_no_default_is_written_out_twice_in_the_config_module():
    """A setting's default is the component's (default_of), never a second literal that could drift:
    every value the config module's source shows beside a field name is a default_of call or a
    generated section."""
    import inspect

    import sao.config as module

    def lines(cls):
        if issubclass(cls, module.DerivedSection):  # generated from its dataclass: no source of its own
            return []
        return [line.strip() for line in inspect.getsource(cls).splitlines()]

    checked = 0
    for key in BUILDS:
        *path, name = key.split(".")
        owner = RunConfig
        for part in path:  # the section (or nested section) that holds the setting
            owner = owner.model_fields[part].annotation
        for stripped in lines(owner):
            if stripped.startswith(f"{name}: ") and "=" in stripped and "Section" not in stripped:
                assert "default_of(" in stripped, f"{key}: its default is written out: {stripped}"
                checked += 1
    assert checked >= 20  # the hand-written sections' settings were found and checked


def test_generated_sections_follow_their_dataclasses():
    algorithm = RunConfig().algorithm
    assert {f.name for f in dataclasses.fields(UpdateConfig)} == set(type(algorithm).model_fields) - {"name"} | {
        "algorithm"}
    assert algorithm.build() == UpdateConfig()
    assert RunConfig().retention.build() == RetentionConfig()
    schema = RunConfig.model_json_schema()["$defs"]["AlgorithmSection"]["properties"]
    assert schema["eps_high"]["description"].startswith("DIS interval (1 - eps_low, 1 + eps_high)")
    assert "K critic optimiser steps" in schema["critic_updates"]["description"]
    # A docstring's Sphinx roles read as names, a module constant with its value (one fact, one place).
    from sao.train.config import TOKEN_BUDGET, TOKEN_BUDGET_ONE_THREAD

    budget = schema["token_budget"]["description"]
    assert f"TOKEN_BUDGET_ONE_THREAD ({TOKEN_BUDGET_ONE_THREAD})" in budget and f"TOKEN_BUDGET ({TOKEN_BUDGET})" in budget
    assert ":data:" not in budget and ":meth:" not in budget and "(micro_batch_tokens)" in budget
    assert "grpo_dis (group-normalised, DIS)" in schema["name"]["description"]


def test_the_demo_config_is_the_laptop_demo():
    config = demo_config()
    assert (config.run_id, config.train.steps, config.train.batch_size, config.train.max_staleness) == (
        "demo", 150, 32, 2)
    assert config.update().bootstrap_reasons == ("timeout",)
    assert config.update().skip_reasons == ("cancelled", "error")
    assert (config.agent().max_tokens, config.value_pretraining.samples, config.eval.tasks) == (96, 256, 300)


def test_layers_apply_in_order_and_say_where_each_value_came_from(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("run_id: mine\ntrain:\n  steps: 7\n  batch_size: 8\nalgorithm:\n  eps_high: 3.0\n")
    config, origin = resolve(path, ["train.steps=9", "algorithm.name=grpo_dis"], {"train.steps": ("--steps", 11),
                                                                                  "seed": ("--seed", None)})
    assert (config.run_id, config.train.steps, config.train.batch_size) == ("mine", 11, 8)
    assert config.update().eps_high == 3.0 and config.update().algorithm == "grpo_dis"
    assert origin == {"run_id": str(path), "train.steps": "--steps", "train.batch_size": str(path),
                      "algorithm.eps_high": str(path), "algorithm.name": "--set algorithm.name=grpo_dis"}
    shown = show(config, origin)
    assert "  steps: 11  # --steps" in shown and "  eps_low: 0.3\n" in shown and f'run_id: "mine"  # {path}' in shown


def test_set_values_are_read_as_yaml():
    config, _ = resolve(None, ["algorithm.bootstrap_reasons=[timeout]", "algorithm.max_grad_norm=null",
                               "rollout.resources={rollout: 1}", "ray.address=auto"])
    assert config.update().bootstrap_reasons == ("timeout",) and config.update().max_grad_norm is None
    assert config.rollout.resources == {"rollout": 1.0} and config.ray.address == "auto"


@pytest.mark.parametrize(("sets", "expected"), [
    (["train.stepz=3"], "train.stepz: unknown key; train has: batch_size, bf16, device, gpus_per_worker, max_staleness, resources, steps"),
    (["trian.steps=3"], "trian: unknown key; the top level has: algorithm, critic, data, env, eval,"),
    (["train.batch_size=many"], "train.batch_size: Input should be a valid integer"),
    (["train.steps=-1"], "train.steps: Input should be greater than or equal to 0 (got -1) [from --set train.steps=-1]"),
    (["algorithm.name=ppo"], "algorithm.name: Input should be 'sao', 'grpo', 'grpo_dis', 'ppo_async', 'running_mean' or"),
    (["algorithm.critic_updates=-2"], "algorithm.critic_updates: critic_updates must be >= 0, got -2"),
    (["algorithm.gamma=2"], "algorithm.gamma: gamma must lie in [0, 1], got 2"),
    (["algorithm.lam_policy=1.5"], "algorithm.lam_policy: lam_policy must lie in [0, 1] or be None"),
    (["rollout.top_p=0"], "rollout.top_p: Input should be greater than 0 (got 0)"),
    (["run_id=../up"], "run_id: '../up' is not a valid run id"),
    (["train.steps"], "--set 'train.steps': expected SECTION.KEY=VALUE"),
    (["train.steps=1", "train.steps.x=1"], "train.steps: is a setting, not a section"),
    (["rollout.group_size=3"], "train.batch_size 16 is not a multiple of rollout.group_size 3"),
    (["train.synchronous=true"], "train.synchronous needs train.max_staleness 0, got 4"),
    (["sft.data=demos.jsonl"], "sft.data is for a model of one's own (model.path)"),
    (["model.chat_template_kwargs={enable_thinking: false}"], "model.chat_template_kwargs sets variables of the "
                                                                "chat template of a model of one's own (model.path)"),
    (["model.path=m", "model.chat_template_kwargs={none: 1}"], "model.chat_template_kwargs: chat template variable "
                                                               "'none': a word of Jinja's own"),
    (["model.path=m", "model.chat_template_kwargs={messages: []}"], "variable 'messages': every rendering gives"),
    (["sft.learning_rate=0"], "sft.learning_rate: Input should be greater than 0"),
    # Refused here, not at the run's start, where the component checking them is built:
    (["rollout.temperature=0"], "rollout.temperature: Input should be greater than 0 (got 0)"),
    (["train.gpus_per_worker=1.5"], "train.gpus_per_worker: gpus_per_worker must be a fraction in (0, 1] or a whole "
                                    "number, got 1.5 [from --set train.gpus_per_worker=1.5]"),
    (["algorithm.value_clip=0"], "algorithm.value_clip: value_clip must be > 0 or None (off), got 0.0"),
])
def test_a_bad_value_is_refused_with_its_dotted_key(sets, expected):
    with pytest.raises(ConfigError) as error:
        resolve(None, sets)
    assert expected in str(error.value)


def test_every_problem_of_a_file_is_reported_at_once(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  steps: -3\n  colour: red\neval:\n  tasks: none\n")
    with pytest.raises(ConfigError) as error:
        resolve(path)
    lines = str(error.value).splitlines()
    assert len(lines) == 3 and all(f"[from {path}]" in line for line in lines)
    assert {line.split(":")[0] for line in lines} == {"train.steps", "train.colour", "eval.tasks"}
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        resolve(path)
    with pytest.raises(ConfigError, match="cannot read config file"):
        resolve(tmp_path / "missing.yaml")


def test_changed_keys_lists_what_differs():
    before = RunConfig().public()
    after = RunConfig(train={"steps": 40}, algorithm={"eps_high": 4.0}).public()
    assert changed_keys(before, after) == {"algorithm.eps_high": (5.0, 4.0), "train.steps": (20, 40)}
    assert changed_keys(before, before) == {}


def test_a_resume_may_change_only_the_safe_keys(tmp_path):
    base = RunConfig(run_id="r", workdir=str(tmp_path / "runs"), lake={"root": str(tmp_path / "lake")})
    assert runs.record_start(base, {"run_id": "test"}) == "start"
    assert runs.record_start(base.with_values({"train.steps": 40, "eval.tasks": 9})) == "resume"
    with pytest.raises(ConfigError) as error:
        runs.record_start(base.with_values({"train.steps": 40, "algorithm.eps_high": 4.0}))
    assert "algorithm.eps_high: recorded 5.0, now 4.0" in str(error.value)
    assert "train.steps" not in str(error.value).split("Changed:")[1]
    rows = Lake.open(base.lake_config()).read("runs").to_pylist()
    assert sorted(row["event"] for row in rows) == ["resume", "start"]  # the refused start wrote nothing
    resumed = next(row for row in rows if row["event"] == "resume")
    assert json.loads(resumed["changed"]) == {"eval.tasks": [500, 9], "train.steps": [20, 40]}
    assert json.loads(resumed["config"])["train"]["steps"] == 40
    assert "train.steps" in RESUME_SAFE and "algorithm.eps_high" not in RESUME_SAFE


def test_a_resume_may_move_a_vllm_replica_onto_more_gpus_but_change_no_other_engine_argument(tmp_path):
    base = RunConfig(run_id="r", workdir=str(tmp_path / "runs"), lake={"root": str(tmp_path / "lake")},
                     rollout={"engine": "vllm", "gpus": 1})
    assert runs.record_start(base) == "start"
    wider = base.with_values({"rollout.gpus": 2, "rollout.vllm.engine_args": {"tensor_parallel_size": 2}})
    assert runs.check_resume(wider) == {"rollout.gpus": (1.0, 2.0),
                                        "rollout.vllm.engine_args.tensor_parallel_size": (None, 2)}
    assert runs.record_start(wider) == "resume"
    assert runs.check_resume(base) == {"rollout.gpus": (2.0, 1.0),  # and back: an argument dropped
                                       "rollout.vllm.engine_args.tensor_parallel_size": (2, None)}
    with pytest.raises(ConfigError) as error:
        runs.check_resume(wider.with_values({"rollout.vllm.engine_args": {"tensor_parallel_size": 2,
                                                                         "quantization": "fp8"}}))
    assert "rollout.vllm.engine_args.quantization: recorded nothing, now 'fp8'" in str(error.value)
    assert "tensor_parallel_size" not in str(error.value).split("Changed:")[1]
    # An argument added as null is a change too (vLLM would be given max_model_len None: the model's window).
    with pytest.raises(ConfigError, match=r"engine_args.max_model_len: recorded nothing, now None"):
        runs.check_resume(wider.with_values({"rollout.vllm.engine_args": {"tensor_parallel_size": 2,
                                                                         "max_model_len": None}}))
    # What a replica's memory and batches are sized by may change, through the section or engine_args.
    assert runs.check_resume(wider.with_values({"rollout.vllm.engine_args": {
        "tensor_parallel_size": 2, "gpu_memory_utilization": 0.5, "max_num_seqs": 8}})) == {
        "rollout.vllm.engine_args.gpu_memory_utilization": (None, 0.5),
        "rollout.vllm.engine_args.max_num_seqs": (None, 8)}


def test_a_key_added_after_a_run_started_is_no_change_at_its_default(tmp_path, monkeypatch):
    base = RunConfig(run_id="r", workdir=str(tmp_path / "runs"), lake={"root": str(tmp_path / "lake")},
                     data={"train": str(tmp_path / "tasks.jsonl")})
    lake = Lake.open(base.lake_config())
    runs.record_start(base, lake=lake)
    older = base.public()
    del older["env"]["tools"]  # what a run recorded before env.tools existed
    assert changed_keys(older, base.public()) == {"env.tools": (None, [])}
    monkeypatch.setattr(runs, "latest_config", lambda lake, run_id: older)  # as an older sao recorded it
    assert runs.check_resume(base, lake) == {}
    with pytest.raises(ConfigError, match=r"env.tools: recorded nothing, now \['x:y'\]"):
        runs.check_resume(base.with_values({"env.tools": ["x:y"]}), lake)


def test_the_train_flow_form_is_generated_from_the_config():
    from prefect.utilities.callables import parameter_schema

    from flows.train import train

    schema = parameter_schema(train).model_dump()
    assert list(schema["properties"]) == ["config", "sources"]
    sections = schema["definitions"]
    assert set(RunConfig.model_fields) - {"run_id", "workdir", "seed"} <= {
        name.removesuffix("Section").lower() for name in sections} | {"value_pretraining", "sft"}
    steps = sections["TrainSection"]["properties"]["steps"]
    assert steps["minimum"] == 0 and steps["default"] == 20 and steps["description"].startswith("Actor updates")
    assert sections["AlgorithmSection"]["properties"]["eps_high"]["default"] == 5.0


runner = CliRunner()


def test_sao_config_show_and_schema():
    shown = runner.invoke(app, ["config", "show", "--config", str(DEMO_CONFIG), "--set", "train.steps=3"])
    assert shown.exit_code == 0, shown.output
    assert "  steps: 3  # --set train.steps=3" in shown.stdout and "  batch_size: 32  # " in shown.stdout
    schema = runner.invoke(app, ["config", "schema"])
    assert schema.exit_code == 0 and json.loads(schema.stdout)["title"] == "RunConfig"


def test_sao_train_refuses_a_bad_config_before_anything_starts(tmp_path):
    result = runner.invoke(app, ["train", "--workdir", str(tmp_path), "--set", "train.stepz=1", "--steps", "-1"])
    assert result.exit_code == 2
    assert "train.stepz: unknown key" in result.stderr and "train.steps: Input should be greater than or equal to 0 " \
        "(got -1) [from --steps]" in result.stderr
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize(("settings", "named"), [
    ({"reward": {"functions": ["my_rewards:correct"]}}, "reward.functions"),
    ({"reward": {"weights": [2.0]}}, "reward.weights"),
    ({"data": {"eval": "heldout.jsonl"}}, "data.eval"),
    ({"data": {"eval_fraction": 0.2}, "env": {"tools": ["shop:price"]}}, "env.tools, data.eval_fraction"),
    ({"env": {"max_tool_calls": 0, "system_prompt": "Be brief."}}, "env.max_tool_calls, env.system_prompt"),
])
def test_task_reward_and_tool_settings_without_data_train_are_refused_not_ignored(settings, named):
    # Before, the run trained on the built-in math_tool task and its own reward with these accepted.
    with pytest.raises(ValidationError, match=f"{named} would be ignored: they set up the tasks of data.train"):
        RunConfig(**settings)
    assert RunConfig(**settings | {"data": {"train": "tasks.jsonl", **settings.get("data", {})}})


def test_a_held_out_file_beside_a_verifiers_environment_is_refused():
    with pytest.raises(ValidationError, match="data.eval would be ignored: env.verifiers brings its own tasks"):
        RunConfig(env={"verifiers": {"id": "my_env"}}, data={"eval": "heldout.jsonl"})
    assert RunConfig(env={"verifiers": {"id": "my_env"}}, data={"eval_fraction": 0.2})  # its held-out share
    # The held-out evaluation scores it with reward.functions (not its rubric): they are read.
    assert RunConfig(env={"verifiers": {"id": "my_env"}}, reward={"functions": ["my_rewards:correct"]})


def test_a_run_recorded_with_a_setting_nothing_read_resumes_and_replays_a_what_if(tmp_path, monkeypatch):
    # A run on the built-in task recorded env.max_tool_calls 2 before such settings were refused: it could
    # neither keep the key (refused now) nor drop it (a changed setting), and a what-if of it failed.
    base = RunConfig(run_id="r", workdir=str(tmp_path / "runs"), lake={"root": str(tmp_path / "lake")})
    lake = Lake.open(base.lake_config())
    runs.record_start(base, lake=lake)
    older = base.public()
    older["env"]["max_tool_calls"] = 2  # what it recorded; the built-in task never read it
    monkeypatch.setattr(runs, "latest_config", lambda lake, run_id: older)
    assert runs.check_resume(base, lake) == {}
    runs.record_what_if(lake, "r-what-if", "r", 0, 0, {"algorithm.eps_high": 4.0}, {})
    rows = lake.read("runs", predicate="run_id = 'r-what-if'").to_pylist()
    assert json.loads(rows[0]["changed"]) == {"algorithm.eps_high": [5.0, 4.0]}


def test_a_vllm_context_window_that_leaves_no_room_for_a_prompt_is_refused():
    # The engine refused each request whose prompt and completion budget overran max_model_len: every
    # rollout of the run ended with an error, and the trainer never filled a batch.
    with pytest.raises(ValidationError, match="rollout.max_tokens 512 leaves no room for a prompt in "
                                              "rollout.vllm.max_model_len 512"):
        RunConfig(rollout={"engine": "vllm", "max_tokens": 512, "vllm": {"max_model_len": 512}})
    assert RunConfig(rollout={"engine": "vllm", "max_tokens": 256, "vllm": {"max_model_len": 512}})
    assert RunConfig(rollout={"max_tokens": 512, "vllm": {"max_model_len": 512}})  # the torch engine: not read
    # engine_args override the section's fields (VLLMEngineConfig.to_engine_args): theirs is the window.
    with pytest.raises(ValidationError, match="rollout.max_tokens 512 leaves no room for a prompt in "
                                              "rollout.vllm.engine_args.max_model_len 300"):
        RunConfig(rollout={"engine": "vllm", "max_tokens": 512, "vllm": {"engine_args": {"max_model_len": 300}}})
    assert RunConfig(rollout={"engine": "vllm", "max_tokens": 512,
                              "vllm": {"max_model_len": 256, "engine_args": {"max_model_len": 1024}}})
    assert RunConfig(rollout={"engine": "vllm", "vllm": {"max_model_len": 256, "engine_args": {"max_model_len": None}}})
    with pytest.raises(ValidationError, match=r"engine_args.max_model_len must be a whole number >= 1 .* got '32k'"):
        RunConfig(rollout={"engine": "vllm", "vllm": {"engine_args": {"max_model_len": "32k"}}})


def test_a_vllm_replica_is_given_a_gpu_for_each_of_its_parallel_workers():
    # vLLM runs tensor_parallel_size x pipeline_parallel_size x data_parallel_size workers, one a GPU; with
    # fewer GPUs than that it asks Ray for more, which the replicas hold.
    def vllm(gpus, **engine_args):
        return RunConfig(rollout={"engine": "vllm", "gpus": gpus, "vllm": {"engine_args": engine_args}})

    with pytest.raises(ValidationError, match=r"tensor_parallel_size 2 x pipeline_parallel_size 1 x data_parallel_size 1 "
                                              r"needs 2 GPUs a replica, but rollout.gpus gives each 1: set rollout.gpus to 2"):
        vllm(1, tensor_parallel_size=2)
    with pytest.raises(ValidationError, match=r"2 x pipeline_parallel_size 2 x data_parallel_size 1 needs 4 GPUs .* each 2"):
        vllm(2, tensor_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(ValidationError, match=r"data_parallel_size 2 needs 4 GPUs"):
        vllm(3, tensor_parallel_size=2, data_parallel_size=2)
    for size in ("2", 0, True, 1.5):
        with pytest.raises(ValidationError, match=r"engine_args.tensor_parallel_size must be a whole number >= 1"):
            vllm(2, tensor_parallel_size=size)
        with pytest.raises(ValidationError, match=r"engine_args.pipeline_parallel_size must be a whole number >= 1"):
            vllm(0, pipeline_parallel_size=size)  # on a CPU too
    assert vllm(2, tensor_parallel_size=2) and vllm(4, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert vllm(1) and vllm(0.5, gpu_memory_utilization=0.4)  # one worker, on a GPU of its own or a share
    assert vllm(0, tensor_parallel_size=2)  # on a CPU vLLM places its workers itself
    assert RunConfig(rollout={"vllm": {"engine_args": {"tensor_parallel_size": "2"}}})  # the torch engine: not read


def test_a_vllm_replica_sharing_a_gpu_must_be_given_its_share_of_the_memory():
    # vLLM takes 0.9 of the GPU's memory by default: a trainer (or a second replica) beside it ran out.
    with pytest.raises(ValidationError, match=r"rollout.gpus 0.5 shares a GPU, but vLLM would take 0.9 of its memory"):
        RunConfig(rollout={"engine": "vllm", "gpus": 0.5})
    assert RunConfig(rollout={"engine": "vllm", "gpus": 0.5, "vllm": {"gpu_memory_utilization": 0.4}})
    assert RunConfig(rollout={"engine": "vllm", "gpus": 0.5, "vllm": {"kv_cache_memory_bytes": 2**30}})
    assert RunConfig(rollout={"engine": "vllm", "gpus": 1})  # a GPU of its own
