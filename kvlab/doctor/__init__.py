"""The prefix-cache doctor: "why is my hit rate low?" answered from your own request log
(docs/doctor.md).

python -m kvlab.doctor requests.jsonl --block-size 16 32 64 --capacity-blocks 4096 --out report/
print(kvlab.doctor.diagnose("requests.jsonl", capacity_blocks=4096).summary())
"""

from .core import Diagnosis, diagnose, write_report
from .culprits import Culprit
from .logio import BadLine, Record, read_log, write_log
from .replay import HitStats, replay_block_manager, replay_tokens

__all__ = [
    "BadLine",
    "Culprit",
    "Diagnosis",
    "HitStats",
    "Record",
    "diagnose",
    "read_log",
    "replay_block_manager",
    "replay_tokens",
    "write_log",
    "write_report",
]
