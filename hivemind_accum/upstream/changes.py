"""
The series cut by change: which parts of this package's modules each commit brings into hivemind.

Each :class:`Change` is one commit. It names the modules it brings in whole (``enters``) and, per module, what the
commits before it lack (``omit``): methods, functions, docstrings and statements named as the defect fixes name their
workarounds, and :class:`Edit` s for what is not a whole statement (a parameter, an ``else`` branch, a docstring
sentence). A module's text in commit ``k`` is ours with the changes after ``k`` peeled off, the last change first.
"""
import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence, Tuple, Union

from hivemind_accum.upstream.fixes import FixError, omit_items


@dataclass(frozen=True)
class Edit:
    """a text of our module (found exactly once, whole or part of lines) and what the earlier commits have instead"""

    old: str
    new: str = ""

    def apply(self, text: str, where: str) -> str:
        """``text`` with ``old`` replaced by ``new``; :class:`FixError` naming ``where`` unless ``old`` is there once"""
        if text.count(self.old) != 1:
            found = text.count(self.old)
            raise FixError(f"{where}: expected this text exactly once, found it {found} times:\n{self.old}")
        return text.replace(self.old, self.new)


Item = Union[str, Edit]


@dataclass(frozen=True)
class Change:
    subject: str
    why: str  # the commit message's body
    enters: Tuple[str, ...] = ()  # modules (ours, e.g. "grad_buckets") whose first commit this is
    omit: Mapping[str, Tuple[Item, ...]] = field(default_factory=dict)  # by module: what earlier commits lack
    hivemind: Mapping[str, Tuple[Edit, ...]] = field(default_factory=dict)  # by module: edits of hivemind's own text


def edit_hivemind(text: str, module: str, changes: Sequence[Change], label: str) -> str:
    """hivemind's module with the edits of ``changes`` (the series so far) to its own text, e.g. a docstring that the
    change makes wrong"""
    for change in changes:
        for edit in change.hivemind.get(module, ()):
            text = edit.apply(text, f"{label}: hivemind's text, edited by '{change.subject}'")
    return text


def for_hivemind(text: str) -> str:
    """our module's text without references to this package's documentation pages, which hivemind does not have"""
    text = re.sub(r" \((?:see )?docs/[\w-]+\.md\)", "", text)
    return re.sub(r"; docs/[\w-]+\.md\)", ")", text)


def peel(ours: str, module: str, later: Sequence[Change], label: str) -> str:
    """our module as it is before ``later`` (changes in series order): each one's items removed, the last first"""
    for change in reversed(later):
        items = change.omit.get(module, ())
        names = [(item, change.subject) for item in items if isinstance(item, str)]
        ours = omit_items(ours, names, label) if names else ours
        for edit in (item for item in items if isinstance(item, Edit)):
            ours = edit.apply(ours, f"{label} (left out before '{change.subject}')")
    return _tidy(ours) if later else ours


def _tidy(text: str) -> str:
    """the blank lines that removed code leaves: at most two between top-level definitions, one inside a class, none
    at the end"""
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    text = re.sub(r"\n{3,}(?=[ \t]+\S)", "\n\n", text)
    return text.rstrip("\n") + "\n"


