"""The cluster service's durable state: one SQLite database (stdlib ``sqlite3``, WAL journal) in
the service's state directory, written by one thread of one process (the service's loop), read
by any.

What must survive a ``kill -9`` of the service lives here: the queue and every job's record, the
allocations the policy decided, the runs started (so none is started twice) and the event
history (every decision with its reason).  What the jobs keep themselves (their job files,
checkpoints, the exit-code files of :mod:`launcher.cluster.wrapper`) is re-adopted from the
state directory, not copied here.

Tables (schema version :data:`SCHEMA_VERSION`, kept in ``meta``):

* ``jobs``: one row per job: ``id``, ``name``, ``argv`` (JSON list), ``cwd``, ``env`` (JSON
  object), ``np`` / ``min_np`` / ``max_np``, ``priority``, ``checkpoint_dir``, ``state``
  (:data:`STATES`), ``submitted_at`` / ``started_at`` / ``finished_at`` (Unix seconds),
  ``exit_code``, ``attained_gpu_s`` (slot-seconds held), ``run`` (runs started: 0 never),
  ``job_file``, ``launcher_pid``, ``wrapper_pid``, ``stopping`` (None, "preempt" or "cancel":
  a stop asked of the current run), ``last_change_at``, ``world_size`` (slots it holds),
  ``speed`` (JSON: world size -> the telemetry's figures at that size), ``reason`` (the last
  decision's), ``goal`` (JSON: a job's objective, samples, deadline, budget, types, samples done
  and the type and number chosen with their predicted time and cost, issue 42; ``{}`` none),
  ``cost_usd`` (dollars spent: slots x each host's price per GPU-hour x hours held),
  ``user`` / ``uid`` (who submitted it: the job runs as that user under a root
  service; "" / None for jobs from before users), ``environ`` (JSON: the environment ``submit``
  ran in, which the job runs with, as ``sbatch``'s; {} for jobs from before: the service's).
* ``allocations``: ``(job_id, host, slots)``, what each job is to hold (the policy's last word).
* ``events``: ``(id, at, job_id, kind, reason, detail JSON)``, append-only.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

SCHEMA_VERSION = 3
# columns added since version 1: name -> SQL type (an older database gets them on open)
_ADDED_COLUMNS = {"goal": "TEXT NOT NULL DEFAULT '{}'", "cost_usd": "REAL NOT NULL DEFAULT 0",
                  "user": "TEXT NOT NULL DEFAULT ''", "uid": "INTEGER",
                  "environ": "TEXT NOT NULL DEFAULT '{}'"}
STATES = ("queued", "running", "suspended", "done", "failed", "cancelled")
ENDED = ("done", "failed", "cancelled")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    name TEXT NOT NULL,
    argv TEXT NOT NULL,
    cwd TEXT NOT NULL,
    env TEXT NOT NULL DEFAULT '{}',
    np INTEGER NOT NULL,
    min_np INTEGER NOT NULL,
    max_np INTEGER NOT NULL,
    priority INTEGER NOT NULL DEFAULT 0,
    checkpoint_dir TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('queued','running','suspended','done','failed',
                                         'cancelled')),
    submitted_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    exit_code INTEGER,
    attained_gpu_s REAL NOT NULL DEFAULT 0,
    run INTEGER NOT NULL DEFAULT 0,
    job_file TEXT,
    launcher_pid INTEGER,
    wrapper_pid INTEGER,
    stopping TEXT,
    last_change_at REAL NOT NULL DEFAULT 0,
    world_size INTEGER NOT NULL DEFAULT 0,
    speed TEXT NOT NULL DEFAULT '{}',
    reason TEXT,
    goal TEXT NOT NULL DEFAULT '{}',
    cost_usd REAL NOT NULL DEFAULT 0,
    user TEXT NOT NULL DEFAULT '',
    uid INTEGER,
    environ TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS allocations (
    job_id TEXT NOT NULL REFERENCES jobs(id),
    host TEXT NOT NULL,
    slots INTEGER NOT NULL CHECK (slots > 0),
    PRIMARY KEY (job_id, host)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    job_id TEXT,
    kind TEXT NOT NULL,
    reason TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT '{}'
);
"""

# columns schema 2 added to ``jobs`` (a schema-1 database gets them when opened)

