"""Where a group's memory lives: its parameters' device, checked against the mesh's."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def target_device(names: Mapping[nn.Parameter, str], mesh: DeviceMesh) -> torch.device:
    """The device a group's buffers live on: its parameters' one device, or the mesh's.

    Parameters on the CPU for a CUDA mesh go to the current CUDA device (FSDP2 moves them
    too); the meta device stays (the group is materialized later).

    Raises:
        ValueError: The parameters are on several devices, or on another device type than
            the mesh's, naming them.

    Example:
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> target_device({nn.Parameter(torch.ones(2)): "w"}, init_device_mesh("cpu", (1,)))
        device(type='cpu')
    """
    devices = {p.device for p in names}
    if len(devices) > 1:
        by_device = {str(d): names[next(p for p in names if p.device == d)] for d in devices}
        raise ValueError(
            f"fully_shard needs the group's parameters on one device; found {by_device} "
            f"(device: first parameter on it)"
        )
    (device,) = devices
    if device.type == "meta":
        return device
    if mesh.device_type == "cuda" and device.type == "cpu":
        return torch.device("cuda", torch.cuda.current_device())
    if device.type != mesh.device_type:
        raise ValueError(
            f"parameters are on {device} but the mesh is on {mesh.device_type}; move the "
            f"module to the mesh's device type first"
        )
    return device