ACCUMULATION = Change(
    subject="Accumulate gradients in flat buffers: one fused op per micro-step, reuse_grad_buffers as views",
    why="""
GradientAverager's no-sync step cost time proportional to the number of parameter tensors: one add_ per tensor,
plus, with reuse_grad_buffers=True, a step that did nothing but could lose gradients (hivemind#566: local throughput
48% of plain PyTorch on ConvNeXt-Large, 78% on ResNet-152, fp16 AMP).

Gradients now accumulate in persistent flat buffers, one per (device, dtype) bucket (optim/grad_buckets.py, the
layout of PyTorch DDP's gradient_as_bucket_view):

- reuse_grad_buffers=False (default): one fused _foreach_add_ per bucket per micro-step, with the same accumulators,
  averaged gradients and averaging weight as before; fp16/bf16 gradients accumulate in float32 unless
  accumulate_in_fp32=False;
- reuse_grad_buffers=True: every param.grad is a view of the accumulator, so autograd accumulates into it and a
  micro-step does no tensor work. A .grad set to None (zero_grad) or replaced is added into its accumulator and the
  view re-attached, so no micro-batch is lost or counted twice (backward(create_graph=True) included: a hook run
  before autograd adds detaches the view, optim/grad_views.py); a .grad computed from the running sum
  (p.grad = f(p.grad)) raises a ValueError naming the parameter; Optimizer.zero_grad is allowed in this mode.

The averaging-time load is one scaled copy per bucket into the averager's shared buffers, which are flat as well and
keep the parameters' dtype, as before; averaged_grads_dtype=torch.float32 makes them float32 for fp16/bf16 parameters
(the copy then rounds nothing). The optimizer creates a missing .grad in the parameter's dtype and device before
copying into it; an offloaded optimizer, whose parameters are float32, gets a float32 .grad of its own where the
averaged buffers are fp16/bf16, filled once per round (its constructor failed on such a model before). Fused ops go
through optim/torch_internals.py, which falls back to one op per sparse tensor where a torch release has no sparse
kernel.

Measured on a CPU (2 cores, fp32, medians of the no-sync step): ResNet-152 34.2 ms before, 31.6 ms with
reuse_grad_buffers=False, 0.56 ms with reuse_grad_buffers=True; ConvNeXt-Large 102.0, 99.5 and 0.52 ms; a
195-tensor transformer runs 1 tensor operation per micro-step instead of 390 (the hivemind_accum repository's
benchmarks/sweep.py and main job). On an accelerator each avoided kernel launch saves its launch latency as well.

What changes for users: parameters must be dense floating-point tensors, each listed once, and averaged_grads, if
given, one CPU tensor per parameter of its shape (a ValueError names the offending position otherwise). The averaged
tensors keep the parameters' dtype by default, so fp16/bf16 peers still average with peers of earlier versions.
With averaged_grads_dtype=torch.float32 the averaged tensors of fp16/bf16 parameters are float32: the averager's
schema hash differs, and such peers join rounds only with peers that set it too. Matchmaking refuses the others with
BAD_SCHEMA_HASH, logged at DEBUG level; a peer on either side of such a refusal now logs a WARNING naming
averaged_grads_dtype, once (optim/schema_mismatch.py). The fused ops need torch 2.3 or newer (torch._foreach_copy_
and torch.amp), above requirements.txt's torch>=1.9.0.
""",
    enters=("torch_internals", "grad_buckets", "grad_views", "schema_mismatch", "grad_averager", "optimizer"),
    hivemind={
        "grad_averager": (
            Edit(
                "        which reduces RAM usage but requires the user to avoid calling zero_grad / clip_grad manually\n",
                "        which reduces RAM usage; each .grad is then a view of the running sum, so edit it only in place\n",
            ),
        ),
        "optimizer": (
            Edit(
                "      This is more memory efficient, but it requires that the user does *NOT* call model/opt zero_grad "
                "at all\n",
                "      This is more memory efficient, and a no-sync step does no tensor work; zero_grad loses nothing\n",
            ),
        ),
    },
)

PROGRESS_RECORD = Change(
    subject="ProgressTracker: build the progress record when it is read, and publish it when peers would see it",
    why="""
report_local_progress built and validated a pydantic LocalTrainingProgress on every micro-step, about half of the
no-sync step's host time on a 400-tensor model, and woke the reporter thread (a DHT store) every time, although
peers see the record only when they refresh. The step now stores the plain values; the record is built when it is
read or published, with the same fields. The reporter is woken at once for a new epoch, a reset, a reached target
or half of min_refresh_period since the last wake-up; other reports are published by a timer at most that late.
Arguments that are not plain non-negative ints still raise the model's ValidationError at once.
""",
    enters=("progress_tracker",),
)

