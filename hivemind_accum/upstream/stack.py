"""
The pull requests for hivemind: ``DIR/prs/NN-slug/``, each a ``git format-patch`` series and its ``description.md``.

Each pull request is one concern, cut as small as a reviewer can judge alone. Its code is a few text edits of
hivemind's modules (``Edit``, or a defect fix from :mod:`hivemind_accum.upstream.fixes`); its tests and benchmark are
files of this repository, under ``pull_requests/NN-slug/``, copied into hivemind's ``tests/`` and ``benchmarks/``.
Its ``description.md`` is the pull request's text; a line ``Depends on: NN-slug`` names a prerequisite. Commits are
made with git in a scratch repository that holds hivemind's modules as the base (the installed package or a
checkout), so every patch applies with ``git am`` to hivemind master after the pull requests it names.
"""
import os
import re
import shutil
import subprocess
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from hivemind_accum.upstream.fixes import FIXES, Fix, FixError, apply_fix

PULL_REQUESTS_DIR = Path(__file__).resolve().parent / "pull_requests"
OUR_OPTIM = Path(__file__).resolve().parent.parent / "optim"
COMMIT_DATE = "2026-12-04T00:00:00+00:00"  # fixed, so that the same sources give the same patches


@dataclass(frozen=True)
class Edit:
    path: str  # relative to the package directory, e.g. "optim/grad_averager.py"
    old: str  # hivemind's text, whole lines, found exactly once in the module
    new: str


@dataclass(frozen=True)
class Commit:
    subject: str
    body: str
    edits: Tuple[object, ...]  # Edit or Fix
    files: Tuple[str, ...] = ()  # paths under the pull request's folder, copied to the same path in hivemind's tree


@dataclass(frozen=True)
class PullRequest:
    slug: str  # "NN-name": its folder under pull_requests/ and in DIR/prs/
    commits: Tuple[Commit, ...]

    @property
    def folder(self) -> Path:
        return PULL_REQUESTS_DIR / self.slug

    @property
    def depends(self) -> List[str]:
        """the pull requests this one applies after, as its description names them"""
        text = (self.folder / "description.md").read_text()
        return [slug for line in re.findall(r"(?im)^depends on:(.*)$", text) for slug in re.findall(r"\d\d-[\w.-]+", line)]

    @property
    def test_files(self) -> List[str]:
        return [path for commit in self.commits for path in commit.files if path.startswith("tests/")]


def _fix(subject_start: str) -> Fix:
    (fix,) = [fix for fix in FIXES if fix.subject.startswith(subject_start)]
    return fix


def _fix_commit(subject_start: str, test_file: str) -> Commit:
    fix = _fix(subject_start)
    return Commit(fix.subject, fix.why, (fix,), (test_file,))


FUSED_ACCUMULATION = Edit(
    path="optim/grad_averager.py",
    old=(
        "            alpha = float(batch_size) / self._anchor_batch_size\n"
        "            for grad_buf, grad_acc in zip(self._grads_from_parameters(), self._grad_accumulators()):\n"
        "                grad_acc.add_(grad_buf.to(grad_acc.device), alpha=alpha)\n"
    ),
    new=(
        "            alpha = float(batch_size) / self._anchor_batch_size\n"
        "            grouped_accs, grouped_bufs = defaultdict(list), defaultdict(list)\n"
        "            for grad_buf, grad_acc in zip(self._grads_from_parameters(), self._local_accumulators):\n"
        "                key = (grad_acc.device, grad_acc.dtype)\n"
        "                if grad_buf.layout != torch.strided or (grad_buf.device, grad_buf.dtype) != key:\n"
        "                    grad_acc.add_(grad_buf.to(grad_acc.device), alpha=alpha)\n"
        "                else:\n"
        "                    grouped_accs[key].append(grad_acc)\n"
        "                    grouped_bufs[key].append(grad_buf)\n"
        "            for key, grad_accs in grouped_accs.items():\n"
        "                torch._foreach_add_(grad_accs, grouped_bufs[key], alpha=alpha)\n"
    ),
)

DEFAULTDICT_IMPORT = Edit(
    path="optim/grad_averager.py",
    old="import contextlib\n",
    new="import contextlib\nfrom collections import defaultdict\n",
)

FALLBACK_KEEPS_ACCUMULATORS = Edit(
    path="optim/optimizer.py",
    old=(
        "                self.scheduled_grads = self.grad_averager.step(\n"
        "                    control=self.scheduled_grads, reset_accumulators=True, wait=False\n"
        "                )\n"
    ),
    new=(
        "                # keep the local gradients until the round ends: if it fails, the optimizer steps with them, and\n"
        "                # _update_global_epoch resets them after that. Not with delay_grad_averaging, whose round ends\n"
        "                # after that reset, nor where the error feedback takes them\n"
        "                self.scheduled_grads = self.grad_averager.step(\n"
        "                    control=self.scheduled_grads,\n"
        "                    reset_accumulators=self.delay_grad_averaging or self._error_feedback_takes_local_grads,\n"
        "                    wait=False,\n"
        "                )\n"
    ),
)

