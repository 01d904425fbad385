"""Where the trainer runs (``train.device``, ``train.bf16``): how a setting resolves, what is refused and
how, the CPU path left exactly as it was, and checkpoints that load on CPU whatever wrote them.

The tests marked ``gpu`` need a CUDA device (deselected by default): a few updates on CUDA against the
same updates on CPU, bf16 autocast, a checkpoint written from CUDA, and runs on CUDA replayed on CPU.
"""

import copy
import dataclasses
import math

import pytest
import ray
import torch

from sao.config import ConfigError, RunConfig
from sao.lake.config import LakeConfig
from sao.models.critic import Critic
from sao.models.policy import load_policy
from sao.train.batch import collate
from sao.train.checkpoint import load_checkpoint, save_checkpoint, weights_hash
from sao.train.config import TrainConfig, UpdateConfig
from sao.train.device import (
    CPU,
    DeviceUnavailableError,
    check_settings,
    configure_torch,
    resolve_device,
    use_gpu,
    worker_device,
)
from sao.train.loop import compute_update, run_training
from sao.train.ray_trainer import fit, scaling_config, torch_config
from sao.train.step import Learner
from tests.train.test_loop import make_config
from tests.train.test_step import hand_built_rows, routed_rows, tiny

# adam_eps = 1 makes Adam's first step about lr * g, linear in the gradient (with 1e-8 every step is
# lr * sign(g), which turns float noise in a near-zero gradient into a whole step): weights compared
# across devices then compare gradients.
LINEAR_ADAM = UpdateConfig(eps_high=0.5, adam_eps=1.0, lr_policy=1e-2, lr_critic=1e-2, token_budget=12,
                           routing_compare_every=1)


@pytest.fixture
def no_cuda(monkeypatch):
    """This process as on a machine without CUDA, whatever this machine has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def ray_cluster(monkeypatch, resources):
    """A Ray instance whose cluster has ``resources`` (None: no Ray instance)."""
    monkeypatch.setattr(ray, "is_initialized", lambda: resources is not None)
    monkeypatch.setattr(ray, "cluster_resources", lambda: dict(resources or {}))


def no_time(metrics):
    return {name: value for name, value in metrics.items() if not name.startswith("time/")}


def state_tensors(learner):
    """Every tensor of the models and the optimisers' states, by name."""
    out = {f"policy.{n}": t for n, t in learner.policy.state_dict().items()}
    out |= {f"critic.{n}": t for n, t in learner.critic.state_dict().items()} if learner.critic is not None else {}
    for label, optimizer in (("policy_opt", learner.policy_optimizer), ("critic_opt", learner.critic_optimizer)):
        for index, state in (optimizer.state_dict()["state"] if optimizer is not None else {}).items():
            out |= {f"{label}.{index}.{key}": value for key, value in state.items()}
    return out


# ----- resolution ------------------------------------------------------------------------------------


def test_auto_is_cpu_when_ray_sees_no_gpu_and_cuda_when_it_does(monkeypatch, no_cuda):
    ray_cluster(monkeypatch, {"CPU": 2.0})
    assert use_gpu("auto") is False and resolve_device("auto") == CPU
    ray_cluster(monkeypatch, None)  # no Ray instance: Ray sees no GPU
    assert use_gpu("auto") is False and resolve_device("auto") == CPU
    ray_cluster(monkeypatch, {"CPU": 2.0, "GPU": 2.0})
    assert use_gpu("auto") is True and use_gpu("auto", workers=2) is True and use_gpu("cuda") is True
    assert use_gpu("cpu") is False  # cpu is cpu, GPUs or not


def test_cuda_without_a_gpu_is_an_error_naming_the_setting_and_what_was_found(monkeypatch, no_cuda):
    ray_cluster(monkeypatch, {"CPU": 2.0})
    with pytest.raises(DeviceUnavailableError, match=r"train.device is 'cuda' but the Ray cluster has no GPU"):
        use_gpu("cuda")
    ray_cluster(monkeypatch, None)
    with pytest.raises(DeviceUnavailableError, match=r"train.device is 'cuda' but this process .* has no GPU"):
        resolve_device("cuda")


