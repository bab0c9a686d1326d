"""The inference engine: Sequence, BlockManager, Scheduler (+ policies), ModelRunner, Engine."""

from testbed.engine.block_manager import BlockManager
from testbed.engine.config import EngineConfig, SchedulerConfig
from testbed.engine.scheduler import Batch, Scheduler, StepReport, StepResult
from testbed.engine.sequence import Sequence, SequenceStatus

# what a step reports (StepRecord, a row of steps.parquet) is imported from testbed/metrics/record.py
__all__ = [
    "Batch",
    "BlockManager",
    "Engine",
    "EngineConfig",
    "Scheduler",
    "SchedulerConfig",
    "Sequence",
    "SequenceStatus",
    "StepReport",
    "StepResult",
]


def __getattr__(name: str):
    # Engine pulls in torch (seconds); the simulator uses the scheduler side only
    if name == "Engine":
        from testbed.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'testbed.engine' has no attribute {name!r}")
