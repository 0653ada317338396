"""
The private torch interfaces of ``hivemind_accum/torch_compat/``: the contract holds on the installed
torch release (CI runs this file on every release it covers), a changed interface is reported with the torch version
and the interface at its first use, before anything is modified, the fused ops' sparse fallback gives the values of
per-tensor ops, and setup.py, CI's environments and docs/compatibility.md name the same releases.
"""
import ast
import re
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

import hivemind_accum
from hivemind_accum import GradientAverager
from hivemind_accum import torch_compat
from hivemind_accum.torch_compat import checks, fused_ops
from hivemind_accum.torch_compat import grad_scaler as scaler_internals
from hivemind_accum.torch_compat import (
    TESTED_TORCH,
    TorchInternalsError,
    check_fused_ops,
    check_grad_scaler_internals,
    check_hivemind_grad_scaler_internals,
    check_torch_internals,
    foreach_add_,
    foreach_zero_,
    inv_loss_scale,
    loss_scale,
    record_found_inf,
)
from tests.conftest import SINGLE_PEER_TRACKER, DispatchedOps

# each test in a child process: on torch 2.3.1 sparse CPU ops in the pytest process (the fallback tests') start its
# OpenMP thread pool, and a later forked test's child (e.g. test_grad_averager's) then hangs at its first parallel op
pytestmark = pytest.mark.forked

REPO = Path(__file__).resolve().parent.parent
SCALE = 2.0**8


def test_grad_scaler_internals_hold_on_this_torch():
    check_grad_scaler_internals()  # on failure the message names torch.__version__ and what changed


def scaled_optimizer():
    """an SGD optimizer over one parameter whose gradient was just computed from a loss scaled by SCALE"""
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    scaler.scale(param.sum()).backward()
    return param, optimizer, scaler


def test_accessors_read_the_scale_and_the_stage():
    param, optimizer, scaler = scaled_optimizer()
    assert loss_scale(scaler).item() == SCALE
    assert inv_loss_scale(scaler, optimizer).item() == 1 / SCALE
    assert torch.equal(param.grad, torch.full((3,), SCALE))
    record_found_inf(scaler, optimizer)  # no record yet: 0.0 on the scale's device
    scaler.unscale_(optimizer)
    assert inv_loss_scale(scaler, optimizer).item() == 1.0  # the loop unscaled: nothing left to unscale
    record_found_inf(scaler, optimizer, torch.tensor(1.0))
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == SCALE * 0.5  # update() read the recorded overflow and backed off
    assert torch.equal(param.detach(), torch.ones(3))  # and step() skipped the optimizer step


def version_and(what: str) -> str:
    return rf"torch {re.escape(torch.__version__)}: .*{what}"


@pytest.mark.parametrize("accessor", ["inv_loss_scale", "record_found_inf"])
def test_a_renamed_record_is_named_with_the_torch_version(accessor):
    _, optimizer, scaler = scaled_optimizer()
    state = scaler._per_optimizer_states[id(optimizer)]
    state["found_inf_per_device_v2"] = state.pop("found_inf_per_device")  # as a future torch might rename it
    with pytest.raises(TorchInternalsError, match=version_and("has no 'found_inf_per_device'")):
        getattr(torch_compat, accessor)(scaler, optimizer)


def test_missing_state_and_scale_are_named_with_the_torch_version(monkeypatch):
    _, optimizer, scaler = scaled_optimizer()
    monkeypatch.setattr(scaler, "_scale", torch.full((2,), SCALE))
    with pytest.raises(TorchInternalsError, match=version_and(r"GradScaler._scale is torch.Size\(\[2\]\)")):
        inv_loss_scale(scaler, optimizer)
    monkeypatch.undo()
    monkeypatch.delattr(scaler, "_per_optimizer_states")
    with pytest.raises(TorchInternalsError, match=version_and("GradScaler has no _per_optimizer_states")):
        record_found_inf(scaler, optimizer)


def test_a_missing_stage_enum_is_named_with_the_torch_version(monkeypatch):
    _, optimizer, scaler = scaled_optimizer()
    check_torch_internals()  # the first use's checks passed before torch lost the enum
    scaler._per_optimizer_states[id(optimizer)]  # created by torch (scaler.step) before any accessor reads it
    monkeypatch.delattr(scaler_internals.amp_grad_scaler, "OptState")
    with pytest.raises(TorchInternalsError, match=version_and(r"OptState.UNSCALED .* is missing")):
        inv_loss_scale(scaler, optimizer)


def update_reading_another_record(monkeypatch) -> None:
    """make torch.amp.GradScaler.update ignore the overflow record, as a torch that kept the flags elsewhere would"""
    update = torch.amp.GradScaler.update

    def reading_another_record(self, new_scale=None):
        for state in self._per_optimizer_states.values():
            state["found_inf_per_device"] = {d: torch.zeros_like(f) for d, f in state["found_inf_per_device"].items()}
        update(self, new_scale)

    monkeypatch.setattr(torch.amp.GradScaler, "update", reading_another_record)


