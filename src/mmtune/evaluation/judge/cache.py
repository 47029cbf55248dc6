"""The judge's reply cache: an append-only SQLite store shared by threads, processes and runs.

Every reply is stored the moment it arrives, keyed by a hash of everything that changes it
(:meth:`~mmtune.evaluation.judge.client.JudgeClient.cache_key`), so a killed or re-run
evaluation never pays for a reply twice; claims let two evaluations on one cache wait for
each other's in-flight request instead of both sending it.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Optional

from mmtune.io.locks import pid_alive

__all__ = ["JudgeCache"]


class JudgeCache:
    """Append-only SQLite store of judge replies. Safe across threads and processes
    (WAL mode; each write commits at once so a SIGKILL loses only calls in flight).

    A second table holds *claims*: the key of a request some caller is sending right now.
    Another evaluation that needs the same reply waits for it instead of paying again.
    A claim is dropped when its owner finishes (reply stored or failure), when its owner
    process on this host is gone (a killed run), or after ``stale_after`` seconds.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(self.path), check_same_thread=False, timeout=30)
        self._conn.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: a committed reply survives a killed process (what resume needs)
        # without an fsync per reply; only an OS crash / power cut can lose the latest ones.
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS replies (key TEXT PRIMARY KEY, model TEXT, content TEXT,"
            " prompt_tokens INTEGER, completion_tokens INTEGER, created REAL)"
        )
        self._conn.execute("CREATE TABLE IF NOT EXISTS claims (key TEXT PRIMARY KEY, owner TEXT, host TEXT, pid INTEGER, claimed REAL)")
        self._conn.commit()
        self._host = socket.gethostname()

    def get(self, key: str) -> Optional[tuple[str, int, int]]:
        with self._lock:
            row = self._conn.execute(
                "SELECT content, prompt_tokens, completion_tokens FROM replies WHERE key = ?", (key,)
            ).fetchone()
        return None if row is None else (row[0], int(row[1]), int(row[2]))

    def put(self, key: str, model: str, content: str, prompt_tokens: int, completion_tokens: int) -> None:
        with self._lock:
            self._conn.execute(
                "INSERT OR REPLACE INTO replies VALUES (?, ?, ?, ?, ?, ?)",
                (key, model, content, prompt_tokens, completion_tokens, time.time()),
            )
            self._conn.execute("DELETE FROM claims WHERE key = ?", (key,))
            self._conn.commit()

    def claim(self, key: str, owner: str, *, stale_after: float) -> bool:
        """True when ``owner`` now holds ``key`` (nobody else is sending that request)."""
        with self._lock:
            now = time.time()
            row = self._conn.execute("SELECT host, pid, claimed FROM claims WHERE key = ?", (key,)).fetchone()
            if row is not None:
                host, pid, claimed = row
                if now - float(claimed) > stale_after or (host == self._host and not pid_alive(int(pid))):
                    self._conn.execute("DELETE FROM claims WHERE key = ?", (key,))
            cursor = self._conn.execute(
                "INSERT OR IGNORE INTO claims VALUES (?, ?, ?, ?, ?)", (key, owner, self._host, os.getpid(), now)
            )
            self._conn.commit()
            return cursor.rowcount == 1

    def release(self, key: str, owner: str) -> None:
        with self._lock:
            self._conn.execute("DELETE FROM claims WHERE key = ? AND owner = ?", (key, owner))
            self._conn.commit()

    def __len__(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM replies").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()