def test_fewer_gpus_than_trainer_workers_is_refused_rather_than_waited_for(monkeypatch):
    ray_cluster(monkeypatch, {"GPU": 1.0})
    for setting in ("cuda", "auto"):
        with pytest.raises(DeviceUnavailableError, match=r"has 1 GPU\(s\) for 2 workers \(train.workers\)"):
            use_gpu(setting, workers=2)
    assert use_gpu("cuda", workers=2, gpus_per_worker=0.5)  # two workers sharing the one GPU
    with pytest.raises(DeviceUnavailableError, match=r"0.5 per worker \(train.gpus_per_worker\).*lower train.workers to 2"):
        use_gpu("cuda", workers=3, gpus_per_worker=0.5)


def test_the_gpus_the_rollout_replicas_hold_are_not_the_trainers(monkeypatch, no_cuda):
    # One GPU and rollout.gpus 1: the check passed (1 >= 1), the replicas took the GPU, and the trainer
    # asked Ray for one that never came free.
    ray_cluster(monkeypatch, {"GPU": 1.0})
    assert use_gpu("auto", rollout_gpus=1.0) is False  # the trainer on CPU beside the vLLM replica
    with pytest.raises(DeviceUnavailableError, match=r"has no GPU left to the trainer \(the rollout replicas hold 1 "
                                                      r"of its 1: rollout.gpus x rollout.num_replicas\).*lower rollout.gpus"):
        use_gpu("cuda", rollout_gpus=1.0)
    assert use_gpu("cuda", gpus_per_worker=0.5, rollout_gpus=0.5)  # the GPU shared: half each
    ray_cluster(monkeypatch, {"GPU": 2.0})
    with pytest.raises(DeviceUnavailableError, match=r"has 1 GPU\(s\) left to the trainer .* for 2 workers"):
        use_gpu("auto", workers=2, rollout_gpus=1.0)
    assert use_gpu("cuda", workers=1, rollout_gpus=1.0)


def test_rollout_replicas_asking_for_more_gpus_than_the_cluster_has_are_refused(monkeypatch):
    from sao.pipeline import PipelineConfig, _check_rollout_gpus

    config = PipelineConfig(train=TrainConfig(run_id="r", lake=LakeConfig(root="lake"), checkpoint_root="c",
                                              policy_path="p"), num_replicas=2, gpus_per_replica=1.0)
    ray_cluster(monkeypatch, {"GPU": 1.0})
    with pytest.raises(DeviceUnavailableError, match=r"ask for 2 GPU\(s\) \(rollout.gpus 1 x rollout.num_replicas 2\)"
                                                      r" and the Ray cluster has 1"):
        _check_rollout_gpus(config)
    ray_cluster(monkeypatch, {"GPU": 2.0})
    _check_rollout_gpus(config)  # they fit
    _check_rollout_gpus(dataclasses.replace(config, gpus_per_replica=0.0))  # on CPU: nothing to count


def test_a_gpu_that_torch_cannot_use_is_named(monkeypatch, no_cuda):
    ray_cluster(monkeypatch, {"GPU": 1.0})
    with pytest.raises(DeviceUnavailableError, match=r"'auto' and the Ray cluster has 1 GPU.*sees no CUDA device"):
        resolve_device("auto")
    with pytest.raises(DeviceUnavailableError, match=r"worker was given a GPU.*sees no CUDA device"):
        worker_device(True)
    assert worker_device(False) == CPU


def test_an_unknown_device_is_refused_naming_train_device(tmp_path, policy_dir):
    with pytest.raises(ValueError, match=r"train.device must be one of auto, cpu, cuda; got 'tpu'"):
        make_config(tmp_path, policy_dir, device="tpu")
    with pytest.raises(ValueError, match=r"train.device must be one of auto, cpu, cuda; got 'gpu'"):
        use_gpu("gpu")
    with pytest.raises(ConfigError, match=r"train.device: Input should be 'auto', 'cpu' or 'cuda' \(got 'tpu'\)"):
        RunConfig().with_values({"train.device": "tpu"})


