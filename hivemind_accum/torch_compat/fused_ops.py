"""
torch's fused (``_foreach``) ops, the unscale kernel and the fused skipping add that gradient accumulation uses, each
checked on small CPU tensors at its first use in the process (:mod:`hivemind_accum.torch_compat.checks`).

:func:`check_fused_ops` runs when the first accumulators are built or an op is first called, before anything the
caller passed is modified. Fused ops that lack a kernel for sparse tensors on some releases (torch 2.3's
``_foreach_add_`` and ``_foreach_zero_`` have none for ``SparseCPU``) fall back to one op per sparse tensor, the dense
tensors still in one fused op.
"""
from typing import Callable, Dict, Sequence, Set, Tuple

import torch

from hivemind_accum.torch_compat.checks import changed, check_once, check_op

def _adds(op: Callable) -> bool:
    tensors = [torch.tensor([0.0, 1.0])]
    op(tensors, [torch.tensor([1.0, 2.0])], alpha=2.0)
    return tensors[0].tolist() == [2.0, 5.0]


def _zeroes(op: Callable) -> bool:
    tensors = [torch.tensor([1.0, 2.0])]
    op(tensors)
    return tensors[0].tolist() == [0.0, 0.0]


def _copies(op: Callable) -> bool:
    targets = [torch.zeros(2)]
    op(targets, [torch.tensor([1.0, 2.0])])
    return targets[0].tolist() == [1.0, 2.0]


def _multiplies(op: Callable) -> bool:
    tensors = [torch.tensor([1.0, 2.0])]
    op(tensors, 3.0)
    return tensors[0].tolist() == [3.0, 6.0]


# the fused ops gradient accumulation uses, each with its small example
FUSED_OPS = {
    "_foreach_add_": _adds, "_foreach_zero_": _zeroes, "_foreach_copy_": _copies, "_foreach_mul_": _multiplies,
}


def _check_fused_ops() -> None:
    for name, example in FUSED_OPS.items():
        check_op(name, example, "accumulates gradients with this fused op")


def check_fused_ops() -> None:
    """
    Check, once per process, that torch's ``_foreach_add_``, ``_foreach_zero_``, ``_foreach_copy_`` and
    ``_foreach_mul_`` exist and compute what this package uses them for, on small CPU tensors. Gradient buckets call
    it when they are built, and every fused op of this module before it runs.

    :raises TorchInternalsError: naming the torch version and the first op that is missing or computes other values
    """
    check_once("fused ops", _check_fused_ops)


