"""The LLM judge: an OpenAI-compatible client with bounded concurrency, retries, an on-disk
cache of every reply (:mod:`.cache`) and loud failures (:mod:`.client`), and its settings (:mod:`.config`).
What a benchmark asks the judge, and how it reads the reply, is the benchmark's."""

from mmtune.evaluation.judge.cache import JudgeCache
from mmtune.evaluation.judge.client import (
    JudgeClient,
    JudgeError,
    JudgeFailures,
    JudgeRequest,
    JudgeResponse,
    JudgeStats,
    check_failures,
    likely_cause,
    resolve_endpoint,
)
from mmtune.evaluation.judge.config import JudgeConfig

__all__ = ["JudgeConfig", "JudgeRequest", "JudgeResponse", "JudgeStats", "JudgeCache", "JudgeClient", "JudgeError",
           "JudgeFailures", "likely_cause", "check_failures", "resolve_endpoint"]