IGNORED_RECORD = version_and("update.. left the scale at 1024.0 after a recorded overflow .expected 512.0.")


def test_the_contract_check_names_an_update_that_ignores_the_record(monkeypatch):
    update_reading_another_record(monkeypatch)
    with pytest.raises(TorchInternalsError, match=IGNORED_RECORD):
        check_grad_scaler_internals()


def test_a_changed_grad_scaler_fails_the_first_scaled_step_before_it_touches_a_gradient(dht, monkeypatch):
    """exact mode: scaler.step(opt) runs the contract check (once per process) before it unscales or accumulates"""
    model = torch.nn.Linear(3, 2)
    opt = hivemind_accum.Optimizer(
        dht=dht, run_id="internals", params=model.parameters(), optimizer=partial(torch.optim.SGD, lr=0.1),
        target_batch_size=100, batch_size_per_step=1, tracker_opts=SINGLE_PEER_TRACKER,
    )
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
        scaler.scale(model(torch.ones(1, 3)).sum()).backward()
        grads = [param.grad.clone() for param in model.parameters()]
        monkeypatch.setattr(checks, "_CHECKED", checks._CHECKED - {"torch.amp.GradScaler"})
        update_reading_another_record(monkeypatch)
        with pytest.raises(TorchInternalsError, match=IGNORED_RECORD), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch announces the end of the scaler hand-over
            scaler.step(opt)
        assert all(torch.equal(param.grad, grad) for param, grad in zip(model.parameters(), grads))
        assert all(acc.count_nonzero() == 0 for acc in opt.grad_averager._grad_accumulators())
        assert opt.grad_averager.local_times_accumulated == 0 and scaler.get_scale() == SCALE
    finally:
        opt.shutdown()


def test_a_missing_fused_op_fails_the_accumulators_before_they_touch_a_gradient(dht, monkeypatch):
    """in-place mode attaches the accumulators to .grad when built: a torch without _foreach_add_ fails first"""
    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    grads = [param.grad for param in model.parameters()]
    values = [grad.clone() for grad in grads]
    monkeypatch.setattr(checks, "_CHECKED", set())  # a process that has not used a fused op yet
    monkeypatch.delattr(torch, "_foreach_add_")  # as a torch release that dropped it
    with pytest.raises(TorchInternalsError, match=version_and(r"torch\._foreach_add_ is missing\. hivemind_accum "
                                                              r"accumulates gradients with this fused op")):
        GradientAverager(model.parameters(), dht=dht, prefix="internals", reuse_grad_buffers=True, start=False)
    assert [param.grad for param in model.parameters()] == grads  # the same tensors, not views of accumulators
    assert all(torch.equal(grad, value) for grad, value in zip(grads, values))


def test_a_changed_hivemind_grad_scaler_call_is_named(monkeypatch):
    monkeypatch.setattr(checks, "_CHECKED", set())
    monkeypatch.delattr(torch.amp.GradScaler, "_check_inf_per_device")
    with pytest.raises(TorchInternalsError, match=version_and(r"torch\.amp\.GradScaler\._check_inf_per_device is "
                                                              r"missing\. hivemind_accum loss-scales in place")):
        check_hivemind_grad_scaler_internals()
    monkeypatch.undo()
    monkeypatch.setattr(checks, "_CHECKED", set())
    monkeypatch.setattr(torch.amp.GradScaler, "_found_inf_per_device", lambda self: {})
    with pytest.raises(TorchInternalsError, match=version_and(r"_found_inf_per_device\(self\) does not take "
                                                              r"\(optimizer\)")):
        check_hivemind_grad_scaler_internals()


