"""A same-node hydration's buffer mapped before the failure (:mod:`hp.checkpointless.premap`), and a spare's
parameters placed where the hydration writes them (:func:`hp.checkpointless.state.place_parameters`).
In one process: its own ``/proc/<pid>/fd`` is as good as a spare's for mapping."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import tempfile

import pytest
import torch
from hp.checkpointless import shm, state
from hp.checkpointless.premap import Premaps
from hp.core.signed_values import seal, unseal


TOKEN = "job-token"


def _premaps(tmp_path, active: bool = True, token: str = TOKEN) -> Premaps:
    p = Premaps(str(tmp_path / "offers"), token)
    p.active = active
    return p


def test_an_offered_buffer_is_mapped_early_and_taken_by_the_matching_offer(tmp_path):
    buf = shm.SharedBuffer.create(1 << 20)
    spare, source = _premaps(tmp_path, active=False), _premaps(tmp_path)
    spare.offer("n0s0", buf)
    folder, path = tmp_path / "offers", tmp_path / "offers" / "n0s0.json"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600
    sealed = unseal(TOKEN, "offers/n0s0", path.read_text())
    assert json.loads(sealed) == dict(zip(("pid", "fd", "size"), buf.offer().tolist()))
    source.poll()
    assert source.wait_mapped(30) == 1
    early = source.take(buf.offer(), 1 << 20)
    assert early is not None and early is not buf
    early.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)  # the same bytes as the spare's
    assert buf.tensor[:4].tolist() == [1, 2, 3, 4]
    assert source.take(buf.offer(), 1 << 20) is None  # taken once
    source.hold(early)
    source.poll()  # the next step boundary unmaps it
    with pytest.raises(ValueError):
        early._map[0]
    source.close()
    buf.received()


def _offered_and_mapped(tmp_path) -> tuple[shm.SharedBuffer, Premaps]:
    """A spare's 64 KiB buffer offered, and a source's step boundary that mapped it."""
    buf = shm.SharedBuffer.create(1 << 16)
    _premaps(tmp_path).offer("n0s0", buf)
    source = _premaps(tmp_path)
    source.poll()
    assert source.wait_mapped(30) == 1
    return buf, source


def test_a_mapping_is_not_used_for_another_offer_or_a_state_larger_than_it(tmp_path):
    buf, source = _offered_and_mapped(tmp_path)
    pid, fd, size = buf.offer().tolist()
    assert source.take(torch.tensor([pid, fd + 1000, size]), 1) is None  # no mapping for that offer
    assert source.take(buf.offer(), (1 << 16) + 1) is None  # too small for the state: not used (and dropped)
    source.close()
    buf.received()


def test_a_mapping_of_a_file_no_longer_behind_the_offer_is_refused(tmp_path):
    buf, source = _offered_and_mapped(tmp_path)
    offer = buf.offer()
    fd = int(offer[1])
    os.close(fd)  # the spare's fd now names another memory of the same size
    other = os.memfd_create("other")
    try:
        assert other == fd
        os.ftruncate(other, 1 << 16)
        assert source.take(offer, 1 << 16) is None
    finally:
        os.close(other)
    source.close()


def test_a_withdrawn_offer_is_unmapped_and_an_inactive_rank_maps_nothing(tmp_path):
    buf = shm.SharedBuffer.create(1 << 16)
    spare, source, idle = _premaps(tmp_path, active=False), _premaps(tmp_path), _premaps(tmp_path, active=False)
    spare.offer("n0s0", buf)
    source.poll()
    idle.poll()
    assert source.wait_mapped(30) == 1 and idle.wait_mapped(30) == 0
    spare.withdraw("n0s0")  # promoted: a rank now
    source.poll()
    assert source.wait_mapped(30) == 0 and source.take(buf.offer(), 1) is None
    buf.received()


@pytest.mark.parametrize("content", [
    "not json", json.dumps({"pid": "1", "fd": 3, "size": 10}), json.dumps({"pid": 1, "fd": -1, "size": 10}),
    json.dumps({"pid": 1, "fd": 3}), json.dumps([1, 3, 10]),
])
def test_malformed_offer_files_are_skipped(tmp_path, content):
    folder = tmp_path / "offers"
    folder.mkdir(mode=0o700)
    (folder / "n0s0.json").write_text(seal(TOKEN, "offers/n0s0", content))  # sealed, yet not an offer
    source = _premaps(tmp_path)
    source.poll()
    assert source.wait_mapped(30) == 0


def test_offer_files_with_other_names_links_and_spare_ids_that_are_paths_are_refused(tmp_path):
    buf = shm.SharedBuffer.create(1 << 16)
    folder = tmp_path / "offers"
    folder.mkdir(mode=0o700)
    good = seal(TOKEN, "offers/n0s0", json.dumps(dict(zip(("pid", "fd", "size"), buf.offer().tolist()))))
    (tmp_path / "elsewhere.json").write_text(good)
    (folder / "n0s0.json").symlink_to(tmp_path / "elsewhere.json")  # a link: not opened
    (folder / "../n0s1.json").write_text(good)
    (folder / "x.json").write_text(good)  # no spare id
    source = _premaps(tmp_path)
    source.poll()
    assert source.wait_mapped(30) == 0
    with pytest.raises(ValueError, match="n<node>s<k>"):
        source.offer("../n0s0", buf)
    buf.received()


def test_no_offer_is_written_into_a_folder_others_can_write(tmp_path):
    folder = tmp_path / "offers"
    folder.mkdir(mode=0o777)
    os.chmod(folder, 0o777)
    buf = shm.SharedBuffer.create(1 << 16)
    _premaps(tmp_path).offer("n0s0", buf)  # best effort: no file, no error
    assert list(folder.iterdir()) == []
    buf.received()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    m[2].weight = torch.nn.Parameter(torch.randn(4, 16))
    return m


def test_a_spares_parameters_placed_in_its_receive_buffer_are_written_in_place_and_adopted():
    source, spare = _model(), _model()
    for p in source.parameters():
        p.data.add_(1.0)  # the source trained on: other values than the spare's
    opt = torch.optim.AdamW(source.parameters(), lr=1e-3)
    for p in source.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    captured = state.capture(source, opt)
    nbytes = state.wire_nbytes(captured)
    data = torch.zeros(nbytes + 4096, dtype=torch.uint8)
    params_before = list(spare.parameters())
    values_before = [p.detach().clone() for p in params_before]
    assert state.place_parameters(spare, data) == len(params_before)
    assert all(torch.equal(p, v) for p, v in zip(spare.parameters(), values_before))  # values kept
    ptrs = [p.data_ptr() for p in spare.parameters()]
    assert all(data.data_ptr() <= q < data.data_ptr() + data.numel() for q in ptrs)
    # the source's state packed into that buffer (as a same-node hydration does), then restored adopting it
    flat = state.StateBuffer(state.flatten(captured)[0], data).pack(state.flatten(captured)[1])
    assert flat.data_ptr() == data.data_ptr()
    received = state.unflatten(state.flatten(captured)[0], state.StateBuffer(state.flatten(captured)[0], data).unpack())
    spare_opt = torch.optim.AdamW(spare.parameters(), lr=1e-3)
    state.restore(received, spare, spare_opt, adopt=True)
    assert list(spare.parameters()) == params_before  # the same Parameter objects (hooks, optimizer)
    assert [p.data_ptr() for p in spare.parameters()] == ptrs  # written in place: nothing moved
    for a, b in zip(source.state_dict().values(), spare.state_dict().values()):
        assert torch.equal(a, b)
    assert spare_opt.param_groups[0]["params"] == params_before


def test_adopting_keeps_copying_what_does_not_fit_and_refuses_a_state_of_another_model():
    source, spare = _model(), _model()
    received = state.capture(source)
    received["model"] = {k: v.clone() for k, v in received["model"].items()}
    params = list(spare.parameters())
    state.restore(received, spare, adopt=True)  # fresh tensors: adopted as they are (nothing placed before)
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), spare.state_dict().values()))
    assert list(spare.parameters()) == params
    assert spare[0].weight.data_ptr() == received["model"]["0.weight"].data_ptr()  # no copy
    assert spare[1].weight.data_ptr() == received["model"]["1.weight"].data_ptr()
    del received["model"]["2.bias"]
    with pytest.raises(KeyError, match="2.bias"):
        state.restore(received, _model(), adopt=True)


def test_a_sigkilled_spares_offer_left_behind_is_not_mapped_again_and_again(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    folder = tmp_path / "offers"
    folder.mkdir(mode=0o700)
    (folder / "n0s0.json").write_text(seal(TOKEN, "offers/n0s0", json.dumps({"pid": dead.pid, "fd": 3, "size": 4096})))
    source = _premaps(tmp_path)
    for _ in range(3):
        source.poll()
    assert source.wait_mapped(30) == 0 and source._maps == {}  # no mapping attempted for a process gone


def test_only_hp_receive_buffers_are_attached_never_another_file_of_the_users():
    other = os.memfd_create("not-hp")
    os.ftruncate(other, 4096)
    with tempfile.NamedTemporaryFile() as f:
        f.truncate(4096)
        for fd in (other, f.fileno()):
            with pytest.raises(ValueError, match="no shared buffer of this user's"):
                shm.SharedBuffer.attach(torch.tensor([os.getpid(), fd, 4096]), 10)
    os.close(other)


def test_an_offer_not_sealed_by_this_job_for_that_spare_is_skipped(tmp_path):
    buf = shm.SharedBuffer.create(1 << 16)
    offer = json.dumps(dict(zip(("pid", "fd", "size"), buf.offer().tolist())))
    folder = tmp_path / "offers"
    folder.mkdir(mode=0o700)
    for name, doc in (("n0s0", offer),  # not sealed
                      ("n0s1", seal("another-job", "offers/n0s1", offer)),  # another job's token
                      ("n0s2", seal(TOKEN, "offers/n0s9", offer))):  # moved from another spare's file
        (folder / f"{name}.json").write_text(doc)
    source = _premaps(tmp_path)
    source.poll()
    assert source.wait_mapped(30) == 0 and source._maps == {}
    _premaps(tmp_path, active=False).offer("n0s3", buf)  # this job's own offer is mapped
    source.poll()
    assert source.wait_mapped(30) == 1
    source.close()
    buf.received()


def test_premaps_need_the_job_token(tmp_path):
    with pytest.raises(ValueError, match="job token"):
        Premaps(str(tmp_path / "offers"), "")
