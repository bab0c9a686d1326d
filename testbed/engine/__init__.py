"""The inference engine: Sequence, BlockManager, Scheduler (+ policies), ModelRunner, Engine."""

from testbed.engine.block_manager import BlockManager
from testbed.engine.config import EngineConfig, SchedulerConfig
from testbed.engine.engine import Engine
from testbed.engine.record import StepRecord
from testbed.engine.scheduler import Batch, Scheduler, StepResult
from testbed.engine.sequence import Sequence, SequenceStatus

__all__ = ["Batch", "BlockManager", "Engine", "EngineConfig", "Scheduler", "SchedulerConfig", "Sequence",
           "SequenceStatus", "StepRecord", "StepResult"]