LOSS_SCALING = Change(
    subject="Loss scaling without a host-device sync per micro-step",
    why="""
With a grad scaler, every no-sync step read the overflow flag on the host (are_grads_finite), stalling the
accelerator once per micro-batch.

- reuse_grad_buffers=False with torch.amp.GradScaler: the optimizer declares _step_supports_amp_scaling, so
  scaler.step(opt) hands the scaler to Optimizer.step. Each micro-step is unscaled, checked and added on the
  device, without a host read; one that holds inf or NaN is dropped whole (a masked add) and its found_inf is
  recorded for the scaler's update(). Dropped micro-steps and samples are counted on the device and subtracted
  from the progress once per epoch (one host read). hivemind.GradScaler is handled the same way, and its scale still
  grows only after a global step. Before, the optimizer stepped with gradients still multiplied by the loss scale in
  this mode. A loop that calls hivemind.GradScaler.unscale_ here gets an error: between global steps it leaves the
  gradients scaled, so clipping after it would clip scaled values.
- reuse_grad_buffers=True with hivemind.GradScaler: the accumulated gradients are unscaled and checked once per
  round, before they reach peers; an overflow drops the round's local gradients (weight 0, no optimizer step), as
  native accumulation does. A torch.amp.GradScaler is refused in this mode.
""",
    omit={
        "torch_internals": (
            "import enum",
            "import inspect",
            "import warnings",
            "from torch.amp import grad_scaler as amp_grad_scaler",
            "_unscales",
            "_check_unscale_op",
            "non_finite_check_and_unscale_",
            "_ADD_EXAMPLE_SIZE = 67",
            "_adds_unless_found_inf",
            "_ADDS_UNLESS_FOUND_INF: Dict[Tuple[str, torch.dtype], bool] = {}",
            "has_add_unless_found_inf",
            "add_unless_found_inf_",
            "declare_scaling_aware_step",
            "_scaler_changed",
            "_optimizer_state",
            "_opt_state_unscaled",
            "_loss_scale",
            "_growth_tracker",
            "_NEVER = 2 ** 31 - 1",
            "_back_off_loss_scale_",
            "_inv_loss_scale",
            "_record_found_inf_",
            "_check_grad_scaler",
            "loss_scale",
            "inv_loss_scale",
            "record_found_inf_",
            "back_off_loss_scale_",
            "check_grad_scaler_internals",
            "_run_grad_scaler_contract",
            "HIVEMIND_GRAD_SCALER_CALLS = {'_unscale_grads_': (('optimizer', 'inv_scale', 'found_inf'), "
            "('allow_fp16',)), '_check_inf_per_device': (('optimizer',), ()), "
            "'_found_inf_per_device': (('optimizer',), ())}",
            "_check_hivemind_grad_scaler",
            "check_hivemind_grad_scaler_internals",
            Edit(
                "    check_fused_ops()\n    _check_unscale_op()\n    _check_grad_scaler()\n"
                "    check_hivemind_grad_scaler_internals()\n",
                "    check_fused_ops()\n",
            ),
            Edit("from typing import Callable, Dict, Optional, Sequence, Set, Tuple",
                 "from typing import Callable, Sequence, Set"),
            Edit(
                "\n\nLoss scaling without a host read per micro-step needs ``torch.amp.GradScaler``'s per-optimizer "
                "state (the overflow\nrecord its ``update()`` reads, the stage that says whether the loop already "
                "unscaled), its loss scale tensor, the\n``_step_supports_amp_scaling`` hand-over and the unscale "
                "kernel ``GradScaler.unscale_`` uses; ``hivemind.GradScaler``\ncalls private methods of "
                "``torch.amp.GradScaler``. None of these is public API: :func:`check_grad_scaler_internals`\nruns the "
                "whole contract on a scaler of its own at the first loss-scaled step, and each accessor checks the "
                "shape of\nwhat it reads."
            ),
        ),
        "grad_buckets": (
            "import math",
            "GradientBuckets.add_finite_",
            "_to_device",
            "_host_check_is_free",
            "_add_finite_with_host_check",
            "_add_finite_on_device",
            "_present_if_unscalable_in_place",
            Edit("    add_unless_found_inf_,\n"),
            Edit("    has_add_unless_found_inf,\n"),
            Edit("    non_finite_check_and_unscale_,\n"),
            Edit(" Adding can also\nunscale the gradients and drop them if not finite, for loss scaling."),
            Edit("; also, on such buckets, to be unscaled and checked for inf/NaN without a host\n"
                 "      read (:meth:`GradientBuckets.add_finite_`)"),
            Edit("    :param strides: each view's strides, kept from the first :meth:`GradientBuckets.add_finite_` on "
                 "the device\n"),
            Edit("    strides: Optional[List[Tuple[int, ...]]] = field(default=None, repr=False)\n"),
            Edit("    :param drop_mask: a 0-dim bool of ``flat``'s device, allocated on first use: whether\n"
                 "      :meth:`GradientBuckets.add_finite_` drops the micro-step it adds\n"),
            Edit("    drop_mask: Optional[torch.Tensor] = field(default=None, repr=False)\n"),
        ),
        "grad_averager": (
            "if inv_grad_scale is not None and self.reuse_grad_buffers:",
            "GradientAverager._settle_dropped_micro_steps",
            "self._settle_dropped_micro_steps()",
            Edit(
                "    def accumulate_grads_(\n"
                "        self, batch_size: int, inv_grad_scale: Optional[torch.Tensor] = None\n"
                "    ) -> Optional[torch.Tensor]:\n",
                "    def accumulate_grads_(self, batch_size: int) -> None:\n",
            ),
            Edit(
                " With\n"
                "        ``inv_grad_scale`` the gradients are unscaled as they are added, and a micro-step holding any inf"
                " or NaN is\n"
                "        dropped whole (it leaves the averaging weight at the next load). Nothing is read on the host on"
                " an accelerator."
            ),
            Edit(
                "        :param inv_grad_scale: optional 0-dim float32 tensor on any device, ``1 / loss_scale`` of this "
                "micro-step's\n"
                "          gradients (``torch.ones(())`` for gradients already unscaled but not yet checked for inf/NaN)\n"
                "        :returns: with ``inv_grad_scale``, ``found_inf``: a 0-dim float32 tensor on the accumulators' "
                "device, 1.0 if\n"
                "          this micro-step was dropped (what ``torch.amp.GradScaler.update`` reads to back off); on an "
                "accelerator the\n"
                "          same tensor at every call, overwritten by the next micro-step (clone it to keep it); "
                "otherwise None\n"
            ),
            Edit(
                ", or ``inv_grad_scale`` is given in in-place\n"
                "          mode (there autograd has already added the gradients to the accumulators)"
            ),
            Edit(
                "        if inv_grad_scale is None:\n"
                "            self._accumulators.add_(grads, alpha=alpha)\n"
                "            return None\n"
                "        found_inf = self._accumulators.add_finite_(grads, inv_grad_scale, alpha=alpha)\n"
                "        self._dropped_samples.add_(found_inf, alpha=batch_size)\n"
                "        self._dropped_micro_steps.add_(found_inf)\n"
                "        unset = torch.logical_not(self._first_kept_batch_size, out=self._first_unset)  # in place: allocates "
                "nothing\n"
                "        self._first_kept_batch_size.add_(unset, alpha=batch_size).addcmul_(unset, found_inf, "
                "value=-batch_size)\n"
                "        self._may_have_dropped = True\n"
                "        return found_inf\n",
                "        self._accumulators.add_(grads, alpha=alpha)\n",
            ),
            Edit("            self._attach_grads_()\n            return None\n",
                 "            self._attach_grads_()\n            return\n"),
            Edit(
                "        # micro-steps dropped for inf/NaN gradients (accumulate_grads_ with inv_grad_scale), counted on "
                "the device\n"
                "        # without a host sync and subtracted from the host counters when the accumulators are loaded\n"
                "        # and the batch size of the first micro-step kept (micro-step i weighs b_i / b_first: if the "
                "first\n"
                "        # micro-step is dropped, the accumulators are rescaled once at load time, by _anchor_correction)\n"
                "        self._drop_counters = torch.zeros(3, device=self._accumulators.buckets[0].flat.device)\n"
                "        self._dropped_samples, self._dropped_micro_steps, self._first_kept_batch_size = "
                "self._drop_counters\n"
                "        self._first_unset = torch.zeros_like(self._first_kept_batch_size)  # scratch: whether no "
                "micro-step was kept\n"
                "        self._may_have_dropped = False\n"
                "        self._anchor_correction = 1.0\n"
            ),
            Edit("        self._drop_counters.zero_()\n        self._may_have_dropped = False\n"
                 "        self._anchor_correction = 1.0\n"),
            Edit(
                "grad_scale = (self._anchor_correction / times) if times != 0 else 0.0",
                "grad_scale = (1.0 / times) if times != 0 else 0.0",
            ),
            Edit(
                " Micro-steps dropped for inf/NaN gradients are\n"
                "        subtracted from the counters here (see ``accumulate_grads_``)."
            ),
        ),
        "optimizer": (
            "from hivemind.optim.grad_scaler import GradScaler as HivemindGradScaler",
            "Optimizer.step",
            "Optimizer._check_and_accumulate_gradients",
            "Optimizer._update_global_epoch",
            "Optimizer._begin_averaging_gradients",
            "Optimizer._begin_hivemind_scaler_micro_step",
            "Optimizer._end_hivemind_scaler_micro_step",
            "if self.use_gradient_averaging and not self.auxiliary:",
            Edit("        self._micro_step_scaler = None\n"),  # in __init__ (step, which also sets it, is gone)
            Edit("        self._own_found_inf_record = []  # the overflow tensors step() last recorded in the grad scaler\n"),
            Edit(
                "from hivemind_accum.optim.torch_internals import (\n"
                "    _optimizer_state,\n"
                "    back_off_loss_scale_,\n"
                "    check_hivemind_grad_scaler_internals,\n"
                "    declare_scaling_aware_step,\n"
                "    foreach_copy_,\n"
                "    foreach_zero_,\n"
                "    inv_loss_scale,\n"
                "    record_found_inf_,\n"
                ")\n",
                "from hivemind_accum.optim.torch_internals import foreach_copy_, foreach_zero_\n",
            ),
        ),
    },
)

