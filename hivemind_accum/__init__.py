"""hivemind_accum: hivemind gradient accumulation as cheap as native PyTorch accumulation."""
from hivemind_accum.optim import GradientAverager, Optimizer, PowerSGDGradientAverager
from hivemind_accum.patch import is_patched, patch_hivemind, unpatch_hivemind
from hivemind_accum.shutdown_noise import silence_exited_sender_errors

__version__ = "0.1.0"

__all__ = [
    "GradientAverager",
    "Optimizer",
    "PowerSGDGradientAverager",
    "is_patched",
    "patch_hivemind",
    "silence_exited_sender_errors",
    "unpatch_hivemind",
]
