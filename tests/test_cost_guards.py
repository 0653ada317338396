"""
Deterministic cost guards for the no-sync step, counted with ``torch.profiler`` (no timing): the exact mode launches
a number of operators that does not grow with the number of parameter tensors, the in-place mode launches none,
and neither allocates memory. Top-level operators are the aten operators the call dispatches itself, counted with a
dispatch mode (:class:`DispatchedOps`): a fused ``_foreach_add_`` over P tensors is one, whatever it runs inside. The
profiler counts device kernels, and bytes from its raw allocation records (:func:`allocated_bytes`): it ties records
and ops together by microsecond timestamps, so its per-op sums can count one allocation twice. With CUDA the same
guards also run on a CUDA model, where device kernels are counted too: a fused op launches as many multi-tensor kernels
as PyTorch's multi_tensor_apply packs its tensors into (:mod:`benchmarks.kernel_launches`), upstream's loop one or more
per tensor.
"""
from typing import NamedTuple

import pytest
import torch
from hivemind.optim.grad_averager import GradientAverager as UpstreamGradientAverager
from torch.profiler import ProfilerActivity, profile

from benchmarks.kernel_launches import multi_tensor_launches
import hivemind_accum
from hivemind_accum import GradientAverager
from hivemind_accum import torch_compat as torch_internals
from hivemind_accum.buffers import finite_add
from hivemind_accum.buffers.buckets import GradientBuckets
from tests.conftest import DEVICES, NEEDS_CUDA, SINGLE_PEER_TRACKER, DispatchedOps
from tests.test_mixed_precision import force_loss_scaling_path



class StepCost(NamedTuple):
    top_level_ops: int
    allocated_bytes: int
    device_to_host_copies: int
    kernels: int = 0  # device kernels, memcpys and memsets (CUDA only)


def no_sync_step_cost(averager, model, batch_size: int = 2) -> StepCost:
    """run two warm-up micro-steps, then profile the third micro-step's ``accumulate_grads_`` alone"""
    device = next(model.parameters()).device
    for _ in range(3):
        if not averager.reuse_grad_buffers:
            model.zero_grad(set_to_none=True)
        model(torch.randn(batch_size, model[0].in_features, device=device)).square().mean().backward()
        if _ < 2:
            averager.accumulate_grads_(batch_size)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof, DispatchedOps() as dispatched:
        averager.accumulate_grads_(batch_size)
        if device.type == "cuda":
            torch.cuda.synchronize()  # outside the guarded call: lets the profiler collect the kernels
    events = [e for e in prof.events() if e.name != "cudaDeviceSynchronize"]
    return StepCost(
        top_level_ops=len(dispatched.ops),
        allocated_bytes=allocated_bytes(prof),
        device_to_host_copies=sum(1 for e in events if "DtoH" in e.name or "Memcpy DtoH" in e.name),
        kernels=sum(1 for e in events if e.device_type != torch.autograd.DeviceType.CPU),
    )


def allocated_bytes(prof: profile) -> int:
    """bytes allocated while ``prof`` recorded, on the host and devices: the sum of its allocation records. Read from
    the raw records: the per-op sums go by microsecond timestamps and count an allocation made in the microsecond one
    op ends and the next begins in both"""
    records = prof.profiler.kineto_results.events()
    return sum(record.nbytes() for record in records if record.name() == "[memory]" and record.nbytes() > 0)


def make_model(num_layers: int, width: int = 8, device: str = "cpu") -> torch.nn.Sequential:
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(num_layers)]).to(device)


def assert_cost_independent_of_tensor_count(averager_cls, dht, reuse_grad_buffers: bool, device: str = "cpu") -> None:
    """the guard: the no-sync step's operator count is the same for 8 and 128 parameter tensors (on CUDA its kernel
    launches at most one fused add's, :func:`benchmarks.kernel_launches.multi_tensor_launches`), allocates nothing and
    copies nothing to the host"""
    costs, launches = {}, {}
    for num_layers in (4, 64):
        model = make_model(num_layers, device=device)
        averager = averager_cls(model.parameters(), dht=dht, prefix="guard", reuse_grad_buffers=reuse_grad_buffers,
                                start=False)
        costs[2 * num_layers] = no_sync_step_cost(averager, model)
        launches[2 * num_layers] = multi_tensor_launches([p.numel() for p in model.parameters()], depth=2)
    small, large = costs.values()
    assert small.top_level_ops == large.top_level_ops, f"no-sync step work grows with the tensor count: {costs}"
    for tensors, cost in costs.items():  # one fused add: 1 and 2 launches (4 KB kernel arguments), 1 (32 KB)
        assert cost.kernels <= launches[tensors], f"more kernels than one fused add needs: {costs}, {launches}"
    assert small.allocated_bytes == large.allocated_bytes == 0, f"no-sync step allocates memory: {costs}"
    assert small.device_to_host_copies == large.device_to_host_copies == 0, f"no-sync step copies to host: {costs}"