ERROR_FEEDBACK_PROPERTY = Edit(
    path="optim/optimizer.py",
    old="    def _begin_averaging_gradients(self, grad_scaler: Optional[GradScaler]) -> bool:\n",
    new=(
        "    @property\n"
        "    def _error_feedback_takes_local_grads(self) -> bool:\n"
        "        \"\"\"PowerSGD adds the local gradients to its error feedback once its all-reduce begins, to send them later:\n"
        "        a failed round must not step with them as well\"\"\"\n"
        "        return isinstance(self.grad_averager, PowerSGDGradientAverager)\n"
        "\n"
        "    def _begin_averaging_gradients(self, grad_scaler: Optional[GradScaler]) -> bool:\n"
    ),
)

POWER_SGD_IMPORT = Edit(
    path="optim/optimizer.py",
    old="from hivemind.optim.grad_scaler import GradScaler\n",
    new=(
        "from hivemind.optim.grad_scaler import GradScaler\n"
        "from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager\n"
    ),
)

DELAYED_FALLBACK_USES_ROUND_GRADIENTS = Edit(
    path="optim/optimizer.py",
    old=(
        "        if not averaged_gradients:\n"
        "            self._load_local_gradients_into_optimizer()\n"
    ),
    new=(
        "        if not averaged_gradients:\n"
        "            if self.delay_grad_averaging and not self._error_feedback_takes_local_grads:\n"
        "                # the accumulators hold the next epoch's micro-steps by now; this round's local gradients are\n"
        "                # where grad_averager.step loaded them when the round began\n"
        "                logger.log(self.status_loglevel, \"Proceeding with local gradients of this round\")\n"
        "                self._load_averaged_gradients_into_optimizer_()\n"
        "            else:\n"
        "                self._load_local_gradients_into_optimizer()\n"
    ),
)

GRADIENT_ROUND_DEADLINE = Edit(
    path="optim/optimizer.py",
    old=(
        "                    reset_accumulators=self.delay_grad_averaging or self._error_feedback_takes_local_grads,\n"
        "                    wait=False,\n"
    ),
    new=(
        "                    reset_accumulators=self.delay_grad_averaging or self._error_feedback_takes_local_grads,\n"
        "                    timeout=self.averaging_timeout,\n"
        "                    wait=False,\n"
    ),
)

AVERAGED_GRADS_DTYPE_PARAM = Edit(
    path="optim/grad_averager.py",
    old="        averaged_grads: Sequence[torch.Tensor] = (),\n        **kwargs,\n",
    new=(
        "        averaged_grads: Sequence[torch.Tensor] = (),\n"
        "        averaged_grads_dtype: Optional[torch.dtype] = None,\n"
        "        **kwargs,\n"
    ),
)

AVERAGED_GRADS_DTYPE_DOC = Edit(
    path="optim/grad_averager.py",
    old="    :param averaged_grads: if provided, it will be used as a set of averagable gradients\n",
    new=(
        "    :param averaged_grads: if provided, it will be used as a set of averagable gradients\n"
        "    :param averaged_grads_dtype: if specified, make the averaged gradients in this dtype instead of the parameters'\n"
        "      dtypes (only if averaged_grads is not provided). E.g. torch.float32 for float16 or bfloat16 parameters with\n"
        "      an offloaded optimizer, whose float32 parameters then get the average unrounded. Peers average only with\n"
        "      peers whose averaged gradients have the same dtypes\n"
    ),
)

AVERAGED_GRADS_DTYPE_CHECKS = Edit(
    path="optim/grad_averager.py",
    old=(
        "        if reuse_grad_buffers and accumulate_grads_on is not None:\n"
        "            logger.warning(\"Setting 'accumulate_grads_on' has no effect if reuse_grad_buffers=True\")\n"
    ),
    new=(
        "        if averaged_grads_dtype is not None and not averaged_grads_dtype.is_floating_point:\n"
        "            raise ValueError(f\"averaged_grads_dtype must be a floating point dtype, got {averaged_grads_dtype}\")\n"
        "        if averaged_grads_dtype is not None and averaged_grads:\n"
        "            raise ValueError(\"Pass averaged_grads or averaged_grads_dtype, not both\")\n"
        "        if reuse_grad_buffers and accumulate_grads_on is not None:\n"
        "            logger.warning(\"Setting 'accumulate_grads_on' has no effect if reuse_grad_buffers=True\")\n"
    ),
)

AVERAGED_GRADS_DTYPE_INIT = Edit(
    path="optim/grad_averager.py",
    old="                    grad.detach().cpu().clone().share_memory_() for grad in self._grads_from_parameters()\n",
    new=(
        "                    grad.detach().to(\"cpu\", dtype=averaged_grads_dtype or grad.dtype, copy=True).share_memory_()\n"
        "                    for grad in self._grads_from_parameters()\n"
    ),
)