def test_bf16_on_cpu_is_refused(tmp_path, policy_dir, monkeypatch, no_cuda):
    with pytest.raises(ValueError, match=r"train.bf16 is true but train.device is 'cpu'"):
        make_config(tmp_path, policy_dir, bf16=True)  # make_config trains on cpu
    with pytest.raises(ConfigError, match=r"train.bf16 is true but train.device is 'cpu'"):
        RunConfig().with_values({"train.device": "cpu", "train.bf16": True})
    ray_cluster(monkeypatch, {"CPU": 2.0})
    check_settings("auto", True)  # fine until auto resolves...
    with pytest.raises(ValueError, match=r"train.bf16 is true but train.device 'auto' resolved to cpu"):
        use_gpu("auto", bf16=True)  # ...to cpu
    policy = tiny()
    with pytest.raises(ValueError, match=r"train.bf16 is true but the models are on cpu"):
        Learner(UpdateConfig(), policy, Critic.from_policy(policy), bf16=True)


def test_the_run_config_builds_the_trainers_device_settings(tmp_path):
    from sao.runs import pipeline_config

    config = RunConfig(run_id="r", workdir=str(tmp_path / "runs"), lake={"root": str(tmp_path / "lake")})
    train = pipeline_config(config, tmp_path / "policy").train
    assert (train.device, train.bf16) == ("auto", False)
    train = pipeline_config(config.with_values({"train.device": "cuda", "train.bf16": True}), tmp_path / "policy").train
    assert (train.device, train.bf16) == ("cuda", True)


def test_ray_train_asks_for_one_gpu_per_worker_and_nccl_only_on_gpus():
    on_gpus = scaling_config(2, 0.5, True, {"trainer": 1.0})
    assert on_gpus.use_gpu and on_gpus.num_workers == 2
    assert on_gpus.resources_per_worker == {"trainer": 1.0, "CPU": 0.5, "GPU": 1}
    on_cpus = scaling_config(2, 0.5, False, {"trainer": 1.0})
    assert not on_cpus.use_gpu and on_cpus.resources_per_worker == {"trainer": 1.0, "CPU": 0.5}
    assert torch_config(True).backend == "nccl" and torch_config(False).backend == "gloo"
    assert scaling_config(1, 0.5, True, gpus_per_worker=0.5).resources_per_worker == {"CPU": 0.5, "GPU": 0.5}


def test_cuda_without_a_gpu_fails_before_anything_starts(tmp_path, policy_dir, monkeypatch, no_cuda):
    from sao.train.pretrain import pretrain_value

    ray_cluster(monkeypatch, {"CPU": 2.0})
    cfg = make_config(tmp_path, policy_dir, device="cuda")
    with pytest.raises(DeviceUnavailableError, match="train.device is 'cuda'"):
        fit(cfg)  # before a TorchTrainer exists
    with pytest.raises(DeviceUnavailableError, match="train.device is 'cuda'"):
        pretrain_value(cfg)  # before the run is prepared or a row is read
    ray_cluster(monkeypatch, None)
    with pytest.raises(DeviceUnavailableError, match="train.device is 'cuda'"):
        run_training(cfg)  # the in-process trainer, before it opens the lake
    assert not (tmp_path / "lake").exists() and not (tmp_path / "ckpt").exists()


# ----- the CPU path is unchanged ---------------------------------------------------------------------


def test_an_update_placed_explicitly_on_cpu_is_exactly_the_default_update(one_thread):
    """Placing the models on ``resolve_device("cpu")`` and moving every batch there (what a worker with
    train.device cpu does) changes no bit of the update: metrics, weights and optimiser states."""
    base = tiny()
    rows, _ = routed_rows(base)  # routing replay and its metrics too
    runs = []
    for placed in (False, True):
        policy = copy.deepcopy(base)
        critic = Critic.from_policy(policy)
        if placed:
            device = resolve_device("cpu")
            policy, critic = policy.to(device), critic.to(device)
        learner = Learner(LINEAR_ADAM, policy, critic)
        metrics = []
        for version in (4, 5):
            torch.manual_seed(version)
            metrics.append(no_time(compute_update(learner, rows, version)))
        runs.append((metrics, state_tensors(learner)))
    (metrics_a, tensors_a), (metrics_b, tensors_b) = runs
    assert metrics_a == metrics_b and "routing/kept_frac_replay" in metrics_a[0]
    assert tensors_a.keys() == tensors_b.keys()
    for name, tensor in tensors_a.items():
        assert torch.equal(tensor, tensors_b[name]), name
    batch = collate(rows, trainer_version=4)
    assert batch.to("cpu") is batch  # already there: not even a copy


