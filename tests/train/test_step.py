"""The update step against a slow per-token reference of the same equations, and its invariances."""

import copy
import dataclasses
import math
import threading

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from sao.lake.records import routing_entries
from sao.models.critic import Critic
from sao.models.routing import record_routing, replay_routing
from sao.train import step as step_module
from sao.train.batch import collate, split_by_token_budget
from sao.train.config import UpdateConfig
from sao.train.step import Learner, policy_logprobs
from tests.models.test_routing import selection_noise

torch.use_deterministic_algorithms(True)


class ValueModel(torch.nn.Module):
    """A small critic for these tests: the policy's trunk and a scalar head, (B, L) values."""

    def __init__(self, policy):
        super().__init__()
        self.model = copy.deepcopy(policy.model)
        self.head = torch.nn.Linear(policy.config.hidden_size, 1)

    def forward(self, input_ids, attention_mask):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden).squeeze(-1)


def tiny(seed=0):
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=128)
    return Qwen3MoeForCausalLM(config)


def row(tid, task, prompt, completion, mask, logprobs, reward, reason, version, temperature=1.0):
    return {"trajectory_id": tid, "task_id": task, "prompt_ids": prompt, "completion_ids": completion,
            "action_mask": mask, "logprobs": logprobs, "reward": reward, "termination_reason": reason,
            "min_policy_version": version, "logprob_kind": "sampling",
            "sampling": {"temperature": temperature, "top_k": None, "top_p": 1.0}}


def hand_built_rows(policy):
    """Three trajectories: two action segments around an observation (natural end), a truncated one,
    and a short one; rollout log-probabilities are the current policy's shifted so DIS masks some."""
    specs = [
        ("t0", "a", [1, 2, 3], [10, 11, 40, 41, 12, 13], [1, 1, 0, 0, 1, 1], 1.0, "stop", 3, 1.0),
        ("t1", "b", [4, 5], [20, 21, 22, 23, 24], [1, 1, 1, 1, 1], 0.0, "length", 2, 0.7),
        ("t2", "a", [6, 7, 8, 9], [30, 31], [1, 1], 0.0, "stop", 4, 1.0),
    ]
    shifts = [[0.1, -0.5, 0, 0, 0.05, 2.0], [0.0, 0.2, -0.1, -1.5, 0.3], [0.0, 0.4]]
    rows = []
    for (tid, task, prompt, completion, mask, reward, reason, version, temp), shift in zip(specs, shifts, strict=True):
        with torch.no_grad():
            logp_now = reference_logprobs(policy, prompt, completion, temp)
        logp = [min(0.0, lp + s) if m else 0.0 for lp, s, m in zip(logp_now, shift, mask, strict=True)]
        rows.append(row(tid, task, prompt, completion, mask, logp, reward, reason, version, temp))
    return rows


def reference_logprobs(policy, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    logits = policy(input_ids=ids).logits[0].double() / temperature
    return [float(torch.log_softmax(logits[len(prompt) + j - 1], -1)[tok]) for j, tok in enumerate(completion)]


def reference_gae(rewards, values, bootstrap, gamma, lam):
    out, last = [0.0] * len(rewards), 0.0
    for i in reversed(range(len(rewards))):
        nxt = values[i + 1] if i + 1 < len(rewards) else bootstrap
        last = rewards[i] + gamma * nxt - values[i] + gamma * lam * last
        out[i] = last
    return out


def reference_update(cfg, policy, critic, rows, trainer_version):
    """One SAO update written token by token, without batching, padding or masks."""
    eps_low, eps_high = cfg.eps_low, cfg.eps_high
    total_actions = sum(sum(r["action_mask"]) for r in rows)
    per_row = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
            v = critic(input_ids=ids, attention_mask=torch.ones_like(ids))[0]
            p = len(r["prompt_ids"])
            actions = [j for j, m in enumerate(r["action_mask"]) if m]
            values = [float(v[p + j - 1]) for j in actions]
            v_end = float(v[-1]) if r["termination_reason"] in ("length", "turns", "timeout") else 0.0
            rewards = [0.0] * len(actions)
            rewards[-1] = r["reward"]
            lam_policy = 1 - 1 / (cfg.alpha * len(actions)) if cfg.lam_policy is None else cfg.lam_policy
            adv = reference_gae(rewards, values, v_end, cfg.gamma, lam_policy)
            ret = [a + b for a, b in zip(reference_gae(rewards, values, v_end, cfg.gamma, cfg.lam_critic), values, strict=True)]
            per_row.append((actions, adv, ret))
    # actor
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr_policy, weight_decay=cfg.weight_decay)
    loss = 0.0
    for r, (actions, adv, _) in zip(rows, per_row, strict=True):
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
        logits = policy(input_ids=ids).logits[0] / r["sampling"]["temperature"]
        p = len(r["prompt_ids"])
        for k, j in enumerate(actions):
            logp = torch.log_softmax(logits[p + j - 1], -1)[r["completion_ids"][j]]
            rho = math.exp(float(logp.detach()) - r["logprobs"][j])
            if 1 - eps_low < rho < 1 + eps_high:
                loss = loss - rho * adv[k] * logp / total_actions
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(policy.parameters()), cfg.max_grad_norm)
    optimizer.step()
    # critic, K times
    critic_optimizer = torch.optim.AdamW([q for q in critic.parameters() if q.requires_grad], lr=cfg.lr_critic,
                                         weight_decay=cfg.weight_decay)
    for step in range(cfg.critic_updates):
        for group in critic_optimizer.param_groups:
            group["lr"] = cfg.lr_critic * min(1.0, (step + 1) / cfg.warmup_steps_critic)
        critic_optimizer.zero_grad()
        loss = 0.0
        for r, (actions, _, ret) in zip(rows, per_row, strict=True):
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
            v = critic(input_ids=ids, attention_mask=torch.ones_like(ids))[0]
            p = len(r["prompt_ids"])
            for k, j in enumerate(actions):
                loss = loss + 0.5 * (v[p + j - 1] - ret[k]) ** 2 / total_actions
        loss.backward()
        torch.nn.utils.clip_grad_norm_([q for q in critic.parameters() if q.grad is not None], cfg.max_grad_norm)
        critic_optimizer.step()


