"""The one per-item status of batch results (dsec.types.v1.ItemStatus): one encoder, one
decoder, in the error vocabulary (libdsec.errors)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from dsec.apiserver.v1 import apiserver_pb2
from dsec.edge.v1 import edge_pb2
from dsec.iam.v1 import iam_pb2
from dsec.placement.v1 import placement_pb2
from dsec.types.v1 import types_pb2
from libdsec import errors
from libdsec.errors import (
    DSecError,
    EdgeCapacity,
    NodeDiskLow,
    QuotaExceeded,
    SandboxTerminated,
    item_error,
    item_status,
)


@pytest.mark.parametrize(
    "err",
    [
        QuotaExceeded("sandboxes would be 33 > 32", metadata={"project": "root/a"}),
        NodeDiskLow("disk low", metadata={"edge": "e1", "free_mb": "10"}),
        SandboxTerminated("ended", metadata={"termination_reason": "EDGE_LOST"}),
        EdgeCapacity("full", reason="SOME_NEW_REASON"),  # an unknown reason: the code's class
    ],
)
def test_an_error_round_trips_as_its_most_specific_class(err: DSecError) -> None:
    status = item_status(err)
    assert status.code == err.code.value[0]
    back = item_error(types_pb2.ItemStatus.FromString(status.SerializeToString()))
    assert type(back) is type(err) or (
        err.reason == "SOME_NEW_REASON" and type(back) is errors.ResourceExhausted
    )
    assert (back.reason, back.message, back.metadata) == (err.reason, err.message, err.metadata)


def test_the_encoder_writes_into_a_results_own_field() -> None:
    r = edge_pb2.CreateSandboxesResult()
    assert not r.HasField("error") and r.error.code == 0  # unset = admitted
    item_status(EdgeCapacity("no room", metadata={"edge": "e1"}), r.error)
    assert r.HasField("error")
    assert (r.error.code, r.error.reason) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
        "EDGE_CAPACITY",
    )
    assert isinstance(item_error(r.error), EdgeCapacity)


def test_an_unknown_code_number_decodes_as_the_root_class() -> None:
    back = item_error(types_pb2.ItemStatus(code=999, reason="X", message="?"))
    assert type(back) is DSecError and back.reason == "X"


def test_every_batch_result_carries_the_one_shape() -> None:
    """The ten per-item results, each with `error` of ItemStatus; the old fields reserved."""
    shapes: list[Any] = [
        apiserver_pb2.CreateSandboxResult,
        apiserver_pb2.TaskSandboxResult,
        apiserver_pb2.TaskEdgeError,
        apiserver_pb2.StreamFunctionsResponse,
        edge_pb2.CreateSandboxesResult,
        edge_pb2.SandboxActionResult,
        edge_pb2.StreamFunctionsResponse,
        placement_pb2.Placement,
        placement_pb2.GroupPlacement,
        iam_pb2.ReserveQuotaResult,
    ]
    for cls in shapes:
        fields = cls.DESCRIPTOR.fields_by_name
        assert fields["error"].message_type is types_pb2.ItemStatus.DESCRIPTOR, cls
        assert not {n for n in fields if n.startswith("error_")}, cls