class StoreError(RuntimeError):
    """The database cannot be used: unreadable, or written by a newer schema (one line)."""


@dataclass
class JobRecord:
    """One row of ``jobs`` (see the module docstring for the fields)."""
    id: str
    name: str
    argv: List[str]
    cwd: str
    env: Dict[str, str]
    np: int
    min_np: int
    max_np: int
    priority: int
    checkpoint_dir: str
    state: str
    submitted_at: float
    started_at: Optional[float] = None
    finished_at: Optional[float] = None
    exit_code: Optional[int] = None
    attained_gpu_s: float = 0.0
    run: int = 0
    job_file: Optional[str] = None
    launcher_pid: Optional[int] = None
    wrapper_pid: Optional[int] = None
    stopping: Optional[str] = None
    last_change_at: float = 0.0
    world_size: int = 0
    speed: Dict[str, dict] = field(default_factory=dict)
    reason: Optional[str] = None
    goal: Dict[str, object] = field(default_factory=dict)
    cost_usd: float = 0.0
    user: str = ""
    uid: Optional[int] = None
    environ: Dict[str, str] = field(default_factory=dict)

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def public(self, allocation: Optional[Dict[str, int]] = None) -> dict:
        """The job as ``hvd-edl-cluster status --json`` shows it."""
        return {"id": self.id, "name": self.name, "user": self.user, "state": self.state,
                "submitted_at": self.submitted_at, "started_at": self.started_at,
                "finished_at": self.finished_at, "exit_code": self.exit_code,
                "world_size": self.world_size, "np": self.np, "min_np": self.min_np,
                "max_np": self.max_np, "priority": self.priority, "runs": self.run,
                "attained_gpu_s": round(self.attained_gpu_s, 3), "command": self.argv,
                "checkpoint_dir": self.checkpoint_dir, "allocation": allocation or {},
                "reason": self.reason, "goal": self.goal or None,
                "cost_usd": round(self.cost_usd, 6)}


_JSON_FIELDS = ("argv", "env", "speed", "goal", "environ")
_FIELDS = [f for f in JobRecord.__dataclass_fields__]


def _record(row: sqlite3.Row) -> JobRecord:
    d = {k: row[k] for k in _FIELDS}
    for k in _JSON_FIELDS:
        d[k] = json.loads(d[k])
    return JobRecord(**d)


