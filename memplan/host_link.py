"""The link between a GPU and host memory: its rate, from the device spec or memplan's
PCIe default, and what offloading saved activations over it costs a micro-step (the
``offload`` checkpoint mode). No torch."""

from __future__ import annotations

from collections.abc import Iterable

from memplan.devices import DeviceSpec

# A CUDA profile planned with no device spec: PCIe 4.0 x16, 32 GB/s per direction raw
# (PCI-SIG), of which about 25 GB/s reach pinned host memory in practice (CUDA samples'
# bandwidthTest on A100 PCIe systems reports 24-26 GB/s).
DEFAULT_HOST_LINK_BYTES_PER_SECOND = 25e9


def host_link_bandwidth(device_spec: DeviceSpec | None) -> tuple[float, str]:
    """Bytes per second between the GPU and host memory, and where the figure comes from."""
    if device_spec is not None:
        if device_spec.host_link_bandwidth > 0:
            return device_spec.host_link_bandwidth, f"{device_spec.display_name} host link"
        return 0.0, f"{device_spec.display_name} has no host_link_bandwidth"
    return DEFAULT_HOST_LINK_BYTES_PER_SECOND, "memplan's default: PCIe 4.0 x16"


def offload_seconds(
    host_bytes: Iterable[int], host_link_bytes_per_second: float
) -> tuple[float, ...]:
    """Per layer: extra seconds per micro-step of offloading ``host_bytes`` — the copy to
    host in forward plus the copy back in backward, at the host link's rate, counted
    without overlap. ``save_on_cpu(pin_memory=True)`` copies into pinned memory with a
    blocking ``copy_`` in forward (torch/autograd/graph.py), so the forward copy does not
    overlap compute; the copy back is ``non_blocking`` and may partly overlap: an upper
    bound."""
    if host_link_bytes_per_second <= 0:
        raise ValueError("host_link_bytes_per_second must be positive")
    return tuple(2 * b / host_link_bytes_per_second for b in host_bytes)
