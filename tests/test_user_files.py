"""The service's opens in a user's job folder (launcher/cluster/user_files.py): the job's user
and the service are accepted, nobody else; links and non-regular files (a FIFO must not block)
are refused.  Pure: files in tmp_path; the other owner is made with chown when run as root."""
import os
import stat
import time

import pytest

from hvd_edl import private_file
from launcher.cluster.user_files import PrivateFileError, job_uids, open_owned, read_owned

NOBODY = 65534


def _file(path, data=b"x", mode=0o600):
    path.write_bytes(data)
    path.chmod(mode)
    return path


def test_job_uids_are_the_service_and_the_folders_owner():
    assert job_uids(None) == {os.geteuid()}
    assert job_uids(NOBODY) == {os.geteuid(), NOBODY}


def test_own_file_opens_and_a_file_of_an_unlisted_owner_is_refused(tmp_path):
    f = _file(tmp_path / "hosts", b"a:1\n")
    fd = open_owned(f, {os.geteuid()})
    try:
        assert stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, 10) == b"a:1\n"
    finally:
        os.close(fd)
    with pytest.raises(PrivateFileError) as e:
        open_owned(f, {NOBODY})  # the caller's own file, but the caller is not accepted
    assert e.value.reason == private_file.OTHER_OWNER and e.value.uid == os.geteuid()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_root_reads_the_job_users_file_only_when_that_user_is_accepted(tmp_path):
    f = _file(tmp_path / "job.json", b"{}")
    os.chown(f, NOBODY, NOBODY)
    assert read_owned(f, job_uids(NOBODY)) == b"{}"
    with pytest.raises(PrivateFileError) as e:
        read_owned(f, job_uids(None))
    assert e.value.reason == private_file.OTHER_OWNER and e.value.uid == NOBODY
    with pytest.raises(PrivateFileError) as e:
        private_file.read_private(f)  # every other caller keeps the one-owner check
    assert e.value.reason == private_file.OTHER_OWNER


def test_symlink_fifo_and_folder_are_refused_without_blocking(tmp_path):
    target = _file(tmp_path / "secret")
    (tmp_path / "link").symlink_to(target)
    os.mkfifo(tmp_path / "fifo", 0o600)  # no writer: a blocking open would hang for ever
    (tmp_path / "dir").mkdir(mode=0o700)
    uids = job_uids(None)
    started = time.monotonic()
    for name, reason in (("link", private_file.SYMLINK), ("fifo", private_file.NOT_REGULAR),
                         ("dir", private_file.NOT_REGULAR), ("gone", private_file.MISSING)):
        with pytest.raises(PrivateFileError) as e:
            open_owned(tmp_path / name, uids)
        assert e.value.reason == reason, name
        with pytest.raises(PrivateFileError):
            read_owned(tmp_path / name, uids)
    assert time.monotonic() - started < 5.0


def test_read_owned_keeps_the_mode_check(tmp_path):
    f = _file(tmp_path / "hosts", mode=0o644)
    with pytest.raises(PrivateFileError) as e:
        read_owned(f, job_uids(None))
    assert e.value.reason == private_file.OPEN_TO_OTHERS
    fd = open_owned(f, job_uids(None))  # open_owned checks owner and kind only
    os.close(fd)