# critic steps after the actor step's, one after the other (the order some tests below check)
CFG = UpdateConfig(eps_low=0.3, eps_high=0.5, lr_policy=1e-5, lr_critic=1e-5, warmup_steps_critic=2,
                   critic_updates=2, token_budget=12, critic_beside_actor=False)


def record_optimizer_steps(monkeypatch, optimizers=None):
    """Record the gradients every AdamW step sees, in order; with ``optimizers`` (a list), also the
    optimiser of each step, in the same order."""
    seen = []
    original = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        seen.append([p.grad.clone() for group in self.param_groups for p in group["params"] if p.grad is not None])
        if optimizers is not None:
            optimizers.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    return seen


@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(CFG, lam_policy=0.95)], ids=["adaptive", "fixed-0.95"])
def test_one_sao_step_matches_the_slow_reference(monkeypatch, cfg):
    # Gradients are compared at every optimiser step: Adam's first step moves each parameter by about
    # lr * sign(grad), so comparing parameters would amplify float noise in near-zero gradients.
    policy = tiny()
    critic = ValueModel(tiny(1))
    rows = hand_built_rows(policy)
    ref_policy, ref_critic = copy.deepcopy(policy), copy.deepcopy(critic)
    optimizers = []
    seen = record_optimizer_steps(monkeypatch, optimizers)
    learner = Learner(cfg, policy, critic)
    metrics = learner.update(collate(rows, trainer_version=5))
    # The learner's order: the first critic step (its forward gives the values), the actor, the others;
    # the reference's: the actor, then K critic steps.
    order = [k for k in range(len(seen)) if optimizers[k] is learner.policy_optimizer]
    order += [k for k in range(len(seen)) if optimizers[k] is not learner.policy_optimizer]
    assert order == [1, 0, 2]
    ours, seen[:] = [seen[k] for k in order], []
    reference_update(cfg, ref_policy, ref_critic, rows, trainer_version=5)
    assert len(ours) == len(seen) == 1 + cfg.critic_updates
    for step, (a_grads, b_grads) in enumerate(zip(ours, seen, strict=True)):
        assert len(a_grads) == len(b_grads)
        for a, b in zip(a_grads, b_grads, strict=True):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-7), f"optimiser step {step}"
    for a, b in zip(list(policy.parameters()) + list(critic.parameters()),
                    list(ref_policy.parameters()) + list(ref_critic.parameters()), strict=True):
        assert torch.allclose(a, b, atol=3 * cfg.lr_policy)
    assert 0 < metrics["actor/kept_frac"] < 1  # the shifts above push some rho out of (0.7, 1.5)
    assert metrics["batch/staleness_count/1"] == 1.0 and metrics["batch/staleness_count/3"] == 1.0


@pytest.mark.parametrize("critic_updates", [1, 2, 3])
def test_the_first_critic_steps_forward_gives_the_values_a_separate_forward_would(critic_updates):
    # The update takes GAE's values from its first critic step's forward (with gradients) instead of a
    # separate no-gradient forward first: every parameter and metric must come out bit for bit as in
    # that order (values, actor step, K critic steps).
    policy = tiny()
    rows = hand_built_rows(policy)
    cfg = dataclasses.replace(CFG, critic_updates=critic_updates, token_budget=10)
    models = [(copy.deepcopy(policy), ValueModel(tiny(1))) for _ in range(2)]
    fused = Learner(cfg, *models[0])
    separate = Learner(cfg, *models[1])
    batch = collate(rows, trainer_version=5)
    metrics = [fused.update(batch)]
    advantages, returns, plain = separate.advantages(batch)
    plain |= separate._actor_step(batch, advantages)
    for _ in range(critic_updates):
        critic_metrics, _ = separate._critic_step(batch, returns)
    metrics.append(plain | critic_metrics)
    for a, b in zip(list(models[0][0].parameters()) + list(models[0][1].parameters()),
                    list(models[1][0].parameters()) + list(models[1][1].parameters()), strict=True):
        assert torch.equal(a, b)
    same = [{k: v for k, v in m.items() if not k.startswith(("time/", "batch/"))} for m in metrics]
    assert same[0] == same[1] and len(same[0]) > 10
    assert fused.critic_steps == separate.critic_steps == critic_updates


def test_value_clip_keeps_the_later_critic_steps_near_the_values_before_the_update():
    # algorithm.value_clip (off by default) clips each critic value to within it of the value before the
    # update's first critic step, PPO style. A clip no value reaches changes nothing, a tight one clips
    # and changes the critic's later steps, and the actor's step (from the first step's values) is the
    # same either way.
    policy = tiny()
    rows = hand_built_rows(policy)
    results = {}
    for clip in (None, 1e6, 1e-4):
        cfg = dataclasses.replace(CFG, critic_updates=3, token_budget=10, value_clip=clip)
        actor, critic = copy.deepcopy(policy), ValueModel(tiny(1))
        metrics = Learner(cfg, actor, critic).update(collate(rows, trainer_version=5))
        results[clip] = (metrics, list(actor.parameters()), list(critic.parameters()))
    off, wide, tight = results[None], results[1e6], results[1e-4]
    assert "critic/value_clip_frac" not in off[0]
    assert wide[0]["critic/value_clip_frac"] < 0.5 < tight[0]["critic/value_clip_frac"]
    assert all(torch.equal(a, b) for a, b in zip(off[1], tight[1], strict=True))
    assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(off[2], wide[2], strict=True))
    assert not all(torch.allclose(a, b, rtol=0, atol=1e-5) for a, b in zip(off[2], tight[2], strict=True))


def _whiten_a_shard(rank: int, init: str, values: torch.Tensor, mask: torch.Tensor, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        rows = slice(0, 3) if rank == 0 else slice(3, None)
        torch.save(step_module.whiten_over_the_batch(values[rows], mask[rows]), f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_workers_whiten_their_shards_by_the_whole_batchs_statistics(tmp_path):
    # algorithm.whiten_advantages on data-parallel workers: each worker's shard is scaled by the mean and
    # variance of the whole batch's action tokens, as one worker with the whole batch scales it.
    torch.manual_seed(0)
    values = torch.randn(5, 7) * 3 + 1
    mask = torch.rand(5, 7) > 0.4
    mask[3:] &= torch.arange(7) < 2  # the second shard holds fewer action tokens
    torch.multiprocessing.spawn(_whiten_a_shard, args=(f"file://{tmp_path}/init", values, mask, str(tmp_path)),
                                nprocs=2)
    sharded = torch.cat([torch.load(tmp_path / "0.pt"), torch.load(tmp_path / "1.pt")])
    whole = step_module.whiten_over_the_batch(values, mask)  # no process group: masked_whiten
    assert torch.allclose(sharded, whole, rtol=0, atol=1e-5)
    assert float(whole[mask].mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(whole[mask].var(unbiased=False)) == pytest.approx(1.0, abs=1e-5)
    alone = torch.cat([step_module.masked_whiten(values[:3], mask[:3]), step_module.masked_whiten(values[3:], mask[3:])])
    assert not torch.allclose(sharded, alone, rtol=0, atol=1e-3)  # what each worker alone would have done


def test_the_output_layer_scores_in_float32_under_bf16_autocast(monkeypatch):
    # bf16 autocast (train.bf16) ran the output layer in bf16: a logit of 16-32 was rounded to steps of
    # 0.125-0.25 before the DIS ratio compared it with the engine's. The decoder's hidden states are
    # fixed here, so that only the output layer's precision is compared.
    policy = tiny()
    batch = collate(hand_built_rows(policy), trainer_version=5)
    positions = step_module.completion_positions(batch)
    hidden = torch.randn(*positions.shape, policy.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 30
    monkeypatch.setattr(step_module, "decoder_at", lambda decoder, ids, at: hidden)
    monkeypatch.setattr(step_module, "forward_mask", lambda batch: None)
    monkeypatch.setattr(step_module, "supports_decoder_at", lambda decoder: True)
    want = policy.get_output_embeddings()(hidden)  # float32, no autocast
    assert torch.equal(step_module.scoring_logits(policy, batch), want)  # float32 path: bit for bit as before
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = step_module.scoring_logits(policy, batch)
        rounded = policy.get_output_embeddings()(hidden).float()  # what the layer gave under autocast
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert not torch.allclose(rounded, want, rtol=0, atol=1e-3)  # bf16 would have moved them


def test_logits_at_the_scoring_positions_are_the_whole_forwards_logits(monkeypatch):
    # The output layer runs at the scoring positions only for plain-head models; a model of any other
    # type takes its whole forward. Both give the same log-probabilities.
    policy = tiny()
    batch = collate(hand_built_rows(policy), trainer_version=5)
    head_only = policy_logprobs(policy, batch)
    monkeypatch.setattr(step_module, "PLAIN_HEAD_MODEL_TYPES", frozenset())
    whole = policy_logprobs(policy, batch)
    assert torch.allclose(head_only, whole, rtol=0, atol=1e-6)
    assert torch.equal(head_only == 0, batch.action_mask == 0)


def test_a_critics_values_and_end_values_are_its_whole_forwards_read_at_the_completion():
    # A Critic on right-padded rows runs its last layer at the T + 1 positions read only.
    policy = tiny()
    critic = Critic.from_policy(policy)
    batch = collate(hand_built_rows(policy), trainer_version=5)
    values, v_end = step_module.critic_values(critic, batch)
    all_values = critic(batch.input_ids)
    want = all_values.gather(1, step_module.completion_positions(batch))
    want = torch.where(batch.action_mask, want, torch.zeros_like(want))
    last = (batch.prompt_lens + batch.completion_lens - 1).unsqueeze(-1)
    assert torch.allclose(values, want, rtol=0, atol=1e-6) and bool((values != 0).any())
    assert torch.allclose(v_end, all_values.gather(1, last).squeeze(-1), rtol=0, atol=1e-6)


def test_an_update_with_the_last_layers_at_the_completion_only_is_the_whole_forwards(monkeypatch):
    policy = tiny()
    batch = collate(hand_built_rows(policy), trainer_version=5)
    runs = []
    for trimmed in (True, False):
        if not trimmed:
            monkeypatch.setattr(step_module, "supports_decoder_at", lambda decoder: False)
            monkeypatch.setattr(Critic, "values_at", lambda self, ids, at: self(ids).gather(1, at))
        models = copy.deepcopy(policy), Critic.from_policy(policy)
        metrics = Learner(CFG, *models).update(batch)
        runs.append((models, metrics))
    (a, m_a), (b, m_b) = runs
    for x, y in zip([*a[0].parameters(), *a[1].parameters()], [*b[0].parameters(), *b[1].parameters()], strict=True):
        assert torch.allclose(x, y, rtol=0, atol=1e-6)
    assert not torch.equal(next(a[1].value_head.parameters()), next(Critic.from_policy(policy).value_head.parameters()))
    for key in ("actor/loss", "critic/loss", "critic/value_mean"):
        assert m_a[key] == pytest.approx(m_b[key], rel=1e-5, abs=1e-7), key


def test_right_padded_rows_are_forwarded_without_a_mask_and_score_as_with_it(monkeypatch):
    # collate pads each row at its end: a causal model's real tokens see real tokens only either way, so the
    # trainer's forwards pass no mask (the faster causal path); a mask padded anywhere else is passed on.
    policy, critic = tiny(), ValueModel(tiny(1))
    batch = collate(hand_built_rows(policy), trainer_version=5)
    assert bool((batch.attention_mask == 0).any())  # the rows are padded
    assert step_module.forward_mask(batch) is None
    left = batch._replace(attention_mask=batch.attention_mask.flip(-1))
    assert step_module.forward_mask(left) is left.attention_mask
    unmasked = policy_logprobs(policy, batch), step_module.critic_values(critic, batch)
    monkeypatch.setattr(step_module, "forward_mask", lambda b: b.attention_mask)
    masked = policy_logprobs(policy, batch), step_module.critic_values(critic, batch)
    assert torch.allclose(unmasked[0], masked[0], rtol=0, atol=1e-6)
    for a, b in zip(unmasked[1], masked[1], strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("critic_updates", [2, 3])
def test_critic_steps_beside_the_actor_step_change_nothing_but_the_thread(critic_updates, monkeypatch):
    # The later critic steps run on a thread of their own while the actor step runs: every parameter and
    # metric (but the timings) comes out bit for bit as with the steps one after the other.
    policy = tiny()
    batch = collate(hand_built_rows(policy), trainer_version=5)
    threads = []
    original = Learner._critic_step

    def critic_step(self, *args, **kwargs):
        threads.append((self.config.critic_beside_actor, threading.current_thread().name))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Learner, "_critic_step", critic_step)
    runs = []
    for beside in (False, True):
        cfg = dataclasses.replace(CFG, critic_updates=critic_updates, critic_beside_actor=beside)
        learner = Learner(cfg, copy.deepcopy(policy), ValueModel(tiny(1)))
        assert learner.critic_beside_actor is beside
        metrics = [learner.update(batch) for _ in range(2)]
        runs.append((learner, [{k: v for k, v in m.items() if not k.startswith("time/")} for m in metrics]))
    (one_by_one, plain), (beside, overlapped) = runs
    assert plain == overlapped and len(plain[0]) > 10
    for a, b in zip(list(one_by_one.policy.parameters()) + list(one_by_one.critic.parameters()),
                    list(beside.policy.parameters()) + list(beside.critic.parameters()), strict=True):
        assert torch.equal(a, b)
    main = threading.current_thread().name
    per_update = [name for flag, name in threads if flag][:critic_updates]
    assert per_update == [main] + ["critic-steps"] * (critic_updates - 1)  # the first gives GAE its values
    assert {name for flag, name in threads if not flag} == {main}


def test_an_error_in_the_critic_steps_beside_the_actor_reaches_the_caller(monkeypatch):
    policy = tiny()
    learner = Learner(dataclasses.replace(CFG, critic_beside_actor=True), policy, ValueModel(tiny(1)))
    original, calls = Learner._critic_step, []

    def critic_step(self, batch, returns, *args, **kwargs):
        calls.append(threading.current_thread().name)
        if returns is not None:
            raise RuntimeError("critic step failed")
        return original(self, batch, returns, *args, **kwargs)

    monkeypatch.setattr(Learner, "_critic_step", critic_step)
    with pytest.raises(RuntimeError, match="critic step failed"):
        learner.update(collate(hand_built_rows(policy), trainer_version=5))
    assert calls[-1] == "critic-steps" and learner.policy_steps == 1  # the actor step ran meanwhile


def test_critic_steps_go_beside_the_actor_only_when_asked_and_never_with_data_parallel_peers(monkeypatch):
    assert Learner(UpdateConfig(), tiny(), ValueModel(tiny(1))).critic_beside_actor is False  # the default
    forced = Learner(dataclasses.replace(CFG, critic_beside_actor=True), tiny(), ValueModel(tiny(1)))
    assert forced.critic_beside_actor is True
    monkeypatch.setattr(step_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(step_module.dist, "get_world_size", lambda: 2)
    with pytest.raises(ValueError, match="critic_beside_actor needs a trainer alone"):
        _ = forced.critic_beside_actor


def test_k_critic_updates_means_exactly_k_critic_optimiser_steps():
    for k in (0, 1, 2, 3):
        policy = tiny()
        learner = Learner(UpdateConfig(critic_updates=k), policy, ValueModel(tiny(1)))
        learner.update(collate(hand_built_rows(policy), trainer_version=5))
        state = learner.critic_optimizer.state_dict()["state"]
        steps = {int(s["step"]) for s in state.values()} if state else {0}
        assert learner.critic_steps == k and steps == {k}
        assert learner.policy_steps == 1


@pytest.mark.parametrize("budget", [1, 7, 12, 30])
def test_the_update_does_not_depend_on_how_the_batch_is_split(budget, monkeypatch):
    base = tiny()
    rows = hand_built_rows(base)
    seen = record_optimizer_steps(monkeypatch)
    runs = []
    for token_budget in (10_000, budget):
        policy, critic = copy.deepcopy(base), ValueModel(tiny(1))
        Learner(UpdateConfig(eps_high=0.5, token_budget=token_budget, lr_policy=1e-5, lr_critic=1e-5),
                policy, critic).update(collate(rows, trainer_version=5))
        runs.append(list(seen))
        seen.clear()
    for whole, split in zip(*runs, strict=True):
        for a, b in zip(whole, split, strict=True):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def test_split_by_token_budget_buckets_by_length():
    policy = tiny()
    batch = collate(hand_built_rows(policy), trainer_version=5)
    # lengths: t0 9, t1 7, t2 6 -> budget 14 fits (t1, t2) as 2 x 7 but not t0 with t1 (2 x 9 = 18)
    assert split_by_token_budget(batch, 14) == [[0], [1, 2]]
    assert split_by_token_budget(batch, 1) == [[0], [1], [2]]
    assert split_by_token_budget(batch, 100) == [[0, 1, 2]]


def test_the_default_token_budget_depends_on_the_update_threads(monkeypatch):
    from sao.train.config import TOKEN_BUDGET, TOKEN_BUDGET_ONE_THREAD

    default = UpdateConfig()
    assert default.token_budget is None
    assert (default.micro_batch_tokens(1), default.micro_batch_tokens(2), default.micro_batch_tokens(16)) == (
        TOKEN_BUDGET_ONE_THREAD, TOKEN_BUDGET, TOKEN_BUDGET) == (2048, 3072, 3072)
    assert UpdateConfig(token_budget=12).micro_batch_tokens(1) == UpdateConfig(token_budget=12).micro_batch_tokens(8) == 12
    with pytest.raises(ValueError, match="token_budget must be >= 1"):
        UpdateConfig(token_budget=0)
    # the learner splits by the budget of the threads torch runs on when it updates
    seen = []
    monkeypatch.setattr("sao.train.step.split_by_token_budget", lambda batch, budget: seen.append(budget) or [
        list(range(batch.action_mask.shape[0]))])
    learner = Learner(default, tiny(), ValueModel(tiny(1)))
    batch = collate(hand_built_rows(learner.policy), trainer_version=5)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            seen.clear()
            learner.update(batch)
            assert seen and set(seen) == {default.micro_batch_tokens(count)}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("algorithm", ["grpo", "grpo_dis", "ppo_async", "running_mean", "self_imitation"])
def test_every_algorithm_runs_through_the_same_loop(algorithm):
    policy = tiny()
    cfg = UpdateConfig(algorithm=algorithm, eps_high=0.5)
    critic = ValueModel(tiny(1)) if cfg.uses_critic else None
    before = [p.detach().clone() for p in policy.parameters()]
    metrics = Learner(cfg, policy, critic).update(collate(hand_built_rows(policy), trainer_version=5))
    assert all(math.isfinite(v) for v in metrics.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))


def test_self_imitation_trains_on_successes_only():
    """The control's advantage is 1 at every action token of a trajectory with the full reward (t0) and 0
    elsewhere; with no success in the batch the policy does not move."""
    policy = tiny()
    learner = Learner(UpdateConfig(algorithm="self_imitation"), policy, None)
    batch = collate(hand_built_rows(policy), trainer_version=5)
    advantages, returns, _ = learner.advantages(batch)
    assert returns is None
    assert advantages.tolist()[0] == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert not advantages[1:].any()
    failures = [dict(r, reward=0.0) for r in hand_built_rows(policy)]
    before = [p.detach().clone() for p in policy.parameters()]
    learner.update(collate(failures, trainer_version=5))
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))
    with pytest.raises(ValueError, match="imitation_threshold must be a finite reward"):
        UpdateConfig(algorithm="self_imitation", imitation_threshold=float("nan"))


def test_the_advantage_floor_raises_only_action_advantages_below_it():
    policy = tiny()
    critic = ValueModel(tiny(1))
    batch = collate(hand_built_rows(policy), trainer_version=5)
    plain, _, _ = Learner(UpdateConfig(), policy, critic).advantages(batch)
    floored, _, metrics = Learner(UpdateConfig(advantage_floor=0.0), policy, critic).advantages(batch)
    action = batch.action_mask
    assert bool((plain[action] < 0).any())  # the check below can fail
    assert torch.equal(floored[action], plain[action].clamp(min=0.0))
    assert not floored[~action].any()
    assert metrics["actor/advantage_floored_frac"] == float((plain[action] < 0).sum()) / float(action.sum())
    with pytest.raises(ValueError, match="advantage_floor must be finite"):
        UpdateConfig(advantage_floor=float("-inf"))


def test_a_critic_algorithm_without_a_critic_is_refused():
    with pytest.raises(ValueError, match="needs a critic"):
        Learner(UpdateConfig(algorithm="sao"), tiny(), None)


def test_the_default_ends_follow_sao_md_and_contradictions_are_refused():
    """SAO.md section 2: budget ends bootstrap, cancelled and error ends are stored and not trained on."""
    default = UpdateConfig()
    assert default.bootstrap_reasons == ("length", "turns", "timeout")
    assert default.skip_reasons == ("cancelled", "error")
    trained = UpdateConfig(bootstrap_reasons=["length", "cancelled", "error"], skip_reasons=[])
    assert trained.skip_reasons == () and "error" in trained.bootstrap_reasons
    with pytest.raises(ValueError, match=r"\['error'\] are in both bootstrap_reasons and skip_reasons"):
        UpdateConfig(bootstrap_reasons=["length", "error"])
    with pytest.raises(ValueError, match=r"skip_reasons \['stop'\] are not among"):
        UpdateConfig(skip_reasons=["stop"])


# Routing replay (R3) ------------------------------------------------------------------------------


def routed_rows(policy, noise=0.05, trainer_version=4):
    """``hand_built_rows`` as a rollout with perturbed routing decisions (see ``selection_noise``) would
    record them: its log-probabilities and its routing of every token but the last, same weights.
    Returns the rows and (B, L) where the live router would have chosen other experts."""
    rows = hand_built_rows(policy)
    batch = collate(rows, trainer_version)
    with selection_noise(policy, noise) as flips, record_routing(policy) as recorder, torch.no_grad():
        logp = policy_logprobs(policy, batch)
    routing = recorder.pop().view(*batch.input_ids.shape, 1, 2)  # one MoE layer, top-2
    for b, r in enumerate(rows):
        tokens = len(r["prompt_ids"]) + len(r["completion_ids"])
        r["routed_experts"], r["router_top_k"] = routing_entries(routing[b, : tokens - 1].numpy()), 2
        r["logprobs"] = [v if m else 0.0 for v, m in zip(logp[b].tolist(), r["action_mask"], strict=False)]
    return rows, flips[0].view(batch.input_ids.shape)


def read_positions(batch):
    """(B, L) bool: the input positions that score a completion token (where the last layer runs)."""
    read = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
    return read.scatter(1, step_module.completion_positions(batch), True)


def test_replay_reproduces_the_rollout_logprobs_exactly_where_recomputed_routing_differs():
    policy = tiny()
    rows, flipped = routed_rows(policy)
    batch = collate(rows, trainer_version=4)
    assert (flipped & batch.routing_mask).any(), "the perturbation must flip recorded routing"
    with replay_routing(policy, batch.routed_experts, batch.routing_mask) as stats, torch.no_grad():
        replayed = policy_logprobs(policy, batch)
    with torch.no_grad():
        live = policy_logprobs(policy, batch)
    assert torch.equal(replayed, batch.logp_rollout)
    assert (live - batch.logp_rollout).abs().max() > 1e-4
    # the (last and only) layer runs where the completion is scored, and is counted there
    counted = flipped & batch.routing_mask & read_positions(batch)
    assert stats.disagree[:, 0].tolist() == counted.sum(-1).float().tolist()
    assert stats.recorded[:, 0].tolist() == (batch.routing_mask & read_positions(batch)).sum(-1).float().tolist()


def test_collate_lays_the_routing_record_over_prompt_and_completion():
    rows, _ = routed_rows(tiny())
    batch = collate(rows, trainer_version=4)
    # t0: 3 + 6 tokens, t1: 2 + 5, t2: 4 + 2; the record covers all but each one's last token.
    assert batch.routed_experts.shape == (3, 9, 1, 2)
    assert batch.routing_mask.sum(-1).tolist() == [8, 6, 5]
    assert batch.select([2]).routing_mask.tolist() == [[True] * 5 + [False]]
    plain = collate([{k: v for k, v in r.items() if k != "routed_experts"} for r in rows], trainer_version=4)
    assert plain.routed_experts is None and plain.routing_mask is None


def test_replay_off_is_bit_identical_to_training_without_a_routing_record():
    base, critic = tiny(), ValueModel(tiny(1))
    rows, _ = routed_rows(base)
    plain = [{k: v for k, v in r.items() if k not in ("routed_experts", "router_top_k")} for r in rows]
    runs = []
    for batch_rows, replay in ((rows, False), (plain, None)):
        policy, value = copy.deepcopy(base), copy.deepcopy(critic)
        metrics = Learner(dataclasses.replace(CFG, routing_replay=replay), policy, value).update(
            collate(batch_rows, trainer_version=4))
        runs.append((policy, value, {k: v for k, v in metrics.items() if not k.startswith(("routing/", "time/"))}))
    (p1, c1, m1), (p2, c2, m2) = runs
    assert all(torch.equal(a, b) for a, b in zip(p1.parameters(), p2.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(c1.parameters(), c2.parameters(), strict=True))
    assert m1 == m2


def test_replay_metrics_report_disagreement_and_the_kept_fraction_with_and_without_replay():
    cfg = dataclasses.replace(CFG, eps_low=1e-4, eps_high=1e-4)
    for replay in (True, False):
        policy = tiny()
        rows, flipped = routed_rows(policy)
        batch = collate(rows, trainer_version=4)
        router = policy.model.layers[0].mlp.gate.weight
        before = router.detach().clone()
        metrics = Learner(dataclasses.replace(cfg, routing_replay=replay), policy, ValueModel(tiny(1))).update(batch)
        # the only layer is the last: it runs (and counts) where the completion is scored, 13 of the 19
        # recorded positions
        run = batch.routing_mask & read_positions(batch)
        recorded = flipped & run
        assert metrics["routing/replay"] == float(replay)
        assert metrics["routing/recorded_tokens"] == 13.0 and int(batch.routing_mask.sum()) == 19
        assert metrics["routing/disagree_frac"] == pytest.approx(float(recorded.sum()) / 13)
        assert metrics["routing/disagree_frac/layer_0"] == metrics["routing/disagree_frac"]
        for staleness, row in ((1, 0), (2, 1), (0, 2)):  # versions 3, 2, 4 at trainer version 4
            expected = float(recorded[row].sum() / run[row].sum())
            assert metrics[f"routing/disagree_frac/staleness_{staleness}"] == pytest.approx(expected)
        # Same weights: replayed, every rho is 1 (kept); live, flipped routing pushes some out of (1 - 1e-4, 1 + 1e-4).
        assert metrics["routing/kept_frac_replay"] == 1.0
        assert metrics["routing/kept_frac_live"] < 1.0
        step_kept = metrics["routing/kept_frac_replay" if replay else "routing/kept_frac_live"]
        assert metrics["actor/kept_frac"] == step_kept
        assert not torch.equal(router, before)  # the router trains through the replayed weights


def test_steps_between_routing_comparisons_report_only_their_own_routing():
    policy = tiny()
    rows, _ = routed_rows(policy)
    batch = collate(rows, trainer_version=4)
    learner = Learner(dataclasses.replace(CFG, routing_compare_every=2), policy, ValueModel(tiny(1)))
    first, second, third = (learner.update(batch) for _ in range(3))
    for compared in (first, third):
        assert {"routing/kept_frac_replay", "routing/kept_frac_live"} <= compared.keys()
    assert "routing/kept_frac_live" not in second  # no extra forward on this step
    assert second["routing/kept_frac_replay"] == second["actor/kept_frac"]
    assert "routing/disagree_frac" in second  # from the replayed forward itself


@pytest.mark.parametrize(("step", "expected"), [
    (0, 0.25), (2, 0.75), (3, 1.0),  # warm-up over 4 steps: (s + 1) / 4
    (4, 1.0), (5, 0.55 + 0.45 * math.cos(math.pi / 10)),  # then a cosine from 1 to 0.1 over 10 steps
    (9, 0.55), (14, 0.1), (50, 0.1),  # halfway (0.1 + 0.9 / 2); the end; held there
])
def test_the_learning_rate_warms_up_then_follows_a_cosine_to_its_final_ratio(step, expected):
    assert step_module.lr_factor(step, warmup_steps=4, cosine_steps=10, final_ratio=0.1) == pytest.approx(expected)


def test_without_cosine_steps_the_learning_rate_stays_at_its_peak_after_the_warm_up():
    assert [step_module.lr_factor(s, 0) for s in (0, 1, 100)] == [1.0, 1.0, 1.0]
    assert [step_module.lr_factor(s, 2) for s in (0, 1, 2, 100)] == [0.5, 1.0, 1.0, 1.0]


def test_the_policy_optimiser_follows_the_cosine_and_both_take_adams_beta2():
    policy = tiny()
    rows = hand_built_rows(policy)
    cfg = dataclasses.replace(CFG, lr_policy=1e-3, cosine_steps_policy=2, lr_final_ratio=0.2, adam_beta2=0.95)
    learner = Learner(cfg, policy, ValueModel(tiny(1)))
    for optimizer in (learner.policy_optimizer, learner.critic_optimizer):
        assert all(group["betas"] == (0.9, 0.95) for group in optimizer.param_groups)
    lrs = [learner.update(collate(rows, trainer_version=5))["actor/lr"] for _ in range(3)]
    # the rate after each step: halfway down the cosine (0.2 + 0.8 / 2), its end, held
    assert lrs == pytest.approx([1e-3 * 0.6, 1e-3 * 0.2, 1e-3 * 0.2])
    assert learner.critic_optimizer.param_groups[0]["lr"] == pytest.approx(cfg.lr_critic)  # warm-up done, constant


@pytest.mark.parametrize("bad", [{"cosine_steps_policy": -1}, {"warmup_steps_critic": -2}, {"lr_final_ratio": 1.5},
                                 {"adam_beta2": 1.0}])
def test_schedule_settings_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        UpdateConfig(**bad)


def test_explained_variance_is_worked_by_hand():
    target = torch.tensor([0.0, 1.0, 1.0, 0.0])  # variance 0.25
    assert step_module.explained_variance(target, target) == 1.0
    assert step_module.explained_variance(target, torch.full((4,), 0.5)) == 0.0  # the mean explains nothing
    # residuals (0, 0.5, 0.5, 0): variance 0.0625, a quarter of the targets'
    assert step_module.explained_variance(target, torch.tensor([0.0, 0.5, 0.5, 0.0])) == pytest.approx(0.75)
    assert step_module.explained_variance(torch.ones(3), torch.zeros(3)) is None  # targets that do not vary


def test_each_update_reports_its_critics_explained_variance_on_its_targets():
    policy = tiny()
    learner = Learner(CFG, policy, ValueModel(tiny(1)))
    batch = collate(hand_built_rows(policy), trainer_version=5)
    with torch.no_grad():
        values, v_end = step_module.critic_values(copy.deepcopy(learner.critic), batch)
    returns = step_module.critic_returns(batch, values, v_end, CFG)  # t1's length end bootstraps
    metrics = learner.update(batch)
    expected = step_module.explained_variance(returns[batch.action_mask], values[batch.action_mask])
    assert metrics["critic/explained_variance"] == pytest.approx(expected, abs=1e-6)


def test_the_entropy_bonus_subtracts_its_coefficient_times_the_mean_action_entropy():
    """``entropy_coef`` c: ``actor/entropy`` is the mean entropy of the sampling distribution (the
    row's temperature) over the batch's action tokens, worked from the logits; the loss is the plain
    loss minus c times it and the step lands elsewhere; with c = 0 no entropy is computed or reported."""
    policy = tiny()
    rows = hand_built_rows(policy)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for r in rows:
            logits = policy(input_ids=torch.tensor([r["prompt_ids"] + r["completion_ids"]])).logits[0].double()
            for j, is_action in enumerate(r["action_mask"]):
                if is_action:
                    logp = torch.log_softmax(logits[len(r["prompt_ids"]) + j - 1] / r["sampling"]["temperature"], -1)
                    total, tokens = total - float((logp.exp() * logp).sum()), tokens + 1
    cfg = UpdateConfig(algorithm="grpo_dis", eps_high=0.5)
    plain = Learner(cfg, copy.deepcopy(policy), None)
    bonus = Learner(dataclasses.replace(cfg, entropy_coef=0.1), copy.deepcopy(policy), None)
    batch = collate(rows, trainer_version=5)
    without, with_bonus = plain.update(batch), bonus.update(batch)
    assert "actor/entropy" not in without
    assert with_bonus["actor/entropy"] == pytest.approx(total / tokens, rel=1e-5)
    assert with_bonus["actor/loss"] == pytest.approx(without["actor/loss"] - 0.1 * total / tokens, rel=1e-5)
    assert any(not torch.equal(a, b) for a, b in zip(plain.policy.parameters(), bonus.policy.parameters(),
                                                     strict=True))
    with pytest.raises(ValueError, match="entropy_coef must be >= 0"):
        UpdateConfig(entropy_coef=-0.1)
