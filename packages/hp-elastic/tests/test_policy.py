"""ScalingPolicy: validation (one-line UsageError), YAML loading, sizes, batch and LR rules."""

from __future__ import annotations

import math

import pytest

from hp.core.errors import UsageError
from hp.elastic.policy import ScalingPolicy, WorldOverride

BASE = dict(min_replicas=2, max_replicas=8, global_batch=48, micro_batch=4)


def policy(**kw) -> ScalingPolicy:
    return ScalingPolicy(**{**BASE, **kw})


@pytest.mark.parametrize("kw, needle", [
    (dict(min_replicas=5, max_replicas=4), "min_replicas 5 > max_replicas 4"),
    (dict(unit=3), "unit 3 does not divide min_replicas 2"),
    (dict(unit=4, min_replicas=4, max_replicas=10), "unit 4 does not divide max_replicas 10"),
    (dict(sizes=[2, 3, 8], unit=2), "unit 2 does not divide sizes [3]"),
    (dict(sizes=[1, 4]), "sizes [1] lie outside [2, 8]"),
    (dict(global_batch=50), "global_batch 50 is not a multiple of micro_batch 4"),
    (dict(micro_batch=0), "micro_batch must be positive"),
    (dict(min_replicas=-1), "min_replicas must be positive"),
    (dict(global_batch=4.5), "global_batch must be an integer"),
    (dict(unit=True), "unit must be an integer"),
    (dict(lr=-0.1), "lr must be a positive number"),
    (dict(lr_rule="cubic"), "unknown lr_rule 'cubic'"),
    (dict(lr_rule="table", lr_table={2: 0.1}), "lr_table lacks world sizes [3, 4, 5, 6, 7, 8]"),
    (dict(overrides={3: {"micro_batch": 5}}), "global_batch 48 is not a multiple of overrides[3].micro_batch 5"),
    (dict(overrides={9: {"lr": 0.1}}), "overrides key 9 is not an allowed world size"),
    (dict(overrides={4: {"lr": 0.1, "beta": 1}}), "overrides[4] has unknown keys beta"),
    (dict(base_world=0), "base_world must be positive"),
    (dict(replica_batch=8), "exactly one of global_batch (constant global batch) and replica_batch"),
    (dict(global_batch=None), "exactly one of global_batch (constant global batch) and replica_batch"),
    (dict(global_batch=None, replica_batch=6), "replica_batch 6 is not a multiple of micro_batch 4"),
    (dict(global_batch=None, replica_batch=0), "replica_batch must be positive"),
    (dict(global_batch=None, replica_batch=8, overrides={4: {"micro_batch": 3}}),
     "replica_batch 8 is not a multiple of overrides[4].micro_batch 3"),
])
def test_bad_policy_is_one_line_usage_error(kw, needle):
    with pytest.raises(UsageError) as e:
        policy(**kw)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_sizes_and_batch():
    assert policy().sizes_allowed() == (2, 3, 4, 5, 6, 7, 8)
    assert policy(unit=2).sizes_allowed() == (2, 4, 6, 8)
    p = policy(sizes=[8, 4, 2, 4])
    assert p.sizes_allowed() == (2, 4, 8) and p.allows(4) and not p.allows(3)
    assert p.largest_at_most(7) == 4 and p.largest_at_most(1) is None and p.largest_at_most(100) == 8
    p = policy(overrides={4: WorldOverride(micro_batch=2), 8: {"micro_batch": 6}})
    assert [p.micro_batch_for(w) for w in (2, 4, 8)] == [4, 2, 6]
    assert [p.micro_batches_for(w) for w in (2, 4, 8)] == [12, 24, 8]


def test_a_per_replica_batch_grows_the_global_batch_with_the_world_size():
    p = policy(global_batch=None, replica_batch=8, overrides={4: {"micro_batch": 2}})
    assert p.batch_key == "replica_batch" and p.batch == 8 and policy().batch_key == "global_batch"
    assert [p.micro_batches_for(w) for w in (2, 3, 4)] == [4, 6, 16]  # 2 per replica, 4 at the override
    assert [p.global_batch_for(w) for w in (2, 3, 4)] == [16, 24, 32]
    assert [policy().global_batch_for(w) for w in (2, 3, 8)] == [48, 48, 48]