@pytest.mark.forked
@pytest.mark.parametrize("device", DEVICES)
def test_exact_mode_cost_is_one_fused_op(dht, device):
    assert_cost_independent_of_tensor_count(GradientAverager, dht, reuse_grad_buffers=False, device=device)
    model = make_model(64, device=device)
    cost = no_sync_step_cost(GradientAverager(model.parameters(), dht=dht, prefix="guard", start=False), model)
    assert cost.top_level_ops == 1  # one _foreach_add_ for the single (device, float32) bucket
    assert (cost.kernels >= 1) == (device == "cuda")  # at most 2 multi-tensor launches for 128 tiny tensors, see above


@pytest.mark.forked
@pytest.mark.parametrize("reuse_grad_buffers", [False, True], ids=["exact", "in_place"])
def test_optimizer_no_sync_step_dispatches_a_fixed_number_of_ops(dht, reuse_grad_buffers):
    """the whole no-sync ``hivemind_accum.Optimizer.step()``, as the floor-cost benchmark runs it, on 40 and 400
    tensors: exact mode dispatches the fused add and nothing else, in place nothing"""
    dispatched = {}
    for num_layers in (20, 200):
        model = make_model(num_layers, width=16)
        opt = hivemind_accum.Optimizer(
            dht=dht, run_id=f"ops_{num_layers}", params=model.parameters(), target_batch_size=10**9,
            batch_size_per_step=4, optimizer=lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
            reuse_grad_buffers=reuse_grad_buffers, tracker_opts=SINGLE_PEER_TRACKER,
        )
        try:
            for step in range(4):
                if not reuse_grad_buffers:
                    opt.zero_grad()
                model(torch.randn(4, 16)).square().mean().backward()
                with DispatchedOps() as ops:
                    opt.step()
            dispatched[2 * num_layers] = ops.ops
        finally:
            opt.shutdown()
    expected = ["aten._foreach_add_.List"] if not reuse_grad_buffers else []
    assert dispatched == {40: expected, 400: expected}, dispatched


@pytest.mark.forked
@pytest.mark.parametrize("device", DEVICES)
def test_in_place_mode_does_no_tensor_work(dht, device):
    assert_cost_independent_of_tensor_count(GradientAverager, dht, reuse_grad_buffers=True, device=device)
    for num_layers in (2, 256):  # a small and a large model
        model = make_model(num_layers, width=64, device=device)
        averager = GradientAverager(model.parameters(), dht=dht, prefix="guard", reuse_grad_buffers=True, start=False)
        assert no_sync_step_cost(averager, model) == StepCost(0, 0, 0, 0)


@pytest.mark.forked
@pytest.mark.parametrize("device", DEVICES)
def test_guard_catches_upstream_per_parameter_loop(dht, device):
    """the same guard run on upstream's GradientAverager must fail: it loops over parameters in Python"""
    with pytest.raises(AssertionError, match="grows with the tensor count"):
        assert_cost_independent_of_tensor_count(UpstreamGradientAverager, dht, reuse_grad_buffers=False, device=device)


@pytest.mark.forked
@NEEDS_CUDA
@pytest.mark.parametrize("reuse_grad_buffers", [False, True])
def test_no_host_sync_in_no_sync_step_cuda(dht, reuse_grad_buffers):
    model = make_model(8).cuda()
    averager = GradientAverager(model.parameters(), dht=dht, prefix="sync", reuse_grad_buffers=reuse_grad_buffers,
                                start=False)
    for _ in range(3):
        model(torch.randn(2, 8, device="cuda")).square().mean().backward()
        torch.cuda.set_sync_debug_mode("error")
        try:
            averager.accumulate_grads_(batch_size=2)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    averager.load_accumulators_into_averager_()
    with averager.get_tensors() as averaged:
        assert all(t.device.type == "cpu" for t in averaged)


