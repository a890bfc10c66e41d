"""Copying a host tensor to a device without making the host wait (every floor uses it: backends,
layers, towers, preprocessing)."""
import torch


def to_device(host: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """`host` (a CPU tensor) on `device` without making the host wait for the device: to CUDA it goes
    through pinned memory as an asynchronous copy (a plain pageable copy waits for every kernel queued
    before it, stalling a pipeline of tower calls); elsewhere a plain `.to`."""
    device = torch.device(device) if device is not None else host.device
    if device.type == "cuda" and host.device.type == "cpu":
        if torch.cuda.is_current_stream_capturing():  # the graph would replay the copy from freed host memory
            raise RuntimeError("a host tensor was copied to the GPU inside a CUDA graph capture; build what a "
                               "tower call needs from the host (its plan) before capturing")
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
