"""Typed configuration of the lake, one frozen dataclass per component. Defaults run on a laptop."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["CommitConfig", "LakeConfig", "MaintenanceConfig", "SizeLimits", "WriterConfig"]


@dataclass(frozen=True)
class LakeConfig:
    """Where the lake lives.

    Attributes:
        root: a local folder (created if missing) or an object-store URI such as ``s3://bucket/prefix``.
            Each table is the folder ``<root>/<table name>``.
        storage_options: options for delta-rs's object store (``AWS_ENDPOINT_URL``, ``AWS_REGION``,
            credentials, ``AWS_ALLOW_HTTP``, ...); empty for a local folder. delta-rs also reads the
            ``AWS_*`` environment variables. On S3, commits use conditional puts (``If-None-Match``),
            which delta-rs 1.x does by default: no locking provider is needed, and
            ``AWS_S3_ALLOW_UNSAFE_RENAME`` must not be set.
    """

    root: str = "lake"
    storage_options: Mapping[str, str] = field(default_factory=dict, repr=False)  # credentials: never in a repr


@dataclass(frozen=True)
class CommitConfig:
    """How a commit that lost a race with another writer is retried (see ``sao.lake.commit``).

    Attributes:
        max_attempts: attempts before giving up with ``CommitConflictError`` (nothing is lost: the rows
            stay with the caller).
        backoff_s: first pause after a lost race, doubled per attempt, with full jitter.
        max_backoff_s: cap of the pause.
    """

    max_attempts: int = 50
    backoff_s: float = 0.005
    max_backoff_s: float = 0.5

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 <= self.backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"need 0 <= backoff_s <= max_backoff_s, got {self.backoff_s}, {self.max_backoff_s}"
            )


@dataclass(frozen=True)
class SizeLimits:
    """The largest trajectory the writer stores; a bigger one is quarantined (rule
    ``payload_too_large``), so one runaway producer cannot bloat the table or the trainer's batches.

    Attributes:
        max_tokens: most entries in ``prompt_ids`` and in ``completion_ids`` (the other token lists
            must match ``completion_ids``).
        max_segments: most segments.
        max_string_bytes: most UTF-8 bytes in each string field (ids, names, versions, ``episode_id``).
        max_text_bytes: most UTF-8 bytes in each free-text field (``error``, ``agent_info``).
        max_quarantine_payload_bytes: the quarantine keeps at most this much of a rejected payload's
            JSON; a longer one is cut there and marked (``...[truncated: N bytes]``).
    """

    max_tokens: int = 1 << 20
    max_segments: int = 1 << 16
    max_string_bytes: int = 4096
    max_text_bytes: int = 1 << 16
    max_quarantine_payload_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_segments", "max_string_bytes", "max_text_bytes",
                     "max_quarantine_payload_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"SizeLimits.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class WriterConfig:
    """The trajectory writer's batching.

    Attributes:
        flush_rows: flush when this many records are buffered (one Delta commit per flush and run
            set; about 1,024 is where commit overhead stops dominating).
        flush_seconds: flush when the oldest buffered record is this old, so a slow trickle of
            rollouts still lands; checked on every ``add`` and by a background timer.
        background_flush: run the timer thread that enforces ``flush_seconds`` between ``add`` calls.
        commit: retry policy when another writer commits first.
        limits: the largest record stored (bigger ones are quarantined).
    """

    flush_rows: int = 1024
    flush_seconds: float = 2.0
    background_flush: bool = True
    commit: CommitConfig = field(default_factory=CommitConfig)
    limits: SizeLimits = field(default_factory=SizeLimits)

    def __post_init__(self) -> None:
        if self.flush_rows < 1:
            raise ValueError(f"flush_rows must be >= 1, got {self.flush_rows}")
        if not self.flush_seconds > 0:
            raise ValueError(f"flush_seconds must be > 0, got {self.flush_seconds}")


@dataclass(frozen=True)
class MaintenanceConfig:
    """Compaction and vacuum.

    Attributes:
        retention_hours: vacuum deletes files removed from the log longer ago than this (and files
            never committed, by age). Versions recorded in ``train_steps`` are kept whatever it says.
        min_retention_hours: retention below this is refused unless forced: a shorter one can delete
            a file another writer has written but not yet committed.
        target_file_mb: size compaction aims for (``sao lake compact``).
        run_target_file_mb: size the compaction under a live run aims for
            (:func:`sao.lake.maintenance.compact_run`, every ``TrainConfig.compact_every`` steps). A file
            larger than the target is left as it is, so each such compaction rewrites at most about
            this much besides what arrived since the last one; with ``target_file_mb`` it would rewrite
            the run's whole partition every time until that reached 128 MB, a cost that grows with the
            run.
    """

    retention_hours: int = 168
    min_retention_hours: int = 1
    target_file_mb: float = 128
    run_target_file_mb: float = 16
