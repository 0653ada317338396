"""
How many kernels one call of PyTorch's CUDA multi-tensor apply launches, from the tensors' sizes alone.

The fused ops (``_foreach_add_``, ``_foreach_copy_``, ``_foreach_zero_``, ``_amp_foreach_non_finite_check_and_unscale_``)
pack their tensors into launches. The rule, from ``aten/src/ATen/native/cuda/MultiTensorApply.cuh``: each tensor is cut
into chunks of :data:`CHUNK_SIZE` elements, one block each; empty tensors are left out; a launch goes off when the
blocks fill up, or when the tensors fill up and the last one's chunks are all placed; a tensor whose chunks do not fit
goes on into the next launch. How many tensors and blocks a launch holds depends on the op's depth (the number of
tensor lists: 1 for zero and unscale, 2 for add and copy) and on the kernel argument size. Why this matters and
the counts on the report's models: docs/measurement.md#kernel-launches.

Run ``python -m benchmarks.kernel_launches`` for the counts on ResNet-152 and ConvNeXt-Large.
"""
from typing import Iterable

CHUNK_SIZE = 65536  # elements per block (kChunkSize)
# 4 KB kernel arguments: tensors per launch by depth 1..5 (depth_to_max_tensors), blocks per launch
SMALL_ARGS = ((110, 64, 48, 36, 30), 320)
# 32 KB kernel arguments, where the CUDA runtime and driver are 12.1 or later and the GPU sm_70 or later (torch 2.5+)
LARGE_ARGS = ((770, 448, 336, 252, 210), 2240)


def multi_tensor_launches(numels: Iterable[int], depth: int, large_kernel_args: bool = False) -> int:
    """
    Kernel launches of one multi-tensor apply over tensors of ``numels`` elements, in order.

    :param numels: each tensor's element count (of the first tensor list)
    :param depth: how many tensor lists the op takes, 1 to 5 (``_foreach_add_(a, b)``: 2)
    :param large_kernel_args: count with 32 KB kernel arguments instead of 4 KB (fewer, larger launches)
    :returns: the launch count; 0 for no tensors or only empty ones
    :raises ValueError: if ``depth`` is not 1 to 5
    """
    if not 1 <= depth <= 5:
        raise ValueError(f"depth: expected 1 to 5 tensor lists, got {depth}")
    max_tensors, max_blocks = LARGE_ARGS if large_kernel_args else SMALL_ARGS
    max_tensors = max_tensors[depth - 1]
    launches = tensors = blocks = 0
    for numel in numels:  # the loop of multi_tensor_apply, one block at a time
        if numel == 0:
            continue
        tensors += 1
        chunks = -(-numel // CHUNK_SIZE)
        for chunk in range(chunks):
            blocks += 1
            last_chunk = chunk == chunks - 1
            if (tensors == max_tensors and last_chunk) or blocks == max_blocks:
                launches += 1
                blocks = 0
                tensors = 0 if last_chunk else 1  # a tensor cut by the launch goes on in the next one
    return launches + (blocks > 0)


# exact mode's loss-scaled no-sync step (scaler.step and scaler.update) runs, besides its two fused ops, these aten ops
# on one element each, each launching one kernel at most: the inverse scale (2 casts, reciprocal), found_inf (zeros), the
# drop flag's slot (select, copy_) and the scaler's update; tests/test_benchmark_tools.py counts them on the CPU
EXACT_STEP_OTHER_OPS = 11
# the same with hivemind.GradScaler (hivemind#566's configuration): the step also backs the scale off on the device
# (torch._amp_update_scale_ and the growth tracker's reset), so its update() reads no record
EXACT_HIVEMIND_STEP_OTHER_OPS = 13


def exact_step_kernels(numels: Iterable[int], large_kernel_args: bool = False,
                       other_ops: int = EXACT_STEP_OTHER_OPS) -> int:
    """
    Kernels exact mode's loss-scaled no-sync step launches at most on CUDA, for parameters in one bucket.

    :param numels: each parameter's element count, in order
    :param large_kernel_args: as in :func:`multi_tensor_launches`
    :param other_ops: the step's ops on one element each: :data:`EXACT_STEP_OTHER_OPS` with ``torch.amp.GradScaler``,
      :data:`EXACT_HIVEMIND_STEP_OTHER_OPS` with ``hivemind.GradScaler``
    :returns: the fused check and unscale of ``.grad`` (depth 1), the fused add that skips on overflow (depth 2) and
      ``other_ops`` launches
    """
    numels = list(numels)
    return (multi_tensor_launches(numels, 1, large_kernel_args) + multi_tensor_launches(numels, 2, large_kernel_args)
            + other_ops)


def main():
    from benchmarks.models import build_model

    print("| model | tensors | chunks | kernel arguments | fused add | fused unscale "
          "| exact step at most |")
    print("|---|---|---|---|---|---|---|")
    for name in ("resnet152", "convnext-large"):
        numels = [p.numel() for p in build_model(name).parameters()]
        chunks = sum(-(-numel // CHUNK_SIZE) for numel in numels)
        for large in (False, True):
            print(f"| {name} | {len(numels)} | {chunks} | {'32 KB' if large else '4 KB'} "
                  f"| {multi_tensor_launches(numels, 2, large)} | {multi_tensor_launches(numels, 1, large)} "
                  f"| {exact_step_kernels(numels, large)} |")


if __name__ == "__main__":
    main()
