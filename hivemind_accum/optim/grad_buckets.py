"""
Flat gradient buckets: one contiguous buffer per (device, dtype) group of tensors, one view per tensor.

This module knows nothing about averaging. It gives :class:`GradientBuckets`, a set of persistent flat
buffers whose per-tensor views keep each tensor's shape and strides (channels_last included), plus the
three fused operations gradient accumulation needs: add a list of gradients, zero, copy with a scale.
The layout follows PyTorch DDP's ``gradient_as_bucket_view=True`` (gradients as views of a communication
bucket) and its ``batched_grad_copy`` (one ``_foreach`` op per bucket instead of a per-parameter loop).
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch


@dataclass
class GradientBucket:
    """
    One flat buffer and the views it is cut into.

    :param flat: 1-D contiguous buffer holding every tensor of this bucket back to back
    :param indices: positions (in the owner's tensor order) of the tensors stored in this bucket
    :param views: per-tensor views of ``flat``, in the order of ``indices``
    :param source_device: the device of the tensors this bucket mirrors (gradients are read from there)
    :param staging: a same-layout buffer on ``flat``'s device, allocated on first use when gradients must cross
      devices before they are added (``accumulate_grads_on`` differs from the parameters' device)
    """

    flat: torch.Tensor
    indices: Tuple[int, ...]
    views: List[torch.Tensor]
    source_device: torch.device
    staging: Optional["GradientBucket"] = field(default=None, repr=False)


def _dense_strides(tensor: torch.Tensor) -> Tuple[int, ...]:
    """strides that ``torch.empty_like`` would give: the tensor's own if dense and non-overlapping
    (e.g. channels_last), contiguous otherwise; computed on the meta device, allocating nothing"""
    return torch.empty_like(tensor, device="meta").stride()


def _make_bucket(
    likes: Sequence[torch.Tensor],
    indices: Tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype,
    share_memory: bool = False,
) -> GradientBucket:
    """allocate one zero-filled flat buffer for ``likes`` (in order) and cut it into views of their shapes"""
    flat = torch.zeros(sum(like.numel() for like in likes), dtype=dtype, device=device)
    if share_memory:
        flat.share_memory_()
    views, offset = [], 0
    for like in likes:
        views.append(flat.as_strided(like.shape, _dense_strides(like), offset))
        offset += like.numel()
    return GradientBucket(flat=flat, indices=indices, views=views, source_device=likes[0].device)


class GradientBuckets:
    """
    Persistent flat buffers mirroring a sequence of tensors, one buffer per (source device, dtype) group.

    :param tensors: tensors to mirror (typically model parameters); only their shape, strides, dtype and device
      are read. ``views[i]`` has the shape, strides and dtype of ``tensors[i]``.
    :param device: where to place the buffers; by default each bucket lives on its tensors' own device.
    :param share_memory: if True, move every buffer to shared memory (``Tensor.share_memory_``), as hivemind
      averagers need for the tensors their background process all-reduces; use with ``device="cpu"``.
    :raises ValueError: if ``tensors`` is empty or holds a non-tensor, a sparse or meta tensor or a non-float dtype
      (the message names the offending position as ``parameters[i]``), or if ``device`` cannot be allocated on.
    """

    def __init__(
        self, tensors: Sequence[torch.Tensor], *, device: Optional[torch.device] = None, share_memory: bool = False
    ):
        tensors = tuple(tensors)
        if len(tensors) == 0:
            raise ValueError("parameters: expected at least one tensor, got an empty sequence")
        groups: Dict[Tuple[torch.device, torch.dtype], List[int]] = {}
        for i, tensor in enumerate(tensors):
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"parameters[{i}]: expected a torch.Tensor, got {type(tensor).__name__}")
            if tensor.layout != torch.strided:
                raise ValueError(f"parameters[{i}]: {tensor.layout} parameters are not supported, use dense ones")
            if tensor.device.type == "meta":
                raise ValueError(f"parameters[{i}]: is on the meta device and holds no data; materialize the model first")
            if not tensor.is_floating_point():
                raise ValueError(f"parameters[{i}]: dtype {tensor.dtype} cannot hold gradients, use a float dtype")
            groups.setdefault((tensor.device, tensor.dtype), []).append(i)

        if device is not None:
            try:
                torch.empty(0, device=device)
            except (RuntimeError, AssertionError) as e:
                raise ValueError(f"accumulate_grads_on: cannot place accumulators on device {device!r} ({e})") from e
        self.buckets: List[GradientBucket] = [
            _make_bucket(
                [tensors[i] for i in indices],
                tuple(indices),
                device=torch.device(device) if device is not None else source_device,
                dtype=dtype,
                share_memory=share_memory,
            )
            for (source_device, dtype), indices in groups.items()
        ]
        views: List[Optional[torch.Tensor]] = [None] * len(tensors)
        for bucket in self.buckets:
            for i, view in zip(bucket.indices, bucket.views):
                views[i] = view
        self.views: Tuple[torch.Tensor, ...] = tuple(views)

    @torch.no_grad()
    def add_(self, sources: Sequence[Optional[torch.Tensor]], alpha: float = 1.0) -> None:
        """
        ``views[i] += alpha * sources[i]`` for every i, with one fused ``_foreach_add_`` per bucket.

        :param sources: one tensor or None per view, same shapes and dtypes as the views, on the bucket's source
          device; None entries contribute nothing. Sparse sources are added densely.
        :param alpha: scalar weight applied to every source
        """
        for bucket in self.buckets:
            grads = [sources[i] for i in bucket.indices]
            views = bucket.views
            present = None
            if any(grad is None for grad in grads):
                present = [k for k, grad in enumerate(grads) if grad is not None]
                grads, views = [grads[k] for k in present], [views[k] for k in present]
                if not grads:
                    continue
            if bucket.source_device != bucket.flat.device:
                # e.g. accumulate_grads_on="cpu" for CUDA gradients: one fused copy into a persistent staging
                # buffer on the accumulator's device, then the fused add; no per-step allocation
                if bucket.staging is None:
                    bucket.staging = _make_bucket(bucket.views, bucket.indices, bucket.flat.device, bucket.flat.dtype)
                staging = bucket.staging.views if present is None else [bucket.staging.views[k] for k in present]
                torch._foreach_copy_(staging, grads)
                grads = staging
            torch._foreach_add_(views, grads, alpha=alpha)

    @torch.no_grad()
    def zero_(self) -> None:
        """set every buffer to zero: one ``zero_`` per bucket"""
        for bucket in self.buckets:
            bucket.flat.zero_()

    @torch.no_grad()
    def scaled_copy_to_(self, destination: Union["GradientBuckets", Sequence[torch.Tensor]], scale: float) -> None:
        """
        ``destination[i] = scale * views[i]`` for every i.

        :param destination: either buckets built from the same tensors (same grouping and layout, e.g. the
          averager's shared CPU buffers): per bucket one ``torch.mul(..., out=)`` when both buffers share a device
          and dtype, otherwise one bulk copy and one in-place ``mul_``; or one tensor per view, of the same shape,
          on any device: per bucket one fused ``_foreach_copy_`` and one ``_foreach_mul_``.
        :param scale: multiplier, e.g. ``1 / micro_steps`` for averaging-time normalization
        """
        if isinstance(destination, GradientBuckets):
            for src, dst in zip(self.buckets, destination.buckets):
                if src.flat.device == dst.flat.device and src.flat.dtype == dst.flat.dtype:
                    torch.mul(src.flat, scale, out=dst.flat)
                else:
                    dst.flat.copy_(src.flat)
                    dst.flat.mul_(scale)
        else:
            for bucket in self.buckets:
                targets = [destination[i] for i in bucket.indices]
                torch._foreach_copy_(targets, bucket.views)
                torch._foreach_mul_(targets, scale)