def foreach_copy_(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for every i, in one fused ``_foreach_copy_``"""
    check_fused_ops()
    torch._foreach_copy_(targets, sources)


def foreach_mul_(tensors: Sequence[torch.Tensor], scalar: float) -> None:
    """``tensors[i].mul_(scalar)`` for every i, in one fused ``_foreach_mul_``"""
    check_fused_ops()
    torch._foreach_mul_(tensors, scalar)


_NO_SPARSE_KERNEL: Set[str] = set()  # fused ops this torch release refused a sparse tensor for (learnt at first use)


def foreach_add_(tensors: Sequence[torch.Tensor], others: Sequence[torch.Tensor], alpha: float = 1.0) -> None:
    """
    ``tensors[i] += alpha * others[i]`` for every i, in one fused ``_foreach_add_``. Where that op has no kernel for
    sparse tensors (torch 2.3), the dense ``others`` are still added in one fused op and each sparse one by its own
    ``add_``.

    :param tensors: dense tensors, modified in place
    :param others: one tensor per entry of ``tensors``, of its shape; dense or sparse
    :param alpha: scalar weight applied to every entry of ``others``
    :raises TorchInternalsError: see :func:`check_fused_ops`
    """
    check_fused_ops()
    if "add" not in _NO_SPARSE_KERNEL:
        try:
            return torch._foreach_add_(tensors, others, alpha=alpha)
        except NotImplementedError:  # raised by the dispatcher before any tensor is modified
            if not any(other.is_sparse for other in others):
                raise
            _NO_SPARSE_KERNEL.add("add")
    sparse = [k for k, other in enumerate(others) if other.is_sparse]
    if not sparse:
        return torch._foreach_add_(tensors, others, alpha=alpha)
    dense = [k for k, other in enumerate(others) if not other.is_sparse]
    if dense:
        torch._foreach_add_([tensors[k] for k in dense], [others[k] for k in dense], alpha=alpha)
    for k in sparse:
        tensors[k].add_(others[k], alpha=alpha)


def foreach_zero_(tensors: Sequence[torch.Tensor]) -> None:
    """
    ``tensors[i].zero_()`` for every i, in one fused ``_foreach_zero_`` (dense tensors in one fused op and each sparse
    one by its own ``zero_`` where that op has no kernel for sparse tensors, as in torch 2.3).

    :param tensors: dense or sparse tensors, modified in place
    :raises TorchInternalsError: see :func:`check_fused_ops`
    """
    check_fused_ops()
    if "zero" not in _NO_SPARSE_KERNEL:
        try:
            return torch._foreach_zero_(tensors)
        except NotImplementedError:
            if not any(tensor.is_sparse for tensor in tensors):
                raise
            _NO_SPARSE_KERNEL.add("zero")
    dense = [tensor for tensor in tensors if not tensor.is_sparse]
    if dense:
        torch._foreach_zero_(dense)
    for tensor in tensors:
        if tensor.is_sparse:
            tensor.zero_()


def _unscales(op: Callable) -> bool:
    clean, overflow = torch.tensor([2.0, 4.0]), torch.tensor([2.0, float("inf")])
    found_clean, found_overflow, inv_scale = torch.zeros(()), torch.zeros(()), torch.tensor(0.5)
    op([clean], found_clean, inv_scale)
    op([overflow], found_overflow, inv_scale)
    return clean.tolist() == [1.0, 2.0] and found_clean.item() == 0.0 and found_overflow.item() == 1.0


def check_unscale_op() -> None:
    check_once(
        "unscale op",
        lambda: check_op("_amp_foreach_non_finite_check_and_unscale_", _unscales, "unscales gradients with this op"),
    )


def non_finite_check_and_unscale_(tensors: Sequence[torch.Tensor], found_inf: torch.Tensor,
                                  inv_scale: torch.Tensor) -> None:
    """
    ``tensors[i] *= inv_scale`` for every i, and ``found_inf`` set to 1.0 if any element is inf or NaN (left as is
    otherwise): the fused kernel ``torch.amp.GradScaler.unscale_`` uses, checked on small CPU tensors at its first
    call in the process.

    :param tensors: float tensors on one device, modified in place
    :param found_inf: a 0-dim float32 tensor on their device
    :param inv_scale: a 0-dim float32 tensor on their device
    :raises TorchInternalsError: if this torch release has no such op or it computes other values
    """
    check_unscale_op()
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)


# elements of the check's example: more than two vector widths plus a tail, so that vectorized and scalar loops both run
# (torch 2.4-2.13's CPU kernel never stores fp16/bf16 results of its vector loop, pytorch/pytorch#191763)
_ADD_EXAMPLE_SIZE = 67


def _adds_unless_found_inf(op: Callable, device: torch.device, dtype: torch.dtype) -> bool:
    def example():
        return torch.zeros(_ADD_EXAMPLE_SIZE, device=device, dtype=dtype)

    kept, skipped, grads = example(), example(), [example().add_(1)]
    for target, found_inf in ((kept, 0.0), (skipped, 1.0)):
        op([target], grads, [], weight_decay=0.0, momentum=0.0, lr=-2.0, dampening=0.0, nesterov=False,
           maximize=False, is_first_step=False, found_inf=torch.tensor(found_inf, device=device))
    # tolist(), not bool(): a copy, which host-read counters (aten::_local_scalar_dense) do not count as a read per step
    n = _ADD_EXAMPLE_SIZE
    return kept.tolist() == [2.0] * n and skipped.tolist() == [0.0] * n and grads[0].tolist() == [1.0] * n


# (device type, dtype) -> whether add_unless_found_inf_ has a correct kernel there
_ADDS_UNLESS_FOUND_INF: Dict[Tuple[str, torch.dtype], bool] = {}


def has_add_unless_found_inf(device: torch.device, dtype: torch.dtype) -> bool:
    """
    Whether :func:`add_unless_found_inf_` runs correctly on ``device``'s type for ``dtype``: checked once per process,
    device type and dtype on small tensors there (torch's fused SGD kernel has CUDA support from torch 2.1 and CPU
    support from torch 2.4; on the CPU, fp16/bf16 lose results before pytorch/pytorch#191763's fix).

    :param device: the device of the tensors to add
    :param dtype: their dtype
    """
    key = (torch.device(device).type, dtype)
    if key not in _ADDS_UNLESS_FOUND_INF:
        op = getattr(torch, "_fused_sgd_", None)
        try:
            works = op is not None and _adds_unless_found_inf(op, torch.device(device), dtype)
        except (RuntimeError, TypeError):  # no kernel for this device (NotImplementedError), a changed signature
            works = False
        _ADDS_UNLESS_FOUND_INF[key] = works
    return _ADDS_UNLESS_FOUND_INF[key]


def add_unless_found_inf_(
    tensors: Sequence[torch.Tensor], others: Sequence[torch.Tensor], found_inf: torch.Tensor, alpha: float = 1.0
) -> None:
    """
    ``tensors[i] += alpha * others[i]`` for every i unless ``found_inf`` is 1.0, in one fused pass that reads the flag
    on the device: torch's fused SGD kernel with ``lr=-alpha`` and no momentum or weight decay. The kernel pairs
    elements by memory order, so each pair must share shape and strides.

    :param tensors: dense float tensors on one device, modified in place
    :param others: one per tensor, of its dtype, shape and strides; not modified
    :param found_inf: a 0-dim float32 tensor on their device, 0.0 (add) or 1.0 (add nothing)
    :param alpha: scalar weight; on CUDA the kernel multiplies in double, so sums may differ from ``add_``'s in the
      last bit where ``alpha`` is not a power of two
    :raises TorchInternalsError: if :func:`has_add_unless_found_inf` is False for their device and dtype
    """
    if not has_add_unless_found_inf(found_inf.device, tensors[0].dtype):
        raise changed(f"torch._fused_sgd_ has no working kernel for {found_inf.device.type}",
                       "adds loss-scaled gradients with this op where it has one")
    torch._fused_sgd_(tensors, others, [], weight_decay=0.0, momentum=0.0, lr=-alpha, dampening=0.0, nesterov=False,
                      maximize=False, is_first_step=False, found_inf=found_inf)