FALLBACK = Change(
    subject="GradientAverager: a failed round falls back to the round's own local gradients",
    why="""
When an averaging round failed, Optimizer proceeded "with local gradients" by loading the accumulators again, but
step() had already reset them: the peer stepped with zeros and the epoch's local work was lost.

The round's local gradients now stay in the accumulators (with reuse_grad_buffers=True: in .grad) until the round
is settled, i.e. its result is used or the fallback is loaded (optim/local_fallback.py). Only if the accumulators are
needed before that, by a micro-step of the next epoch (delay_grad_averaging=True) or reset_accumulated_grads_, are
they first copied to host memory, once per such round; without delay_grad_averaging no host memory is allocated.
Settling a round leaves the accumulators alone until the next micro-step or reset_accumulated_grads_ zeroes them:
with an optimizer that is not offloaded, Optimizer copies the averaged gradients into .grad, which with
reuse_grad_buffers=True is a view of the accumulators, and steps with them after the round is settled.
PowerSGDGradientAverager opts out (keep_local_fallback = False): it adds the local gradients into its error feedback
when the all-reduce starts, so applying them again would count them twice.

Each round's local gradients are kept under the round's StepControl, also while later rounds begin (at most two
rounds are kept; a third drops the oldest). With delay_grad_averaging=True a round's fallback can wait for the
averager's lock, held by the round's all-reduce, until the next round has begun; it then loads its own round's
gradients, where it would load the next round's window, which the next round then uses again.
""",
    enters=("local_fallback", "power_sgd_averager"),
    omit={
        "grad_buckets": (
            Edit("    share_memory: bool = False,\n    pin_memory: bool = False,\n) -> GradientBucket:",
                 "    share_memory: bool = False,\n) -> GradientBucket:"),
            Edit(", device=device, pin_memory=pin_memory)", ", device=device)"),
            Edit("        upcast: bool = False,\n        pin_memory: bool = False,\n    ):",
                 "        upcast: bool = False,\n    ):"),
            Edit("                pin_memory=pin_memory,\n"),
            Edit(
                "    :param pin_memory: if True, allocate the buffers in page-locked host memory (``device=\"cpu\"``, "
                "needs an\n      accelerator), so that copies from an accelerator into them can run without blocking\n"
            ),
        ),
        "grad_averager": (
            "from hivemind_accum.optim.local_fallback import LocalFallback",
            "keep_local_fallback: bool = True",
            "self.local_fallback = LocalFallback(self._accumulators, self.parameters, in_place=reuse_grad_buffers)",
            "self._loaded_scale = 0.0",
            "self._loaded_scale = grad_scale",
            "handing_off = self._accumulators_used_in_step and self.keep_local_fallback",
            "GradientAverager.step",
            "GradientAverager._beginning_round",
            "GradientAverager.notify_used_averaged_gradients",
            Edit("from typing import AsyncIterator, ContextManager, Iterable,", "from typing import AsyncIterator, Iterable,"),
            Edit(
                "        if self.local_fallback.holding:  # the first micro-step after a round began: the accumulators "
                "start over\n"
                "            self.local_fallback.release_()\n"
            ),
            Edit(
                "        if handing_off:\n"
                "            self.local_fallback.hand_off_(self._loaded_scale)\n"
                "        else:\n"
                "            self.local_fallback.release_()\n",
                "        self._accumulators.zero_()\n",
            ),
            Edit(
                ". Right after ``step`` loaded\n"
                "        them for a round, the accumulators are kept until the round is settled instead (see :meth:`step`)"
            ),
            Edit(
                "        with self.get_tensors() as averaged_grads:\n"
                "            if self.local_fallback.load_into_(self._averaged_target(averaged_grads)):\n"
                "                logger.info(\"Averaging round was not used: loaded this round's local gradients "
                "again\")\n"
                "                return\n"
                "        if self.local_fallback.lost:  # never another round's gradients instead\n"
                "            logger.warning(\"Averaging round was not used and its local gradients are no longer kept: "
                "nothing loaded\")\n"
                "            return False\n"
                "        if self.local_fallback.holding:  # a round began since the last micro-step: there is nothing "
                "new to load\n"
                "            self.local_fallback.release_()\n"
            ),
            Edit(
                " If the last round is not settled (it failed), load that\n"
                "        round's local gradients again instead (see ``step``)."
            ),
            Edit(
                "\n\n        :returns: False (loading nothing) where ``local_fallback.for_round(control)`` names a round "
                "that keeps its\n          local gradients no longer: a fallback loads only its own round's; else None"
            ),
        ),
        "optimizer": (
            "import contextlib",
            "from hivemind.averaging.control import StepControl",
            "Optimizer._average_gradients_and_load_into_optimizer",
            "Optimizer._bound_to_round",
            "Optimizer._schedule_round",
            "if self.scheduled_grads is None and self.tracker.global_progress.num_peers > 1:",
            Edit("from typing import Callable, ContextManager, List,", "from typing import Callable, List,"),
        ),
    },
)

NONFINITE_GUARD = Change(
    subject="Keep inf and NaN out of averaging rounds",
    why="""
One peer whose gradients or parameters became inf or NaN made every member of its group NaN at the next
all-reduce, and a peer downloading the state copied whatever it received.

- GradientAverager checks this peer's gradients once per round, as they are loaded (sums of each chunk taken while
  the copy writes it, in cache; optim/round_guard.py). Non-finite ones reach peers as zeros with weight 0, and the
  optimizer skips this epoch's step.
- Optimizer checks the averaged gradients before using them; if they are not finite, the round counts as failed and
  the optimizer steps with this peer's own gradients of the round (or, where the averager keeps none, skips its
  step). A skipped step joins the next state averaging round with weight 0.
- TrainingStateAverager offers non-finite parameters or statistics as zeros with weight 0 and does not take a
  non-finite result. It does not share a non-finite state, and load_state_from_peers (with wait=True, as Optimizer
  calls it) discards a downloaded state that is not finite.
- PowerSGDGradientAverager resets error feedback and Q left non-finite by a round before the next one.
- A round's fallback that finds its local gradients kept no longer (two later rounds began) skips its step; one
  whose local gradients were copied to host memory (offloaded, the next epoch accumulated during the round) steps
  with that copy as .grad and leaves the averager's buffers, which may hold the next round's part by then, alone.
""",
    enters=("round_guard", "state_averager"),
    omit={
        "grad_buckets": (
            "CHECK_CHUNK = 1 << 18",
            "GradientBuckets.scaled_copy_with_checksums_",
            "_scaled_copy_with_checksums",
            Edit("from typing import Dict, Iterable, Iterator,", "from typing import Dict, Iterable,"),
        ),
        "local_fallback": (
            Edit("    def hand_off_(self, scale: float, finite: bool) -> None:\n",
                 "    def hand_off_(self, scale: float) -> None:\n"),
            Edit("        :param finite: whether they were finite (if not, the fallback is zeros, as sent to peers)\n"),
            Edit("self._kept[key] = [None, scale if finite else 0.0]", "self._kept[key] = [None, scale]"),
        ),
        "grad_averager": (
            "from hivemind_accum.optim.round_guard import RoundGuard",
            'self.round_guard = RoundGuard("accumulated gradients")',
            "GradientAverager.flat_averaged_grads",
            "GradientAverager.discard_nonfinite_round_",
            Edit("self.local_fallback.hand_off_(self._loaded_scale, finite=self.round_guard.own_finite)",
                 "self.local_fallback.hand_off_(self._loaded_scale)"),
            Edit(
                "\n\n        The loaded gradients are checked once (``round_guard.offer_``) from sums of each chunk, "
                "taken while the copy\n        writes it (with ``averaged_grads`` given at construction: one read-only "
                "reduction per tensor). If any is inf\n        or NaN, the buffers are set to zeros and "
                "``local_samples_accumulated`` to 0, so ``step`` joins the round with\n        weight 0; "
                "``round_guard.own_finite`` becomes False, and the optimizer skips this epoch's step."
            ),
            Edit(
                "        with self.get_tensors() as averaged_grads:\n"
                "            target, checksums = self._averaged_target(averaged_grads), None\n"
                "            if target is self._averaged_buckets:  # the check's sums, taken as the copy writes each "
                "chunk (in cache)\n"
                "                checksums = self._accumulators.scaled_copy_with_checksums_(target, grad_scale)\n"
                "            else:\n"
                "                self._accumulators.scaled_copy_to_(target, grad_scale)\n"
                "            guarded = self.flat_averaged_grads(averaged_grads)\n"
                "            if not self.round_guard.offer_(guarded, checksums, round_key=self.local_fallback.named_round):\n"
                "                self.local_samples_accumulated = 0  # step() then joins the round with weight 0 (and "
                "zeros)\n",
                "        with self.get_tensors() as averaged_grads:\n"
                "            self._accumulators.scaled_copy_to_(self._averaged_target(averaged_grads), grad_scale)\n",
            ),
        ),
        "power_sgd_averager": (
            "from hivemind_accum.optim.round_guard import all_finite",
            "PowerSGDGradientAverager._aggregate_with_group",
            "PowerSGDGradientAverager.load_accumulators_into_averager_",
            "PowerSGDGradientAverager.discard_nonfinite_round_",
        ),
        "optimizer": (
            "import threading",
            "self._step_decisions = StepDecisions()  # each round's decision for its optimizer step: _round_usable",
            "Optimizer._round_own_finite",
            "self._host_copy_step = threading.local()  # see _step_with_host_copy",
            "Optimizer._round_usable",
            "Optimizer._step_with_host_copy",
            "Optimizer._swap_in_host_copy",
            "Optimizer._swap_out_host_copy",
            "from hivemind_accum.optim.round_guard import SkipUnusableSteps, StepDecisions, all_finite",
            "from hivemind_accum.optim.state_averager import TrainingStateAverager",
            "if self.use_gradient_averaging and self._guards_gradients():",
            "Optimizer._load_averaged_gradients_into_optimizer_",
            "Optimizer._load_local_gradients_into_optimizer",
            "Optimizer._on_skipped_step",
            "Optimizer._compute_schema_hash",
            "Optimizer._guards_gradients",
            "Optimizer._make_state_averager",
            Edit("    def _load_gradients_into_optimizer_(self):\n",
                 "    def _load_averaged_gradients_into_optimizer_(self):\n"),
            Edit(":meth:`_load_gradients_into_optimizer_` fills", ":meth:`_load_averaged_gradients_into_optimizer_` fills"),
        ),
    },
)

