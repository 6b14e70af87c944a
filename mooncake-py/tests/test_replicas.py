"""Replica descriptors, batch_replica_clear, and copy/move tasks."""

import time

import pytest

from conftest import connect, wait_lease
from mooncake_rs.store import (
    Descriptor,
    MooncakeDistributedStore,
    QueryTaskResponse,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    TaskStatus,
    TaskType,
)

INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
TASK_NOT_FOUND = -1400


@pytest.fixture()
def trio(master):
    """Three clients, each giving a segment to the pool."""
    stores = [connect(master, segment=16 << 20) for _ in range(3)]
    yield stores
    stores[0].remove_all(True)
    for s in stores:
        s.close()


def segment_of(s, key):
    return [d.segment_name for d in s.get_replica_desc(key)]


def on(s, store):
    """A config placing on `store`'s segment (named as the reference names it)."""
    cfg = ReplicateConfig()
    cfg.preferred_segment = store.get_hostname()
    return cfg


def wait_task(s, task_id, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        resp, rc = s.query_task(task_id)
        assert rc == 0 and isinstance(resp, QueryTaskResponse)
        if resp.status in (TaskStatus.SUCCESS, TaskStatus.FAILED):
            return resp
        assert time.monotonic() < deadline, resp
        time.sleep(0.01)


def test_replica_descriptors(trio):
    a, b, c = trio
    cfg = ReplicateConfig()
    cfg.replica_num = 2
    assert a.put("two", b"x" * 1000, cfg) == 0
    descs = a.get_replica_desc("two")
    assert len(descs) == 2
    names = set()
    for d in descs:
        assert isinstance(d, ReplicaDescriptor)
        assert d.status == ReplicaStatus.COMPLETE and d.status.name == "COMPLETE"
        assert d.is_memory_replica() and not d.is_disk_replica() and not d.is_local_disk_replica()
        assert not d.is_nof_replica()
        buf = d.get_memory_descriptor().buffer_descriptor
        assert isinstance(buf, Descriptor) and buf.size == 1000
        assert d.segment_name.split("#")[0] == buf.transport_endpoint
        names.add(d.segment_name)
        with pytest.raises(RuntimeError):
            d.get_disk_descriptor()
        with pytest.raises(RuntimeError):
            d.get_local_disk_descriptor()
    assert len(names) == 2
    assert a.get_replica_desc("missing") == []
    got = b.batch_get_replica_desc(["two", "missing", "two"])
    assert set(got) == {"two"} and len(got["two"]) == 2
    assert b.batch_get_replica_desc([]) == {}
    # Asking is not reading: no lease is left behind, the object goes at once.
    assert a.remove("two") == 0


def test_batch_replica_clear(trio):
    a, b, c = trio
    cfg = ReplicateConfig()
    cfg.replica_num = 2
    cfg.preferred_segments = [a.get_hostname(), b.get_hostname()]
    for k in ("c1", "c2", "c3"):
        assert a.put(k, k.encode() * 100, cfg) == 0
    seg_a = [n for n in segment_of(a, "c1") if n.split("#")[0].endswith(a.get_hostname().rsplit(":", 1)[1])][0]
    # Only the replicas on a's segment go; the objects live on in b's.
    assert a.batch_replica_clear(["c1", "c2", "missing"], seg_a) == ["c1", "c2"]
    assert len(segment_of(a, "c1")) == 1 and seg_a not in segment_of(a, "c1")
    assert c.get("c1") == b"c1" * 100
    wait_lease()
    # Named as the reference names segments (host:port).
    assert a.batch_replica_clear(["c3"], a.get_hostname()) == ["c3"]
    # Nothing of them is there any more; an unknown segment clears nothing.
    assert a.batch_replica_clear(["c1"], seg_a) == []
    assert a.batch_replica_clear(["c1"], "nowhere:1") == []
    # The last replica: the object goes.
    assert a.batch_replica_clear(["c1"], b.get_hostname()) == ["c1"]
    assert a.get("c1") == b""
    # No segment: the objects are removed.
    assert a.batch_replica_clear(["c2", "c3", "missing"]) == ["c2", "c3"]
    assert a.batch_is_exist(["c2", "c3"]) == [0, 0]
    assert MooncakeDistributedStore().batch_replica_clear(["x"]) == []


def test_copy_task(trio):
    a, b, c = trio
    data = bytes(range(256)) * 400
    assert a.put("copied", data, on(a, a)) == 0
    task_id, rc = a.create_copy_task("copied", [b.get_hostname(), c.get_hostname()])
    assert rc == 0 and isinstance(task_id, tuple) and len(task_id) == 2
    resp = wait_task(a, task_id)
    assert resp.status == TaskStatus.SUCCESS and resp.type == TaskType.REPLICA_COPY, resp
    assert resp.id == task_id and resp.message == ""
    assert resp.last_updated_at_ms_epoch >= resp.created_at_ms_epoch > 0
    assert "QueryTaskResponse(" in repr(resp)
    assert len(segment_of(a, "copied")) == 3
    # Every replica holds the bytes: drop the others one by one and read.
    for s in (a, b):
        assert a.batch_replica_clear(["copied"], s.get_hostname()) == ["copied"]
        assert c.get("copied") == data
        wait_lease()  # a read's lease keeps its replicas (clear skips leased objects)
    # Copying to where it already is: nothing to do.
    task_id, rc = a.create_copy_task("copied", [c.get_hostname()])
    assert rc == 0 and wait_task(a, task_id).status == TaskStatus.SUCCESS
    assert len(segment_of(a, "copied")) == 1


def test_copy_task_errors(trio):
    a, b, _ = trio
    assert a.put("src", b"x", on(a, a)) == 0
    assert a.create_copy_task("src", []) == ((0, 0), INVALID_PARAMS)
    assert a.create_copy_task("missing", [b.get_hostname()]) == ((0, 0), OBJECT_NOT_FOUND)
    assert a.create_copy_task("src", ["nowhere:1"]) == ((0, 0), INVALID_PARAMS)
    assert a.query_task((1, 2)) == (None, TASK_NOT_FOUND)
    assert MooncakeDistributedStore().create_copy_task("src", ["x"]) == ((0, 0), INVALID_PARAMS)


def test_move_task(trio):
    a, b, c = trio
    data = b"move me " * 1000
    assert a.put("moved", data, on(a, a)) == 0
    src = a.get_hostname()
    task_id, rc = c.create_move_task("moved", src, b.get_hostname())
    assert rc == 0
    resp = wait_task(c, task_id)
    assert resp.status == TaskStatus.SUCCESS and resp.type == TaskType.REPLICA_MOVE, resp
    [name] = segment_of(a, "moved")
    assert name.split("#")[0].endswith(":" + b.get_hostname().rsplit(":", 1)[1])
    assert a.get("moved") == data
    # A task is known to the client that created it.
    assert a.query_task(task_id) == (None, TASK_NOT_FOUND)


def test_move_task_errors(trio):
    a, b, c = trio
    assert a.put("m", b"x", on(a, a)) == 0
    assert a.create_move_task("missing", a.get_hostname(), b.get_hostname()) == ((0, 0), OBJECT_NOT_FOUND)
    assert a.create_move_task("m", a.get_hostname(), a.get_hostname()) == ((0, 0), INVALID_PARAMS)
    # The source holds no replica of it.
    assert a.create_move_task("m", b.get_hostname(), c.get_hostname()) == ((0, 0), INVALID_PARAMS)
    assert a.create_move_task("m", a.get_hostname(), "nowhere:1") == ((0, 0), INVALID_PARAMS)