def test_a_checkpoint_loads_on_cpu_and_resumes_the_update_exactly(tmp_path, policy_dir, tokenizer, monkeypatch,
                                                                   one_thread):
    policy = load_policy(policy_dir)
    learner = Learner(LINEAR_ADAM, policy, Critic.from_policy(policy))
    rows = hand_built_rows(policy)
    compute_update(learner, rows, 5)
    _, digest = save_checkpoint(tmp_path, 1, learner.policy, tokenizer, learner.critic, learner.state_dict())
    loads = []
    original_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: loads.append(kw.get("map_location")) or original_load(*a, **kw))
    checkpoint = load_checkpoint(tmp_path, 1)
    assert loads == ["cpu"]
    resumed = Learner(LINEAR_ADAM, checkpoint.policy, checkpoint.critic)
    resumed.load_state_dict(checkpoint.trainer_state)
    assert weights_hash(resumed.policy) == digest
    assert all(t.device == CPU for t in state_tensors(resumed).values())
    torch.manual_seed(6)
    continued = no_time(compute_update(learner, rows, 6))
    torch.manual_seed(6)
    assert no_time(compute_update(resumed, rows, 6)) == continued
    for name, tensor in state_tensors(learner).items():
        assert torch.equal(tensor, state_tensors(resumed)[name]), name


# ----- on a GPU ---------------------------------------------------------------------------------------

CUDA = torch.device("cuda")


def on_gpu(test):
    """Marked ``gpu`` (deselected by default), and skipped where torch sees no CUDA device."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


@pytest.fixture
def cuda_settings():
    """The CUDA worker's torch settings (configure_torch), restored afterwards."""
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    configure_torch(CUDA, threads=1, deterministic=True)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


def updates(policy, critic, rows, steps=3, bf16=False):
    """``steps`` updates (versions 5, 6, ...) on ``rows``: (metrics of each, the learner)."""
    learner = Learner(LINEAR_ADAM, policy, critic, bf16=bf16)
    metrics = []
    for version in range(5, 5 + steps):
        torch.manual_seed(version)
        metrics.append(no_time(compute_update(learner, rows, version)))
    return metrics, learner


def assert_close_metrics(expected, actual, rel=1e-3, abs_=1e-5):
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        assert math.isclose(value, actual[name], rel_tol=rel, abs_tol=abs_), (name, value, actual[name])


@on_gpu
def test_updates_on_cuda_agree_with_the_same_updates_on_cpu(cuda_settings):
    base = tiny()
    rows = hand_built_rows(base)
    cpu_metrics, on_cpu = updates(copy.deepcopy(base), Critic.from_policy(base), rows)
    gpu_policy = copy.deepcopy(base).to(CUDA)
    gpu_metrics, on_gpu = updates(gpu_policy, Critic.from_policy(base).to(CUDA), rows)
    assert on_gpu.device.type == "cuda"
    for expected, actual in zip(cpu_metrics, gpu_metrics, strict=True):
        assert_close_metrics(expected, actual)
    gpu_tensors = state_tensors(on_gpu)
    for name, tensor in state_tensors(on_cpu).items():
        other = gpu_tensors[name]
        assert other.device.type == ("cpu" if name.endswith(".step") else "cuda"), name  # AdamW keeps steps on CPU
        assert torch.allclose(tensor, other.cpu(), rtol=1e-4, atol=1e-6), name