def loss_scaled_add_cost(num_layers: int) -> dict:
    """profile the second ``GradientBuckets.add_finite_`` of a model's gradients (the first allocates the staging
    buffer): top-level ops and bytes allocated, and the bytes the first call allocated"""
    model = make_model(num_layers)
    buckets = GradientBuckets(list(model.parameters()))
    grads = [torch.randn_like(param) * 1024 for param in model.parameters()]
    inv_scale = torch.tensor(1 / 1024)
    costs = {}
    for call in ("first", "second"):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, DispatchedOps() as dispatched:
            buckets.add_finite_(grads, inv_scale)
        costs[call] = StepCost(
            top_level_ops=len(dispatched.ops),
            allocated_bytes=allocated_bytes(prof),
            device_to_host_copies=0,
        )
    return costs


def force_fused_add(fused: bool) -> None:
    """make add_finite_'s device path take the fused skipping add (``fused``) or the staging buffer; call it in the
    test's own process (forked). The fused add needs a torch with a CPU kernel for ``_fused_sgd_`` (2.4 and later)"""
    if fused and not torch_internals.has_add_unless_found_inf(torch.device("cpu"), torch.float32):
        pytest.skip(f"torch {torch.__version__} has no CPU kernel for _fused_sgd_: the staging path runs here")
    finite_add.has_add_unless_found_inf = lambda device, dtype: fused


# per (device path's add, tensors): the first micro-step's bytes allocated, and the top-level ops of every later one
FUSED_ADD_COSTS = {
    # zero_ (found_inf), the fused check and unscale of .grad in place, the fused skipping add; found_inf: 4 bytes
    True: (lambda tensors: 4, 3),
    # zero_, _foreach_copy_ (staging), the fused check and unscale, logical_or, masked_fill_, add_; the staging
    # buffer (float32, the gradients' size), the drop mask (1 byte) and found_inf (4 bytes)
    False: (lambda tensors: 4 * tensors // 2 * (8 * 8 + 8) + 1 + 4, 6),
}


@pytest.mark.forked
@pytest.mark.parametrize("fused", [True, False], ids=["fused_add", "staging"])
def test_loss_scaled_device_path_allocates_nothing_after_the_first_micro_step(fused):
    """add_finite_ as on an accelerator (forced on the CPU): the first micro-step allocates its flags (and, without the
    fused skipping add, the staging buffer) once; later ones allocate nothing and run as many top-level ops for 400
    tensors as for 40"""
    force_loss_scaling_path("device_check")
    force_fused_add(fused)
    torch_internals.check_torch_internals()  # the first use's checks of torch's private interfaces, not counted here
    costs = {2 * num_layers: loss_scaled_add_cost(num_layers) for num_layers in (20, 200)}
    first_bytes, ops = FUSED_ADD_COSTS[fused]
    for tensors, cost in costs.items():
        assert cost["first"].allocated_bytes == first_bytes(tensors), costs
        assert cost["second"].allocated_bytes == 0, costs
    assert costs[40]["second"].top_level_ops == costs[400]["second"].top_level_ops == ops, costs


@pytest.mark.forked
@pytest.mark.parametrize("fused", [True, False], ids=["fused_add", "staging"])
def test_loss_scaled_micro_step_of_the_averager_allocates_nothing_after_the_first(dht, fused):
    """GradientAverager.accumulate_grads_ with a loss scale, as on an accelerator (forced on the CPU): from the second
    micro-step on it allocates nothing (staging buffer, overflow flags and drop counters persist) and runs as many
    top-level ops for 400 tensors as for 40"""
    force_loss_scaling_path("device_check")
    force_fused_add(fused)
    torch_internals.check_torch_internals()  # the first use's checks of torch's private interfaces, not counted here
    inv_scale = torch.tensor(1 / 1024)
    costs = {}
    for num_layers in (20, 200):
        model = make_model(num_layers)
        averager = GradientAverager(model.parameters(), dht=dht, prefix="guard", start=False)
        costs[2 * num_layers] = []
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            (model(torch.randn(2, 8)).square().mean() * 1024).backward()
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, DispatchedOps() as ops:
                averager.accumulate_grads_(2, inv_grad_scale=inv_scale)
            costs[2 * num_layers].append(StepCost(len(ops.ops), allocated_bytes(prof), device_to_host_copies=0))
    for tensors, steps in costs.items():
        assert steps[1].allocated_bytes == steps[2].allocated_bytes == 0, costs
    # add_finite_'s (see FUSED_ADD_COSTS), then the drop flag's slot: select, copy_
    assert costs[40][2].top_level_ops == costs[400][2].top_level_ops == FUSED_ADD_COSTS[fused][1] + 2, costs