SCHEMA_REJECTION_SEEN = Edit(
    path="averaging/matchmaking.py",
    old="        self.client_mode = client_mode\n",
    new=(
        "        self.client_mode = client_mode\n"
        "        self._warned_bad_schema_hash = False\n"
    ),
)

SCHEMA_REJECTION_WARNING = Edit(
    path="averaging/matchmaking.py",
    old=(
        "            if message.code != averaging_pb2.ACCEPTED:\n"
        "                code = averaging_pb2.MessageCode.Name(message.code)\n"
    ),
    new=(
        "            if message.code == averaging_pb2.BAD_SCHEMA_HASH and not self._warned_bad_schema_hash:\n"
        "                self._warned_bad_schema_hash = True\n"
        "                logger.warning(\n"
        "                    f\"{self.peer_id} - {leader} will not average with this peer (BAD_SCHEMA_HASH): peers average \"\n"
        "                    f\"only if their averaged tensors have the same shapes and dtypes, in the same order. Check that \"\n"
        "                    f\"all peers use the same model and dtypes (further rejections are logged at DEBUG level)\"\n"
        "                )\n"
        "            if message.code != averaging_pb2.ACCEPTED:\n"
        "                code = averaging_pb2.MessageCode.Name(message.code)\n"
    ),
)

NONFINITE_GRADS_WEIGHT_ZERO = Edit(
    path="optim/grad_averager.py",
    old="        control.weight = self.local_samples_accumulated if weight is None else weight\n",
    new=(
        "        control.weight = self.local_samples_accumulated if weight is None else weight\n"
        "        with self.get_tensors() as averaged_grads:\n"
        "            # inf and NaN propagate through a sum; finite float32/16 values cannot overflow a float64 sum\n"
        "            if not all(grad.sum(dtype=torch.float64).isfinite() for grad in averaged_grads):\n"
        "                logger.warning(\"Local gradients contain inf or NaN: averaging zeros with weight 0 instead\")\n"
        "                for grad in averaged_grads:\n"
        "                    grad.zero_()\n"
        "                control.weight = 0\n"
    ),
)

NONFINITE_GRADS_POWER_SGD_ADD = Edit(
    path="optim/power_sgd_averager.py",
    old=(
        "                for grad, m in zip(averaged_grads_via_sgd, self._ms):\n"
        "                    m.add_(grad.to(m.device))\n"
    ),
    new=(
        "                # with weight 0, this peer sends nothing to compress: its error-feedback residual stays as it was\n"
        "                update_residuals = kwargs.get(\"weight\") != 0\n"
        "                for grad, m in zip(averaged_grads_via_sgd, self._ms):\n"
        "                    if update_residuals:\n"
        "                        m.add_(grad.to(m.device))\n"
    ),
)

NONFINITE_GRADS_POWER_SGD_SUB = Edit(
    path="optim/power_sgd_averager.py",
    old=(
        "                    new_m = torch.matmul(p, q.t()).reshape(m.size())\n"
        "                    m.sub_(new_m)\n"
    ),
    new=(
        "                    new_m = torch.matmul(p, q.t()).reshape(m.size())\n"
        "                    if update_residuals:\n"
        "                        m.sub_(new_m)\n"
    ),
)

NONFINITE_GRADS_WEIGHT_DOC = Edit(
    path="optim/grad_averager.py",
    old="        :param weight: overrides the averaging weight; by default, weight equals the number of accumulated samples\n",
    new=(
        "        :param weight: overrides the averaging weight; by default, weight equals the number of accumulated samples\n"
        "          (if the accumulated gradients contain inf or NaN, this peer averages zeros with weight 0 instead)\n"
    ),
)

ACCUMULATORS_DTYPE_DOC = Edit(
    path="optim/grad_averager.py",
    old=(
        "    :param averaged_grads_dtype: if specified, make the averaged gradients in this dtype instead of the parameters'\n"
        "      dtypes (only if averaged_grads is not provided). E.g. torch.float32 for float16 or bfloat16 parameters with\n"
        "      an offloaded optimizer, whose float32 parameters then get the average unrounded. Peers average only with\n"
        "      peers whose averaged gradients have the same dtypes\n"
    ),
    new=(
        "    :param averaged_grads_dtype: if specified, make the averaged gradients in this dtype instead of the parameters'\n"
        "      dtypes (only if averaged_grads is not provided); the local accumulators (reuse_grad_buffers=False) take the\n"
        "      wider of this dtype and the gradients'. E.g. torch.float32 for float16 or bfloat16 parameters: micro-steps\n"
        "      are summed in float32, and an offloaded optimizer's float32 parameters get the average unrounded. Peers\n"
        "      average only with peers whose averaged gradients have the same dtypes\n"
    ),
)