@on_gpu
def test_bf16_autocast_keeps_float32_master_weights_and_moves_them_as_float32_does(cuda_settings):
    base = tiny()
    rows = hand_built_rows(base)
    start = [p.detach().clone().to(CUDA) for p in base.parameters()]
    fp32_metrics, fp32 = updates(copy.deepcopy(base).to(CUDA), Critic.from_policy(base).to(CUDA), rows, steps=1)
    bf16_metrics, bf16 = updates(copy.deepcopy(base).to(CUDA), Critic.from_policy(base).to(CUDA), rows, steps=1,
                                 bf16=True)
    assert all(math.isfinite(v) for v in bf16_metrics[0].values())
    assert fp32_metrics[0].keys() == bf16_metrics[0].keys()
    for name, tensor in state_tensors(bf16).items():
        assert tensor.dtype == torch.float32, name  # weights, Adam's moments and steps
    delta32 = torch.cat([(p.detach() - s).flatten() for p, s in zip(fp32.policy.parameters(), start, strict=True)])
    delta16 = torch.cat([(p.detach() - s).flatten() for p, s in zip(bf16.policy.parameters(), start, strict=True)])
    assert float(torch.nn.functional.cosine_similarity(delta32, delta16, dim=0)) > 0.9


@on_gpu
def test_a_checkpoint_written_on_cuda_loads_on_cpu_and_back_on_cuda(tmp_path, policy_dir, tokenizer, cuda_settings):
    policy = load_policy(policy_dir)
    critic = Critic.from_policy(policy)
    _, learner = updates(policy.to(CUDA), critic.to(CUDA), hand_built_rows(load_policy(policy_dir)), steps=1)
    _, digest = save_checkpoint(tmp_path, 1, learner.policy, tokenizer, learner.critic, learner.state_dict())
    checkpoint = load_checkpoint(tmp_path, 1)  # on CPU, as a CPU-only machine loads it
    on_cpu = Learner(LINEAR_ADAM, checkpoint.policy, checkpoint.critic)
    on_cpu.load_state_dict(checkpoint.trainer_state)
    assert weights_hash(checkpoint.policy) == digest == weights_hash(learner.policy)
    saved = state_tensors(learner)
    for name, tensor in state_tensors(on_cpu).items():
        assert tensor.device == CPU and torch.equal(tensor, saved[name].cpu()), name
    again = load_checkpoint(tmp_path, 1)  # and back on a GPU: AdamW's moments follow the parameters
    on_gpu = Learner(LINEAR_ADAM, again.policy.to(CUDA), again.critic.to(CUDA))
    on_gpu.load_state_dict(again.trainer_state)
    for name, tensor in state_tensors(on_gpu).items():
        assert tensor.device.type == ("cpu" if name.endswith(".step") else "cuda"), name
        assert torch.equal(tensor.cpu(), saved[name].cpu()), name


def assert_replays_on_cpu_within_tolerance(cfg):
    from sao.lake.store import Lake
    from sao.train.replay import replay_steps

    report = replay_steps(Lake.open(cfg.lake), cfg.run_id, 0, metric_tolerance=1e-2)
    (step,) = report.steps
    assert report.start_ok and not step.metric_mismatches, step.metric_mismatches


@on_gpu
def test_the_in_process_trainer_on_cuda_commits_a_step_that_replays_on_cpu_within_tolerance(
        tmp_path, policy_dir, tokenizer, cuda_settings):
    from sao.lake.store import Lake
    from sao.train.loop import prepare_run
    from tests.train.test_loop import roll_out

    cfg = make_config(tmp_path, policy_dir, device="cuda", total_steps=1)
    prepare_run(cfg)
    roll_out(policy_dir, tokenizer, Lake.open(cfg.lake), cfg.run_id, 4)
    (report,) = run_training(cfg)
    assert all(math.isfinite(v) for v in report.metrics.values())
    assert load_checkpoint(cfg.checkpoint_root, 1).policy.device == CPU
    assert_replays_on_cpu_within_tolerance(cfg)


@on_gpu
@pytest.mark.ray
def test_ray_train_workers_train_on_their_gpu(tmp_path, policy_dir, tokenizer, ray_session):
    from sao.lake.store import Lake
    from sao.train.loop import prepare_run
    from tests.train.test_loop import roll_out

    cfg = make_config(tmp_path, policy_dir, device="auto", total_steps=1)  # the local Ray instance sees the GPU
    assert use_gpu(cfg.device, workers=cfg.num_workers)
    prepare_run(cfg)
    roll_out(policy_dir, tokenizer, Lake.open(cfg.lake), cfg.run_id, 4)
    fit(cfg)
    steps = Lake.open(cfg.lake).read("train_steps").to_pylist()
    assert [row["step"] for row in steps] == [0]
    assert_replays_on_cpu_within_tolerance(cfg)