def test_a_policy_is_the_step_sampler_s_geometry():
    from hp.checkpointless.sampler import StepSampler

    per_replica = StepSampler(100, geometry=policy(global_batch=None, replica_batch=8), seed=1)
    assert per_replica.global_batch is None and per_replica.samples_at(3) == 24 and per_replica.micro_batches_at(3) == 6
    constant = StepSampler(100, geometry=policy(overrides={4: {"micro_batch": 2}}), seed=1)
    assert constant.global_batch == 48 and constant.micro_batches_at(4) == 24 and constant.micro_batches_at(3) == 12
    # the same samples at every world size, cut into other micro-batches at the override
    at = lambda w: [i for m in range(constant.micro_batches_at(w)) for i in constant.indices(5, m, w)]  # noqa: E731
    assert at(4) == at(3) == at(8)


@pytest.mark.parametrize("kw, world, lr", [
    (dict(lr=0.1), 8, 0.1),  # constant: the default with a constant global batch
    (dict(lr=0.1, lr_rule="linear"), 8, 0.4),  # base_world defaults to min_replicas (2)
    (dict(lr=0.1, lr_rule="linear", base_world=4), 2, 0.05),
    (dict(lr=0.1, lr_rule="sqrt"), 8, 0.2),
    (dict(lr=0.1, lr_rule="sqrt", base_world=8), 2, 0.05),
    (dict(sizes=[2, 4], lr_rule="table", lr_table={2: 0.3, "4": 0.5}), 4, 0.5),
    (dict(lr=0.1, lr_rule="linear", overrides={6: {"lr": 0.7}}), 6, 0.7),
    (dict(lr=0.1, lr_rule="linear", overrides={6: {"lr": 0.7}}), 4, 0.2),
    (dict(sizes=[2, 4], lr_rule="table", lr_table={2: 0.3, 4: 0.5}, overrides={2: {"lr": 0.9}}), 2, 0.9),
])
def test_lr_rules(kw, world, lr):
    assert math.isclose(policy(**kw).lr_for(world), lr)


def test_lr_needs_base_lr():
    with pytest.raises(UsageError, match="needs lr"):
        policy(lr_rule="linear").lr_for(4)


def write(tmp_path, text):
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return path


def test_from_yaml(tmp_path):
    path = write(tmp_path, """
min_replicas: 2
max_replicas: 8
unit: 2
global_batch: 64
micro_batch: 4
lr: 0.01
lr_rule: sqrt
base_world: 2
overrides:
  8: {micro_batch: 8, lr: 0.03}
""")
    p = ScalingPolicy.from_yaml(path)
    assert p.sizes_allowed() == (2, 4, 6, 8) and p.micro_batches_for(8) == 8 and p.micro_batches_for(4) == 16
    assert p.lr_for(8) == 0.03 and math.isclose(p.lr_for(4), 0.01 * math.sqrt(2))
    assert ScalingPolicy.from_dict({**BASE, "sizes": [2, 8]}).sizes == (2, 8)


@pytest.mark.parametrize("text, needle", [
    ("min_replicas: 2\nmax_replicas: 4\nglobal_batch: 8\nmicro_batch: 2\nmax_replica: 5\nfoo: 1\n",
     "unknown keys foo, max_replica"),
    ("min_replicas: 4\nmax_replicas: 2\nglobal_batch: 8\nmicro_batch: 2\n", "min_replicas 4 > max_replicas 2"),
    ("min_replicas: 2\nmax_replicas: 4\nglobal_batch: 9\nmicro_batch: 2\n", "not a multiple of micro_batch 2"),
    ("min_replicas: 2\nmax_replicas: 6\nunit: 4\nglobal_batch: 8\nmicro_batch: 2\n", "unit 4 does not divide"),
    ("min_replicas: 2\nglobal_batch: 8\n", "missing keys max_replicas, micro_batch"),
    ("min_replicas: 2\nmax_replicas: 4\nmicro_batch: 2\n", "missing keys global_batch (or replica_batch)"),
    ("- 1\n- 2\n", "expected a mapping"),
    ("min_replicas: [1\n", "invalid YAML"),
])
def test_bad_yaml_is_one_line_usage_error(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(UsageError) as e:
        ScalingPolicy.from_yaml(path)
    msg = str(e.value)
    assert needle in msg and str(path) in msg and "\n" not in msg, msg


def test_missing_file(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        ScalingPolicy.from_yaml(tmp_path / "nope.yaml")
