"""
Checks of the arguments users pass, shared by the buffers, the averager and the optimizer: each raises a
``ValueError`` that names the argument (and the position of the offending tensor) before anything is built.
"""
import numbers
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch


def is_positive_int(value) -> bool:
    """whether ``value`` is an int (of any integral type, but not a bool) greater than zero"""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value > 0


def check_distinct(named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
    """
    :param named_tensors: (position, tensor) pairs, e.g. ``("parameters[3]", param)``
    :raises ValueError: naming both positions if the same tensor object appears twice (in place, both would get the
      same ``.grad`` and its gradient would be accumulated twice)
    """
    first_seen: Dict[int, str] = {}
    for name, tensor in named_tensors:
        if id(tensor) in first_seen:
            raise ValueError(f"{first_seen[id(tensor)]} and {name} are the same tensor: pass each parameter once")
        first_seen[id(tensor)] = name


def check_averaged_grads(parameters: Sequence[torch.Tensor], averaged_grads: Sequence[torch.Tensor]) -> None:
    """:raises ValueError: unless ``averaged_grads`` holds one CPU tensor per parameter, of its shape"""
    if len(averaged_grads) != len(parameters):
        raise ValueError(
            f"averaged_grads: expected one tensor per parameter ({len(parameters)}), got {len(averaged_grads)}"
        )
    for i, (param, grad) in enumerate(zip(parameters, averaged_grads)):
        if not isinstance(grad, torch.Tensor) or grad.shape != param.shape:
            got = tuple(grad.shape) if isinstance(grad, torch.Tensor) else type(grad).__name__
            raise ValueError(
                f"averaged_grads[{i}]: expected shape {tuple(param.shape)} (as parameters[{i}]), got {got}"
            )
        if grad.device.type != "cpu":
            raise ValueError(f"averaged_grads[{i}]: must be on CPU to be shared with the averager, got {grad.device}")


def named_params(groups, prefix: str) -> List[Tuple[str, torch.Tensor]]:
    """(position, tensor) for every parameter of a sequence of param groups, positions written from ``prefix``"""
    return [
        (f'{prefix}[{i}]["params"][{j}]', param)
        for i, group in enumerate(groups)
        if isinstance(group, dict)
        for j, param in enumerate(group.get("params", ()))
    ]


def params_as_lists(params):
    """``params`` (tensors or param groups, each possibly a one-pass iterator) as lists, and its named parameters"""
    params = list(params)
    if all(isinstance(param, torch.Tensor) for param in params):
        return params, [(f"params[{i}]", param) for i, param in enumerate(params)]
    params = [
        dict(group, params=[group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"]))
        if isinstance(group, dict) and "params" in group
        else group
        for group in params
    ]
    return params, named_params(params, "params")


def check_batch_size_per_step(batch_size_per_step) -> None:
    """:raises ValueError: unless ``batch_size_per_step`` of ``hivemind.Optimizer`` is a positive int or None"""
    if batch_size_per_step is not None and not is_positive_int(batch_size_per_step):
        raise ValueError(
            f"batch_size_per_step: expected a positive int (samples per micro-step) or None (then pass batch_size= to "
            f"every step()), got {batch_size_per_step!r}"
        )


def check_micro_step(batch_size, inv_grad_scale: Optional[torch.Tensor], reuse_grad_buffers: bool) -> None:
    """the arguments of ``GradientAverager.accumulate_grads_``: see its ``:raises ValueError:``"""
    if not is_positive_int(batch_size):
        raise ValueError(
            f"batch_size: expected a positive int (samples in this micro-batch), got {batch_size!r}; "
            f"hivemind.Optimizer passes step(batch_size=...) or else its batch_size_per_step"
        )
    if inv_grad_scale is not None and reuse_grad_buffers:
        raise ValueError(
            "inv_grad_scale: with reuse_grad_buffers=True gradients are already in the accumulators and cannot be "
            "unscaled or dropped per micro-step; unscale the accumulated gradients once per round "
            "(hivemind.GradScaler does) or use reuse_grad_buffers=False"
        )
