"""In-process peer transport: one process drives every GPU of its EP groups (CUDA peer access over NVLink).

Per mesh axis, one native group per EP group (rank order = order along the axis), all in one group set so a single
axis binding serves every EP group of a (dp x ep) mesh: each device finds the group that holds it.
"""

from __future__ import annotations

import dataclasses

import jax

from .. import _native
from ..errors import EPError


def local_ordinal(device_id: int) -> int:
    for d in jax.local_devices():
        if d.id == device_id:
            return int(getattr(d, "local_hardware_id", d.id))
    raise EPError(f"jax_ep.initialize: device {device_id} is not local to this process")


@dataclasses.dataclass
class PeerTransport:
    buffer_bytes: int
    sets: dict  # axis -> set id
    ids: list  # every group id
    name: str = "cuda-peer"

    @classmethod
    def connect(cls, groups: dict, axes, buffer_bytes: int) -> "PeerTransport":
        """groups: axis -> [GroupInfo] (device ids in rank order). Allocates, enables peer access, warms up."""
        native = _native.module()
        sets, ids = {}, []
        try:
            for axis in axes:
                set_id = -1
                for group in groups[axis]:
                    ordinals = [local_ordinal(d) for d in group.device_ids]
                    gid = native.group_create(ordinals, buffer_bytes, set_id)
                    ids.append(gid)
                    if set_id < 0:
                        set_id = gid
                sets[axis] = set_id
        except BaseException:
            for gid in ids:
                native.group_destroy(gid)
            raise
        return cls(buffer_bytes=buffer_bytes, sets=sets, ids=ids)

    def set_id(self, axis: str) -> int:
        return self.sets[axis]

    def group_ids(self) -> list[int]:
        return list(self.ids)

    def summary(self) -> dict:
        return {"transport": self.name, "buffer_bytes": self.buffer_bytes, "groups": len(self.ids)}

    def teardown(self, timeout_s: float) -> None:
        native = _native.module()
        errors = []
        for gid in self.ids:
            try:
                native.group_destroy(gid)
            except Exception as e:  # noqa: BLE001 - free the others, then report
                errors.append(f"group {gid}: {e}")
        self.ids.clear()
        if errors:
            raise EPError("jax_ep.finalize: " + "; ".join(errors))