ACCUMULATORS_DTYPE_INIT = Edit(
    path="optim/grad_averager.py",
    old="                torch.zeros_like(grad, device=accumulate_grads_on) for grad in self._grads_from_parameters()\n",
    new=(
        "                torch.zeros_like(\n"
        "                    grad,\n"
        "                    device=accumulate_grads_on,\n"
        "                    dtype=torch.promote_types(grad.dtype, averaged_grads_dtype or grad.dtype),\n"
        "                )\n"
        "                for grad in self._grads_from_parameters()\n"
    ),
)

POWER_SGD_FLOAT32_ERROR_FEEDBACK = Edit(
    path="optim/power_sgd_averager.py",
    old="        self._ms = [\n            torch.zeros_like(grad, device=\"cpu\").share_memory_()\n",
    new=(
        "        # error feedback in float32, as P and Q are, also for float16 or bfloat16 gradients\n"
        "        self._ms = [\n"
        "            torch.zeros_like(grad, device=\"cpu\", dtype=torch.float32).share_memory_()\n"
    ),
)

GRAD_SCALER_DEFAULTDICT_IMPORT = Edit(
    path="optim/grad_scaler.py",
    old="from copy import deepcopy\n",
    new="from collections import defaultdict\nfrom copy import deepcopy\n",
)

GRAD_SCALER_UPDATE_ON_DEVICE = Edit(
    path="optim/grad_scaler.py",
    old=(
        "        with self._lock:\n"
        "            total_infs = 0\n"
        "            for optimizer_state in self._per_optimizer_states.values():\n"
        "                total_infs += sum(v.item() for v in optimizer_state[\"found_inf_per_device\"].values())\n"
        "\n"
        "            if self._is_ready_to_update or total_infs != 0:\n"
        "                # note: we update either during actual optimizer step or if we need to reduce scale due to NaN\n"
        "                super().update(new_scale)\n"
        "                self._is_ready_to_update = False\n"
        "                return True\n"
        "            else:\n"
        "                for opt_id in self._optimizer_states_to_reset:\n"
        "                    self._per_optimizer_states[opt_id] = _refresh_per_optimizer_state()\n"
        "                self._optimizer_states_to_reset.clear()\n"
        "                return False\n"
    ),
    new=(
        "        with self._lock:\n"
        "            if self._is_ready_to_update:\n"
        "                super().update(new_scale)\n"
        "                self._is_ready_to_update = False\n"
        "                return True\n"
        "            found_infs = [\n"
        "                found_inf.to(self._scale.device)\n"
        "                for optimizer_state in self._per_optimizer_states.values()\n"
        "                for found_inf in optimizer_state[\"found_inf_per_device\"].values()\n"
        "            ]\n"
        "            if found_infs:\n"
        "                # no global step: back the scale off after an overflow, as super().update() does, but without growing\n"
        "                # it and without reading found_inf on the host\n"
        "                found_inf = torch.stack(found_infs).sum() > 0\n"
        "                self._scale.mul_(torch.where(found_inf, self._backoff_factor, 1.0))\n"
        "                self._growth_tracker.masked_fill_(found_inf, 0)\n"
        "            self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)\n"
        "            self._optimizer_states_to_reset.clear()\n"
        "            return False\n"
    ),
)

PROGRESS_REPORT_STATE = Edit(
    path="optim/progress_tracker.py",
    old="        self.shutdown_triggered, self.shutdown_complete = threading.Event(), threading.Event()\n",
    new=(
        "        self.shutdown_triggered, self.shutdown_complete = threading.Event(), threading.Event()\n"
        "        self._last_wakeup_progress: Optional[LocalTrainingProgress] = None\n"
        "        self._delayed_report: Optional[threading.Timer] = None\n"
    ),
)

PROGRESS_REPORT_WAKEUPS = Edit(
    path="optim/progress_tracker.py",
    old=(
        "        self.local_progress = self._get_local_progress(local_epoch, samples_accumulated)\n"
        "        self.should_report_progress.set()\n"
    ),
    new=(
        "        self.local_progress = self._get_local_progress(local_epoch, samples_accumulated)\n"
        "        if self._peers_need_report_now(self.local_progress):\n"
        "            self._last_wakeup_progress = self.local_progress\n"
        "            self.should_report_progress.set()\n"
        "        elif self._delayed_report is None:\n"
        "            # publish this report (or a later one) at most min_refresh_period / 2 after the last wake-up\n"
        "            delay = self._last_wakeup_progress.time + self.min_refresh_period / 2 - self.local_progress.time\n"
        "            self._delayed_report = threading.Timer(max(0.0, delay), self._report_delayed_progress)\n"
        "            self._delayed_report.daemon = True\n"
        "            self._delayed_report.start()\n"
        "\n"
        "    def _peers_need_report_now(self, progress: LocalTrainingProgress) -> bool:\n"
        "        \"\"\"Whether to wake the reporter now (peers fetch at most every min_refresh_period, extrapolating in between)\"\"\"\n"
        "        last_progress = self._last_wakeup_progress\n"
        "        return (\n"
        "            last_progress is None\n"
        "            or progress.epoch != last_progress.epoch\n"
        "            or progress.samples_accumulated < last_progress.samples_accumulated  # progress was reset\n"
        "            or max(progress.samples_accumulated, self.global_progress.samples_accumulated) >= self.target_batch_size\n"
        "            or progress.time - last_progress.time >= self.min_refresh_period / 2\n"
        "        )\n"
        "\n"
        "    def _report_delayed_progress(self):\n"
        "        self._delayed_report = None\n"
        "        self._last_wakeup_progress = self.local_progress\n"
        "        self.should_report_progress.set()\n"
    ),
)

