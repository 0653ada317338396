"""
:class:`hivemind.optim.progress_tracker.ProgressTracker` whose per-micro-step report costs no pydantic model.

``report_local_progress`` runs on every micro-step of :class:`hivemind.Optimizer`, but peers see the progress only
when the tracker's reporter thread publishes it. So the reported values are kept as a plain tuple and the
:class:`LocalTrainingProgress` record is built when it is read (by the reporter thread as it publishes, or by anyone
reading ``local_progress``): the same fields and values reach the DHT.

A report wakes the reporter thread, which stores the record in the DHT, only when peers would see the difference:
a new epoch, progress that went back (a reset), a swarm that may have reached its target, or half of
``min_refresh_period`` since the last wake-up (peers fetch records no more often than that, and extrapolate between
records at the reported speed). A report that does not wake it is published at most that much later (a timer).
Upstream wakes it at every micro-step.
"""
import logging
import threading
from typing import Optional, Tuple

from hivemind.optim import progress_tracker as upstream
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.utils import get_dht_time, get_logger

logger = get_logger(__name__)


class ProgressTracker(upstream.ProgressTracker):
    """
    :class:`hivemind.optim.progress_tracker.ProgressTracker` (same arguments and behaviour) whose
    ``report_local_progress`` accepts what :class:`LocalTrainingProgress` accepts (plain non-negative ints) and stores
    it without building the record; ``local_progress`` builds one, once per report, when read. Other arguments are
    validated by building the record at once, which raises its ``ValidationError``.
    """

    def report_local_progress(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True):
        """Update the number of locally accumulated samples and notify to other peers about this."""
        if not (_is_count(local_epoch) and _is_count(samples_accumulated)):
            return super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)
        epoch, samples = self._progress_record[:2]
        extra_samples = samples_accumulated - samples
        if update_global_samples and local_epoch == epoch == self.global_progress.epoch:
            self.global_progress.samples_accumulated += extra_samples
            # note: the above line can decrease the number of samples, e.g. if forced to reset due to overflow

        if extra_samples > 0:
            self.performance_ema.update(task_size=extra_samples)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug(f"Updated performance EMA: {self.performance_ema.samples_per_second:.5f}")
        else:
            logger.debug("Resetting performance timestamp to current time (progress was reset)")
            self.performance_ema.reset_timer()

        speed = self.performance_ema.samples_per_second
        record = (local_epoch, samples_accumulated, speed, get_dht_time(), self.client_mode)
        if type(speed) is float and speed >= 0.0:
            self._progress_record = record
        else:  # built now: raises the model's ValidationError for what confloat(ge=0, strict=True) rejects
            self.local_progress = self._build_local_progress(record)
        if self._peers_need_report(record):
            self._woken = record
            self.should_report_progress.set()
        elif self._deferred is None:  # published at most half a refresh period late, also if no report follows
            delay = self._report_lag - (record[3] - self._woken[3])
            self._deferred = threading.Timer(max(delay, 0.0), self._wake_deferred)
            self._deferred.daemon = True
            self._deferred.start()

    @property
    def _report_lag(self) -> float:
        """how late, at most, a report that does not wake the reporter reaches peers: half a refresh period"""
        return self.min_refresh_period / 2

    _woken: Optional[Tuple] = None  # the record of the last report that woke the reporter
    _deferred: Optional[threading.Timer] = None  # the wake-up of a report that did not wake the reporter

    def _wake_deferred(self) -> None:
        self._deferred = None
        self._woken = self._progress_record
        self.should_report_progress.set()

    def shutdown(self, *args, **kwargs):
        deferred = self._deferred
        if deferred is not None:
            deferred.cancel()
        return super().shutdown(*args, **kwargs)

    def _peers_need_report(self, record: Tuple) -> bool:
        """whether peers would see this report differ from the last one published: see the module's docstring"""
        woken = self._woken
        return (
            woken is None
            or record[0] != woken[0]
            or record[1] < woken[1]
            or max(self.global_progress.samples_accumulated, record[1]) >= self.target_batch_size
            or record[3] - woken[3] >= self._report_lag
        )

    def _read_local_progress(self) -> LocalTrainingProgress:
        """the record of the last report, built at the first read after it"""
        record, built = self._progress_record, self._built_progress
        if built is None or built[0] is not record:
            built = self._built_progress = (record, self._build_local_progress(record))
        return built[1]

    def _build_local_progress(self, record: Tuple) -> LocalTrainingProgress:
        """the :class:`LocalTrainingProgress` of a report's values"""
        epoch, samples, speed, time, client_mode = record
        return LocalTrainingProgress(
            peer_id=self.dht.peer_id.to_bytes(), epoch=epoch, samples_accumulated=samples, samples_per_second=speed,
            time=time, client_mode=client_mode,
        )

    def _write_local_progress(self, progress: LocalTrainingProgress) -> None:
        record = (progress.epoch, progress.samples_accumulated, progress.samples_per_second, progress.time,
                  progress.client_mode)
        self._progress_record: Tuple = record
        self._built_progress: Optional[Tuple[Tuple, LocalTrainingProgress]] = (record, progress)

    local_progress = property(_read_local_progress, _write_local_progress, doc="this peer's last reported progress")

    @property
    def ready_to_update_epoch(self) -> bool:
        """Whether or not this peer can increment epoch right away."""
        return (
            self.global_epoch > self._progress_record[0]
            or self.global_progress.samples_accumulated >= self.target_batch_size
            or get_dht_time() >= self.global_progress.eta_next_epoch
        )


def _is_count(value) -> bool:
    """what ``conint(ge=0, strict=True)`` accepts, for plain ints (a subclass of int is validated by the model)"""
    return type(value) is int and value >= 0
