"""The device mesh hp hands to FSDP2: its layout (pure) and its groups that outlive generations."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hp.checkpointless.mesh import GenerationMesh, MeshLayout, StableGroup
from hp.checkpointless.sharded import ShardLost
from hp.core.errors import UsageError
from hp.core.transport import GlooTransport


def test_fsdp_is_one_shard_dimension_over_every_rank():
    layout = MeshLayout.of(4)
    assert (layout.names, layout.sizes, layout.replicas) == (("shard",), (4,), 1)
    assert layout.group_ranks(2, 0) == [0, 1, 2, 3]
    assert layout.holders(2) == [2]  # each shard exists once
    assert layout.grid() == [0, 1, 2, 3]


def test_hsdp_shard_groups_are_consecutive_ranks_and_replicate_groups_stride_over_them():
    layout = MeshLayout.of(8, replicate=2)
    assert (layout.names, layout.sizes, layout.replicas) == (("replicate", "shard"), (2, 4), 2)
    assert layout.coords(6) == (1, 2) and layout.rank_of((1, 2)) == 6
    assert layout.group_ranks(6, 1) == [4, 5, 6, 7]  # its shard group
    assert layout.group_ranks(6, 0) == [2, 6]  # its replicate group: the ranks holding the same shard
    assert layout.holders(6) == [2, 6]
    assert layout.grid() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert MeshLayout.of(8, replicate=4, shard=2).holders(3) == [1, 3, 5, 7]


@pytest.mark.parametrize("kw, message", [
    ({"replicate": 3}, "replicate=3 x shard=1 does not cover the job's 4 ranks"),
    ({"replicate": 2, "shard": 3}, "replicate=2 x shard=3 does not cover the job's 4 ranks"),
    ({"replicate": 0}, "replicate must be a positive int, got 0"),
    ({"replicate": True}, "replicate must be a positive int, got True"),
    ({"shard": "2"}, "does not cover"),
    ({"shard": 3}, "a mesh of shard groups of 3 ranks does not cover the job's 4 ranks"),
])
def test_a_mesh_that_does_not_cover_the_job_is_a_one_line_error(kw, message):
    with pytest.raises(UsageError, match=message) as e:
        MeshLayout.of(4, **kw)
    assert "\n" not in str(e.value)


def test_a_rank_outside_the_mesh_is_refused():
    with pytest.raises(ValueError, match="rank 4 is not in a mesh of 4 ranks"):
        MeshLayout.of(4).coords(4)


def test_an_unbound_group_raises_naming_itself_and_refuses_a_group_of_another_shape():
    calls = []
    group = StableGroup(1, 2, "hp-mesh-test", before=calls.append)
    with pytest.raises(RuntimeError, match="hp-mesh-test group of the last generation was released"):
        group.allreduce([torch.zeros(1)])
    assert calls == ["allreduce"]  # the runtime's hook saw the collective first
    with pytest.raises(ValueError, match="group of rank 0/1 for a mesh group of rank 1/2"):
        group.bind(dist.ProcessGroup(0, 1), [0])
    assert not group.bound


@pytest.fixture
def one_rank_group(tmp_path):
    """A real gloo default group of one rank (what a generation of a 1-rank job forms)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    GlooTransport().init_process_group(store, 0, 1, 1, timedelta(seconds=10))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_mesh_routes_every_collective_to_the_current_generation_and_survives_its_destruction(one_rank_group, tmp_path):
    seen = []
    mesh = GenerationMesh(MeshLayout.of(1), 0, "cpu", before=seen.append)
    mesh.form(GlooTransport(), 0, 1, timedelta(seconds=10), None)
    t = torch.ones(3)
    dist.all_reduce(t, group=mesh.device_mesh.get_group())
    assert seen == ["allreduce"] and t.tolist() == [1.0, 1.0, 1.0]
    first = mesh.groups[0]
    mesh.release()
    dist.destroy_process_group()  # the generation ends: torch forgets every group it registered
    GlooTransport().init_process_group(dist.FileStore(str(tmp_path / "store2"), 1), 0, 1, 2, timedelta(seconds=10))
    mesh.form(GlooTransport(), 0, 1, timedelta(seconds=10), None)
    assert mesh.device_mesh.get_group() is first and first.bound  # the same object, bound to the new group
    dist.all_reduce(t, group=mesh.device_mesh.get_group())
    assert seen == ["allreduce", "allreduce"]


