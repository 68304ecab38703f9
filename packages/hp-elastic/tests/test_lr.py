"""The LR at a new world size: the scheduler keeps its shape at the new level (hp.elastic.lr)."""

from __future__ import annotations

import torch

from hp.elastic.lr import on_scale_lr, rescale_lr
from hp.elastic.policy import ScalingPolicy


def _opt(lr: float = 0.1, steps: int = 10) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)


def _run(opt, sched, n: int) -> list[float]:
    out = []
    for _ in range(n):
        opt.step()
        sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out


def test_a_linear_rule_doubles_the_schedule_from_the_event_on():
    policy = ScalingPolicy(min_replicas=2, max_replicas=4, global_batch=8, micro_batch=2, lr=0.1, lr_rule="linear")
    opt, sched = _opt(policy.lr_for(2))
    _run(opt, sched, 3)
    assert on_scale_lr(policy, opt, sched, 2, 4) == 2.0
    after = _run(opt, sched, 5)
    ref_opt, ref_sched = _opt(policy.lr_for(4))  # the same schedule tuned at 4 ranks from the start
    expect = _run(ref_opt, ref_sched, 8)[3:]
    assert after == expect  # the same bits: scaling by a power of two is exact
    assert sched.last_epoch == 8 and sched.base_lrs == [0.2]


def test_constant_global_batch_keeps_the_lr():
    policy = ScalingPolicy(min_replicas=2, max_replicas=4, global_batch=8, micro_batch=2, lr=0.1)
    opt, sched = _opt()
    _run(opt, sched, 2)
    before = (opt.param_groups[0]["lr"], list(sched.base_lrs))
    assert on_scale_lr(policy, opt, sched, 2, 3) == 1.0
    assert (opt.param_groups[0]["lr"], sched.base_lrs) == before


def test_a_table_and_an_override():
    policy = ScalingPolicy.from_dict({"min_replicas": 1, "max_replicas": 4, "global_batch": 8, "micro_batch": 2,
                                      "lr_rule": "table", "lr_table": {1: 0.1, 2: 0.2, 3: 0.25, 4: 0.4},
                                      "overrides": {3: {"lr": 0.3}}})
    opt, sched = _opt(0.2)
    assert on_scale_lr(policy, opt, sched, 2, 3) == 0.3 / 0.2  # the override wins over the table
    assert abs(opt.param_groups[0]["lr"] - 0.3) < 1e-12 and abs(sched.base_lrs[0] - 0.3) < 1e-12


def test_without_a_scheduler_only_the_groups_change():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5)
    rescale_lr(opt, None, 0.5)
    assert opt.param_groups[0]["lr"] == 0.25