def test_an_untested_release_runs_when_its_interfaces_hold(monkeypatch):
    """no refusal and no warning; a changed interface names the release and the tested ones"""
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    monkeypatch.setattr(checks, "_CHECKED", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_torch_internals()
    assert checks._CHECKED == {"fused ops", "unscale op", "torch.amp.GradScaler", "hivemind.GradScaler"}
    monkeypatch.setattr(checks, "_CHECKED", set())
    monkeypatch.delattr(torch, "_foreach_mul_")
    with pytest.raises(TorchInternalsError) as error:
        check_fused_ops()
    assert str(error.value) == (
        "torch 2.15.0: torch._foreach_mul_ is missing. hivemind_accum accumulates gradients with this fused op; "
        f"hivemind_accum was tested with torch {', '.join(TESTED_TORCH)}, not with this release: install one of those"
    )


def test_each_check_runs_once_per_process(monkeypatch):
    runs = []
    monkeypatch.setattr(checks, "_CHECKED", set())
    monkeypatch.setattr(fused_ops, "_check_fused_ops", lambda: runs.append("fused ops"))
    for _ in range(3):
        foreach_zero_([torch.ones(2)])
    check_fused_ops()
    assert runs == ["fused ops"]


def dense_and_sparse():
    """four float32 targets and the tensors to add: dense, sparse (an embedding's kind of gradient), dense, sparse"""
    generator = torch.Generator().manual_seed(0)
    targets = [torch.randn(4, 3, generator=generator) for _ in range(4)]
    dense = [torch.randn(4, 3, generator=generator) for _ in range(2)]
    rows = [torch.tensor([[0, 2, 2]]), torch.tensor([[3]])]
    sparse = [torch.sparse_coo_tensor(r, torch.randn(r.shape[1], 3, generator=generator), (4, 3), check_invariants=True) for r in rows]
    return targets, [dense[0], sparse[0], dense[1], sparse[1]]


@pytest.mark.parametrize("no_sparse_kernel", [False, True], ids=["this_torch", "fallback"])
def test_foreach_add_with_sparse_tensors_adds_each_value(monkeypatch, no_sparse_kernel):
    monkeypatch.setattr(fused_ops, "_NO_SPARSE_KERNEL", {"add"} if no_sparse_kernel else set())
    targets, others = dense_and_sparse()
    expected = [t + 0.5 * o.to_dense() for t, o in zip(targets, others)]  # to_dense sums the two entries of row 2
    # each side rounds at most twice (row 2: two entries, in either order), each time by at most eps / 2 of |t| + |o|
    atols = [2 * torch.finfo(torch.float32).eps * (t.abs() + o.abs().to_dense()).max() for t, o in zip(targets, others)]
    foreach_add_([t.clone() for t in targets], others, alpha=0.5)  # where torch refuses sparse ones, learnt here
    with DispatchedOps() as dispatched:
        foreach_add_(targets, others, alpha=0.5)
    for target, value, atol in zip(targets, expected, atols):
        assert torch.allclose(target, value, rtol=0, atol=atol)
    if no_sparse_kernel or fused_ops._NO_SPARSE_KERNEL:  # dense ones in one fused op, each sparse one alone
        assert dispatched.ops == ["aten._foreach_add_.List", "aten.add_.Tensor", "aten.add_.Tensor"]
    else:
        assert dispatched.ops == ["aten._foreach_add_.List"]


@pytest.mark.parametrize("no_sparse_kernel", [False, True], ids=["this_torch", "fallback"])
def test_foreach_zero_with_sparse_tensors_zeroes_each(monkeypatch, no_sparse_kernel):
    monkeypatch.setattr(fused_ops, "_NO_SPARSE_KERNEL", {"zero"} if no_sparse_kernel else set())
    _, tensors = dense_and_sparse()
    foreach_zero_(tensors)
    for tensor in tensors:
        assert tensor.shape == (4, 3) and torch.count_nonzero(tensor.to_dense()) == 0


def test_foreach_add_of_dense_tensors_is_one_fused_op_on_every_torch(monkeypatch):
    monkeypatch.setattr(fused_ops, "_NO_SPARSE_KERNEL", {"add"})  # even where sparse ones fall back
    check_fused_ops()  # the first use's check (its examples run the ops too) before the counted call
    targets, sources = [torch.zeros(5) for _ in range(6)], [torch.full((5,), float(i)) for i in range(6)]
    with DispatchedOps() as dispatched:
        foreach_add_(targets, sources, alpha=2.0)
    assert [t[0].item() for t in targets] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert dispatched.ops == ["aten._foreach_add_.List"]


def install_requires() -> dict:
    """setup.py's install_requires, parsed: {name: Requirement}"""
    tree = ast.parse((REPO / "setup.py").read_text())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup"]
    (call,) = calls
    requires = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "install_requires"))
    return {requirement.name: requirement for requirement in map(Requirement, requires)}


def test_setup_requires_hivemind_1_1_12_and_torch_without_an_upper_bound():
    """pip keeps an installed torch newer than the tested ones (the run-time checks guard it) and never downgrades it"""
    requires = install_requires()
    assert sorted(requires) == ["hivemind", "torch"]
    assert str(requires["hivemind"].specifier) == "==1.1.12"
    assert [(spec.operator, spec.version) for spec in requires["torch"].specifier] == [(">=", TESTED_TORCH[0])]
    assert requires["torch"].specifier.contains("2.15.0") and requires["torch"].specifier.contains("3.0.0")


def test_tested_releases_are_the_ci_environments_and_the_documented_ones():
    """requirements.txt pins the default environment's release, .ci/torch-<version>.txt pins each other one (.ci/run
    runs every such file), and docs/compatibility.md's table lists exactly these releases"""
    default = re.findall(r"^torch==(\S+)$", (REPO / "requirements.txt").read_text(), re.M)
    others = sorted(path.name[len("torch-"):-len(".txt")] for path in (REPO / ".ci").glob("torch-*.txt"))
    assert sorted(default + others, key=_release) == list(TESTED_TORCH)
    assert ".ci/torch-*.txt" in (REPO / ".ci" / "run").read_text()
    for version in others:
        assert re.findall(r"^torch==(\S+)$", (REPO / ".ci" / f"torch-{version}.txt").read_text(), re.M) == [version]
    table = re.findall(r"^\| torch (\d+\.\d+\.\d+) \|", (REPO / "docs" / "compatibility.md").read_text(), re.M)
    assert table == list(TESTED_TORCH)


def _release(version: str):
    return tuple(int(part) for part in version.split("."))
