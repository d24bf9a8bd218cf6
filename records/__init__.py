"""The records that cross the process doors of an RL run, torch-free: rollout/, trainer/ and rl/ all
import them (docs/ARCHITECTURE.md).

    Sample, TrainBatch, RecordError    records/samples.py
    EngineAnswer, PackedChunk, SyncReport, Publication, ...   records/weights.py (the weight sync's)
"""

from records.samples import RecordError, Sample, TrainBatch

__all__ = ["RecordError", "Sample", "TrainBatch"]