PROGRESS_REPORT_SHUTDOWN = Edit(
    path="optim/progress_tracker.py",
    old=(
        "        self.shutdown_triggered.set()\n"
        "        self.should_report_progress.set()\n"
    ),
    new=(
        "        self.shutdown_triggered.set()\n"
        "        delayed_report = self._delayed_report\n"
        "        if delayed_report is not None:\n"
        "            delayed_report.cancel()\n"
        "        self.should_report_progress.set()\n"
    ),
)


PULL_REQUESTS: Sequence[PullRequest] = (
    PullRequest(
        "01-fused-accumulation",
        (
            Commit(
                "Use torch._foreach_add_ in GradientAverager.accumulate_grads_",
                "accumulate_grads_ added each gradient into its accumulator in a Python loop, one add_ per "
                "parameter tensor: a kernel launch per tensor on a GPU on every no-sync Optimizer.step() "
                "(related to #566). Gradients whose accumulator has the same device and dtype are now added with "
                "one torch._foreach_add_ per (device, dtype) group, as torch.optim groups its foreach ops. Sparse "
                "or other non-strided gradients and accumulators on another device (accumulate_grads_on=) keep the "
                "per-tensor add. The loop reads self._local_accumulators directly: accumulate_grads_ already runs "
                "under torch.no_grad(), and the _grad_accumulators() generator re-entered it for every tensor. "
                "The values are the same: the same additions with the same alpha.",
                (DEFAULTDICT_IMPORT, FUSED_ACCUMULATION),
                ("tests/test_grad_accumulation.py", "benchmarks/benchmark_no_sync_step.py"),
            ),
        ),
    ),
    PullRequest(
        "02-optimizer-client-mode",
        (_fix_commit("Optimizer: fall back to the DHT's client mode", "tests/test_optimizer_client_mode.py"),),
    ),
    PullRequest(
        "03-optimizer-del",
        (_fix_commit("Optimizer: do not fail in __del__", "tests/test_optimizer_del.py"),),
    ),
    PullRequest(
        "04-grad-scaler-disabled-update",
        (_fix_commit("GradScaler: make update() a no-op", "tests/test_grad_scaler.py"),),
    ),
    PullRequest(
        "05-step-control-cancel-order",
        (_fix_commit("StepControl: mark a round cancelled", "tests/test_step_control.py"),),
    ),
    PullRequest(
        "06-failed-round-fallback",
        (
            Commit(
                "Optimizer: step with local gradients, not zeros, when gradient averaging fails",
                "When a gradient averaging round began and then failed, Optimizer logged \"Proceeding with local "
                "gradients\" and loaded the gradient accumulators into the optimizer. But _begin_averaging_gradients "
                "had called grad_averager.step(reset_accumulators=True), which zeroes them as soon as the round "
                "begins: the peer stepped with zero gradients and lost its local epoch. The accumulators are now "
                "kept until the round ends; _update_global_epoch already resets them after the optimizer step. "
                "Two configurations keep the old behaviour. With delay_grad_averaging=True the round ends in the "
                "background after that reset, while the next epoch accumulates: its fallback is a separate change. "
                "PowerSGDGradientAverager adds the local gradients to its error feedback once "
                "its all-reduce begins, and stepping with them as well would count them twice.",
                (POWER_SGD_IMPORT, ERROR_FEEDBACK_PROPERTY, FALLBACK_KEEPS_ACCUMULATORS),
                ("tests/test_optimizer_fallback.py",),
            ),
        ),
    ),
    PullRequest(
        "07-delayed-fallback",
        (
            Commit(
                "Optimizer: with delay_grad_averaging, a failed round steps with its own gradients",
                "With delay_grad_averaging=True the gradient averaging round ends in the background, while the next "
                "epoch accumulates. When the round failed, the fallback called load_accumulators_into_averager_(), "
                "which loaded the next epoch's micro-steps accumulated so far (zeros if there were none): the peer "
                "stepped with them, then sent them again in the next round. The round's own local gradients are "
                "still in the averaged tensors, where grad_averager.step loaded them when the round began. The "
                "fallback now steps with those. PowerSGDGradientAverager keeps the old fallback, as it does without "
                "delay_grad_averaging: its error feedback already holds those gradients.",
                (DELAYED_FALLBACK_USES_ROUND_GRADIENTS,),
                ("tests/test_optimizer_delayed_fallback.py",),
            ),
        ),
    ),
    PullRequest(
        "08-gradient-round-deadline",
        (
            Commit(
                "Optimizer: give a gradient averaging round that was not pre-scheduled a deadline",
                "A round pre-scheduled by _maybe_schedule_gradient_averaging ends by averaging_timeout. One begun "
                "without pre-scheduling had no deadline: _begin_averaging_gradients called grad_averager.step "
                "without a timeout. After _average_gradients_and_load_into_optimizer stopped waiting for it and "
                "stepped with local gradients, it kept looking for a group. It held up this peer's later rounds (one "
                "matchmaking at a time), and could join other peers' next round with the old round's weight, "
                "sending whatever the averaged tensors held by then and writing into them. It now gets "
                "timeout=self.averaging_timeout, as pre-scheduled gradient rounds and state averaging rounds do.",
                (GRADIENT_ROUND_DEADLINE,),
                ("tests/test_optimizer_round_deadline.py",),
            ),
        ),
    ),
    PullRequest(
        "09-averaged-grads-dtype",
        (
            Commit(
                "GradientAverager: add averaged_grads_dtype, e.g. float32 averaged gradients for float16 parameters",
                "GradientAverager made its averaged gradients as copies of the parameters' gradients, in their dtype. "
                "With float16 or bfloat16 parameters, the all-reduce averages in float32, but the result is rounded "
                "when written into the averaged gradients: two peers with gradients 2048 and 1 get 1024 instead of "
                "1024.5. averaged_grads_dtype=torch.float32 makes the averaged gradients float32 (first part of "
                "#476). This matters where they are used as float32: with offload_optimizer=True they become the "
                ".grad of the optimizer's float32 copies of the parameters. That configuration raised RuntimeError "
                "in Optimizer() with float16 parameters (a float16 gradient for a float32 tensor) and now trains. "
                "The default, None, keeps the parameters' dtypes, so the averaged tensors and the schema hash of "
                "existing peers do not change. A dtype that is not floating point, or averaged_grads given as well, "
                "raises ValueError before anything is allocated.",
                (AVERAGED_GRADS_DTYPE_PARAM, AVERAGED_GRADS_DTYPE_DOC, AVERAGED_GRADS_DTYPE_CHECKS, AVERAGED_GRADS_DTYPE_INIT),
                ("tests/test_grad_averager_dtype.py",),
            ),
        ),
    ),
    PullRequest(
        "10-schema-hash-warning",
        (
            Commit(
                "Matchmaking: warn once when a leader rejects this peer for its schema hash",
                "Two averagers whose averaged tensors differ in shape, dtype or order never average together: the "
                "leader rejects the follower's request with BAD_SCHEMA_HASH. The follower logged that at DEBUG level "
                "only, like the rejections that resolve themselves (NOT_LOOKING_FOR_GROUP, BAD_EXPIRATION_TIME, ...). "
                "So a swarm whose peers disagree on the model, or on the dtypes of their averaged tensors, looked "
                "like a swarm with no one to average with. The first rejection for the schema hash now logs a "
                "WARNING, once per averager; later ones, and other rejections, stay at DEBUG level.",
                (SCHEMA_REJECTION_SEEN, SCHEMA_REJECTION_WARNING),
                ("tests/test_matchmaking_schema.py",),
            ),
        ),
    ),
    PullRequest(
        "11-nonfinite-grads-weight-zero",
        (
            Commit(
                "GradientAverager: average inf/NaN gradients as zeros with weight 0",
                "One peer whose accumulated gradients held inf or NaN sent them into the all-reduce, which computes "
                "sum(weight * grad) / sum(weight): every peer of the group received inf or NaN and stepped with it. "
                "GradientAverager.step now checks the gradients it has loaded for averaging (one float64 sum per "
                "tensor, once per round); if any is not finite, it averages zeros with weight 0, overriding a weight "
                "passed to step(), and logs a warning. Every peer of the group then receives the average of the "
                "others. Peers without this change average with it as before.",
                (NONFINITE_GRADS_WEIGHT_DOC, NONFINITE_GRADS_WEIGHT_ZERO),
                ("tests/test_grad_averager_nonfinite.py",),
            ),
        ),
    ),
    PullRequest(
        "12-accumulators-dtype",
        (
            Commit(
                "GradientAverager: accumulate in averaged_grads_dtype, e.g. float32 for float16 parameters",
                "With reuse_grad_buffers=False, GradientAverager sums each micro-step's gradients into local "
                "accumulators made like the parameters' gradients, in their dtype. With float16 or bfloat16 "
                "parameters every addition rounds the running sum: a micro-step's gradient smaller than half the "
                "sum's spacing is lost (2048 + 1 is 2048 in float16; 256 + 1 is 256 in bfloat16), so four "
                "micro-steps of 2048, 1, 1 and 2 average to 512.5 in float16 instead of 513, and 256, 1, 1, 2 to "
                "64.5 in bfloat16 instead of 65. The accumulators now take the wider of averaged_grads_dtype (the "
                "averaged gradients' dtype) and the gradients' dtype, so with torch.float32 the micro-steps are "
                "summed in float32 and the average is rounded at most once, where it is copied into a low-precision "
                ".grad. A narrower averaged_grads_dtype never narrows the accumulators. The default, None, "
                "keeps the parameters' dtypes. Nothing sent to peers changes: the averaged tensors are those "
                "averaged_grads_dtype already chose. Float32 accumulators take twice the memory of float16 ones, on "
                "the device they are on (accumulate_grads_on).",
                (ACCUMULATORS_DTYPE_DOC, ACCUMULATORS_DTYPE_INIT),
                ("tests/test_grad_averager_accumulators_dtype.py",),
            ),
        ),
    ),
    PullRequest(
        "13-power-sgd-half-precision",
        (
            Commit(
                "PowerSGDGradientAverager: keep error feedback in float32, fixing float16/bfloat16 parameters",
                "PowerSGDGradientAverager made its error-feedback buffers (_ms) like the gradients, in their dtype, "
                "and its P and Q matrices in float32. With float16 or bfloat16 parameters every round failed in "
                "torch.matmul(m, q, out=p) (#545: \"Expected out tensor to have dtype c10::BFloat16, but got float "
                "instead\"), and the averager retried until its timeout. The error feedback is now float32 for "
                "every gradient dtype, as P and Q are: the matmuls run in float32 and the result is rounded once, "
                "where it is copied into the averaged gradients. Float32 gradients are unchanged. Nothing sent to "
                "peers changes: P and Q were float32 already, and the uncompressed gradients keep their dtype.",
                (POWER_SGD_FLOAT32_ERROR_FEEDBACK,),
                ("tests/test_power_sgd_half_precision.py",),
            ),
        ),
    ),
    PullRequest(
        "15-grad-scaler-update-on-device",
        (
            Commit(
                "GradScaler: back the scale off on the device in update() without a global step",
                "After a micro-step without a global step, GradScaler.update() read every found_inf with .item() to "
                "decide whether to back the scale off: a host read per micro-step, which stalls a GPU until its queued "
                "work is done. It now backs the scale off on the device (scale *= backoff_factor and the growth "
                "tracker reset, where found_inf is set), as torch's update() does, and still never grows it there. "
                "It returns False then, since it no longer knows whether the scale changed. Updates after a global "
                "step are unchanged.",
                (GRAD_SCALER_DEFAULTDICT_IMPORT, GRAD_SCALER_UPDATE_ON_DEVICE),
                ("tests/test_grad_scaler_update.py",),
            ),
        ),
    ),
    PullRequest(
        "17-power-sgd-weight-zero",
        (
            Commit(
                "PowerSGDGradientAverager: keep the error feedback as it was in a round joined with weight 0",
                "A peer that joins a PowerSGD round with weight 0 (step(weight=0), or a round the Optimizer tags "
                "along with) sends nothing to compress, but the round still added its local gradients into its "
                "error-feedback residual and subtracted the group's result from it. The next round sent that "
                "residual: in the test below, the second round averaged to twice the gradients both peers had. "
                "With weight 0 the residual is now left as it was.",
                (NONFINITE_GRADS_POWER_SGD_ADD, NONFINITE_GRADS_POWER_SGD_SUB),
                ("tests/test_power_sgd_weight_zero.py",),
            ),
        ),
    ),
    PullRequest(
        "18-progress-reporter-wakeups",
        (
            Commit(
                "ProgressTracker: wake the reporter only when peers would see the report",
                "report_local_progress runs on every no-sync Optimizer.step() and woke the reporter thread every "
                "time: one DHT store and one LocalTrainingProgress.dict() per micro-step (related to #566), "
                "although peers fetch progress at most every min_refresh_period and extrapolate it at the reported "
                "speed in between. A report now wakes the reporter at once only for the first report, a new epoch, "
                "progress that went back (a reset), a swarm that may have reached target_batch_size, or when "
                "min_refresh_period / 2 has passed since the last wake-up. Any other report is published by a "
                "timer at most min_refresh_period / 2 after the last wake-up; shutdown() cancels it. So the "
                "samples and speed peers read are at most min_refresh_period / 2 older than the last report.",
                (PROGRESS_REPORT_STATE, PROGRESS_REPORT_WAKEUPS, PROGRESS_REPORT_SHUTDOWN),
                ("tests/test_progress_tracker.py", "benchmarks/benchmark_progress_reports.py"),
            ),
        ),
    ),
)