ARGUMENT_CHECKS = Change(
    subject="Optimizer, GradientAverager: clear errors for bad arguments and for an averager that is not running",
    why="""
A batch_size_per_step that is not a positive int or None is a ValueError at construction (it failed at the first
step()); a parameter listed twice in params (or in the optimizer's param_groups) is a ValueError naming both
positions, raised before the progress tracker and averagers start (it was an AssertionError from the state averager,
after they started). One-pass iterators inside param groups are read once. GradientAverager.step and schedule_step
on an averager that is not running raise a RuntimeError that says so.
""",
    omit={
        "optimizer": (
            "Optimizer.__init__.__doc__",
            "if batch_size_per_step is not None and not is_positive_int(batch_size_per_step):",
            "if params is not None:",
            "check_distinct(named)",
            "_named_params",
            "_params_as_lists",
        ),
        "grad_averager": (
            'self._check_running("step")',
            Edit("; raises a\n        clear ``RuntimeError`` if the averager is not running"),
            "GradientAverager.schedule_step",
            "GradientAverager._check_running",
        ),
    },
)

# the series after the defect fixes, in order: first the fix for hivemind#566, then each change that builds on it
CHANGES: Sequence[Change] = (ACCUMULATION, PROGRESS_RECORD, LOSS_SCALING, FALLBACK, NONFINITE_GUARD, ARGUMENT_CHECKS)
