"""
Flat gradient buckets: one contiguous buffer per (device, dtype) group of tensors, one view per tensor.

This module knows nothing about averaging. It gives :class:`GradientBuckets`, a set of persistent flat
buffers whose per-tensor views keep each tensor's shape and strides (channels_last included), plus the
fused operations gradient accumulation needs: add a list of gradients, zero, copy with a scale (into the averager's
shared buffers, summing each chunk as it is written). Adding can also unscale the gradients and drop them if not
finite, for loss scaling (its two paths, host and device: :mod:`hivemind_accum.buffers.finite_add`). Low-precision
(fp16, bf16) tensors may get float32 buffers.
The layout follows PyTorch DDP's ``gradient_as_bucket_view=True`` (gradients as views of a communication
bucket) and its ``batched_grad_copy`` (one ``_foreach`` op per bucket instead of a per-parameter loop).
"""
import operator
from dataclasses import dataclass, field
from itertools import repeat
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from hivemind_accum.arguments import check_distinct
from hivemind_accum.buffers import finite_add
from hivemind_accum.torch_compat import check_fused_ops, foreach_add_, foreach_copy_, foreach_mul_, foreach_zero_


@dataclass
class GradientBucket:
    """
    One flat buffer and the views it is cut into.

    :param flat: 1-D contiguous buffer holding every tensor of this bucket back to back
    :param indices: positions (in the owner's tensor order) of the tensors stored in this bucket
    :param views: per-tensor views of ``flat``, in the order of ``indices``
    :param source_device: the device of the tensors this bucket mirrors (gradients are read from there)
    :param source_dtype: the dtype of the tensors this bucket mirrors (``flat`` may be float32 for fp16/bf16 ones)
    :param staging: a same-layout buffer of ``flat``'s device and dtype, allocated on first use when gradients must
      be copied (and cast) before they are added: across devices (``accumulate_grads_on``) or across dtypes (float32
      buffers for fp16/bf16 gradients); also, on such buckets, to be unscaled and checked for inf/NaN without a host
      read (:meth:`GradientBuckets.add_finite_`)
    :param drop_mask: a 0-dim bool of ``flat``'s device, allocated on first use: whether
      :meth:`GradientBuckets.add_finite_` drops the micro-step it adds
    :param found_inf: a 0-dim float32 of ``flat``'s device, allocated on first use: whether
      :meth:`GradientBuckets.add_finite_` found inf or NaN in this bucket's sources (the first bucket's: in any)
    :param strides: each view's strides, kept from the first :meth:`GradientBuckets.add_finite_` on the device
    """

    flat: torch.Tensor
    indices: Tuple[int, ...]
    views: List[torch.Tensor]
    source_device: torch.device
    source_dtype: torch.dtype
    staging: Optional["GradientBucket"] = field(default=None, repr=False)
    drop_mask: Optional[torch.Tensor] = field(default=None, repr=False)
    found_inf: Optional[torch.Tensor] = field(default=None, repr=False)
    strides: Optional[List[Tuple[int, ...]]] = field(default=None, repr=False)

    @property
    def needs_staging(self) -> bool:
        """whether gradients must be copied (and cast) into the staging buffer before they are added: they live on
        another device or have another dtype than ``flat``"""
        return self.source_device != self.flat.device or self.source_dtype != self.flat.dtype

    def stage_(self, sources: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
        """copy ``sources`` (one per view, None = zeros) into the staging buffer with one fused copy, cast to the
        buffer's dtype; return the staging buffer flat"""
        if self.staging is None:
            self.staging = _make_bucket(self.views, self.indices, self.flat.device, self.flat.dtype)
        staging = self.staging
        if all(grad is not None and not grad.is_sparse for grad in sources):  # the usual micro-step: no index lists
            foreach_copy_(staging.views, sources)
            return staging.flat
        present = [k for k, grad in enumerate(sources) if grad is not None]
        absent = [staging.views[k] for k, grad in enumerate(sources) if grad is None]
        if absent:
            foreach_zero_(absent)
        if present:
            foreach_copy_(
                [staging.views[k] for k in present],
                [sources[k].to_dense() if sources[k].is_sparse else sources[k] for k in present],
            )
        return staging.flat


def _dense_strides(tensor: torch.Tensor) -> Tuple[int, ...]:
    """strides that ``torch.empty_like`` would give: the tensor's own if dense and non-overlapping
    (e.g. channels_last), contiguous otherwise; computed on the meta device, allocating nothing"""
    return torch.empty_like(tensor, device="meta").stride()


LOW_PRECISION = (torch.float16, torch.bfloat16)


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for fp16/bf16, else ``dtype``: the dtype fp16/bf16 gradients are accumulated, averaged or summed in
    where they are upcast"""
    return torch.float32 if dtype in LOW_PRECISION else dtype




def _make_bucket(
    likes: Sequence[torch.Tensor],
    indices: Tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype,
    share_memory: bool = False,
    pin_memory: bool = False,
) -> GradientBucket:
    """allocate one zero-filled flat buffer of ``dtype`` for ``likes`` (in order), cut into views of their shapes"""
    flat = torch.zeros(sum(like.numel() for like in likes), dtype=dtype, device=device, pin_memory=pin_memory)
    if share_memory:
        flat.share_memory_()
    views, offset = [], 0
    for like in likes:
        views.append(flat.as_strided(like.shape, _dense_strides(like), offset))
        offset += like.numel()
    return GradientBucket(
        flat=flat, indices=indices, views=views, source_device=likes[0].device, source_dtype=likes[0].dtype
    )


class GradientBuckets:
    """
    Persistent flat buffers mirroring a sequence of tensors, one buffer per (source device, dtype) group.

    :param tensors: tensors to mirror (typically model parameters); only their shape, strides, dtype and device
      are read. ``views[i]`` has the shape and strides of ``tensors[i]`` and its dtype (see ``upcast``).
    :param device: where to place the buffers; by default each bucket lives on its tensors' own device.
    :param share_memory: if True, move every buffer to shared memory (``Tensor.share_memory_``), as hivemind
      averagers need for the tensors their background process all-reduces; use with ``device="cpu"``.
    :param upcast: if True, float16 and bfloat16 tensors get float32 buffers (and float32 views); tensors are still
      grouped by their own dtype, so buckets built from the same tensors with and without ``upcast`` pair up.
    :param pin_memory: if True, allocate the buffers in page-locked host memory (``device="cpu"``, needs an
      accelerator), so that copies from an accelerator into them can run without blocking
    :raises ValueError: if ``tensors`` is empty or holds a non-tensor, a sparse or meta tensor, a non-float dtype or
      the same tensor twice (the message names the offending positions as ``parameters[i]``), or if ``device``
      cannot be allocated on.
    :raises TorchInternalsError: if this torch release lacks or changed a fused op (see ``check_fused_ops``)
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        device: Optional[torch.device] = None,
        share_memory: bool = False,
        upcast: bool = False,
        pin_memory: bool = False,
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
                raise ValueError(
                    f"parameters[{i}]: is on the meta device and holds no data; materialize the model first"
                )
            if not tensor.is_floating_point():
                raise ValueError(f"parameters[{i}]: dtype {tensor.dtype} cannot hold gradients, use a float dtype")
            groups.setdefault((tensor.device, tensor.dtype), []).append(i)
        check_distinct((f"parameters[{i}]", tensor) for i, tensor in enumerate(tensors))

        if device is not None:
            try:
                torch.empty(0, device=device)
            except (RuntimeError, AssertionError) as e:
                raise ValueError(f"accumulate_grads_on: cannot place accumulators on device {device!r} ({e})") from e
        check_fused_ops()  # before any buffer is built: the ops that will add into them exist and add
        self.buckets: List[GradientBucket] = [
            _make_bucket(
                [tensors[i] for i in indices],
                tuple(indices),
                device=torch.device(device) if device is not None else source_device,
                dtype=wide_dtype(dtype) if upcast else dtype,
                share_memory=share_memory,
                pin_memory=pin_memory,
            )
            for (source_device, dtype), indices in groups.items()
        ]
        views: List[Optional[torch.Tensor]] = [None] * len(tensors)
        for bucket in self.buckets:
            for i, view in zip(bucket.indices, bucket.views):
                views[i] = view
        self.views: Tuple[torch.Tensor, ...] = tuple(views)
        self._single = len(self.buckets) == 1  # then its indices are 0, 1, ...: sources need no regrouping

    def pairs_with(self, other: "GradientBuckets") -> bool:
        """whether ``other`` groups the same tensors into buckets in the same order and layout (strides), so that
        bucket-to-bucket copies apply"""
        def layout(buckets: "GradientBuckets"):
            return [(bucket.indices, [view.stride() for view in bucket.views]) for bucket in buckets.buckets]

        return layout(self) == layout(other)

    @torch.no_grad()
    def add_(self, sources: Sequence[Optional[torch.Tensor]], alpha: float = 1.0) -> None:
        """
        ``views[i] += alpha * sources[i]`` for every i: one fused ``_foreach_add_`` per bucket, or, for a bucket whose
        buffer differs from its sources in device or dtype, one fused copy into a persistent staging buffer and one
        flat ``add_`` (no per-step allocation, no per-tensor kernel).

        :param sources: one tensor or None per view, of the view's shape and the source tensor's dtype, on the
          bucket's source device; None entries contribute nothing. Sparse sources are added densely.
        :param alpha: scalar weight applied to every source
        """
        for bucket in self.buckets:
            grads = sources if self._single else [sources[i] for i in bucket.indices]
            if not any(map(operator.is_, grads, repeat(None))):
                if bucket.needs_staging:
                    bucket.flat.add_(bucket.stage_(grads), alpha=alpha)
                else:
                    with torch.inference_mode():  # the fused op's per-tensor adds skip autograd's dispatch
                        foreach_add_(bucket.views, grads, alpha=alpha)
            elif not all(map(operator.is_, grads, repeat(None))):
                if bucket.needs_staging:
                    bucket.flat.add_(bucket.stage_(grads), alpha=alpha)
                else:
                    present = [k for k, grad in enumerate(grads) if grad is not None]
                    foreach_add_([bucket.views[k] for k in present], [grads[k] for k in present], alpha=alpha)

    @torch.no_grad()
    def add_finite_(
        self, sources: Sequence[Optional[torch.Tensor]], inv_scale: torch.Tensor, alpha: float = 1.0
    ) -> torch.Tensor:
        """
        ``views[i] += alpha * inv_scale * sources[i]`` for every i if every source is finite; if any element of any
        source is inf or NaN, add nothing at all. With everything on the CPU the decision is read on the host (one
        read-only pass, then :meth:`add_`); the sources are not modified. Otherwise it stays on the device: where a
        bucket's buffer shares its sources' device, dtype and strides, the sources are unscaled in place (as
        ``torch.amp.GradScaler.unscale_`` does) and added by a fused kernel that skips the add on overflow, two passes
        and no buffer; other buckets copy their sources into a staging buffer, kept from the first call on, then
        unscale, mask and add it. All paths give bit-identical sums for power-of-two scales and ``alpha``
        (docs/guide.md#no-host-read-per-micro-step).

        :param sources: as in :meth:`add_`
        :param inv_scale: 0-dim floating-point tensor of any float dtype, ``1 / loss_scale`` (``1.0`` for already
          unscaled gradients), on any device; copied to each bucket's device (blocking only towards the CPU)
        :param alpha: scalar weight applied to every source
        :returns: ``found_inf``, a 0-dim float32 tensor on the first bucket's device: 1.0 if the sources were
          dropped, 0.0 if they were added; off the host path the same tensor each call, overwritten by the next one
          (in stream order)
        """
        if inv_scale.dtype != torch.float32:  # the unscale kernel takes float32 only; a cast on the device, no sync
            inv_scale = inv_scale.float()
        if finite_add.host_check_is_free(self):
            return finite_add.add_finite_with_host_check(self, sources, inv_scale, alpha)
        return finite_add.add_finite_on_device(self, sources, inv_scale, alpha)

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
          (a float32 source rounded once into an fp16/bf16 destination), otherwise one bulk copy and one in-place
          ``mul_``; or one tensor per view, of the same shape, on any device: per bucket one fused ``_foreach_copy_``
          and one ``_foreach_mul_``.
        :param scale: multiplier, e.g. ``1 / micro_steps`` for averaging-time normalization
        """
        if isinstance(destination, GradientBuckets):
            for src, dst in zip(self.buckets, destination.buckets):
                if _mul_fits(src.flat, dst.flat):
                    torch.mul(src.flat, scale, out=dst.flat)
                else:
                    dst.flat.copy_(src.flat)
                    dst.flat.mul_(scale)
            return
        for bucket in self.buckets:
            targets = [destination[i] for i in bucket.indices]
            foreach_copy_(targets, bucket.views)
            foreach_mul_(targets, scale)

    @torch.no_grad()
    def scaled_copy_with_checksums_(self, destination: "GradientBuckets", scale: float) -> torch.Tensor:
        """
        :meth:`scaled_copy_to_` into buckets, summing what was written chunk by chunk while each chunk of the
        destination is still in cache (:data:`CHECK_CHUNK` elements), instead of a separate read pass.

        :param destination: buckets built from the same tensors (same grouping and layout)
        :param scale: multiplier, as in :meth:`scaled_copy_to_`
        :returns: a 1-D float32 tensor on the CPU holding the sum of every chunk written (inf or NaN if that chunk
          holds any: see :func:`hivemind_accum.rounds.finite.all_finite`)
        :raises ValueError: if ``destination`` is not :class:`GradientBuckets`
        """
        if not isinstance(destination, GradientBuckets):
            raise ValueError("destination: checksums need GradientBuckets as the destination")
        pairs = list(zip(self.buckets, destination.buckets))
        sums = torch.empty(sum(-(-dst.flat.numel() // CHECK_CHUNK) for _, dst in pairs), dtype=torch.float32)
        slots = iter(sums.unbind())
        for src, dst in pairs:
            _scaled_copy_with_checksums(src.flat, dst.flat, scale, slots)
        return sums


# elements per chunk of the averaging-time load's checksums: a chunk of the destination and of the source (float32: 2 x
# 1 MiB) stay in a core's L2 or L3 cache between the write and the sum (see docs/measurement.md#floor-costs)
CHECK_CHUNK = 1 << 18


def _scaled_copy_with_checksums(src: torch.Tensor, dst: torch.Tensor, scale: float, slots: Iterator[torch.Tensor]):
    """``dst = scale * src`` (1-D buffers of the same length) and, for each chunk of ``dst`` just written, its sum
    into the next 0-dim float32 tensor of ``slots``: the sum reads the chunk from cache, not memory. Across devices
    the copy is one bulk transfer first, then the scale and sum go chunk by chunk on ``dst``"""
    same_device = src.device == dst.device
    if not same_device:
        dst.copy_(src)
    for src_chunk, dst_chunk in zip(src.split(CHECK_CHUNK), dst.split(CHECK_CHUNK)):
        if _mul_fits(src, dst):
            torch.mul(src_chunk, scale, out=dst_chunk)
        else:
            if same_device:
                dst_chunk.copy_(src_chunk)
            dst_chunk.mul_(scale)
        torch.sum(dst_chunk, dim=0, dtype=torch.float32, out=next(slots))


def _mul_fits(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """whether ``torch.mul(src, scale, out=dst)`` writes the scaled copy directly: same device, and ``src``'s dtype at
    least as wide as ``dst``'s (float32 into bf16 is rounded once; bf16 into float32 would be scaled in bf16)"""
    return src.device == dst.device and src.dtype.itemsize >= dst.dtype.itemsize
