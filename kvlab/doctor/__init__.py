"""The prefix-cache doctor: "why is my hit rate low?" answered from your own request log.

    python -m kvlab.doctor requests.jsonl --block-size 16 32 64 --capacity-blocks 4096 --out report/

    from kvlab.doctor import diagnose
    d = diagnose("requests.jsonl", capacity_blocks=4096)
    print(d.summary())

Reads a JSONL log (OpenAI chat messages, plain prompts or token ids), renders and tokenizes it with a
model's chat template and tokenizer, replays it in order through a prefix cache with vLLM's rules
(``kvlab.doctor.replay``, checked against kvlab's real Scheduler and BlockManager), finds where prompts stop
matching and why (``kvlab.doctor.culprits``), and re-measures the log with each fix applied.
Modules: ``logio`` (read/write logs), ``tokenization`` (template + batched tokenizer), ``prepare``,
``divergence``, ``replay``, ``culprits`` (``textdiff``, ``fields``, ``structure``, ``blocks``), ``measure``,
``core`` (``diagnose``, ``write_report``), ``report`` (text, HTML, figures from one dict), ``vllm_metrics``.
"""

from .core import Diagnosis, diagnose, write_report
from .culprits import Culprit
from .logio import BadLine, Record, read_log, write_log
from .replay import HitStats, replay_block_manager, replay_tokens

__all__ = ["BadLine", "Culprit", "Diagnosis", "HitStats", "Record", "diagnose", "read_log", "replay_block_manager",
           "replay_tokens", "write_log", "write_report"]