class StackError(Exception):
    """a pull request cannot be written; the message says which and why"""


def write_pull_requests(
    package_dir: Path, out: Path, author: str, pull_requests: Sequence[PullRequest] = PULL_REQUESTS
) -> Dict[str, List[Path]]:
    """
    Write ``out/NN-slug/`` for each pull request: its ``git format-patch`` series and ``description.md``.

    :param package_dir: hivemind's package directory (``.../hivemind``) the patches are made against
    :param out: the folder that receives one folder per pull request (replaced if present)
    :param author: "Name <email>" for the commits: the contributor who sends them (required, no default)
    :returns: the patch files, by slug
    :raises StackError: an edit does not match hivemind's text, or a prerequisite is unknown
    """
    by_slug = {pr.slug: pr for pr in pull_requests}
    if out.exists():
        shutil.rmtree(out)
    written = {}
    with tempfile.TemporaryDirectory() as scratch:
        repo = Path(scratch)
        env = _git_env(author)
        _git(repo, env, "init", "-q")
        edited = sorted({edit.path for pr in pull_requests for commit in pr.commits for edit in commit.edits})
        for path in edited:
            (repo / "hivemind" / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(package_dir / path, repo / "hivemind" / path)
        _git(repo, env, "add", "-A")
        _git(repo, env, "commit", "-q", "-m", "hivemind")
        base = _git(repo, env, "rev-parse", "HEAD").strip()
        for pr in pull_requests:
            _git(repo, env, "checkout", "-q", "--detach", base)
            for slug in _prerequisites(pr, by_slug) + [pr.slug]:
                for commit in by_slug[slug].commits:
                    _commit(repo, env, by_slug[slug], commit)
            folder = out / pr.slug
            folder.mkdir(parents=True)
            _git(repo, env, "format-patch", "-q", "--zero-commit", "--no-signature", "-o", str(folder),
                 f"HEAD~{len(pr.commits)}")
            shutil.copyfile(pr.folder / "description.md", folder / "description.md")
            written[pr.slug] = sorted(folder.glob("*.patch"))
    return written


def _prerequisites(pr: PullRequest, by_slug: Dict[str, PullRequest]) -> List[str]:
    """the pull requests ``pr`` applies after, prerequisites first, each once"""
    order: List[str] = []
    for slug in pr.depends:
        if slug not in by_slug:
            raise StackError(f"{pr.slug}: its description depends on {slug!r}, which is not a pull request here")
        order += [s for s in _prerequisites(by_slug[slug], by_slug) + [slug] if s not in order]
    return order


def _commit(repo: Path, env: Dict[str, str], pr: PullRequest, commit: Commit):
    for edit in commit.edits:
        target = repo / "hivemind" / edit.path
        text = target.read_text()
        try:
            if isinstance(edit, Fix):
                ours = (OUR_OPTIM / f"{edit.module}.py").read_text() if edit.module else ""
                new_text = apply_fix(text, edit, ours)
            elif text.count(edit.old) == 1:
                new_text = text.replace(edit.old, edit.new)
            else:
                raise FixError(f"expected this text once in hivemind/{edit.path}, found it {text.count(edit.old)} "
                               f"times:\n{edit.old}")
        except FixError as e:
            raise StackError(f"{pr.slug} ('{commit.subject}'): {e}") from e
        if new_text == text:
            raise StackError(f"{pr.slug} ('{commit.subject}'): hivemind/{edit.path} already has this change")
        target.write_text(new_text)
    for path in commit.files:
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pr.folder / path, repo / path)
    _git(repo, env, "add", "-A")
    _git(repo, env, "commit", "-q", "-F", "-", input=f"{commit.subject}\n\n{_wrap(commit.body)}\n")


def _wrap(text: str) -> str:
    return textwrap.fill(" ".join(text.split()), width=72, break_on_hyphens=False)


def _git_env(author: str) -> Dict[str, str]:
    match = re.fullmatch(r"\s*(.+?)\s*<([^>]+)>\s*", author or "")
    if match is None:
        raise StackError(f"author {author!r}: expected 'Name <email>'")
    name, email = match.groups()
    env = dict(os.environ, GIT_AUTHOR_DATE=COMMIT_DATE, GIT_COMMITTER_DATE=COMMIT_DATE, GIT_CONFIG_GLOBAL=os.devnull,
               GIT_CONFIG_NOSYSTEM="1")
    env.update(GIT_AUTHOR_NAME=name, GIT_AUTHOR_EMAIL=email, GIT_COMMITTER_NAME=name, GIT_COMMITTER_EMAIL=email)
    return env


def _git(repo: Path, env: Dict[str, str], *args: str, input: str = None) -> str:
    result = subprocess.run(["git", *args], cwd=repo, env=env, input=input, capture_output=True, text=True)
    if result.returncode != 0:
        raise StackError(f"git {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout
