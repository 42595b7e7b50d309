"""The users of one cluster service: who a request comes from, who a job runs as, and who may
do what to it.

Identity comes from the kernel, never from a secret: the service answers only processes on its
own host and asks the kernel which user owns the caller's socket (:mod:`hvd_edl.peer_uid`,
sock_diag, the lookup ``ss -e`` makes), as Slurm's munge and Unix sockets' ``SO_PEERCRED`` do.
The rules, Slurm's on a login node:

* everyone sees every job (``squeue``), with its ``user``;
* only the job's user, root and the service's own user may cancel it or read its logs;
* a service run by root runs each job as its submitter (:func:`popen_user`); a service run by
  an ordinary user runs jobs only for that user (:func:`may_submit` refuses the others), as a
  single user's ``slurmd -D`` would;
* draining a host is the operator's (root's or the service user's).

Each refusal is a :class:`Refusal` (HTTP 403), one line naming whose job it is.
"""
from __future__ import annotations

import os
import pwd
from dataclasses import dataclass
from typing import Optional, Tuple


class Refusal(ValueError):
    """A request this caller may not make (HTTP 403), one line for people."""

    status = 403


@dataclass(frozen=True)
class User:
    """A local Unix user: ``uid``, ``name``, primary group ``gid``, supplementary ``groups``
    (every group id, the primary one included) and ``home``."""
    uid: int
    name: str
    gid: int
    groups: Tuple[int, ...]
    home: str

    @classmethod
    def of_uid(cls, uid: int) -> "User":
        """The user with ``uid`` from the password database (a uid without an entry gets the
        name ``uid<N>``, its own gid and home ``/``).  Raises nothing."""
        try:
            pw = pwd.getpwuid(uid)
        except KeyError:
            return cls(uid, f"uid{uid}", uid, (uid,), "/")
        try:
            groups = tuple(os.getgrouplist(pw.pw_name, pw.pw_gid))
        except OSError:
            groups = (pw.pw_gid,)
        return cls(uid, pw.pw_name, pw.pw_gid, groups, pw.pw_dir)

    @property
    def is_root(self) -> bool:
        return self.uid == 0


def service_user() -> User:
    """The user this service runs as (its effective uid)."""
    return User.of_uid(os.geteuid())


def is_operator(uid: int) -> bool:
    """Whether ``uid`` runs the cluster: root or the service's own user."""
    return uid in (0, os.geteuid())


def may_submit(caller: User) -> None:
    """Whether ``caller`` may submit here.

    Raises:
        Refusal: the service runs as an ordinary user and ``caller`` is someone else (it
            could only run their job as itself: their files would be its own).
    """
    me = os.geteuid()
    if me != 0 and caller.uid != me:
        owner = User.of_uid(me).name
        raise Refusal(f"this cluster service runs as {owner}: only {owner} may submit to it "
                      f"(a service started by root runs each user's jobs as that user)")


def may_manage(caller: User, job_id: str, job_user: str, job_uid: Optional[int],
               what: str) -> None:
    """Whether ``caller`` may ``what`` (``"cancel"``, ``"read the logs of"``) job ``job_id``
    of ``job_user`` (uid ``job_uid``; None: a job from before users, the operator's).

    Raises:
        Refusal: ``caller`` is neither the job's user nor root nor the service's user.
    """
    if is_operator(caller.uid) or (job_uid is not None and caller.uid == job_uid):
        return
    raise Refusal(f"job {job_id} is {job_user or 'the operator'}'s: only "
                  f"{job_user or 'the operator'} (or root) may {what} it")


def may_operate(caller: User, what: str) -> None:
    """Whether ``caller`` may ``what`` (``"drain a host"``): root and the service's user only.

    Raises:
        Refusal: anyone else.
    """
    if not is_operator(caller.uid):
        owner = service_user().name
        raise Refusal(f"only root may {what}" if owner == "root" else
                      f"only root or {owner} (who runs the service) may {what}")


def runs_as_other(job_uid: Optional[int]) -> bool:
    """Whether a job of ``job_uid`` runs as a user other than the service's: only under a root
    service (:func:`may_submit` refuses the rest)."""
    return job_uid is not None and os.geteuid() == 0 and job_uid != 0


def popen_user(job_uid: Optional[int]) -> dict:
    """``subprocess.Popen`` keyword arguments that start a process as the job's user (its uid,
    primary group and supplementary groups, as ``su`` does) under a root service; ``{}`` when
    the job runs as the service's user."""
    if not runs_as_other(job_uid):
        return {}
    u = User.of_uid(job_uid)
    return {"user": u.uid, "group": u.gid, "extra_groups": list(u.groups)}


def give(path, job_uid: Optional[int]) -> None:
    """Make ``path`` (a job's folder or file the service created) the job's user's, under a root
    service; nothing otherwise.

    Raises:
        OSError: it cannot be changed.
    """
    if runs_as_other(job_uid):
        u = User.of_uid(job_uid)
        os.chown(path, u.uid, u.gid, follow_symlinks=False)


HIDDEN_REASON = "failed: its error is in its output, which only its user (or root) may read"


def hide_output(answer: dict, caller: User, store) -> dict:
    """``answer`` (status's ``jobs`` or the ``events``) as ``caller`` may see it: every job and
    event (like ``squeue``), but a failed job's reason quotes the first lines of its error (its
    log: :func:`launcher.cluster.runs.error_excerpt`), which only those who may read its logs
    see (:func:`may_manage`); others read :data:`HIDDEN_REASON`."""
    if is_operator(caller.uid):
        return answer
    uids = {j.id: j.uid for j in store.jobs()}

    def theirs(job_id) -> bool:
        uid = uids.get(job_id)
        return uid is not None and uid == caller.uid

    for row in answer.get("jobs", ()):
        if row.get("state") == "failed" and row.get("reason") and not theirs(row.get("id")):
            row["reason"] = HIDDEN_REASON
    for ev in answer.get("events", ()):
        if (isinstance(ev, dict) and ev.get("kind") == "end" and ev.get("state") == "failed"
                and ev.get("reason") and not theirs(ev.get("job"))):
            ev["reason"] = HIDDEN_REASON
    return answer