class Store:
    """The service's database at ``path`` (created with the schema when missing).

    Writes (every method but the readers :meth:`jobs`, :meth:`job`, :meth:`allocations`,
    :meth:`events`) belong to one thread; each is one transaction.  Readers on other threads
    open their own connection (WAL: they never block the writer, nor it them).

    Raises:
        StoreError: the file is not a database of ours, or of a newer schema.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._local = threading.local()
        try:
            db = self._db()
            db.execute("PRAGMA journal_mode=WAL")
            with db:
                db.executescript(_SCHEMA)
                row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
                if row is None:
                    db.execute("INSERT INTO meta VALUES ('schema_version', ?)",
                               (str(SCHEMA_VERSION),))
                elif int(row[0]) > SCHEMA_VERSION:
                    raise StoreError(f"{self.path} has schema version {row[0]}, newer than "
                                     f"this hvd-edl-cluster's {SCHEMA_VERSION}: upgrade hvd_edl")
                have = {r[1] for r in db.execute("PRAGMA table_info(jobs)")}
                for name, sql in _ADDED_COLUMNS.items():
                    if name not in have:
                        db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {sql}")
                db.execute("UPDATE meta SET value=? WHERE key='schema_version'",
                           (str(SCHEMA_VERSION),))
        except sqlite3.DatabaseError as e:
            raise StoreError(f"cannot use {self.path} as the cluster's database: {e}") from None

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(str(self.path), timeout=10.0, isolation_level=None)
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash loses no committed write
            db.execute("PRAGMA foreign_keys=ON")
            self._local.db = db
        return db

    def _tx(self):
        """A transaction (BEGIN IMMEDIATE ... COMMIT, ROLLBACK on error)."""
        store = self

        class _T:
            def __enter__(self):
                self.db = store._db()
                self.db.execute("BEGIN IMMEDIATE")
                return self.db

            def __exit__(self, et, ev, tb):
                self.db.execute("ROLLBACK" if et else "COMMIT")
                return False
        return _T()

    # ---- readers -------------------------------------------------------------------------------

    def jobs(self, states=None) -> List[JobRecord]:
        """Every job (in submission order), or those in ``states``."""
        rows = self._db().execute("SELECT * FROM jobs ORDER BY seq").fetchall()
        out = [_record(r) for r in rows]
        return out if states is None else [j for j in out if j.state in states]

    def job(self, job_id: str) -> Optional[JobRecord]:
        row = self._db().execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        return None if row is None else _record(row)

    def allocations(self) -> Dict[str, Dict[str, int]]:
        """job id -> {host: slots} (jobs with none are absent)."""
        out: Dict[str, Dict[str, int]] = {}
        for r in self._db().execute("SELECT job_id, host, slots FROM allocations"):
            out.setdefault(r[0], {})[r[1]] = r[2]
        return out

    def events(self, since_id: int = 0, job_id: Optional[str] = None) -> List[dict]:
        """Events after ``since_id``, oldest first (one job's when ``job_id``)."""
        q = "SELECT * FROM events WHERE id > ?" + (" AND job_id = ?" if job_id else "")
        args = (since_id, job_id) if job_id else (since_id,)
        return [{"id": r["id"], "at": r["at"], "job": r["job_id"], "kind": r["kind"],
                 "reason": r["reason"], **json.loads(r["detail"])}
                for r in self._db().execute(q + " ORDER BY id", args)]

    def event_counts(self) -> Dict[str, int]:
        """kind -> how many events of that kind the store holds (every one since the
        cluster's first service: the ``/metrics`` counters)."""
        return {r[0]: r[1] for r in
                self._db().execute("SELECT kind, COUNT(*) FROM events GROUP BY kind")}

    def meta(self, key: str) -> Optional[str]:
        row = self._db().execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else row[0]

    # ---- writers (the service's loop thread) --------------------------------------------------

    def set_meta(self, key: str, value: str) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def add_job(self, job: JobRecord, event: Optional[dict] = None) -> JobRecord:
        """Insert a new job with a fresh id (``j1``, ``j2``, ...); returns it with its id."""
        with self._tx() as db:
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()[0]
            job.id = f"j{seq}"
            d = {k: getattr(job, k) for k in _FIELDS}
            for k in _JSON_FIELDS:
                d[k] = json.dumps(d[k])
            db.execute(f"INSERT INTO jobs (seq, {', '.join(_FIELDS)}) VALUES "
                       f"(?, {', '.join('?' for _ in _FIELDS)})",
                       [seq] + [d[k] for k in _FIELDS])
            if event:
                self._event(db, job.id, **event)
        return job

    def update(self, job_id: str, event: Optional[dict] = None,
               allocation: Optional[Dict[str, int]] = None, **fields) -> None:
        """Set ``fields`` of one job, and in the same transaction its allocation (when given:
        ``{}`` clears it) and an event (``{"kind", "reason", ...detail}``)."""
        with self._tx() as db:
            if fields:
                for k in _JSON_FIELDS:
                    if k in fields:
                        fields[k] = json.dumps(fields[k])
                bad = set(fields) - set(_FIELDS)
                if bad:
                    raise KeyError(f"no such job field: {sorted(bad)}")
                db.execute(f"UPDATE jobs SET {', '.join(f'{k}=?' for k in fields)} WHERE id=?",
                           list(fields.values()) + [job_id])
            if allocation is not None:
                db.execute("DELETE FROM allocations WHERE job_id=?", (job_id,))
                db.executemany("INSERT INTO allocations VALUES (?, ?, ?)",
                               [(job_id, h, k) for h, k in allocation.items() if k > 0])
            if event:
                self._event(db, job_id, **event)

    def add_event(self, job_id: Optional[str], kind: str, reason: str, **detail) -> None:
        with self._tx() as db:
            self._event(db, job_id, kind, reason, **detail)

    @staticmethod
    def _event(db, job_id: Optional[str], kind: str, reason: str, at: Optional[float] = None,
               **detail) -> None:
        db.execute("INSERT INTO events (at, job_id, kind, reason, detail) VALUES (?, ?, ?, ?, ?)",
                   (time.time() if at is None else at, job_id, kind, reason,
                    json.dumps(detail)))

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None