def test_a_generation_of_another_size_than_the_mesh_loses_its_shards(one_rank_group):
    mesh = GenerationMesh(MeshLayout.of(2), 0, "cpu")
    with pytest.raises(ShardLost, match=r"generation of 1 ranks for a device mesh of \(2,\): only an HSDP mesh"):
        mesh.form(GlooTransport(), 0, 1, timedelta(seconds=10), None)


def test_an_hsdp_layout_resizes_by_whole_replica_groups_only():
    hsdp = MeshLayout.of(4, replicate=2)
    assert hsdp.resized(4) is hsdp
    assert hsdp.resized(2) == MeshLayout(("replicate", "shard"), (1, 2)) and hsdp.resized(2).replicas == 1
    assert hsdp.resized(6).sizes == (3, 2) and hsdp.resized(6).holders(5) == [1, 3, 5]
    assert hsdp.resized(3) is None and hsdp.resized(1) is None  # a shard group cut in two
    assert MeshLayout.of(4).resized(2) is None  # pure FSDP: every shard is a quarter of the model


def test_a_resized_group_reports_its_new_place_to_torch():
    group = StableGroup(1, 3, "hp-mesh-resize")
    group.resize(0, 2)
    assert (group.rank(), group.size()) == (0, 2)
    with pytest.raises(ValueError, match="rank 2 in a group of 2"):
        group.resize(2, 2)


def test_an_hsdp_mesh_re_forms_with_fewer_replica_groups_keeping_its_shard(one_rank_group, tmp_path):
    """Rank 1 of a 2 x 1 HSDP mesh (its replica group 1) is rank 0 of the 1-rank generation after its peer's
    replica group left: the replicate group now has one member, and torch's callers see that size."""
    mesh = GenerationMesh(MeshLayout.of(2, replicate=2), 1, "cpu")
    mesh.form(GlooTransport(), 0, 1, timedelta(seconds=10), None)
    replicate = mesh.device_mesh.get_group("replicate")
    assert mesh.layout.sizes == (1, 1) and mesh.rank == 0 and mesh.shard_coordinate == 0
    assert (replicate.rank(), replicate.size(), dist.get_world_size(replicate), dist.get_rank(replicate)) == (0, 1, 1, 0)
    t = torch.ones(2)
    dist.all_reduce(t, group=replicate)
    assert t.tolist() == [1.0, 1.0]
    mesh.release()
    dist.destroy_process_group()  # a new generation: torch forgets the groups registered by name
    GlooTransport().init_process_group(dist.FileStore(str(tmp_path / "store2"), 1), 0, 1, 2, timedelta(seconds=10))
    two_by_two = GenerationMesh(MeshLayout.of(4, replicate=2), 3, "cpu")  # a shard group of 2 cannot fit in 1 rank
    with pytest.raises(ShardLost, match=r"device mesh of \(2, 2\): only an HSDP mesh changes its world size, by "
                                        r"whole replica groups of 2"):
        two_by_two.form(GlooTransport(), 0, 1, timedelta(seconds=10), None)


def _sharded(mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model[0], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def test_an_fsdp_model_is_registered_on_hp_s_mesh_only(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh

    from hp.checkpointless.registry import TrainingState

    hp_mesh = GenerationMesh(MeshLayout.of(1), 0, "cpu")
    hp_mesh.form(GlooTransport(), 0, 1, timedelta(seconds=10), None)
    model = _sharded(hp_mesh.device_mesh)
    st = TrainingState(model, torch.optim.AdamW(model.parameters()), mesh=hp_mesh)
    assert st.fsdp is not None and len(st.fsdp.params) == 4
    scaled = TrainingState(model, torch.optim.AdamW(model.parameters()), mesh=hp_mesh, scaler=torch.amp.GradScaler("cpu"))
    assert scaled.replicated_part()["scaler"]["scale"] == 65536.0  # what a replacement gets with the rest
    with pytest.raises(UsageError, match=r"shard the model on the mesh hp forms for each generation: mesh = ctx.device_mesh\(...\)"):
        TrainingState(model, torch.optim.AdamW(model.parameters()))
    foreign = _sharded(init_device_mesh("cpu", (1,)))  # torch's own mesh: its groups die with the generation
    with pytest.raises(UsageError, match=r"shard every parameter on it .*not sharded on it: 0.weight, 0.bias"):
        TrainingState(foreign, torch.optim.AdamW(foreign.parameters()), mesh=hp_mesh)
